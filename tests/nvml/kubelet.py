"""A stand-in kubelet: a real gRPC server on a unix socket serving v1.PodResourcesLister/List.

Its replies are encoded here on the protobuf wire by hand, from the field numbers of
k8s.io/kubelet/pkg/apis/podresources/v1/api.proto, not with otelgpu's message classes: a wrong
number in otelgpu's descriptor would then show as a pod not found, not pass unseen. A reply is
given as the JSON shape of dcgm-exporter's fixture (kubernetes_mig_test.samplePodResources.json).
"""

from __future__ import annotations

import tempfile
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

SERVICE = "v1.PodResourcesLister"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (strings and messages: wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _text(number: int, value: str) -> bytes:
    return _field(number, value.encode()) if value else b""


def encode(doc: dict[str, Any]) -> bytes:
    """ListPodResourcesResponse{1: PodResources{1 name, 2 namespace, 3 ContainerResources{1 name,
    2 ContainerDevices{1 resource_name, 2 device_ids, 3 TopologyInfo{1 NUMANode{1 ID}}}}}}."""
    out = b""
    for pod in doc.get("pod_resources", []):
        body = _text(1, pod["name"]) + _text(2, pod["namespace"])
        for c in pod.get("containers", []):
            container = _text(1, c["name"])
            for d in c.get("devices", []):
                device = _text(1, d["resource_name"]) + b"".join(_text(2, i) for i in d.get("device_ids", []))
                nodes = [n.get("id", n.get("ID", 0)) for n in (d.get("topology") or {}).get("nodes", [])]
                if nodes:
                    numa = b"".join(_field(1, _varint(1 << 3 | 0) + _varint(i)) for i in nodes)
                    device += _field(3, numa)
                container += _field(2, device)
            body += _field(3, container)
        out += _field(1, body)
    return out


def pod(namespace: str, name: str, container: str, resource: str, *device_ids: str) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "containers": [
        {"name": container, "devices": [{"resource_name": resource, "device_ids": list(device_ids),
                                         "topology": {"nodes": [{"id": 0}]}}]}]}


class Kubelet:
    """Serves `reply` (the JSON shape) to every List; `set` replaces it; `calls` counts them."""

    def __init__(self, reply: dict[str, Any]) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="kubelet-")  # short: a socket path has ~100 bytes
        self.socket = str(Path(self._dir.name) / "kubelet.sock")
        self._reply, self.calls = encode(reply), 0
        self._lock = threading.Lock()
        handler = grpc.method_handlers_generic_handler(SERVICE, {"List": grpc.unary_unary_rpc_method_handler(
            self._list, request_deserializer=None, response_serializer=None)})
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=(handler,))
        self.server.add_insecure_port(f"unix://{self.socket}")
        self.server.start()

    def _list(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self._lock:
            self.calls += 1
            return self._reply

    def set(self, reply: dict[str, Any]) -> None:
        with self._lock:
            self._reply = encode(reply)

    def stop(self) -> None:
        self.server.stop(grace=None)
        self._dir.cleanup()
