"""The columnar decoder (numba over the wire bytes) against the reference decoder (protobuf
messages, a Python loop per point): on every fixture, on the fuzz classes' hostile traffic, on
random bit flips and cuts, and on values and labels at every bound, both give the same points,
labels, rejections (with their reasons), ignored counts and scrape targets. Where the kernel is
unsure it hands the request to the reference; valid Collector traffic never needs to. Where
protobuf refuses a request only for a defect in what otelgpu skips (the metrics it ignores,
descriptions, exemplars, ...), the columnar decoder takes the rest: exactly what the reference
reads from the same request with the skipped parts left out (`pruned`)."""

from __future__ import annotations

import math
import os
import random
import struct
from typing import Optional

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from fuzz_traffic import plan, valid_cluster
from fuzzing import STRUCTURED, WIRE
from otelgpu.enrich.window import NS
from otelgpu.receiver import columnar, wire
from otelgpu.receiver.columnar import ColumnarDecoder
from otelgpu.receiver.decode import PointBatch, decode_reference
from otelgpu.receiver.interner import Interner
from otelgpu.receiver.limits import Limits, wanted_keys
from otelgpu.receiver.schema import DCGM_METRICS, KNOWN_METRICS, MAX_BYTES, MAX_CORES, MAX_GPU_UNITS, METRIC_NAME
from support import DCGM_4_6, fixtures_dir, otlp_fixture, prom_fixture_request

T = 1_700_000_000 * NS
LIMITS = Limits(max_age_ns=86400 * NS, wanted=wanted_keys({"label_team", "label_nvidia_com_gpu_count"}))


def as_strings(batch: PointBatch, strings: Interner) -> tuple:
    """A batch with its codes turned back into strings: comparable across interners."""
    rows = []
    for i in range(len(batch)):
        a, b = batch.attr_off[i], batch.attr_off[i + 1]
        labels = tuple((strings.string(int(k)), strings.string(int(v)))
                       for k, v in zip(batch.attr_key[a:b], batch.attr_val[a:b]))
        value = batch.value[i]
        rows.append((int(batch.metric[i]), int(batch.time_ns[i]), "nan" if math.isnan(value) else value.hex(),
                     bool(batch.stale[i]), strings.string(int(batch.resource_node[i])),
                     strings.string(int(batch.resource_pod[i])), labels))
    return rows, dict(batch.rejected), batch.ignored, batch.sources


def reference(raw: bytes, limits: Limits, now: int) -> Optional[tuple]:
    """The reference decoder's reading of `raw`; None where protobuf refuses it."""
    try:
        request = ExportMetricsServiceRequest.FromString(raw)
    except DecodeError:
        return None
    strings = Interner()
    return as_strings(decode_reference(request, strings, limits, now_ns=now), strings)


def told(rejected: dict) -> dict[str, int]:
    """Rejections as the sender is told of them (partial_success's sentences)."""
    return {r.text: n for r, n in rejected.items()}


class Both:
    """One columnar decoder kept across requests (its label-set table fills as a sidecar's does),
    compared with a fresh reference reading of each request."""

    def __init__(self, limits: Limits = LIMITS) -> None:
        self.limits = limits
        self.strings = Interner()
        self.columnar = ColumnarDecoder(self.strings, limits)
        self.unsure = 0
        self.lenient = 0  # requests protobuf refuses whose defects lie wholly in what otelgpu skips

    def same(self, raw: bytes, now: int = T) -> Optional[tuple]:
        expected = reference(raw, self.limits, now)
        batch = self.columnar.decode(raw, now_ns=now)
        if batch is None:  # the kernel left it to protobuf: the sidecar then decodes it as the reference
            self.unsure += 1
            return expected
        read = pruned(raw)
        assert read is not None, "the columnar decoder took bytes whose framing is broken"
        if expected is None:  # refused by protobuf for something otelgpu never reads
            self.lenient += 1
            expected = reference(read, self.limits, now)
            assert expected is not None, "the columnar decoder took a defect in what it reads"
        else:
            assert reference(read, self.limits, now) == expected  # `pruned` leaves out only what is not read
        got = as_strings(batch, self.strings)
        assert got == expected
        return got


# --- what the columnar decoder reads, as bytes: the rest of a request left out ---------------------------

READ = set(KNOWN_METRICS) | {"up"}


