"""Scrapes of the demo cluster at a point in time, as the Collector would forward them."""

from __future__ import annotations

from opentelemetry.proto.metrics.v1.metrics_pb2 import ResourceMetrics

from otelgpu.demo.otlp import Series, kvs, scrape
from otelgpu.demo.scenario import Node, Pod
from otelgpu.enrich.labels import ksm_label_name

DRIVER = "575.51.03"
PHASES = ("Pending", "Running", "Succeeded", "Failed", "Unknown")


def dcgm(node: Node, time_ns: int, hour: float) -> ResourceMetrics:
    active: list[Series] = []
    util: list[Series] = []
    fb: list[Series] = []
    for d in node.devices:
        base = {"DCGM_FI_DRIVER_VERSION": DRIVER, "Hostname": node.name, "UUID": d.uuid, "device": f"nvidia{d.index}",
                "gpu": str(d.index), "modelName": d.model, "pci_bus_id": f"00000000:{0x10 + d.index * 0x10:02X}:00.0",
                "GPU_I_ID": d.gi, "GPU_I_PROFILE": d.profile}
        if node.shared:
            shares = [(i, p, p.activity(hour)) for i, p in enumerate(node.shared)]
            device_util = min(sum(u for _, _, u in shares), 1.0)
            util.append((base, round(device_util * 100)))
            for vgpu, p, u in shares:
                who = {**base, **_workload(p)}
                active.append((who, device_util))  # dcgm-exporter copies device-level profiling metrics per pod
                util.append(({**who, "pod_uid": p.uid, "vgpu": str(vgpu)}, round(u * 100)))
                fb.append(({**who, "pod_uid": p.uid, "vgpu": str(vgpu)}, 4000.0 + 100 * vgpu))
            continue
        activity = d.holder.activity(hour) if d.holder else 0.0
        labels = {**base, **(_workload(d.holder) if d.holder else {})}
        active.append((labels, round(activity, 6)))
        fb.append((labels, 9000.0 if d.holder else 0.0))
        if not d.profile:  # DCGM_FI_DEV_GPU_UTIL does not exist on MIG instances
            util.append((labels, round(activity * 100)))
    return scrape("dcgm-exporter", f"{node.ip}:9400", node.name, time_ns,
                  {"DCGM_FI_DEV_FB_USED": fb, "DCGM_FI_DEV_GPU_UTIL": util, "DCGM_FI_PROF_GR_ENGINE_ACTIVE": active})


def _workload(pod: Pod) -> dict[str, str]:
    return {"namespace": pod.namespace, "pod": pod.name, "container": pod.container}


def ksm(nodes: list[Node], ns_labels: dict[str, dict[str, str]], time_ns: int) -> ResourceMetrics:
    series: dict[str, list[Series]] = {k: [] for k in (
        "kube_node_info", "kube_node_labels", "kube_node_status_capacity", "kube_namespace_labels", "kube_pod_info",
        "kube_pod_labels", "kube_pod_status_phase", "kube_pod_container_resource_requests")}
    for ns, labels in ns_labels.items():
        series["kube_namespace_labels"].append(({"namespace": ns, **_labels(labels)}, 1.0))
    for node in nodes:
        series["kube_node_info"].append(({"node": node.name, "provider_id": node.provider_id,
                                          "internal_ip": node.ip}, 1.0))
        series["kube_node_labels"].append(({"node": node.name, **_labels(node.labels)}, 1.0))
        for res, qty in node.capacity.items():
            unit = {"cpu": "core", "memory": "byte"}.get(res, "integer")
            series["kube_node_status_capacity"].append(({"node": node.name, "resource": res, "unit": unit}, float(qty)))
        for p in node_pods(node):
            ident = {"namespace": p.namespace, "pod": p.name, "uid": p.uid}
            series["kube_pod_info"].append(({**ident, "node": node.name, "host_ip": node.ip,
                                             "created_by_kind": "ReplicaSet",
                                        "created_by_name": p.name.rsplit("-", 1)[0]}, 1.0))
            series["kube_pod_labels"].append(({**ident, **_labels(p.labels)}, 1.0))
            for phase in PHASES:
                series["kube_pod_status_phase"].append(({**ident, "phase": phase}, float(phase == "Running")))
            req = {**ident, "node": node.name, "container": p.container}
            series["kube_pod_container_resource_requests"] += [
                ({**req, "resource": p.resource, "unit": "integer"}, float(p.count)),
                ({**req, "resource": "cpu", "unit": "core"}, p.cpu),
                ({**req, "resource": "memory", "unit": "byte"}, p.memory_gib * 2**30)]
    return scrape("kube-state-metrics", "10.20.0.77:8080", "ip-10-20-0-5.us-west-2.compute.internal", time_ns, series)


def _labels(k8s_labels: dict[str, str]) -> dict[str, str]:
    return {ksm_label_name(k): v for k, v in k8s_labels.items()}


def node_pods(node: Node) -> list[Pod]:
    return list({id(p): p for p in [d.holder for d in node.devices if d.holder] + node.shared}.values())


def cadvisor(node: Node, time_ns: int, elapsed_s: float) -> ResourceMetrics:
    """The kubelet's cAdvisor scrape: per-container CPU (a cumulative counter) and working set."""
    rm = scrape("kubelet", f"{node.ip}:10250", node.name, time_ns, {"container_memory_working_set_bytes": [
        (_cgroup(p), p.memory_used_gib * 2**30) for p in node_pods(node)]})
    cpu = rm.scope_metrics[0].metrics.add(name="container_cpu_usage_seconds_total")
    cpu.sum.is_monotonic = True
    cpu.sum.aggregation_temporality = 2  # cumulative, as the prometheus receiver sends counters
    for p in node_pods(node):
        point = cpu.sum.data_points.add(time_unix_nano=time_ns, as_double=p.cpu_used * elapsed_s)
        point.attributes.extend(kvs(_cgroup(p)))
    return rm


def _cgroup(pod: Pod) -> dict[str, str]:
    return {"namespace": pod.namespace, "pod": pod.name, "container": pod.container,
            "id": f"/kubepods/burstable/pod{pod.uid}/{pod.container}", "image": f"registry.example/{pod.container}:1"}


def vllm(node: Node, time_ns: int, elapsed_s: float) -> list[ResourceMetrics]:
    """Each serving pod's own scrape (its namespace and pod are the resource's, from service
    discovery): vLLM's token counters, one series per tenant, counted from the replay's start."""
    out = []
    for p in node_pods(node):
        if not p.serves:
            continue
        rm = scrape("vllm", f"{node.ip}:8000", node.name, time_ns, {})
        rm.resource.attributes.extend(kvs({"k8s.namespace.name": p.namespace, "k8s.pod.name": p.name}))
        for k, name in enumerate(("vllm:prompt_tokens_total", "vllm:generation_tokens_total")):
            counter = rm.scope_metrics[0].metrics.add(name=name)
            counter.sum.is_monotonic = True
            counter.sum.aggregation_temporality = 2  # cumulative
            for tenant, rates in sorted(p.serves.items()):
                point = counter.sum.data_points.add(time_unix_nano=time_ns, as_double=rates[k] * elapsed_s)
                point.attributes.extend(kvs({"engine": "0", "model_name": p.served_model, "tenant": tenant}))
        out.append(rm)
    return out
