"""Mutators: one generator of hostile input per class, each `(rng, t, valid request) -> Hostile`
for the valid scrape at time `t` that it is mixed into (see fuzz_traffic.py for the rules).

STRUCTURED classes build OTLP messages; WIRE classes build bytes that go out as they are;
`broken_http` breaks a raw HTTP request."""

from __future__ import annotations

import math
import random
import struct
import time

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.metrics.v1.metrics_pb2 import ResourceMetrics

from fuzz_traffic import A10G, A100, Generator, Hostile, both, harmless, hostile_scrape, invalid, point, points_of
from fuzz_traffic import target, variants
from otelgpu.enrich.window import NS

STALE_NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000002))[0]  # Prometheus' stale marker, no flag
DAY = 86400 * NS
U64_MAX, I64_MAX, I64_MIN = 2**64 - 1, 2**63 - 1, -(2**63)
ACTIVE, PHASE, CPU = "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "kube_pod_status_phase", "container_cpu_usage_seconds_total"
REQUESTS, CAPACITY, NODE_LABELS = "kube_pod_container_resource_requests", "kube_node_status_capacity", "kube_node_labels"
COUNT, REPLICAS = "label_nvidia_com_gpu_count", "label_nvidia_com_gpu_replicas"
INSTANCE = "label_node_kubernetes_io_instance_type"
Req = ExportMetricsServiceRequest


def _ksm(metrics: dict) -> ResourceMetrics:
    """A kube-state-metrics target of its own (its facts may still name valid nodes and pods)."""
    return target("kube-state-metrics", "evil-ksm", metrics)


def non_finite(rng: random.Random, t: int, req: Req) -> Hostile:
    """NaN, infinities and the stale-marker NaN without its flag, on valid series."""
    pick = lambda: {"value": rng.choice([math.nan, math.inf, -math.inf, STALE_NAN])}  # noqa: E731
    return invalid(variants(req, ACTIVE, {"UUID": "GPU-a0"}, [pick(), pick()]),
                   variants(req, REQUESTS, {"pod": "train", "resource": "nvidia_com_gpu"}, [pick()]),
                   variants(req, CAPACITY, {"node": "gpu-b", "resource": "cpu"}, [pick()]),
                   variants(req, CPU, {"pod": "llm-0", "container": "main"}, [pick()]))


def out_of_range(rng: random.Random, t: int, req: Req) -> Hostile:
    """Activity outside 0..1 (or 0..100 %), negative CPU and memory use, on valid series."""
    ratios = [{"value": v} for v in rng.sample([87.0, -0.25, 1.5, 1e300], 2)]
    return invalid(variants(req, ACTIVE, {"UUID": "GPU-b0"}, ratios),
                   variants(req, ACTIVE, {"UUID": "GPU-a3"}, [{"value": rng.choice([250.0, -3.0])}],
                            as_name="DCGM_FI_DEV_GPU_UTIL"),
                   variants(req, CPU, {"pod": "train", "container": "main"}, [{"value": -1.0}]),
                   variants(req, "container_memory_working_set_bytes", {"pod": "train"}, [{"value": -5.0}]))


def _blind_pod(t: int, resource: str, qty: float) -> tuple[ResourceMetrics, ResourceMetrics]:
    """(its request, its info and phase): a Running pod on a hostile node DCGM does not report."""
    pod = {"namespace": "evil", "pod": "evil-blind"}
    request = _ksm({REQUESTS: [point({**pod, "container": "main", "node": "evil-blind", "resource": resource},
                                     t, qty)]})
    return request, _ksm({"kube_pod_info": [point({**pod, "node": "evil-blind", "uid": "evil-uid"}, t, 1.0)],
                          PHASE: [point({**pod, "phase": "Running"}, t, 1.0)]})


def absurd_requests(rng: random.Random, t: int, req: Req) -> Hostile:
    """Requests of a million GPUs, negative cores, 1e30 bytes: on valid pods and on a hostile one."""
    cases = [("train", "nvidia_com_gpu", 1e6), ("train", "nvidia_com_gpu", -2.0), ("llm-0", "cpu", 1e9),
             ("llm-0", "cpu", -4.0), ("tenant-0", "memory", 1e30), ("tenant-1", "memory", -1.0),
             ("embed", "nvidia_com_mig_3g_40gb", 1e5)]
    bad = [variants(req, REQUESTS, {"pod": p, "resource": r}, [{"value": v}]) for p, r, v in rng.sample(cases, 3)]
    request, info = _blind_pod(t, "nvidia_com_gpu", rng.choice([1e12, 1e18]))
    return both(bad + [request], [info])