def _fields(data: bytes) -> Optional[list[tuple[int, int, bytes]]]:
    """(number, wire type, raw field bytes) of a message, or None where its framing is broken."""
    out, i = [], 0
    while i < len(data):
        start = i
        tag, i = _read_varint(data, i)
        if i < 0 or tag >> 3 == 0:
            return None
        wire_type = tag & 7
        if wire_type == 0:
            _, i = _read_varint(data, i)
        elif wire_type in (1, 5):
            i += 8 if wire_type == 1 else 4
        elif wire_type == 2:
            n, i = _read_varint(data, i)
            i = i + n if i >= 0 else -1
        else:
            return None
        if i < 0 or i > len(data):
            return None
        out.append((tag >> 3, wire_type, data[start:i]))
    return out


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    for _ in range(10):
        if i >= len(data):
            return 0, -1
        b = data[i]
        n, i, shift = n | (b & 0x7F) << shift, i + 1, shift + 7
        if b < 0x80:
            return n, i
    return 0, -1


def _content(field: bytes) -> bytes:
    _, i = _read_varint(field, 0)
    _, i = _read_varint(field, i)
    return field[i:]


def pruned(raw: bytes) -> Optional[bytes]:
    """`raw` with everything the columnar decoder skips left out: of each target its resource and
    metrics; of each metric otelgpu reads (a consumed one, `up`) its name and its points' time,
    value, flags and (consumed ones) attributes; of the others as many empty points as they carry,
    so that the counts stay. None where the framing is broken."""
    def walk(data: bytes, keep) -> Optional[bytes]:  # noqa: ANN001
        fields = _fields(data)
        if fields is None:
            return None
        out = []
        for number, wire_type, field in fields:
            kept = keep(number, wire_type, field)
            if kept is None:
                return None
            out.append(kept)
        return b"".join(out)

    def metric(data: bytes) -> Optional[bytes]:
        fields = _fields(data)
        if fields is None:
            return None
        names = [_content(f) for n, w, f in fields if n == 1 and w == 2]
        name = names[-1] if names else b""
        kinds = [(n, _fields(_content(f))) for n, w, f in fields if n in (5, 7, 9, 10, 11) and w == 2]
        if not kinds:
            return _ld(1, name) if name.decode("utf-8", "replace") in READ else b""
        number, data_fields = kinds[-1]
        if data_fields is None:
            return None
        dps = [_content(f) for n, w, f in data_fields if n == 1 and w == 2]
        read = name.decode("utf-8", "replace") in READ and number in (5, 7)
        if not read:
            label = name if name.decode("utf-8", "replace") in READ else b"ignored"
            return _ld(1, label) + _ld(number, b"".join(_ld(1, b"") for _ in dps))
        keep_attrs = name != b"up"
        points = []
        for dp in dps:
            dp_fields = _fields(dp)
            if dp_fields is None:
                return None
            points.append(_ld(1, b"".join(f for n, w, f in dp_fields if n in (3, 4, 6, 8) or (n == 7 and keep_attrs))))
        return _ld(1, name) + _ld(number, b"".join(points))

    def scope_metrics(n, w, f):  # noqa: ANN001, ANN202
        if n != 2 or w != 2:
            return b""
        kept = metric(_content(f))
        return None if kept is None else _ld(2, kept)

    def resource_metrics(n, w, f):  # noqa: ANN001, ANN202
        if n == 1 and w == 2:
            return f
        if n != 2 or w != 2:
            return b""
        kept = walk(_content(f), scope_metrics)
        return None if kept is None else _ld(2, kept)

    def request(n, w, f):  # noqa: ANN001, ANN202
        if n != 1 or w != 2:
            return b""
        kept = walk(_content(f), resource_metrics)
        return None if kept is None else _ld(1, kept)

    return walk(raw, request)


def request_bytes(*points: tuple[str, dict[str, str], float]) -> bytes:
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.add(key="service.name", value=AnyValue(string_value="kube-state-metrics"))
    rm.resource.attributes.add(key="k8s.node.name", value=AnyValue(string_value="n1"))
    metrics = rm.scope_metrics.add().metrics
    for name, labels, value in points:
        p = metrics.add(name=name).gauge.data_points.add(time_unix_nano=T, as_double=value)
        p.attributes.extend(KeyValue(key=k, value=AnyValue(string_value=v)) for k, v in labels.items())
    return req.SerializeToString()


# --- fixtures ---------------------------------------------------------------------------------------

OTEL = sorted(p.name for p in (fixtures_dir() / "otel").glob("*.json")) + sorted(DCGM_4_6.glob("*.json"))
PROM = sorted(str(p.relative_to(fixtures_dir())) for p in (fixtures_dir() / "dcgm").glob("*.prom")) + sorted(
    DCGM_4_6.glob("*.prom"))


