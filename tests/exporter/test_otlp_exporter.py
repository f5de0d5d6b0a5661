"""OtlpSender and its delivery queue against a real in-process OTLP/gRPC server that can be
scripted to fail as a Collector does (UNAVAILABLE with RetryInfo, RESOURCE_EXHAUSTED with and
without it, INVALID_ARGUMENT, partial success) or be down altogether."""

from __future__ import annotations

import math
import time

import grpc
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality, Metric
from otlpsink import Answer, MetricsSink, serve_sink
from support import eventually

from otelgpu.exporter.columns import Point
from otelgpu.exporter.config import DeliveryConfig, OtlpExporterConfig
from otelgpu.exporter.delivery import Delivery
from otelgpu.exporter.otlp import MAX_POINTS_PER_REQUEST, NO_RECORDED_VALUE, OtlpSender, requests_reference
from otelgpu.exporter.store import CostStore
from otelgpu.telemetry import SelfMetrics, by_label


def _metrics(sink, i: int) -> dict[str, Metric]:
    rm = sink.received[i].request.resource_metrics
    assert len(rm) == 1 and len(rm[0].scope_metrics) == 1
    assert rm[0].scope_metrics[0].scope.name == "otelgpu"
    out = {m.name: m for m in rm[0].scope_metrics[0].metrics}
    assert len(out) == len(rm[0].scope_metrics[0].metrics), "one Metric per spec"
    return out


def _attrs(dp) -> dict[str, str]:
    return {kv.key: kv.value.string_value for kv in dp.attributes}


def _sender(endpoint: str, store: CostStore, metrics: SelfMetrics, **kw) -> OtlpSender:
    return OtlpSender(OtlpExporterConfig(endpoint=endpoint, **kw), store.specs, metrics, cluster="prod-eu")


def test_cumulative_sums_keep_start_and_advance(otlp_sink, store: CostStore, intervals) -> None:
    metrics = SelfMetrics()
    sender = _sender(otlp_sink.endpoint, store, metrics, headers={"Authorization": "Bearer t"})
    try:
        intervals.record(0)
        assert sender.send(store.points()).ok
        intervals.record(1)
        assert sender.send(store.points()).ok
    finally:
        sender.close()
    assert len(otlp_sink.received) == 2
    assert all(r.gzipped for r in otlp_sink.received)  # the default compression is gzip
    assert otlp_sink.received[0].metadata["authorization"] == "Bearer t"

    resource = {kv.key: kv.value.string_value
                for kv in otlp_sink.received[0].request.resource_metrics[0].resource.attributes}
    assert resource["k8s.cluster.name"] == "prod-eu" and resource["service.name"] == "otelgpu"
    assert "service.instance.id" not in resource  # a gateway: the only writer of its cluster's series

    first, second = _metrics(otlp_sink, 0), _metrics(otlp_sink, 1)
    assert set(first) == {"gpu.cost.allocated", "gpu.held", "gpu.cost.idle", "gpu.activity"}
    alloc = first["gpu.cost.allocated"]
    assert alloc.unit == "{USD}" and alloc.description
    assert alloc.sum.aggregation_temporality == AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
    assert alloc.sum.is_monotonic
    assert first["gpu.held"].unit == "s"
    assert first["gpu.activity"].WhichOneof("data") == "gauge"

    T0, MIN = intervals.T0, intervals.MIN
    (a1,), (a2,) = alloc.sum.data_points, second["gpu.cost.allocated"].sum.data_points
    assert a1.start_time_unix_nano == a2.start_time_unix_nano == T0
    assert (a1.time_unix_nano, a2.time_unix_nano) == (T0 + MIN, T0 + 2 * MIN)
    assert (a1.as_double, a2.as_double) == (1.5, 3.0) and a1.flags == 0
    # Attributes travel exactly as the store holds them (cost_model is one of them, set upstream).
    assert _attrs(a1) == {"namespace": "ml", "pod": "train-0", "team": "a", "cost_model": "request"}
    assert "cost_model" not in _attrs(first["gpu.held"].sum.data_points[0])
    assert _attrs(first["gpu.cost.idle"].sum.data_points[0])["cost_model"] == "request"
    (g1,), (g2,) = first["gpu.activity"].gauge.data_points, second["gpu.activity"].gauge.data_points
    assert g2.time_unix_nano > g1.time_unix_nano and abs(g2.as_double - 0.6) < 1e-9