def absurd_capacity(rng: random.Random, t: int, req: Req) -> Hostile:
    """Node capacities of 1e12 cores, -1 bytes, a million GPUs."""
    cases = [("gpu-a", "cpu", 1e12), ("gpu-b", "memory", -1.0), ("mig-1", "cpu", -96.0),
             ("ts-1", "nvidia_com_gpu", 1e6)]
    bad = [variants(req, CAPACITY, {"node": n}, [{"value": v, "labels": {"resource": r}}])
           for n, r, v in rng.sample(cases, 2)]
    # A node without GFD's count label is counted from its capacity.
    evil = _ksm({CAPACITY: [point({"node": "evil-cap", "resource": "nvidia_com_gpu", "unit": "integer"}, t, 1e12)]})
    return invalid(*bad, evil)


def absurd_gpu_count(rng: random.Random, t: int, req: Req) -> Hostile:
    """GFD's nvidia.com/gpu.count of -3, 10,000 or 10**20 on a valid node, 10**12 on a hostile one."""
    node, count = rng.choice([("gpu-a", "-3"), ("gpu-b", "10000"), ("mig-1", "99999999999999999999"),
                              ("ts-1", "4096")])
    evil = _ksm({NODE_LABELS: [point({"node": "evil-count", COUNT: "1000000000000", INSTANCE: "g5.xlarge"}, t, 1.0)]})
    return invalid(variants(req, NODE_LABELS, {"node": node}, [{"labels": {COUNT: count}}]), evil)


def absurd_replicas(rng: random.Random, t: int, req: Req) -> Hostile:
    """Time-slicing replicas (nvidia.com/gpu.replicas) of 0, -4, a million, 10**20."""
    value = rng.choice(["1000000", "0", "-4", "99999999999999999999"])
    labels = {"node": "evil-ts", COUNT: "1", REPLICAS: "1000000000", INSTANCE: "g5.xlarge"}
    evil = _ksm({NODE_LABELS: [point(labels, t, 1.0)]})
    return invalid(variants(req, NODE_LABELS, {"node": "ts-1"}, [{"labels": {REPLICAS: value}}]), evil)


def mig_ids(rng: random.Random, t: int, req: Req) -> Hostile:
    """MIG instances on the valid H100 with impossible GPU_I_ID or GPU_I_PROFILE values."""
    cases = [{"GPU_I_PROFILE": "999g.999gb", "GPU_I_ID": "5"}, {"GPU_I_ID": "-1"}, {"GPU_I_ID": "99999999999999999999"},
             {"GPU_I_PROFILE": "", "GPU_I_ID": "7"}, {"GPU_I_ID": "abc"}]
    bad = variants(req, ACTIVE, {"UUID": "GPU-h", "GPU_I_ID": "9"},
                   [{"labels": c, "value": 0.9} for c in rng.sample(cases, 2)])
    # Thirty 7-slice instances on one hostile GPU: absurd, but about a hostile node only.
    gpu = {"Hostname": "evil-mig2", "UUID": "EVIL-MIG-9", "GPU_I_PROFILE": "7g.40gb", "modelName": A100}
    evil = target("dcgm-exporter", "evil-mig2", {ACTIVE: [point({**gpu, "GPU_I_ID": str(i)}, t, 0.5)
                                                          for i in range(30)]})
    return both([bad], [evil])


def empty_names(rng: random.Random, t: int, req: Req) -> Hostile:
    """Empty pod, UUID, Hostname, node and namespace names next to valid series."""
    ghost = {"namespace": "ml", "pod": ""}
    cases = [
        lambda: variants(req, ACTIVE, {"UUID": "GPU-a3"}, [{"labels": {**ghost, "container": "main"}, "value": 0.8}]),
        lambda: variants(req, ACTIVE, {"UUID": "GPU-a0"}, [{"labels": {"UUID": ""}}]),
        lambda: variants(req, ACTIVE, {"UUID": "GPU-b3"}, [{"labels": {"Hostname": ""}}]),
        lambda: _ksm({"kube_pod_info": [point({**ghost, "node": "gpu-a", "uid": "u"}, t, 1.0)],
                      PHASE: [point({**ghost, "phase": "Running"}, t, 1.0)],
                      REQUESTS: [point({**ghost, "container": "main", "resource": "cpu", "node": "gpu-a"}, t, 10.0)]}),
        lambda: _ksm({NODE_LABELS: [point({"node": "", COUNT: "2", INSTANCE: "p4d.24xlarge"}, t, 1.0)]}),
        lambda: variants(req, REQUESTS, {"pod": "train", "resource": "cpu"}, [{"labels": {"namespace": ""}}]),
    ]
    return invalid(*(make() for make in rng.sample(cases, 3)))


