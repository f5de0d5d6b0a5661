"""Hostile OTLP input mixed into a valid cluster's traffic must never fail, alter or delay the
processing of the valid points.

An hour of a valid cluster (two whole-GPU nodes, a mixed-MIG H100, a time-sliced A10G; five
teams; request and scad) run alone gives the reference. Each mutation class (fuzzing.py) is
then mixed into the same traffic with a fixed seed, before, between and inside the valid
requests, and the run must keep the valid nodes' totals to 1e-9, store and export no series
starting before the cluster's first interval (or after the receiver's horizon) and no
non-finite value, reject exactly the points that must be rejected (counted, with a reason),
and never raise. Structured classes go through `ingest.consume` + `process`; wire mutations
and the everything-at-once run go through the real gRPC receiver as raw bytes."""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse

from fuzz_traffic import PRICES, VALID_NODES, Send, plan, valid_cluster
from fuzzing import STRUCTURED, WIRE
from otelgpu.config import Config, parse_config
from otelgpu.enrich.window import NS
from otelgpu.exporter.store import CostStore, Point
from otelgpu.pipeline import Pipeline
from otelgpu.telemetry import SelfMetrics, by_label
from support import CollectorSink, eventually

SEED = 20240611
PER_CLASS = 6  # placements of each class in the hour: at the first request, at the last, between
EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
METRICS = ("allocated", "effective", "waste", "unmeasured", "unused", "idle", "capacity", "held")
BY = ("cost_model", "team", "pod", "node", "resource", "attribution")
# No cost point may end later than this after the test's clock: the receiver refuses points more
# than max_future_seconds (120 s) ahead, and an interval (300 s) ends at most that much after its
# points; 600 s leaves room for a slow machine.
LATEST_NS = (600 + 300) * NS


def config(**exporter: object) -> Config:
    """The product's own receiver limits (the data is recent: nothing needs relaxing, unlike the
    usual test helpers' fixtures from years ago), loopback endpoints, request and scad.
    tag_values.max_distinct is lowered so that a bomb of 150 values reaches it (and its namespace's
    share, a quarter of it)."""
    return parse_config({
        "receiver": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": {"enabled": False}, "queue_size": 1000},
        "exporter": {"prometheus": {"enabled": False, "endpoint": "127.0.0.1:0"}, **exporter},
        "attribution": {"interval_seconds": 300, "lateness_seconds": 60, "cost_models": ["request", "scad"],
                        "prices": {"gpu_hour_by_gpu_model": PRICES}},
        "tag_values": {"max_distinct": 50},
    })


@dataclass
class World:
    t0: int  # the start of the cluster's first interval
    valid: list  # its scrapes, one request each, every 60 s for an hour
    clean: dict[tuple, float]  # the valid nodes' totals without hostile input


@dataclass
class Outcome:
    store: CostStore
    problems: list[str] = field(default_factory=list)  # broken invariants, first ones first
    rejected: int = 0  # rejected points reported to the senders
    kinds: dict[str, int] = field(default_factory=dict)  # problems of each kind

    def check_counted(self, metrics: SelfMetrics) -> None:
        """Every rejection the senders were told of is in the self-metrics, under a reason."""
        rejected = by_label(metrics.points_rejected)
        if sum(rejected.values()) != self.rejected or any(not reason for _, reason in rejected):
            self.note("miscounted", f"points_rejected counts {dict(rejected)}, "
                                    f"the senders were told {self.rejected}")

    def check_points(self, points: Iterable[Point], t0: int) -> None:
        latest = time.time_ns() + LATEST_NS
        for p in points:
            if p.start_ns < t0 or p.time_ns < t0 or p.time_ns > latest:
                node = dict(p.attrs).get("node")
                self.note("outside the data", f"{p.metric} on {node!r} spans {p.start_ns}..{p.time_ns}")
            if not p.ended and not math.isfinite(p.value):
                self.note("not finite", f"{p.metric} {dict(p.attrs)} has value {p.value}")

    def note(self, kind: str, problem: str) -> None:
        """Keep the first few problems of each kind."""
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        if self.kinds[kind] <= 4:
            self.problems.append(f"{kind}: {problem}")


