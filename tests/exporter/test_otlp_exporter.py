"""OtlpCostExporter through the SDK's real OTLP/gRPC exporter to a real in-process server."""

from __future__ import annotations

import time

from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality, Metric

from otelgpu.config import OtlpExporterConfig
from otelgpu.exporter.otlp import OtlpCostExporter
from otelgpu.exporter.store import CostStore
from otelgpu.telemetry import SelfMetrics


def _metrics(sink, i: int) -> dict[str, Metric]:
    rm = sink.received[i].request.resource_metrics
    assert len(rm) == 1 and len(rm[0].scope_metrics) == 1
    assert rm[0].scope_metrics[0].scope.name == "otelgpu"
    out = {m.name: m for m in rm[0].scope_metrics[0].metrics}
    assert len(out) == len(rm[0].scope_metrics[0].metrics), "one Metric per spec"
    return out


def _attrs(dp) -> dict[str, str]:
    return {kv.key: kv.value.string_value for kv in dp.attributes}


def _exporter(endpoint: str, store: CostStore, metrics: SelfMetrics, **kw) -> OtlpCostExporter:
    config = OtlpExporterConfig(endpoint=endpoint, **kw)
    return OtlpCostExporter(config, store, metrics, cluster="prod-eu")


def test_cumulative_sums_keep_start_and_advance(otlp_sink, store: CostStore, intervals) -> None:
    metrics = SelfMetrics()
    exp = _exporter(otlp_sink.endpoint, store, metrics, headers={"Authorization": "Bearer t"})
    try:
        intervals.record(0)
        assert exp.export() is True
        intervals.record(1)
        assert exp.export() is True
    finally:
        exp.shutdown()
    assert len(otlp_sink.received) == 2
    assert all(r.gzipped for r in otlp_sink.received)  # the default compression is gzip
    assert otlp_sink.received[0].metadata["authorization"] == "Bearer t"
    assert metrics.exports["otlp"] == 2 and not metrics.export_failures

    resource = {kv.key: kv.value.string_value
                for kv in otlp_sink.received[0].request.resource_metrics[0].resource.attributes}
    assert resource["k8s.cluster.name"] == "prod-eu" and resource["service.name"] == "otelgpu"

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
    assert (a1.as_double, a2.as_double) == (1.5, 3.0)
    # Attributes travel exactly as the store holds them (cost_model is one of them, set upstream).
    assert _attrs(a1) == {"namespace": "ml", "pod": "train-0", "team": "a", "cost_model": "request"}
    assert "cost_model" not in _attrs(first["gpu.held"].sum.data_points[0])
    assert _attrs(first["gpu.cost.idle"].sum.data_points[0])["cost_model"] == "request"
    (g1,), (g2,) = first["gpu.activity"].gauge.data_points, second["gpu.activity"].gauge.data_points
    assert g2.time_unix_nano > g1.time_unix_nano and abs(g2.as_double - 0.6) < 1e-9


def test_no_compression_when_configured(otlp_sink, store: CostStore, intervals) -> None:
    exp = _exporter(otlp_sink.endpoint, store, SelfMetrics(), compression="none")
    intervals.record(0)
    assert exp.export()
    exp.shutdown()
    assert [r.gzipped for r in otlp_sink.received] == [False]


def test_empty_store_sends_nothing(otlp_sink, store: CostStore) -> None:
    metrics = SelfMetrics()
    exp = _exporter(otlp_sink.endpoint, store, metrics)
    assert exp.export() is True
    exp.shutdown()
    assert otlp_sink.received == [] and not metrics.exports and not metrics.export_failures


def test_dead_endpoint_fails_fast_and_counts(store: CostStore, intervals) -> None:
    metrics = SelfMetrics()
    exp = _exporter("127.0.0.1:1", store, metrics, timeout_seconds=1.0)
    intervals.record(0)
    began = time.monotonic()
    assert exp.export() is False
    assert time.monotonic() - began < 3.0
    assert metrics.export_failures["otlp"] == 1 and not metrics.exports
    exp.shutdown()


def test_lifecycle_shutdown_twice_then_export_fails(otlp_sink, store: CostStore, intervals) -> None:
    metrics = SelfMetrics()
    exp = _exporter(otlp_sink.endpoint, store, metrics)
    intervals.record(0)
    exp.shutdown()
    exp.shutdown()
    assert exp.export() is False
    assert metrics.export_failures["otlp"] == 1 and otlp_sink.received == []