def far_future(rng: random.Random, t: int, req: Req) -> Hostile:
    """A day or ten years past the receiver's clock (not the data's: replayed data may be old)."""
    now = max(t, time.time_ns())
    when = lambda: rng.choice([now + DAY, now + 3650 * DAY, I64_MAX, U64_MAX])  # noqa: E731
    return invalid(variants(req, ACTIVE, {"UUID": "GPU-a0"}, [{"time": when()}]),
                   variants(req, PHASE, {"pod": "train", "phase": "Running"}, [{"time": when()}]),
                   variants(req, NODE_LABELS, {"node": "gpu-b"}, [{"time": when(), "labels": {COUNT: "8"}}]))


def far_past(rng: random.Random, t: int, req: Req) -> Hostile:
    """Plausible old values (an unheld GPU active, an older replica count, a larger request),
    stamped in 1970, 2000 or a month before the cluster's data."""
    when = lambda: rng.choice([1, NS, 946_684_800 * NS, t - 30 * DAY])  # noqa: E731
    evil = {"Hostname": "evil-old", "UUID": "EVIL-OLD-0", "modelName": A10G}
    return invalid(variants(req, ACTIVE, {"UUID": "GPU-a3"}, [{"time": when(), "value": 0.9}]),
                   variants(req, NODE_LABELS, {"node": "ts-1"}, [{"time": when(), "labels": {REPLICAS: "2"}}]),
                   variants(req, REQUESTS, {"pod": "llm-0", "resource": "cpu"}, [{"time": when(), "value": 40.0}]),
                   target("dcgm-exporter", "evil-old", {ACTIVE: [point(evil, when(), 0.5)]}))


def int_overflow(rng: random.Random, t: int, req: Req) -> Hostile:
    """Values and ids at and past the 64-bit limits."""
    cases = [
        lambda: variants(req, REQUESTS, {"pod": "train", "resource": "cpu"}, [{"int": I64_MAX}]),
        lambda: variants(req, CAPACITY, {"node": "gpu-a", "resource": "memory"}, [{"int": I64_MIN}]),
        lambda: variants(req, ACTIVE, {"UUID": "GPU-a2"}, [{"int": I64_MAX}]),
        lambda: variants(req, ACTIVE, {"UUID": "GPU-b0"}, [{"time": U64_MAX}]),
        lambda: variants(req, NODE_LABELS, {"node": "gpu-a"}, [{"labels": {COUNT: "18446744073709551617"}}]),
        lambda: variants(req, ACTIVE, {"UUID": "GPU-h", "GPU_I_ID": "9"},
                         [{"labels": {"GPU_I_ID": "18446744073709551617"}, "value": 0.9}]),
        lambda: variants(req, REQUESTS, {"pod": "embed", "resource": "nvidia_com_mig_3g_40gb"}, [{"value": 2.0**64}]),
    ]
    return invalid(*(make() for make in rng.sample(cases, 3)))


def _as_kind(req: Req, name: str, match: dict[str, str], kind: str) -> ResourceMetrics:
    """The valid point `name{match}` sent as a histogram, summary, exponential histogram or a
    metric without data."""
    rm = variants(req, name, match, [{}])
    m = rm.scope_metrics[0].metrics[0]
    p = points_of(m)[0]
    attrs, when = list(p.attributes), p.time_unix_nano
    m.ClearField(m.WhichOneof("data"))
    if kind != "none":
        getattr(m, kind).data_points.add(attributes=attrs, time_unix_nano=when, count=1)
    return rm


def swapped_types(rng: random.Random, t: int, req: Req) -> Hostile:
    """Valid series as histograms, summaries or without data, or under another metric's name."""
    series = [(ACTIVE, {"UUID": "GPU-a0"}), (REQUESTS, {"pod": "train", "resource": "nvidia_com_gpu"}),
              (NODE_LABELS, {"node": "ts-1"}), (PHASE, {"pod": "llm-1", "phase": "Running"})]
    kinds = ["histogram", "summary", "exponential_histogram", "none"]
    bad = [_as_kind(req, name, match, rng.choice(kinds)) for name, match in rng.sample(series, 2)]
    bad += [variants(req, PHASE, {"pod": "train", "phase": "Running"}, [{}], as_name=ACTIVE),  # no UUID
            variants(req, ACTIVE, {"UUID": "GPU-a1"}, [{}], as_name=CAPACITY)]  # no node, no resource
    # The same gauge point again as a delta Sum: a duplicate, harmless either way.
    dup = variants(req, ACTIVE, {"UUID": "GPU-b0"}, [{}])
    m = dup.scope_metrics[0].metrics[0]
    pts = list(m.gauge.data_points)
    m.ClearField("gauge")
    m.sum.aggregation_temporality = 1
    m.sum.data_points.extend(pts)
    return both(bad, [dup])