def valid_totals(store: CostStore) -> dict[tuple, float]:
    return {(m, *k): v for m in METRICS for k, v in store.totals(m, BY).items() if k[3] in VALID_NODES}


def recent_hour() -> int:
    """Two hours before the current hour: the data is recent, as a Collector's is, so the
    receiver's clock-based checks see it as they would in a cluster."""
    hour = 3600 * NS
    return time.time_ns() // hour * hour - 2 * hour


@pytest.fixture(scope="module")
def world() -> World:
    t0 = recent_hour()
    valid = valid_cluster(t0).scrapes(60, 3600)
    out = run_offline([Send(r, valid=True) for r in valid], t0)
    assert not out.problems and out.rejected == 0
    clean = valid_totals(out.store)
    assert {(k[0], k[1], k[4]) for k in clean if k[0] == "capacity"} == {
        ("capacity", model, node) for model in ("request", "scad") for node in VALID_NODES}
    return World(t0, valid, clean)


def run_offline(sends: list[Send], t0: int) -> Outcome:
    """Every request through ingest.consume and process, as the pipeline's worker would run
    them; what either raises is noted and the run goes on."""
    p = Pipeline(config(), serve_receivers=False, keep_ended=True)
    out = Outcome(p.store)
    for i, s in enumerate(sends):
        try:
            _, rejected, message = p.ingest.consume(s.payload)
        except Exception as exc:  # noqa: BLE001 - what a hostile request makes it raise is the finding
            out.note("raised", f"request {i}: consume raised {exc!r}")
            continue
        out.rejected += rejected
        check_rejected(out, i, s, rejected, message)
        batch = p.ingest.get(timeout=0)
        if batch is not None:
            try:
                p.process(batch)
            except Exception as exc:  # noqa: BLE001
                out.note("raised", f"request {i}: process raised {exc!r}")
            p.ingest.task_done()
            out.check_points(p.store.points(), t0)
    try:
        p.close_due(flush=True)
    except Exception as exc:  # noqa: BLE001
        out.note("raised", f"closing the last intervals raised {exc!r}")
    out.check_points(p.store.points(), t0)
    out.check_counted(p.metrics)
    return out


def check_rejected(out: Outcome, i: int, s: Send, rejected: int, message: str) -> None:
    if not s.must <= rejected <= s.must + s.may:
        expected = f"{s.must}..{s.must + s.may}"
        out.note("miscounted", f"request {i}: {rejected} points rejected, expected {expected}: {message[:300]}")
    if rejected and not message:
        out.note("miscounted", f"request {i}: {rejected} points rejected without a reason")


def run_served(sends: list[Send], t0: int, sink: CollectorSink | None = None) -> Outcome:
    """Every send as raw bytes through the real OTLP/gRPC receiver of a started pipeline."""
    otlp = {"otlp": {"endpoint": sink.endpoint, "tls": {"insecure": True}, "timeout_seconds": 5}} if sink else {}
    p = Pipeline(config(**otlp), keep_ended=True)
    p.start()
    out = Outcome(p.store)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{p.grpc.port}") as channel:
            export = channel.unary_unary(EXPORT, request_serializer=None,
                                         response_deserializer=ExportMetricsServiceResponse.FromString)
            for i, s in enumerate(sends):
                answer(out, i, s, export)
            if _try(export, b"") != ExportMetricsServiceResponse():
                out.note("status", "an empty request after the rest was not answered OK")
        drained = threading.Thread(target=p.drain, daemon=True)
        drained.start()
        eventually(lambda: not drained.is_alive(), timeout=300)  # a dead worker would never drain
        out.check_points(p.store.points(), t0)
    finally:
        try:
            p.shutdown()  # closes the open intervals here, in this thread
        except Exception as exc:  # noqa: BLE001
            out.note("raised", f"shutdown raised {exc!r}")
    out.check_points(p.store.points(), t0)
    if by_label(p.metrics.points_rejected).get(("", "internal_error")):
        out.note("raised", "the pipeline raised while processing a batch (see the log)")
    else:
        out.check_counted(p.metrics)
    return out