def fixture_id(fixture) -> str:  # noqa: ANN001 - a shared fixture's name, or a Path in tests/data
    return getattr(fixture, "name", fixture)


@pytest.mark.parametrize("name", OTEL, ids=fixture_id)
def test_collector_fixtures_decode_the_same_and_take_the_fast_path(name):
    req = otlp_fixture(name)
    times = [p.time_unix_nano for rm in req.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
             for p in (m.gauge.data_points or m.sum.data_points)]
    now = max(times, default=T)
    both = Both(Limits())
    first = both.same(req.SerializeToString(), now)
    again = both.same(req.SerializeToString(), now)  # from the label-set table this time
    assert first == again and both.unsure == 0
    assert len(both.columnar) > 0 or not first[0]


@pytest.mark.parametrize("path", PROM, ids=fixture_id)
def test_dcgm_exporter_fixtures_decode_the_same(path):
    both = Both()
    raw = prom_fixture_request(path, T, "ip-10-0-0-1").SerializeToString()
    got = both.same(raw)
    assert got[0] or got[2], "the fixture has points, consumed or ignored"
    assert both.same(raw) == got and both.unsure == 0


def test_each_name_of_a_dcgm_field_is_stored_in_its_metrics_unit_by_both():
    """DCGM 4.6 renamed fields (the old names stay aliases) and 4.6.1 added the energy in joules:
    whichever name a point comes under, both decoders store it in its metric's one unit, so that
    activity, and effective cost, are the same; a value outside its unit's range is refused, a
    percentage where a ratio belongs among them."""
    gpu = {"UUID": "GPU-1"}
    sent = [("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 0.5, 0.5), ("DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO", 0.5, 0.5),
            ("DCGM_FI_DEV_GPU_UTIL", 50.0, 50.0), ("DCGM_FI_DEV_GPU_UTIL_RATIO", 50.0, 50.0),  # a percentage still
            ("DCGM_FI_DEV_POWER_USAGE", 300.0, 300.0), ("DCGM_FI_DEV_BOARD_POWER_WATTS", 300.0, 300.0),
            ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 2.5e6, 2.5e6), ("DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL", 2500.0, 2.5e6),
            ("DCGM_FI_DEV_FB_USED", 1024.0, 1024.0), ("DCGM_FI_DEV_FB_FREE", 1024.0, 1024.0)]
    assert {name for name, _, _ in sent} == set(DCGM_METRICS)
    rows, rejected, _, _ = Both().same(request_bytes(*((name, gpu, value) for name, value, _ in sent)))
    assert not rejected
    assert [(m, float.fromhex(v)) for m, _, v, *_ in rows] == [(DCGM_METRICS[name], stored) for name, _, stored in sent]

    rows, rejected, _, _ = Both().same(request_bytes(
        ("DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO", gpu, 87.0), ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", gpu, 1.5),
        ("DCGM_FI_DEV_GPU_UTIL_RATIO", gpu, 187.0), ("DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL", gpu, 2e15)))
    assert rows == [] and told(rejected) == {"DCGM_FI_PROF_GR_ENGINE_ACTIVE value outside [0, 1]": 2,
                                       "DCGM_FI_DEV_GPU_UTIL value outside [0, 100]": 1,
                                       "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION value outside [0, 1e+18]": 1}

    req = ExportMetricsServiceRequest.FromString(request_bytes(("DCGM_FI_DEV_GPU_UTIL", gpu, 1.0)))
    req.resource_metrics[0].scope_metrics[0].metrics.add(name="DCGM_FI_DEV_GPU_UTIL_RATIO").histogram.data_points.add()
    rows, rejected, _, _ = Both().same(req.SerializeToString())
    assert len(rows) == 1 and told(rejected) == {"DCGM_FI_DEV_GPU_UTIL arrived as histogram, expected gauge or sum": 1}


# --- fuzzed traffic -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(STRUCTURED) + sorted(WIRE))
def test_every_fuzz_class_decodes_the_same(name):
    generators = {**STRUCTURED, **WIRE}
    t0 = T // (3600 * NS) * 3600 * NS
    valid = valid_cluster(t0).scrapes(60, 900)
    both = Both(Limits(max_age_ns=86400 * NS, wanted=LIMITS.wanted))
    sends = plan(random.Random(name), valid, {name: generators[name]}, per_class=4)
    for s in sends:
        both.same(s.wire(), now=t0 + 900 * NS)
    valid_unsure = sum(both.columnar.decode(s.wire(), now_ns=t0 + 900 * NS) is None for s in sends if s.valid
                       and name not in ("swapped_types",))
    assert valid_unsure == 0


