"""Traffic for the fuzz tests and benchmark: a valid GPU cluster, the points a mutation copies
from its scrapes, and the plan that mixes hostile input into those scrapes (before, between and
inside the valid requests). The mutations themselves are in fuzzing.py.

Hostile data about nodes of its own (names, UUIDs and pods the valid cluster never uses) may be
accepted and costed there. Points about the valid cluster's series must be invalid, and so
rejected: a copy of a valid point with a NaN, an absurd quantity, an empty name or a timestamp
decades away. Each mutation says how many of its points must be rejected (`must`) and how many
more a stricter validator may reject too (`may`)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import NumberDataPoint, ResourceMetrics

from cluster import Cluster, Node, Pod, Unit
from otelgpu.demo.otlp import SCOPE

A100, A10G, H100 = "NVIDIA A100-SXM4-40GB", "NVIDIA A10G", "NVIDIA H100 80GB HBM3"
PRICES = {A100: 4.0, A10G: 1.2, H100: 7.0}
VALID_NODES = frozenset({"gpu-a", "gpu-b", "mig-1", "ts-1"})


def valid_cluster(t0: int) -> Cluster:
    """Two whole-GPU nodes, a mixed-MIG H100 and a time-sliced A10G; five teams; CPU and memory
    use on every node (scad)."""
    count = lambda n: {"nvidia.com/gpu.count": str(n)}  # noqa: E731
    nodes = [
        Node("gpu-a", "p4d.24xlarge", 96, 1152, count(4), [Unit(f"GPU-a{i}", A100) for i in range(4)]),
        Node("gpu-b", "g5.12xlarge", 48, 192, count(4), [Unit(f"GPU-b{i}", A10G) for i in range(4)]),
        Node("mig-1", "p5.48xlarge", 192, 2048, count(1), [Unit("GPU-h", H100, "3g.40gb", "2"),
             Unit("GPU-h", H100, "2g.20gb", "3"), Unit("GPU-h", H100, "1g.10gb", "9")]),
        Node("ts-1", "g5.2xlarge", 8, 32, {**count(1), "nvidia.com/gpu.replicas": "4",
             "nvidia.com/gpu.sharing-strategy": "time-slicing"}, [Unit("GPU-t", A10G)]),
    ]
    gpu = lambda n, res="nvidia_com_gpu": (res, n)  # noqa: E731
    pods = [
        Pod("ml", "train", "gpu-a", {"team": "research"}, 16, 128, gpu(2), ("GPU-a0", "GPU-a1"), 0.9, 20, 100),
        Pod("web", "serve", "gpu-a", {"team": "search"}, 8, 64, gpu(1), ("GPU-a2",), 0.3, start_s=600),
        Pod("etl", "cpu-job", "gpu-a", {"team": "data"}, 4, 16, cpu_used=2, memory_used_gib=8, end_s=2400),
        Pod("infer", "llm-0", "gpu-b", {"team": "search"}, 4, 32, gpu(1), ("GPU-b0",), 0.5, 3, 20),
        Pod("infer", "llm-1", "gpu-b", {"team": "search"}, 4, 32, gpu(2), ("GPU-b1", "GPU-b2"), 0.6),
        Pod("search", "embed", "mig-1", {"team": "search"}, 8, 64, gpu(1, "nvidia_com_mig_3g_40gb"),
            ("GPU-h/2",), 0.6, 6, 40),
        Pod("research", "nb", "mig-1", {"team": "research"}, 2, 16, gpu(1, "nvidia_com_mig_2g_20gb"),
            ("GPU-h/3",), 0.1, 1, 4, end_s=3000),
        *(Pod("tenants", f"tenant-{i}", "ts-1", {"team": t}, 2, 8, gpu(1), ("GPU-t",), 0.4, 1.0, 4)
          for i, t in enumerate(("blue", "green", "blue"))),
    ]
    return Cluster(nodes, pods, {"ml": {"team": "research"}}, t0=t0)


def hostile_scrape(t: int) -> ExportMetricsServiceRequest:
    """One scrape at `t` of legitimate-looking nodes that are none of the valid cluster's, from
    scrape targets of their own (a kube-state-metrics instance of their own too)."""
    nodes = [Node("evil-gpu", "g5.12xlarge", 48, 192, {"nvidia.com/gpu.count": "2"},
                  [Unit("EVIL-GPU-0", A10G), Unit("EVIL-GPU-1", A10G)]),
             Node("evil-mig", "p4d.24xlarge", 96, 1152, {"nvidia.com/gpu.count": "1"},
                  [Unit("EVIL-MIG-0", A100, "3g.20gb", "1"), Unit("EVIL-MIG-0", A100, "1g.5gb", "7")])]
    pods = [Pod("evil", "evil-a", "evil-gpu", {"team": "evil-team"}, 4, 16, ("nvidia_com_gpu", 1), ("EVIL-GPU-0",),
                0.7, 2, 8),
            Pod("evil", "evil-b", "evil-mig", {"team": "evil-team"}, 2, 8, ("nvidia_com_mig_3g_20gb", 1),
                ("EVIL-MIG-0/1",), 0.2)]
    req = Cluster(nodes, pods, t0=t).scrape(0)
    ksm = req.resource_metrics[0]
    del ksm.resource.attributes[:]
    ksm.resource.attributes.extend(kvs({"service.name": "kube-state-metrics", "service.instance.id": "10.9.9.9:8080",
                                        "k8s.node.name": "evil-ksm"}))
    return req


# --- points ------------------------------------------------------------------------------------

def kvs(labels: dict[str, str]) -> list[KeyValue]:
    """Attributes, keeping empty values (the Collector drops them; a hostile sender need not)."""
    return [KeyValue(key=k, value=AnyValue(string_value=v)) for k, v in sorted(labels.items())]


def labels_of(p: NumberDataPoint) -> dict[str, str]:
    return {kv.key: kv.value.string_value for kv in p.attributes}


def points_of(m):  # noqa: ANN001, ANN201 - a Metric's NumberDataPoints, whichever kind it is
    return getattr(m, m.WhichOneof("data")).data_points


def count_points(rms: list[ResourceMetrics]) -> int:
    return sum(len(getattr(m, m.WhichOneof("data")).data_points) if m.WhichOneof("data") else 1
               for rm in rms for sm in rm.scope_metrics for m in sm.metrics)


def target(job: str, node: str, metrics: dict[str, list[NumberDataPoint]]) -> ResourceMetrics:
    """One scrape target's ResourceMetrics carrying gauge `metrics`."""
    rm = ResourceMetrics()
    rm.resource.attributes.extend(kvs({"service.name": job, "service.instance.id": f"{node}:1",
                                       "k8s.node.name": node}))
    sm = rm.scope_metrics.add(scope=SCOPE)
    for name, pts in metrics.items():
        sm.metrics.add(name=name).gauge.data_points.extend(pts)
    return rm