def test_ended_series_carry_no_recorded_value(otlp_sink, intervals) -> None:
    store = intervals.store
    intervals.record(0)
    T0, MIN = intervals.T0, intervals.MIN
    snapshots = [store.record(T0 + i * MIN, T0 + (i + 1) * MIN, sums={}, gauges={}) for i in (1, 2)]
    # The gauge ends at once; the sums after end_after_intervals (2) intervals without increments.
    assert [p.metric for p in snapshots[0] if p.ended] == ["activity"]
    assert sorted(p.metric for p in snapshots[1] if p.ended) == ["allocated", "held", "idle"]
    assert store.points() == [] and store.series_ended == 4
    sender = _sender(otlp_sink.endpoint, store, SelfMetrics())
    assert sender.send(snapshots[1]).ok
    sender.close()
    (dp,) = _metrics(otlp_sink, 0)["gpu.cost.allocated"].sum.data_points
    assert dp.flags & NO_RECORDED_VALUE and dp.WhichOneof("value") is None
    assert dp.start_time_unix_nano == T0 and dp.time_unix_nano == T0 + 3 * MIN


def test_no_compression_when_configured(otlp_sink, store: CostStore, intervals) -> None:
    sender = _sender(otlp_sink.endpoint, store, SelfMetrics(), compression="none")
    intervals.record(0)
    assert sender.send(store.points()).ok
    sender.close()
    assert [r.gzipped for r in otlp_sink.received] == [False]


def test_failures_are_classified_as_the_otlp_spec_says(otlp_sink, store: CostStore, intervals) -> None:
    intervals.record(0)
    sender = _sender(otlp_sink.endpoint, store, SelfMetrics())
    C = grpc.StatusCode
    otlp_sink.script = [Answer(C.UNAVAILABLE, retry_after=2.5), Answer(C.UNAVAILABLE),
                        Answer(C.RESOURCE_EXHAUSTED), Answer(C.RESOURCE_EXHAUSTED, retry_after=1.0),
                        Answer(C.INVALID_ARGUMENT, message="bad points"), Answer(C.UNAUTHENTICATED),
                        Answer(C.DEADLINE_EXCEEDED)]
    got = [sender.send(store.points()) for _ in range(7)]
    sender.close()
    assert [(r.retryable, r.reason, r.retry_after) for r in got] == [
        (True, "unavailable", 2.5), (True, "unavailable", None),
        (False, "resource_exhausted", None),  # without RetryInfo: never retried
        (True, "resource_exhausted", 1.0),
        (False, "invalid_argument", None), (False, "unauthenticated", None), (True, "deadline_exceeded", None)]
    assert got[4].detail == "bad points" and not any(r.ok for r in got)
    assert otlp_sink.received == []


def test_partial_success_is_delivered_and_counted(otlp_sink, store: CostStore, intervals) -> None:
    intervals.record(0)
    metrics = SelfMetrics()
    sender = _sender(otlp_sink.endpoint, store, metrics)
    otlp_sink.script = [Answer(rejected=2, message="2 points out of range")]
    assert sender.send(store.points()).ok
    sender.close()
    assert by_label(metrics.export_points_rejected)["otlp"] == 2


def _delivery(endpoint: str, store: CostStore, metrics: SelfMetrics, **kw) -> Delivery:
    config = DeliveryConfig(**{"backoff_initial_seconds": 0.05, "backoff_max_seconds": 0.2, **kw})
    return Delivery(_sender(endpoint, store, metrics, timeout_seconds=2.0), config, metrics, interval_s=60)


def _collector_away(store: CostStore, metrics: SelfMetrics) -> tuple[MetricsSink, int, Delivery]:
    """A sink whose port is picked and then taken away (the Collector down), and a delivery of
    queue_size 3 to it: serve the sink on the port again to bring the Collector back."""
    sink = MetricsSink()
    with serve_sink(sink) as port:
        pass
    return sink, port, _delivery(f"127.0.0.1:{port}", store, metrics, queue_size=3)


def test_queue_retries_with_retry_info_and_keeps_order(otlp_sink, store: CostStore, intervals) -> None:
    metrics = SelfMetrics()
    delivery = _delivery(otlp_sink.endpoint, store, metrics)
    otlp_sink.script = [Answer(grpc.StatusCode.UNAVAILABLE, retry_after=0.3), Answer(grpc.StatusCode.UNAVAILABLE)]
    began = time.monotonic()
    sizes = []
    for i in range(3):
        intervals.record(i)
        delivery.put(store.points())
        sizes.append(len(store.points()))
    assert delivery.wait_idle(10)
    assert time.monotonic() - began >= 0.3  # the server's delay was honoured
    delivery.close()
    values = [_metrics(otlp_sink, i)["gpu.cost.allocated"].sum.data_points[0].as_double for i in range(3)]
    assert values == [1.5, 3.0, 4.5] and otlp_sink.calls == 5
    assert by_label(metrics.exports)["otlp"] == 3 and by_label(metrics.export_failures)[("otlp", "unavailable")] == 2
    # The Collector's exporter series: points sent, points of the failed attempts (the first
    # snapshot, twice), the queue against its capacity.
    assert by_label(metrics.exporter_sent_points) == {"otlp": sum(sizes)}
    assert by_label(metrics.exporter_send_failed_points) == {"otlp": 2 * sizes[0]}
    assert by_label(metrics.exporter_queue_capacity) == {"otlp": 60} and by_label(metrics.exporter_queue_size) == {"otlp": 0}