def test_random_bit_flips_and_cuts_decode_the_same_or_are_refused_by_both():
    rng = random.Random(7)
    t0 = T // (3600 * NS) * 3600 * NS
    raws = [r.SerializeToString() for r in valid_cluster(t0).scrapes(60, 300)]
    both = Both()
    outcomes = {"refused": 0, "decoded": 0}
    for k in range(int(os.environ.get("OTELGPU_FLIPS", "400"))):
        data = bytearray(rng.choice(raws))
        if k % 4 == 0:
            data = data[:rng.randrange(len(data))]
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        got = both.same(bytes(data), now=t0 + 300 * NS)
        outcomes["refused" if got is None else "decoded"] += 1
    assert outcomes["refused"] and outcomes["decoded"]  # both kinds were met
    assert both.lenient  # flips in what otelgpu skips: protobuf refuses the request, the columnar decoder not


# --- values and labels at every bound -------------------------------------------------------------------

EDGES = [0.0, -0.0, 1.0, 1.0 + 1e-6, 1.0 + 2e-6, -1e-300, 0.5, 100.0, 100.0 + 1e-6, 100.1, 4.0, 4.5,
         float(MAX_GPU_UNITS), MAX_GPU_UNITS + 1.0, MAX_CORES, MAX_CORES * 1.0000001, MAX_BYTES, MAX_BYTES * 2,
         2.0**31 - 1, 2.0**31, 1e18, 1e19, math.nan, math.inf, -math.inf,
         struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000002))[0]]
LABELS = {"UUID": ["GPU-1", ""], "namespace": ["ml", ""], "pod": ["p", ""], "resource": [
    "nvidia_com_gpu", "nvidia_com_mig_1g_10gb", "cpu", "memory", "pods", "ephemeral_storage", "nvidia_com_gpumem",
    "nvidia_com_gpumem_percentage", "nvidia_com_gpucores", "nvidia_com_priority"],
    "node": ["n1"], "phase": ["Running"], "GPU_I_ID": ["3", "32", "x"], "GPU_I_PROFILE": ["1g.10gb", "9g.1gb"],
    "label_nvidia_com_gpu_count": ["8", "65", "-1"], "replicaset": ["rs"], "owner_kind": ["Deployment"],
    "owner_name": ["d"], "job_name": ["j"], "container": ["main", ""], "label_team": ["a" * 5000, "t"],
    "ignored_key": ["x"]}


def test_values_and_labels_at_every_bound_are_judged_the_same():
    rng = random.Random(3)
    names = sorted(KNOWN_METRICS)
    both = Both(Limits(max_age_ns=86400 * NS, max_label_bytes=4096, max_attributes=12, wanted=LIMITS.wanted))
    for _ in range(60):
        points = []
        for _ in range(40):
            keys = rng.sample(sorted(LABELS), rng.randint(0, len(LABELS)))
            points.append((rng.choice(names), {k: rng.choice(LABELS[k]) for k in keys}, rng.choice(EDGES)))
        both.same(request_bytes(*points))
    assert both.unsure == 0


def test_unusual_but_valid_encodings_go_to_the_reference():
    """Written so that protobuf keeps the last of a repeated field, switches a oneof, or skips a
    group: the kernel does not guess, and the result is the reference's."""
    base = request_bytes(("DCGM_FI_DEV_GPU_UTIL", {"UUID": "GPU-1"}, 50.0))
    req = ExportMetricsServiceRequest.FromString(base)
    point = req.resource_metrics[0].scope_metrics[0].metrics[0].gauge.data_points[0]
    point_bytes = point.SerializeToString()
    later = point_bytes + b"\x19" + struct.pack("<Q", T + 1)  # time_unix_nano again: protobuf keeps T + 1
    metric = req.resource_metrics[0].scope_metrics[0].metrics[0]
    with_group = metric.SerializeToString() + b"\xa3\x01\xa4\x01"  # an empty group, field 20
    for raw in (_swap(base, point_bytes, later), _swap(base, metric.SerializeToString(), with_group)):
        both = Both()
        assert both.columnar.decode(raw, now_ns=T) is None
        assert both.same(raw) is not None
    assert reference(_swap(base, point_bytes, later), LIMITS, T)[0][0][1] == T + 1