def point(labels: dict[str, str], t: int, value: float) -> NumberDataPoint:
    return NumberDataPoint(attributes=kvs(labels), time_unix_nano=t, as_double=value)


def vary(p: NumberDataPoint, change: dict) -> NumberDataPoint:
    """A copy of `p` with a new `value` (double), `int` (as_int), `time`, or `labels` (None deletes)."""
    q = NumberDataPoint()
    q.CopyFrom(p)
    if "value" in change:
        q.as_double = change["value"]
    if "int" in change:
        q.as_int = change["int"]
    q.time_unix_nano = change.get("time", q.time_unix_nano)
    if "labels" in change:
        labels = {**labels_of(q), **change["labels"]}
        del q.attributes[:]
        q.attributes.extend(kvs({k: v for k, v in labels.items() if v is not None}))
    return q


def variants(req: ExportMetricsServiceRequest, name: str, match: dict[str, str], changes: list[dict],
             as_name: Optional[str] = None) -> ResourceMetrics:
    """The target of the valid point `name{match}` in `req`, carrying one changed copy of that
    point per change (under `as_name` if given), in a metric of the same kind."""
    for rm in req.resource_metrics:
        for m in rm.scope_metrics[0].metrics:
            p = next((p for p in points_of(m) if m.name == name and match.items() <= labels_of(p).items()), None)
            if p is not None:
                out = ResourceMetrics(resource=rm.resource)
                copy = out.scope_metrics.add(scope=SCOPE).metrics.add(name=as_name or name)
                if m.HasField("sum"):
                    copy.sum.is_monotonic, copy.sum.aggregation_temporality = m.sum.is_monotonic, 2
                getattr(copy, m.WhichOneof("data")).data_points.extend(vary(p, c) for c in changes)
                return out
    raise LookupError(f"no {name}{match} in the valid request")