def answer(out: Outcome, i: int, s: Send, export) -> None:  # noqa: ANN001 - a grpc callable
    """One Export: a structured request is answered OK or partial_success with the points it
    must reject; bytes that cannot decode, INVALID_ARGUMENT; nothing ever another status."""
    try:
        response = eventually(lambda: _try(export, s.wire()), timeout=60)
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.INVALID_ARGUMENT or not isinstance(s.payload, bytes):
            out.note("status", f"request {i}: answered {err.code().name}: {err.details()}")
        return
    if s.undecodable:
        out.note("status", f"request {i}: undecodable bytes answered OK")
    rejected = response.partial_success.rejected_data_points
    out.rejected += rejected
    if not isinstance(s.payload, bytes):
        check_rejected(out, i, s, rejected, response.partial_success.error_message)


def _try(export, data: bytes):  # noqa: ANN001, ANN202
    """The response, or None while the queue is full (UNAVAILABLE: send the same again)."""
    try:
        return export(data, timeout=30)
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.UNAVAILABLE:
            return None
        raise


def assert_survived(world: World, out: Outcome) -> None:
    got = valid_totals(out.store)
    changed = sorted(f"{k}: {world.clean.get(k)} -> {got.get(k)}" for k in world.clean.keys() | got.keys()
                     if not abs(world.clean.get(k, math.nan) - got.get(k, math.nan)) <= 1e-9)
    if changed:
        out.problems += [f"{len(changed)} totals of the valid nodes changed, e.g.:", *changed[:6]]
    counts = ", ".join(f"{n} {kind}" for kind, n in out.kinds.items())
    assert not out.problems, f"{counts}\n" + "\n".join(out.problems)


@pytest.mark.parametrize("name", list(STRUCTURED))
def test_structured_mutations_leave_the_valid_cluster_alone(world: World, name: str) -> None:
    sends = plan(random.Random(f"{SEED}-{name}"), world.valid, {name: STRUCTURED[name]}, PER_CLASS)
    assert any(s.must or s.may for s in sends)
    assert_survived(world, run_offline(sends, world.t0))


@pytest.mark.parametrize("name", list(WIRE))
def test_wire_mutations_through_grpc(world: World, name: str) -> None:
    sends = plan(random.Random(f"{SEED}-{name}"), world.valid, {name: WIRE[name]}, 2 * PER_CLASS)
    assert_survived(world, run_served(sends, world.t0))


def exported(sink: CollectorSink) -> Iterator[Point]:
    """Every point the sidecar exported, as the store's Point (a gauge's start is its time)."""
    for req in sink.requests:
        for rm in req.resource_metrics:
            for m in rm.scope_metrics[0].metrics:
                is_sum = m.HasField("sum")
                for p in m.sum.data_points if is_sum else m.gauge.data_points:
                    attrs = tuple((kv.key, kv.value.string_value) for kv in p.attributes)
                    yield Point(m.name, attrs, p.start_time_unix_nano if is_sum else p.time_unix_nano,
                                p.time_unix_nano, p.as_double, bool(p.flags & 1))


def test_everything_at_once_through_grpc(world: World) -> None:
    rng = random.Random(f"{SEED}-all")
    sends = plan(rng, world.valid, {**STRUCTURED, **WIRE}, 3)
    for k in sorted(rng.sample(range(len(sends)), 8), reverse=True):  # resent after a reconnect
        sends.insert(k + 1, sends[k])
    sink = CollectorSink()
    try:
        out = run_served(sends, world.t0, sink)
        out.check_points(exported(sink), world.t0)
        if not sink.requests:
            out.note("exported", "no cost series reached the OTLP receiver")
    finally:
        sink.stop()
    assert_survived(world, out)