def _swap(raw: bytes, old: bytes, new: bytes) -> bytes:
    """`raw` with the message `old` (and the lengths of the messages around it) replaced by `new`."""
    req = ExportMetricsServiceRequest.FromString(raw)
    m = req.resource_metrics[0].scope_metrics[0].metrics[0]
    if old == m.SerializeToString():
        sm = req.resource_metrics[0].scope_metrics[0]
        sm_bytes = b"".join(_ld(2, new if i == 0 else x.SerializeToString()) for i, x in enumerate(sm.metrics))
    else:
        g = m.gauge
        gauge = _ld(1, new) + b"".join(_ld(1, p.SerializeToString()) for p in g.data_points[1:])
        metric = _ld(1, m.name.encode()) + _ld(5, gauge)
        sm_bytes = _ld(2, metric)
    rm = req.resource_metrics[0]
    rm_bytes = _ld(1, rm.resource.SerializeToString()) + _ld(2, sm_bytes)
    return _ld(1, rm_bytes)


def _ld(number: int, payload: bytes) -> bytes:
    out, n = bytearray([number << 3 | 2]), len(payload)
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out) + payload


# --- the label-set table ----------------------------------------------------------------------------------

def test_a_compaction_empties_the_label_set_table():
    both = Both()
    raw = request_bytes(("kube_pod_info", {"namespace": "ml", "pod": "p"}, 1.0))
    both.same(raw)
    assert len(both.columnar) == 1
    both.strings.compact(np.zeros(0, np.int32))  # every code dropped: the table's codes are stale
    again = both.same(raw)
    assert both.columnar.epoch == 1 and again[0][0][-1] == (("namespace", "ml"), ("pod", "p"))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_a_tables_room_takes_no_memory_until_it_is_used():
    """A table grows half as large again; the room of zeros past its entries is not written, so
    its pages take no memory until sets use them (a 128 MiB table here: mapped apart by the
    allocator at any threshold). Room of another fill is written, and every entry is kept."""
    table = np.arange(1000, dtype=np.int32)
    before = _rss_mib()
    grown = columnar._grown(table, 32 << 20)
    added = _rss_mib() - before
    assert len(grown) == 32 << 20 and np.array_equal(grown[:1000], table)
    assert added < 16, f"{added:.1f} MiB resident for a table of 128 MiB with 4 KiB in use"
    assert not grown[1000:1 << 20].any() and not grown[-(1 << 20):].any()
    filled = columnar._grown(table, 1500, fill=-7)
    assert np.array_equal(filled[:1000], table) and (filled[1000:] == -7).all() and len(filled) == 1500
    assert columnar._grown(table, 1000) is table


def test_sets_with_one_hash_are_told_apart_by_their_bytes():
    buf = np.frombuffer(b"\x3a\x02ab" + b"\x3a\x02cd", np.uint8)
    pieces = np.frombuffer(b"\x3a\x02cd\x3a\x02ab", np.uint8).copy()
    piece_off = np.array([0, 4, 8], np.int64)
    set_pieces, set_off = np.array([0, 1, 1, 0], np.int32), np.array([0, 1, 2, 4], np.int64)  # cd; ab; ab cd
    set_hash = np.array([42, 42, 42], np.uint64)  # the same hash: only the bytes differ
    slots = np.full(8, -1, np.int32)
    for s in range(3):
        wire.place_set(slots, set_hash, s)
    spans = np.array([[0, 4], [4, 8]], np.int64)
    table = (slots, set_hash, set_pieces, set_off, pieces, piece_off)
    assert wire.find_set(buf, spans[:1], 1, np.uint64(42), *table) == 1
    assert wire.find_set(buf, spans[1:], 1, np.uint64(42), *table) == 0
    assert wire.find_set(buf, spans, 2, np.uint64(42), *table) == 2
    assert wire.find_set(buf, spans[::-1].copy(), 2, np.uint64(42), *table) == -1  # cd ab: no such set
    assert wire.find_set(buf, spans, 2, np.uint64(41), *table) == -1  # another hash


def _attribute(key: str, value: str) -> bytes:
    return _ld(7, KeyValue(key=key, value=AnyValue(string_value=value)).SerializeToString())


def _point(labels: list[tuple[str, str]], value: float, apart: bool = False) -> bytes:
    """A NumberDataPoint's bytes: its attributes as one run, or (`apart`) the time between the first and the rest."""
    fields = [_attribute(k, v) for k, v in labels]
    when, what = b"\x19" + struct.pack("<Q", T), b"\x21" + struct.pack("<d", value)
    if apart and len(fields) > 1:
        return fields[0] + when + b"".join(fields[1:]) + what
    return b"".join(fields) + when + what