def test_outage_merges_snapshots_without_losing_cost(store: CostStore, intervals) -> None:
    """A Collector down for many intervals: the queue keeps at most queue_size snapshots and
    merges the oldest; when it comes back, the newest totals (and every ended series' last value)
    arrive."""
    metrics = SelfMetrics()
    sink, port, delivery = _collector_away(store, metrics)
    T0, MIN = intervals.T0, intervals.MIN
    gone = (("namespace", "ml"), ("pod", "short-job"))
    store.record(T0 - MIN, T0, sums={"allocated": {gone: 2.0}}, gauges={})
    delivery.put(store.points())
    for i in range(8):
        delivery.put(intervals.record(i))  # short-job ends after the second of these
    eventually(lambda: by_label(metrics.export_failures)[("otlp", "unavailable")] >= 1, timeout=30)  # the outage was seen
    assert delivery.depth <= 3 and by_label(metrics.export_snapshots_merged)["otlp"] >= 5
    with serve_sink(sink, port):
        assert delivery.wait_idle(10)
        delivery.close()
    latest, ended = {}, set()
    for r in sink.received:
        for m in r.request.resource_metrics[0].scope_metrics[0].metrics:
            if m.name == "gpu.cost.allocated":
                for dp in m.sum.data_points:
                    if dp.flags & NO_RECORDED_VALUE:
                        ended.add(_attrs(dp)["pod"])
                    else:
                        latest[_attrs(dp)["pod"]] = dp.as_double
    assert latest == {"train-0": 12.0, "short-job": 2.0} and ended == {"short-job"}
    assert not by_label(metrics.export_snapshots_dropped)


def test_the_delivered_gauge_holds_at_the_oldest_snapshot_waiting_and_catches_up(store: CostStore, intervals) -> None:
    """While the Collector is down the gauge stays at the start of the oldest interval waiting,
    though it was merged into a newer snapshot; an interval without series waits for nothing;
    once the Collector is back it reaches the newest interval handed over."""
    metrics = SelfMetrics()
    sink, port, delivery = _collector_away(store, metrics)
    T0, MIN = intervals.T0, intervals.MIN
    for i in range(6):
        delivery.put(intervals.record(i))
    eventually(lambda: by_label(metrics.export_failures)[("otlp", "unavailable")] >= 1, timeout=30)
    assert by_label(metrics.export_snapshots_merged)["otlp"] >= 3
    assert by_label(metrics.exporter_delivered) == {"otlp": T0 / 1e9}
    delivery.release(T0 + 7 * MIN)  # interval 6 had no series: it staged nothing
    assert by_label(metrics.exporter_delivered) == {"otlp": T0 / 1e9}
    with serve_sink(sink, port):
        assert delivery.wait_idle(10)
        delivery.close()
    assert by_label(metrics.exporter_delivered) == {"otlp": (T0 + 7 * MIN) / 1e9}


def test_a_refused_snapshot_is_carried_into_the_next_one(otlp_sink, store: CostStore, intervals) -> None:
    metrics = SelfMetrics()
    delivery = _delivery(otlp_sink.endpoint, store, metrics)
    otlp_sink.script = [Answer(grpc.StatusCode.INVALID_ARGUMENT)]
    intervals.record(0)
    delivery.put(store.points())
    intervals.record(1)
    delivery.put(store.points())
    assert delivery.wait_idle(10)
    delivery.close()
    assert by_label(metrics.export_snapshots_carried) == {"otlp": 1}
    assert not by_label(metrics.export_snapshots_dropped)
    assert by_label(metrics.export_failures)[("otlp", "invalid_argument")] == 1
    # The next snapshot's newer value of each series supersedes the carried one.
    (dp,) = _metrics(otlp_sink, 0)["gpu.cost.allocated"].sum.data_points
    assert dp.as_double == 3.0 and dp.time_unix_nano == intervals.T0 + 2 * intervals.MIN