def huge_labels(rng: random.Random, t: int, req: Req) -> Hostile:
    """A 1 MiB pod name, a 64 KiB label key, 5,000 labels on a point, a 100 kB team value."""
    big = lambda n: rng.choice("xyz") * n  # noqa: E731
    evil = {"Hostname": "evil-huge", "UUID": "EVIL-HUGE-0", "modelName": A10G, "namespace": "evil", "container": "c"}
    dcgm = target("dcgm-exporter", "evil-huge", {ACTIVE: [
        point({**evil, "pod": big(2**20)}, t, 0.5),
        point({**evil, "UUID": "EVIL-HUGE-1", "pod": "evil-p", big(2**16): "v"}, t, 0.5),
        point({**evil, "UUID": "EVIL-HUGE-2", "pod": "evil-q", **{f"k{i}": str(i) for i in range(5000)}}, t, 0.5)]})
    team = {"namespace": "evil", "pod": "evil-p", "label_team": big(100_000)}
    labels = _ksm({"kube_pod_labels": [point(team, t, 1.0)]})
    junk = variants(req, ACTIVE, {"UUID": "GPU-a0"}, [{"labels": {"junk": big(2**18)}}])  # a duplicate plus a label
    return harmless(dcgm, labels, junk)


def cardinality_bomb(rng: random.Random, t: int, req: Req) -> Hostile:
    """150 pods on 50 GPUs of one hostile node, 100 MIG instances on one GPU, 150 team values."""
    tag = f"{rng.getrandbits(32):x}"
    pods = [{"namespace": "evil", "pod": f"bomb-{tag}-{i}"} for i in range(150)]
    node = {"Hostname": "evil-bomb", "modelName": A10G}
    mig = {**node, "UUID": "EVIL-BOMB-MIG", "GPU_I_PROFILE": "1g.5gb", "modelName": A100}
    dcgm = target("dcgm-exporter", "evil-bomb", {ACTIVE: [
        *(point({**node, **p, "UUID": f"EVIL-BOMB-{i % 50}", "container": "main"}, t, 0.5) for i, p in enumerate(pods)),
        *(point({**mig, "GPU_I_ID": str(i)}, t, 0.3) for i in range(100))]})
    ksm = _ksm({"kube_pod_info": [point({**p, "node": "evil-bomb", "uid": p["pod"]}, t, 1.0) for p in pods],
                PHASE: [point({**p, "phase": "Running"}, t, 1.0) for p in pods],
                "kube_pod_labels": [point({**p, "label_team": f"team-{tag}-{i}"}, t, 1.0) for i, p in enumerate(pods)],
                NODE_LABELS: [point({"node": "evil-bomb", COUNT: "51", INSTANCE: "g5.48xlarge"}, t, 1.0)]})
    return harmless(dcgm, ksm)


def hostile_provider_ids(rng: random.Random, t: int, req: Req) -> Hostile:
    """kube_node_info of hostile nodes whose provider_id is 100 kB, a path, markup or newlines, one
    of them with a GPU in use: none may name an instance beyond what its id says, nor touch valid nodes."""
    ids = rng.sample(["aws:///us-east-1a/" + "i-" + "f" * 100_000, "aws:///zone/i-0abc/../../etc/passwd",
                      "aws:///zone/i-0abc\nteam=\"x\"", "<script>i-0abc</script>", "i-", "gce://p/z/i-0abc"], 3)
    nodes = [f"evil-pid-{k}" for k in range(len(ids))]
    info = _ksm({"kube_node_info": [point({"node": n, "provider_id": pid}, t, 1.0) for n, pid in zip(nodes, ids)],
                 NODE_LABELS: [point({"node": n, COUNT: "1", INSTANCE: "g5.xlarge"}, t, 1.0) for n in nodes]})
    gpu = target("dcgm-exporter", nodes[0], {ACTIVE: [point({"Hostname": nodes[0], "UUID": "EVIL-PID-0",
                                                             "modelName": A10G}, t, 0.5)]})
    return harmless(info, gpu)


def foreign_nodes(rng: random.Random, t: int, req: Req) -> Hostile:
    """Well-formed scrapes of nodes that are not the valid cluster's: the control class."""
    return harmless(*hostile_scrape(t).resource_metrics)