def _target(*metrics: tuple[str, list[bytes]]) -> bytes:
    """One scrape target's request: each metric a gauge of the given points' bytes, in order."""
    resource = ExportMetricsServiceRequest()
    resource.resource_metrics.add().resource.attributes.add(key="k8s.node.name", value=AnyValue(string_value="n1"))
    body = b"".join(_ld(2, _ld(1, name.encode()) + _ld(5, b"".join(_ld(1, p) for p in points)))
                    for name, points in metrics)
    return _ld(1, _ld(1, resource.resource_metrics[0].resource.SerializeToString()) + _ld(2, body))


def test_a_point_takes_the_set_of_the_point_at_its_place_only_where_their_bytes_are_the_same():
    """The scan tries each point against the point at its place in the target's largest metric
    before it: the same length and one byte apart, the other order, attributes not one run of
    bytes, a smaller metric between: each point keeps its own labels, as the reference reads them."""
    a, b = [("UUID", "GPU-a"), ("pod", "p")], [("UUID", "GPU-b"), ("pod", "p")]
    raw = _target(("DCGM_FI_DEV_FB_USED", [_point(a, 1), _point(b, 2)]),
                  ("DCGM_FI_DEV_FB_FREE", [_point(b, 3), _point(a, 4)]),
                  ("DCGM_FI_DEV_GPU_UTIL", [_point(b, 5)]),
                  ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", [_point(a, 0.6, apart=True), _point(a, 0.7)]),
                  ("DCGM_FI_DEV_POWER_USAGE", [_point(a, 8), _point(b, 9, apart=True)]))
    both = Both(Limits())
    for _ in range(2):  # the labels' sets new to the table, then known
        rows = both.same(raw)[0]
        assert [(row[2], dict(row[6])["UUID"]) for row in rows] == [
            (float(v).hex(), u) for v, u in ((1, "GPU-a"), (2, "GPU-b"), (3, "GPU-b"), (4, "GPU-a"), (5, "GPU-b"),
                                             (0.6, "GPU-a"), (0.7, "GPU-a"), (8, "GPU-a"), (9, "GPU-b"))]
    assert both.unsure == 0


_SERIES = [[("UUID", f"GPU-{k}"), ("pod", pod), ("namespace", "ml")] for k in "ab" for pod in ("p1", "p2")] + [
    [("UUID", "GPU-a"), ("pod", "p1")], []]  # the first one's attributes cut short; none
_DCGM = ["DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_PROF_GR_ENGINE_ACTIVE"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_DCGM), st.lists(st.tuples(st.integers(0, len(_SERIES) - 1), st.booleans()),
                                                              max_size=7)), min_size=1, max_size=5))
def test_points_of_any_order_and_layout_keep_their_own_labels(metrics):
    """Metrics listing a target's series in any order, any subset, any repeat, each point's
    attributes one run of bytes or not: the columnar decoder reads what the reference reads."""
    raw = _target(*[(name, [_point(_SERIES[k], 50.0, apart) for k, apart in points]) for name, points in metrics])
    both = Both(Limits())
    assert both.same(raw) == both.same(raw)  # the labels' sets new to the table, then known
    assert both.unsure == 0


def test_each_distinct_attribute_field_is_kept_once_and_sets_refer_to_it():
    both = Both()
    raw = request_bytes(*[("kube_pod_info", {"namespace": "ml", "pod": f"p-{k}", "node": "n-1"}, 1.0)
                          for k in range(5)])
    both.same(raw)
    d = both.columnar
    assert len(d) == 5 and d.n_pieces == 5 + 2  # five pods, one namespace, one node
    stored = bytes(d.pieces[:d.piece_off[d.n_pieces]])
    assert stored.count(b"ml") == 1 and stored.count(b"n-1") == 1
    assert len(set(d.set_pieces[:d.set_off[d.sets]].tolist())) == d.n_pieces


