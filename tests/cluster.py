"""A small declarative GPU cluster that scrapes itself: kube-state-metrics, dcgm-exporter and
kubelet/cAdvisor series at any second, as OTLP requests shaped like a Collector's prometheus
receiver sends them (gauges as Gauge, counters as cumulative monotonic Sum without start time)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.metrics.v1.metrics_pb2 import ResourceMetrics

from otelgpu.demo.objects import k8s_resource
from otelgpu.demo.otlp import Series, request, scrape
from otelgpu.enrich.labels import ksm_annotation_name, ksm_label_name
from otelgpu.enrich.window import NS

T0 = 1_700_000_000 * NS - (1_700_000_000 * NS) % (3600 * NS)  # an hour boundary, in the past
PHASES = ("Pending", "Running", "Succeeded", "Failed", "Unknown")


@dataclass
class Unit:
    """A DCGM entity: a whole GPU (no profile) or a MIG instance."""

    uuid: str
    model: str = "NVIDIA A100-SXM4-40GB"
    profile: str = ""
    gi: str = ""
    busy: float = 0.0  # its activity while no pod holds it (a process outside Kubernetes)
    memory_mib: Optional[float] = None  # DCGM_FI_DEV_FB_USED + FB_FREE, when the exporter sends them


@dataclass
class Node:
    name: str
    instance_type: str
    cpu: float
    memory_gib: float
    labels: dict[str, str] = field(default_factory=dict)  # Kubernetes label keys
    units: list[Unit] = field(default_factory=list)
    capacity: dict[str, float] = field(default_factory=dict)  # extra resources, KSM names
    provider_id: str = ""  # spec.providerID (kube_node_info's provider_id): none when empty

    def k8s_labels(self) -> dict[str, str]:
        return {"node.kubernetes.io/instance-type": self.instance_type, **self.labels}


@dataclass
class Pod:
    namespace: str
    name: str
    node: str
    labels: dict[str, str] = field(default_factory=dict)
    cpu: float = 0.0  # requested cores
    memory_gib: float = 0.0  # requested
    gpu: Optional[tuple[str, int]] = None  # (KSM resource, count) requested
    holds: tuple[str, ...] = ()  # UUIDs (or UUID/GI) of the units it holds, as DCGM maps them
    activity: float | Callable[[float], float] = 0.5  # or its activity at each scrape (seconds after T0)
    cpu_used: Optional[float] = None  # cores; None: no cAdvisor series
    memory_used_gib: Optional[float] = None
    start_s: float = 0.0  # running from (seconds after T0)
    end_s: float = float("inf")
    owner: Optional[tuple[str, str]] = None  # controller (kind, name): kube_pod_info's created_by_*
    ksm: bool = True  # False: kube-state-metrics does not report it (only DCGM and cAdvisor show it)
    # A vLLM server: tenant -> (prompt, generation) tokens a second while running, counted from the
    # pod's start, as vllm:*_tokens_total with a `tenant` label and model_name `serves_model`
    serves: dict[str, tuple[float, float]] = field(default_factory=dict)
    serves_model: str = "meta-llama/Llama-3.1-8B-Instruct"
    annotations: dict[str, str] = field(default_factory=dict)  # Kubernetes keys (kube_pod_annotations)
    extended: dict[str, float] = field(default_factory=dict)  # other extended resources requested, KSM names
    # The scrape (seconds after T0) at which its kube-state-metrics series end with staleness
    # markers, as Prometheus writes them at the first scrape a series is missing from
    ksm_stale_s: Optional[float] = None

    def running(self, t_s: float) -> bool:
        return self.start_s <= t_s < self.end_s


@dataclass
class Cluster:
    nodes: list[Node]
    pods: list[Pod]
    namespace_labels: dict[str, dict[str, str]] = field(default_factory=dict)
    t0: int = T0  # the time of t_s = 0, in ns

    def scrape(self, t_s: float, ksm: bool = True) -> ExportMetricsServiceRequest:
        t = self.t0 + int(t_s * NS)
        return request(*([self._ksm(t_s, t)] if ksm else []), *(self._dcgm(n, t_s, t) for n in self.nodes if n.units),
                       *(self._cadvisor(n, t_s, t) for n in self.nodes),
                       *(self._vllm(p, t_s, t) for p in self.pods if p.serves and p.running(t_s)))

    def _vllm(self, p: Pod, t_s: float, t: int) -> ResourceMetrics:
        """The pod's own scrape: its namespace and pod are the resource's, from service discovery."""
        rm = scrape("vllm", f"10.1.0.1:{8000 + self.pods.index(p)}", p.node, t, {
            name: [({"engine": "0", "model_name": p.serves_model, "tenant": tenant}, rates[k] * (t_s - p.start_s))
                   for tenant, rates in sorted(p.serves.items())]
            for k, name in enumerate(("vllm:prompt_tokens_total", "vllm:generation_tokens_total"))})
        rm.resource.attributes.add(key="k8s.namespace.name").value.string_value = p.namespace
        rm.resource.attributes.add(key="k8s.pod.name").value.string_value = p.name
        for m in rm.scope_metrics[0].metrics:  # counters: cumulative monotonic sums, as the receiver sends them
            if m.name.startswith("vllm:"):
                points = list(m.gauge.data_points)
                m.ClearField("gauge")
                m.sum.is_monotonic, m.sum.aggregation_temporality = True, 2
                m.sum.data_points.extend(points)
        return rm

    def scrapes(self, every_s: float, until_s: float, ksm: bool = True, from_s: float = 0.0
                ) -> list[ExportMetricsServiceRequest]:
        k, out = 0, []
        while from_s + k * every_s < until_s:
            out.append(self.scrape(from_s + k * every_s, ksm))
            k += 1
        return out

    def namespace_objects(self) -> list[dict]:
        names = sorted(set(self.namespace_labels) | {p.namespace for p in self.pods})
        return [{"apiVersion": "v1", "kind": "Namespace",
                 "metadata": {"name": ns, "labels": self.namespace_labels.get(ns, {})}} for ns in names]

    def node_objects(self) -> list[dict]:
        out = []
        for n in self.nodes:
            capacity = {"cpu": f"{n.cpu:g}", "memory": f"{int(n.memory_gib * 2**30)}",
                        **{k8s_resource(k): f"{v:g}" for k, v in n.capacity.items()}}
            out.append({"apiVersion": "v1", "kind": "Node", "metadata": {"name": n.name, "labels": n.k8s_labels()},
                        "spec": {"providerID": n.provider_id} if n.provider_id else {},
                        "status": {"capacity": capacity}})
        return out

    def pod_object(self, p: Pod) -> dict:
        requests = {"cpu": f"{p.cpu:g}", "memory": f"{int(p.memory_gib * 2**30)}"}
        if p.gpu:
            requests[k8s_resource(p.gpu[0])] = str(p.gpu[1])
        requests.update({k8s_resource(k): f"{v:g}" for k, v in p.extended.items()})
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": p.name, "namespace": p.namespace, "uid": f"uid-{p.namespace}-{p.name}",
                             "labels": dict(p.labels), "annotations": dict(p.annotations)},
                "spec": {"nodeName": p.node, "containers": [{"name": "main", "resources": {"requests": requests}}]},
                "status": {"phase": "Running"}}

    def _ksm(self, t_s: float, t: int) -> ResourceMetrics:
        g: dict[str, list[Series]] = {k: [] for k in (
            "kube_node_info", "kube_node_labels", "kube_node_status_capacity", "kube_namespace_labels",
            "kube_pod_info", "kube_pod_labels", "kube_pod_status_phase", "kube_pod_container_resource_requests",
            "kube_pod_annotations")}
        for ns, labels in self.namespace_labels.items():
            g["kube_namespace_labels"].append(({"namespace": ns, **_ksm_labels(labels)}, 1.0))
        for n in self.nodes:
            if n.provider_id:
                g["kube_node_info"].append(({"node": n.name, "provider_id": n.provider_id}, 1.0))
            g["kube_node_labels"].append(({"node": n.name, **_ksm_labels(n.k8s_labels())}, 1.0))
            for res, qty in {"cpu": n.cpu, "memory": n.memory_gib * 2**30, **n.capacity}.items():
                unit = {"cpu": "core", "memory": "byte"}.get(res, "integer")
                g["kube_node_status_capacity"].append(({"node": n.name, "resource": res, "unit": unit}, float(qty)))
        for p in self.pods:
            stale = p.ksm_stale_s == t_s
            if not (p.running(t_s) or stale) or not p.ksm:
                continue
            ident = {"namespace": p.namespace, "pod": p.name, "uid": f"uid-{p.namespace}-{p.name}"}
            before = {name: len(series) for name, series in g.items()}
            owner = {"created_by_kind": p.owner[0], "created_by_name": p.owner[1]} if p.owner else {}
            g["kube_pod_info"].append(({**ident, "node": p.node, **owner}, 1.0))
            g["kube_pod_labels"].append(({**ident, **_ksm_labels(p.labels)}, 1.0))
            if p.annotations:
                g["kube_pod_annotations"].append(({**ident, **{ksm_annotation_name(k): v for k, v in
                                                                p.annotations.items()}}, 1.0))
            for phase in PHASES:
                g["kube_pod_status_phase"].append(({**ident, "phase": phase}, float(phase == "Running")))
            req = {"container": "main", "node": p.node, **ident}
            for res, unit, qty in (("cpu", "core", p.cpu), ("memory", "byte", p.memory_gib * 2**30)):
                if qty:
                    g["kube_pod_container_resource_requests"].append(({**req, "resource": res, "unit": unit}, qty))
            gpu = {p.gpu[0]: p.gpu[1]} if p.gpu else {}
            for res, qty in {**gpu, **p.extended}.items():
                g["kube_pod_container_resource_requests"].append(({**req, "resource": res, "unit": "integer"}, float(qty)))
            if stale:  # NaN here: written as a staleness marker below
                for name, series in g.items():
                    series[before[name]:] = [(labels, math.nan) for labels, _ in series[before[name]:]]
        rm = scrape("kube-state-metrics", "10.0.0.2:8080", "ksm-node", t, {k: v for k, v in g.items() if v})
        for m in rm.scope_metrics[0].metrics:
            for dp in m.gauge.data_points:
                if math.isnan(dp.as_double):
                    dp.ClearField("as_double")
                    dp.flags = 1  # NO_RECORDED_VALUE
        return rm

    def _dcgm(self, node: Node, t_s: float, t: int) -> ResourceMetrics:
        active: list[Series] = []
        memory: dict[str, list[Series]] = {"DCGM_FI_DEV_FB_USED": [], "DCGM_FI_DEV_FB_FREE": []}
        for i, u in enumerate(node.units):
            base = {"Hostname": node.name, "UUID": u.uuid, "gpu": str(i), "modelName": u.model,
                    "GPU_I_ID": u.gi, "GPU_I_PROFILE": u.profile}
            if u.memory_mib is not None:
                memory["DCGM_FI_DEV_FB_USED"].append((base, 1000.0))
                memory["DCGM_FI_DEV_FB_FREE"].append((base, u.memory_mib - 1000.0))
            key = f"{u.uuid}/{u.gi}" if u.gi else u.uuid
            holders = [p for p in self.pods if p.node == node.name and p.running(t_s) and key in p.holds]
            if not holders:
                active.append((base, u.busy))
            for p in holders:  # time-sliced devices repeat the device series per pod
                activity = p.activity(t_s) if callable(p.activity) else p.activity
                active.append(({**base, "namespace": p.namespace, "pod": p.name, "container": "main"}, activity))
        return scrape("dcgm-exporter", f"{node.name}:9400", node.name, t,
                      {"DCGM_FI_PROF_GR_ENGINE_ACTIVE": active, **{k: v for k, v in memory.items() if v}})

    def _cadvisor(self, node: Node, t_s: float, t: int) -> ResourceMetrics:
        rm = scrape("kubelet", f"{node.name}:10250", node.name, t, {})
        cpu, mem = rm.scope_metrics[0].metrics.add(), rm.scope_metrics[0].metrics.add()
        cpu.name, mem.name = "container_cpu_usage_seconds_total", "container_memory_working_set_bytes"
        cpu.sum.is_monotonic = True
        cpu.sum.aggregation_temporality = 2  # cumulative
        for p in self.pods:
            if p.node != node.name or not p.running(t_s):
                continue
            labels = {"container": "main", "namespace": p.namespace, "pod": p.name,
                      "id": f"/kubepods/pod-{p.name}/main", "image": "img", "name": "main"}
            if p.cpu_used is not None:
                _point(cpu.sum.data_points.add(), labels, t, p.cpu_used * (t_s - p.start_s) + 1.0)
                _point(cpu.sum.data_points.add(), {**labels, "container": "", "id": f"/kubepods/pod-{p.name}"},
                       t, 999.0 * t_s)  # the pod-level cgroup series: never counted
            if p.memory_used_gib is not None:
                _point(mem.gauge.data_points.add(), labels, t, p.memory_used_gib * 2**30)
        # As the prometheus receiver: a metric no series of the scrape has is not sent at all.
        kept = [m for m in rm.scope_metrics[0].metrics if m.WhichOneof("data")]
        rm.scope_metrics[0].ClearField("metrics")
        rm.scope_metrics[0].metrics.extend(kept)
        return rm


def _point(dp, labels: dict[str, str], t: int, value: float) -> None:  # noqa: ANN001
    from otelgpu.demo.otlp import kvs

    dp.attributes.extend(kvs(labels))
    dp.time_unix_nano = t
    dp.as_double = value


def _ksm_labels(k8s: dict[str, str]) -> dict[str, str]:
    return {ksm_label_name(k): v for k, v in k8s.items()}
