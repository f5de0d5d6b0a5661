"""The kubelet's pod-resources API (v1.PodResourcesLister/List on a unix socket): which devices the
kubelet gave each container on this node.

The messages are built at import from a descriptor written here with the field numbers of
k8s.io/kubelet/pkg/apis/podresources/v1/api.proto (only the fields read; the rest of a reply is
skipped as unknown fields), in a pool of their own: no generated code, and nothing that depends on
the protobuf runtime's version beyond descriptor_pb2 and message_factory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from otelgpu.nvml import DEFAULT_POD_RESOURCES_SOCKET

LIST_METHOD = "/v1.PodResourcesLister/List"

_STRING, _MESSAGE, _INT64 = (descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
                             descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE,
                             descriptor_pb2.FieldDescriptorProto.TYPE_INT64)
_OPTIONAL, _REPEATED = (descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
                        descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED)
# message -> (field, number, type, repeated, message type)
_MESSAGES: dict[str, list[tuple[str, int, int, bool, str]]] = {
    "ListPodResourcesRequest": [],
    "ListPodResourcesResponse": [("pod_resources", 1, _MESSAGE, True, "PodResources")],
    "PodResources": [("name", 1, _STRING, False, ""), ("namespace", 2, _STRING, False, ""),
                     ("containers", 3, _MESSAGE, True, "ContainerResources")],
    "ContainerResources": [("name", 1, _STRING, False, ""), ("devices", 2, _MESSAGE, True, "ContainerDevices")],
    "ContainerDevices": [("resource_name", 1, _STRING, False, ""), ("device_ids", 2, _STRING, True, ""),
                         ("topology", 3, _MESSAGE, False, "TopologyInfo")],
    "TopologyInfo": [("nodes", 1, _MESSAGE, True, "NUMANode")],
    "NUMANode": [("ID", 1, _INT64, False, "")],
}


def _file() -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto(name="otelgpu/nvml/podresources/v1/api.proto", package="v1",
                                           syntax="proto3")
    for name, fields in _MESSAGES.items():
        message = proto.message_type.add(name=name)
        for field_name, number, kind, repeated, type_name in fields:
            fd = message.field.add(name=field_name, number=number, type=kind,
                                   label=_REPEATED if repeated else _OPTIONAL)
            if type_name:
                fd.type_name = f".v1.{type_name}"
    return proto


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file())
ListPodResourcesRequest: Any = message_factory.GetMessageClass(_POOL.FindMessageTypeByName("v1.ListPodResourcesRequest"))
ListPodResourcesResponse: Any = message_factory.GetMessageClass(_POOL.FindMessageTypeByName("v1.ListPodResourcesResponse"))


@dataclass(frozen=True)
class Allocation:
    """A device the kubelet gave a container: `device_id` as the device plugin names it
    (`GPU-<uuid>`, `GPU-<uuid>::<replica>`, `MIG-<uuid>`, ...)."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_id: str


class PodResourcesUnavailable(RuntimeError):
    """The socket is missing, or the kubelet did not answer."""


def allocations(response: Any) -> list[Allocation]:
    """A ListPodResourcesResponse as one Allocation per device id."""
    return [Allocation(p.namespace, p.name, c.name, d.resource_name, device_id)
            for p in response.pod_resources for c in p.containers for d in c.devices for device_id in d.device_ids]


class PodResourcesClient:
    """One channel to the kubelet's socket, kept (gRPC reconnects it); `list` each cycle."""

    def __init__(self, socket: str = DEFAULT_POD_RESOURCES_SOCKET, timeout_s: float = 5.0) -> None:
        self.socket, self._timeout = socket, timeout_s
        self._channel = grpc.insecure_channel(f"unix://{socket}")
        self._list = self._channel.unary_unary(LIST_METHOD, request_serializer=ListPodResourcesRequest.SerializeToString,
                                               response_deserializer=ListPodResourcesResponse.FromString)

    def list(self) -> list[Allocation]:
        try:
            return allocations(self._list(ListPodResourcesRequest(), timeout=self._timeout))
        except grpc.RpcError as exc:
            raise PodResourcesUnavailable(f"{self.socket}: {exc.code().name} {exc.details()}") from None

    def close(self) -> None:
        self._channel.close()