def test_a_sets_labels_are_its_pieces_otelgpu_reads_whoever_met_them_first():
    """A piece first met in a set refused for its labels (an empty pod name) is read when a usable
    set carries it; labels otelgpu does not read are kept as pieces but never interned; the same
    piece twice in one point gives the label twice, as protobuf reads it."""
    both = Both()
    both.same(request_bytes(("kube_pod_info", {"namespace": "ml", "pod": "", "node": "n-1"}, 1.0)))
    assert both.strings.find("ml") == -1  # a refused set interns nothing
    got = both.same(request_bytes(
        ("kube_pod_info", {"namespace": "ml", "pod": "p-1", "node": "n-1", "unread": "x"}, 1.0),
        ("kube_pod_labels", {"namespace": "ml", "pod": "p-1", "label_team": "vision", "label_other": "y"}, 1.0)))[0]
    assert [dict(row[-1]) for row in got] == [{"namespace": "ml", "pod": "p-1", "node": "n-1"},
                                             {"namespace": "ml", "pod": "p-1", "label_team": "vision"}]
    assert both.strings.find("unread") == both.strings.find("x") == both.strings.find("label_other") == -1
    d = both.columnar
    assert d.n_pieces == 3 + 1 + 1 + 2  # the refused set's three, p-1, unread, and the two labels
    twice = ExportMetricsServiceRequest.FromString(request_bytes(("kube_pod_info", {"namespace": "ml"}, 1.0)))
    attrs = twice.resource_metrics[0].scope_metrics[0].metrics[0].gauge.data_points[0].attributes
    attrs.extend([KeyValue(key="pod", value=AnyValue(string_value="p-2"))] * 2)
    got = both.same(twice.SerializeToString())[0]
    assert got[0][-1] == (("namespace", "ml"), ("pod", "p-2"), ("pod", "p-2"))


def test_label_sets_idle_for_five_minutes_are_swept_and_learnt_again(monkeypatch):
    from otelgpu.receiver import columnar

    monkeypatch.setattr(columnar, "SWEEP_FROM", 6)
    both = Both()
    gone = [request_bytes(("kube_pod_info", {"namespace": "ml", "pod": f"old-{k}"}, 1.0)) for k in range(4)]
    for raw in gone:
        both.same(raw)
    later = T + columnar.SET_IDLE_NS + NS
    live = [request_bytes(("kube_pod_info", {"namespace": "ml", "pod": f"new-{k}"}, 1.0)).replace(
        struct.pack("<Q", T), struct.pack("<Q", later)) for k in range(2)]
    for raw in live:
        both.same(raw, now=later)
    assert len(both.columnar) == 6 and both.columnar.kept == 0
    assert both.columnar.n_pieces == 6 + 1  # six pods, one namespace
    both.same(live[0], now=later)  # six sets: this decode sweeps first
    assert len(both.columnar) == 2 and both.columnar.kept == 2  # only the pods still reported
    d = both.columnar
    kept = bytes(d.pieces[:d.piece_off[d.n_pieces]])
    assert d.n_pieces == 3 and b"old-" not in kept and b"new-0" in kept  # the swept sets' own pieces went too
    assert both.same(live[1], now=later)[0] and len(d) == 2  # a kept set is still found, renumbered pieces
    assert both.same(gone[0], now=later)[0]  # a swept set comes back as it was
    assert len(both.columnar) == 3 and both.columnar.n_pieces == 4
    # kept as the kernels were compiled for them: 4-byte offsets, whole seconds
    assert d.set_off.dtype == np.int32 and d.set_seen.dtype == np.uint32
    assert d.set_seen[:d.sets].max() == later // NS