def test_a_series_only_a_refused_snapshot_had_arrives_with_the_next_one(otlp_sink, store: CostStore,
                                                                       intervals) -> None:
    """A series that ended (or is in no later snapshot for any reason): its last value comes with
    the next snapshot, 1 ms before that one's end, and its end marker at the end."""
    metrics = SelfMetrics()
    delivery = _delivery(otlp_sink.endpoint, store, metrics)
    otlp_sink.script = [Answer(grpc.StatusCode.INVALID_ARGUMENT)]
    T0, MIN = intervals.T0, intervals.MIN
    first = intervals.record(0)
    ended = [p for p in first if p.metric == "held"]
    ended.append(Point("held", ended[0].attrs, ended[0].start_ns, T0 + MIN, float("nan"), ended=True))
    delivery.put([p for p in first if p.metric != "held"] + ended)
    later = [p for p in intervals.record(1) if p.metric != "held"]
    delivery.put(later)
    assert delivery.wait_idle(10)
    delivery.close()
    got = _metrics(otlp_sink, 0)
    value, end = got["gpu.held"].sum.data_points
    assert (value.as_double, value.time_unix_nano, value.start_time_unix_nano) == (60.0, T0 + 2 * MIN - 10**6, T0)
    assert end.flags & NO_RECORDED_VALUE and end.time_unix_nano == T0 + 2 * MIN
    assert got["gpu.cost.allocated"].sum.data_points[0].as_double == 3.0  # the later snapshot's own
    assert len(otlp_sink.received) == 1 and not by_label(metrics.export_snapshots_dropped)


def test_shutdown_gives_up_at_its_deadline_and_counts(store: CostStore, intervals) -> None:
    metrics = SelfMetrics()
    delivery = _delivery("127.0.0.1:1", store, metrics, shutdown_timeout_seconds=0.5)
    intervals.record(0)
    delivery.put(store.points())
    began = time.monotonic()
    assert delivery.close() == 1
    assert time.monotonic() - began < 3.0
    assert by_label(metrics.export_snapshots_dropped)[("otlp", "shutdown")] == 1
    assert by_label(metrics.export_points_undeliverable)[("otlp", "shutdown")] == len(store.points())
    assert by_label(metrics.export_failures)[("otlp", "unavailable")] >= 1 and not by_label(metrics.exports)
    assert not math.isnan(sum(p.value for p in store.points()))


def test_a_per_node_sidecar_names_its_node_as_the_instance(store: CostStore, intervals) -> None:
    """Per-node sidecars each write their own resource (the Collector turns service.instance.id
    into the `instance` label and a target_info series of its own), never one shared by all."""
    intervals.record(0)
    (request,) = requests_reference(store.points(), store.specs, "prod-eu", instance="ip-10-0-1-1.ec2.internal")
    resource = {kv.key: kv.value.string_value for kv in request.resource_metrics[0].resource.attributes}
    assert resource == {"k8s.cluster.name": "prod-eu", "service.name": "otelgpu",
                        "service.instance.id": "ip-10-0-1-1.ec2.internal"}


def test_a_snapshot_of_several_requests_arrives_whole_and_one_refused_request_fails_the_attempt(
        otlp_sink, store: CostStore, intervals) -> None:
    """The sender keeps two requests out at once (the next one is built while the last is on its
    way): every point still arrives once, partial successes of any of them are counted, and a
    failure of any one fails the attempt, which the queue then retries whole."""
    series = {(("pod", f"p-{k:05d}"), ("team", "a")): 1.0 for k in range(3 * MAX_POINTS_PER_REQUEST + 5)}
    snapshot = store.record(intervals.T0, intervals.T0 + intervals.MIN, {"allocated": series}, {})
    metrics = SelfMetrics()
    sender = _sender(otlp_sink.endpoint, store, metrics)
    otlp_sink.script = [Answer(rejected=2, message="two"), Answer(rejected=1, message="one")]
    assert sender.send(snapshot).ok
    assert len(otlp_sink.received) == 4 and by_label(metrics.export_points_rejected)["otlp"] == 3
    pods = [_attrs(dp)["pod"] for r in otlp_sink.received for m in _metrics_of(r) for dp in m.sum.data_points]
    assert sorted(pods) == sorted(dict(attrs)["pod"] for attrs in series)  # each point once

    otlp_sink.script = [Answer(grpc.StatusCode.UNAVAILABLE)]  # whichever request comes first
    failed = sender.send(snapshot)
    sender.close()
    assert (failed.ok, failed.retryable, failed.reason) == (False, True, "unavailable")


def _metrics_of(received) -> list[Metric]:
    return list(received.request.resource_metrics[0].scope_metrics[0].metrics)