@dataclass
class Hostile:
    """One mutation's output: ResourceMetrics to mix into traffic, or wire bytes sent alone."""

    rms: list[ResourceMetrics] = field(default_factory=list)
    must: int = 0  # points that must be rejected
    may: int = 0  # further points a validator may reject too (about hostile nodes, or exact duplicates)
    raw: Optional[bytes] = None
    undecodable: bool = False  # raw bytes that must be answered INVALID_ARGUMENT


def invalid(*rms: ResourceMetrics) -> Hostile:
    return Hostile(list(rms), must=count_points(list(rms)))


def harmless(*rms: ResourceMetrics) -> Hostile:
    return Hostile(list(rms), may=count_points(list(rms)))


def both(bad: list[ResourceMetrics], other: list[ResourceMetrics]) -> Hostile:
    return Hostile(bad + other, must=count_points(bad), may=count_points(other))


Generator = Callable[[random.Random, int, ExportMetricsServiceRequest], Hostile]


# --- the wire -------------------------------------------------------------------------------------

@dataclass
class Send:
    """One Export call: a request (with what it must and may have rejected) or raw bytes."""

    payload: Union[ExportMetricsServiceRequest, bytes]
    must: int = 0
    may: int = 0
    undecodable: bool = False
    valid: bool = False  # carries one of the valid cluster's scrapes

    def wire(self) -> bytes:
        return self.payload if isinstance(self.payload, bytes) else self.payload.SerializeToString()


def _merge(req: ExportMetricsServiceRequest, rm: ResourceMetrics, rng: random.Random) -> bool:
    """Put the points of `rm` (one metric) into the same target's same metric in `req`, before or
    after the valid points; False where `req` has no such metric."""
    if len(rm.scope_metrics[0].metrics) != 1:
        return False
    theirs = rm.scope_metrics[0].metrics[0]
    for mine in (r for r in req.resource_metrics if r.resource == rm.resource):
        for m in mine.scope_metrics[0].metrics:
            if m.name == theirs.name and m.WhichOneof("data") == theirs.WhichOneof("data"):
                pts, extra = list(points_of(m)), list(points_of(theirs))
                del points_of(m)[:]
                points_of(m).extend(extra + pts if rng.random() < 0.5 else pts + extra)
                return True
    return False


def place(rng: random.Random, valid: ExportMetricsServiceRequest, hostiles: list[Hostile]) -> list[Send]:
    """The valid request with `hostiles` mixed in: each one alone before or after it, as further
    targets inside it, or merged into the metrics of the target it imitates."""
    main = Send(ExportMetricsServiceRequest(), valid=True)
    main.payload.CopyFrom(valid)
    before: list[Send] = []
    after: list[Send] = []
    for h in hostiles:
        modes = ("before", "after") if h.raw is not None else ("before", "after", "inside", "merge")
        mode = rng.choice(modes)
        if mode in ("before", "after"):
            payload = h.raw if h.raw is not None else ExportMetricsServiceRequest(resource_metrics=h.rms)
            (before if mode == "before" else after).append(Send(payload, h.must, h.may, h.undecodable))
            continue
        main.must, main.may = main.must + h.must, main.may + h.may
        for rm in h.rms:
            if mode == "merge" and _merge(main.payload, rm, rng):
                continue
            rms = list(main.payload.resource_metrics)
            rms.insert(rng.randint(0, len(rms)), rm)
            del main.payload.resource_metrics[:]
            main.payload.resource_metrics.extend(rms)
    return before + [main] + after


def plan(rng: random.Random, valid: list[ExportMetricsServiceRequest], generators: dict[str, Generator],
         per_class: int) -> list[Send]:
    """The valid requests in order with each class's mutations mixed in `per_class` times: at the
    first request (before any interval closed), at the last, and between."""
    at: dict[int, list[Hostile]] = {}
    middle = range(1, len(valid) - 1)
    for gen in generators.values():
        spots = [0, len(valid) - 1] + rng.sample(middle, max(per_class - 2, 0))
        for i in spots[:per_class]:
            at.setdefault(i, []).append(gen(rng, time_of(valid[i]), valid[i]))
    return [s for i, req in enumerate(valid) for s in place(rng, req, at.get(i, []))]


def time_of(req: ExportMetricsServiceRequest) -> int:
    m = req.resource_metrics[0].scope_metrics[0].metrics[0]
    return points_of(m)[0].time_unix_nano