def test_a_sweep_keeps_the_sets_seen_in_the_last_five_minutes_to_the_second():
    from otelgpu.receiver import columnar

    both = Both()
    times = [T + k * NS // 2 for k in range(6)]  # every half second
    for k, t in enumerate(times):
        raw = request_bytes(("kube_pod_info", {"namespace": "ml", "pod": f"p-{k}"}, 1.0))
        both.same(raw.replace(struct.pack("<Q", T), struct.pack("<Q", t)), now=t)
    d = both.columnar
    cutoff = times[3]  # seconds: T, T, T+1, T+1, T+2, T+2; the cutoff T+1.5 reads T+1
    d.sweep(cutoff)
    assert len(d) == 4 and d.set_off.dtype == np.int32
    assert columnar._seconds(np.array([-NS, 0, 2 * NS - 1, (1 << 32) * NS])).tolist() == [0, 0, 1, (1 << 32) - 1]


def test_series_from_untrusted_scrape_targets_are_refused_the_same_by_both():
    from otelgpu.receiver.config import SourcesConfig
    from otelgpu.receiver.sources import BIT, SourceTrust, untrusted_reason

    trusting = Limits(max_age_ns=86400 * NS, wanted=LIMITS.wanted, trust=SourceTrust(SourcesConfig()))
    t0 = T // (3600 * NS) * 3600 * NS
    both = Both(trusting)
    for req in valid_cluster(t0).scrapes(60, 300):
        honest = both.same(req.SerializeToString(), now=t0 + 300 * NS)
        assert honest[0] and not any(r.reason.startswith("untrusted_") for r in honest[1])
        for rm in req.resource_metrics:  # the same series, from a job nobody trusts
            for kv in rm.resource.attributes:
                if kv.key == "service.name":
                    kv.value.string_value = "kubernetes-pods"
        spoofed = both.same(req.SerializeToString(), now=t0 + 300 * NS)
        consumed = len(honest[0]) + sum(n for r, n in honest[1].items())
        assert spoofed[0] == [] and sum(spoofed[1].values()) == consumed
        assert set(spoofed[1]) <= {untrusted_reason(b) for b in BIT.values()}

    # A decoder that never saw these series keeps none of a refused target's labels.
    fresh = Both(trusting)
    strings = len(fresh.strings)
    assert fresh.same(req.SerializeToString(), now=t0 + 300 * NS)[0] == []
    # No label set, and no string but the targets' own node and pod names, as the reference reads
    assert len(fresh.columnar) == 0 and len(fresh.strings) - strings <= 2 * len(req.resource_metrics)


def test_token_counters_belong_to_the_pod_that_exposes_them_in_both():
    """vLLM's token series name no pod: each takes its scrape target's (the resource's namespace
    and pod, from service discovery), in place of any `namespace` or `pod` a point claims; a target
    that names no pod has its token series refused, with the reason, by both decoders."""
    req = otlp_fixture("otlp_vllm_scrape_text004_collector_v0.142.json")
    (rm,) = req.resource_metrics
    for m in rm.scope_metrics[0].metrics:
        if m.name == "vllm:generation_tokens_total":  # a point that says it is another team's
            m.sum.data_points[0].attributes.extend([KeyValue(key="pod", value=AnyValue(string_value="billing-0")),
                                                    KeyValue(key="namespace", value=AnyValue(string_value="team-b"))])
    now = max(p.time_unix_nano for m in rm.scope_metrics[0].metrics for p in (m.gauge.data_points or m.sum.data_points))
    both = Both(Limits())
    rows, rejected, _, _ = both.same(req.SerializeToString(), now)
    tokens = {METRIC_NAME[metric]: dict(labels) for metric, _, _, _, _, _, labels in rows}
    assert set(tokens) == {"vllm:prompt_tokens_total", "vllm:generation_tokens_total"} and not rejected
    for labels in tokens.values():
        assert labels["namespace"] == "team-a" and labels["pod"] == "vllm-llama3-8b-5c9d7b8f6d-k2x7q"
        assert labels["model_name"] == "meta-llama/Llama-3.1-8B-Instruct"

    # Scraped as OpenMetrics with underscore escaping, the names lose their colon: the same series.
    for m in rm.scope_metrics[0].metrics:
        m.name = m.name.replace("vllm:", "vllm_") if m.name.endswith("tokens_total") else m.name
    escaped, rejected, _, _ = Both(Limits()).same(req.SerializeToString(), now)
    assert escaped == rows and not rejected

    attrs = [kv for kv in rm.resource.attributes if kv.key != "k8s.namespace.name"]
    del rm.resource.attributes[:]
    rm.resource.attributes.extend(attrs)
    rows, rejected, _, _ = Both(Limits()).same(req.SerializeToString(), now)
    assert rows == [] and told(rejected) == {
        f"{name} from a scrape target without k8s.namespace.name and k8s.pod.name": 1
        for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 11), max_size=6), min_size=1, max_size=8), st.data())
def test_the_labels_of_chosen_sets_are_the_numpy_gathering_s(sets, data):
    """The kernel that lays out the labels of a batch's sets, against numpy's gathering (what
    interpreted kernels run): pieces otelgpu reads and pieces it does not, any set chosen any
    number of times, in any order."""
    piece_key = np.array(data.draw(st.lists(st.integers(-1, 3), min_size=12, max_size=12)), np.int32)
    piece_val = np.arange(100, 112, dtype=np.int32)
    set_off = np.concatenate([[0], np.cumsum([len(s) for s in sets])]).astype(np.int32)
    set_pieces = np.array([p for s in sets for p in s], np.int32)
    chosen = np.array(data.draw(st.lists(st.integers(0, len(sets) - 1), max_size=12)), np.int64)
    got = columnar._labels(chosen, set_off, set_pieces, piece_key, piece_val)
    want = columnar._labels_numpy(chosen, set_off, set_pieces, piece_key, piece_val)
    assert [(a.dtype, a.tolist()) for a in got] == [(b.dtype, b.tolist()) for b in want]