def _of_node(req: Req, node: str, jobs: tuple[str, ...]) -> list[ResourceMetrics]:
    """The targets in `req` that scrape `node` for one of `jobs`."""
    def attr(rm: ResourceMetrics, key: str) -> str:
        return next((kv.value.string_value for kv in rm.resource.attributes if kv.key == key), "")

    return [rm for rm in req.resource_metrics if attr(rm, "k8s.node.name") == node and attr(rm, "service.name") in jobs]


def skewed_target(rng: random.Random, t: int, req: Req) -> Hostile:
    """One well-formed scrape target of another node stamped 9 minutes ahead of the cluster (the
    receiver allows 10 minutes of clock skew)."""
    return harmless(*_of_node(hostile_scrape(t + 540 * NS), "evil-gpu", ("dcgm-exporter",)))


def skewed_node(rng: random.Random, t: int, req: Req) -> Hostile:
    """Both targets of another node (dcgm-exporter and the kubelet, as a Collector running on
    that node scrapes them) stamped 9 minutes ahead."""
    return harmless(*_of_node(hostile_scrape(t + 540 * NS), "evil-gpu", ("dcgm-exporter", "kubelet")))


STRUCTURED: dict[str, Generator] = {g.__name__: g for g in (
    foreign_nodes, non_finite, out_of_range, absurd_requests, absurd_capacity, absurd_gpu_count, absurd_replicas,
    mig_ids, empty_names, far_future, far_past, int_overflow, swapped_types, huge_labels, cardinality_bomb,
    skewed_target, skewed_node, hostile_provider_ids)}


# --- wire bytes ----------------------------------------------------------------------------------

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def bitflip(rng: random.Random, t: int, req: Req) -> Hostile:
    """A scrape of hostile nodes with 1 to 8 bits flipped: it may still decode."""
    data = bytearray(hostile_scrape(t).SerializeToString())
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return Hostile(raw=bytes(data))


def truncation(rng: random.Random, t: int, req: Req) -> Hostile:
    """A hostile scrape, or a copy of the valid one (a duplicate where it decodes), cut short."""
    data = (hostile_scrape(t) if rng.random() < 0.5 else req).SerializeToString()
    return Hostile(raw=data[:rng.randrange(len(data))])


def garbage(rng: random.Random, t: int, req: Req) -> Hostile:
    """Bytes no Collector sends: half of them cannot decode at all."""
    deep = _field(1, b"x")  # AnyValue{string}; then kvlist{KeyValue{key, value}} 200 deep
    for _ in range(200):
        deep = _field(6, _field(1, _field(1, b"k") + _field(2, deep)))
    undecodable = [b"\xff" * 11,  # a varint longer than 64 bits
                   b"\x0a" + _varint(2**62),  # a length past the end
                   _field(1, _field(1, _field(1, _field(1, b"deep") + _field(2, deep)))),  # nesting past the limit
                   _field(1, _field(1, _field(1, _field(1, b"\xff\xfe"))))]  # a key that is not UTF-8
    if rng.random() < 0.5:
        return Hostile(raw=rng.choice(undecodable), undecodable=True)
    return Hostile(raw=rng.choice([b"", bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300))),
                                   _varint(536870911 << 3) + b"\x01"]))  # an unknown field


WIRE: dict[str, Generator] = {g.__name__: g for g in (bitflip, truncation, garbage)}


def broken_http(rng: random.Random, data: bytes) -> bytes:
    """A raw HTTP request `data` broken one of the ways requests get broken on the way: cut, a byte
    changed, bytes inserted or removed, a header repeated, a Content-Length that lies."""
    kind, at = rng.randrange(6), rng.randrange(len(data))
    if kind == 0:
        return data[:at]
    if kind == 1:
        return data[:at] + bytes([rng.randrange(256)]) + data[at + 1:]
    if kind == 2:
        return data[:at] + rng.randbytes(rng.randrange(1, 40)) + data[at:]
    if kind == 3:
        return data[:at] + data[at + rng.randrange(1, 200):]
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    if kind == 4:
        line = rng.choice(lines[1:])
        return b"\r\n".join(lines + [line]) + b"\r\n\r\n" + body
    length = rng.choice([0, 1, len(body) - 1, len(body) + 1, len(body) * 2, 2**31, 10**20])
    return b"\r\n".join(line if not line.startswith(b"Content-Length") else b"Content-Length: " + str(length).encode()
                        for line in lines) + b"\r\n\r\n" + body
