"""The demo cluster as the Kubernetes API serves it: Namespace, Node and Pod objects carrying the
same facts its kube-state-metrics scrape does, so either source attributes it the same way."""

from __future__ import annotations

from typing import Any

from otelgpu.demo.scenario import Node, Pod
from otelgpu.demo.scrapes import node_pods
from otelgpu.enrich.nodes import profile_of_resource
from otelgpu.receiver.schema import MIG_PREFIX


def k8s_resource(ksm_name: str) -> str:
    """`nvidia_com_mig_1g_5gb` -> `nvidia.com/mig-1g.5gb`, `nvidia_com_gpu` -> `nvidia.com/gpu`."""
    if ksm_name.startswith(MIG_PREFIX):
        return "nvidia.com/mig-" + profile_of_resource(ksm_name)
    if ksm_name.startswith("nvidia_com_"):
        return "nvidia.com/" + ksm_name[len("nvidia_com_"):].replace("_", ".")
    return ksm_name


def _quantity(resource: str, value: float) -> str:
    return str(int(value)) if resource == "memory" or float(value).is_integer() else f"{value:g}"


def namespace(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": dict(labels)},
            "status": {"phase": "Active"}}


def node(spec: Node) -> dict[str, Any]:
    capacity = {k8s_resource(k): _quantity(k, v) for k, v in spec.capacity.items()}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": spec.name, "labels": dict(spec.labels)},
            "spec": {"providerID": spec.provider_id},
            "status": {"capacity": capacity, "allocatable": capacity,
                       "addresses": [{"type": "InternalIP", "address": spec.ip}]}}


def pod(spec: Pod, node_name: str) -> dict[str, Any]:
    requests = {k8s_resource(spec.resource): str(spec.count), "cpu": _quantity("cpu", spec.cpu),
                "memory": _quantity("memory", spec.memory_gib * 2**30)}
    replica_set = spec.name.rsplit("-", 1)[0]
    owner = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": replica_set, "uid": f"rs-{spec.uid}",
             "controller": True, "blockOwnerDeletion": True}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": spec.name, "namespace": spec.namespace, "uid": spec.uid, "labels": dict(spec.labels),
                         "ownerReferences": [owner]},
            "spec": {"nodeName": node_name, "containers": [
                {"name": spec.container, "image": f"registry.example/{spec.container}:1",
                 "resources": {"requests": requests, "limits": {k8s_resource(spec.resource): str(spec.count)}}}]},
            "status": {"phase": "Running", "hostIP": ""}}


def objects(nodes: list[Node], ns_labels: dict[str, dict[str, str]]) -> list[dict[str, Any]]:
    """Every Namespace, Node and Pod of the demo cluster."""
    pods = [(p, n.name) for n in nodes for p in node_pods(n)]
    names = sorted(set(ns_labels) | {p.namespace for p, _ in pods})
    return ([namespace(ns, ns_labels.get(ns, {})) for ns in names] + [node(n) for n in nodes]
            + [pod(p, name) for p, name in pods])
