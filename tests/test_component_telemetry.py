"""Each component's handle on the self-metrics, its labels bound once: an export operation counts
the attempt by how it went (an exception is a failure), request outcomes are an enum, and every
rejection a decoder makes names its metric and one of the fixed reason codes."""

from __future__ import annotations

from collections import Counter

import pytest

from otelgpu.exporter.sending import DELIVERED, SendResult
from otelgpu.receiver.rejection import REASONS, describe, rejection
from otelgpu.telemetry import (DurabilityTelemetry, ExporterTelemetry, IntervalScope, IntervalTelemetry, KubeReason,
                               KubeTelemetry, KubeVerb, ReceiverTelemetry, RequestOutcome, SelfMetrics, WorkStep,
                               by_label)


def test_an_export_operation_counts_the_attempt_by_how_it_went() -> None:
    metrics = SelfMetrics()
    otlp = ExporterTelemetry(metrics, "otlp")
    with otlp.export_operation(5) as operation:
        operation.finished(DELIVERED)
    with otlp.export_operation(3) as operation:
        operation.finished(SendResult(ok=False, retryable=True, reason="unavailable"))
    with pytest.raises(RuntimeError), otlp.export_operation(2):
        raise RuntimeError("the sender broke its promise not to raise")
    assert by_label(metrics.exports) == {"otlp": 1} and by_label(metrics.exporter_sent_points) == {"otlp": 5}
    assert by_label(metrics.export_failures) == {("otlp", "unavailable"): 1, ("otlp", "unknown"): 1}
    assert by_label(metrics.exporter_send_failed_points) == {"otlp": 5}
    assert by_label(metrics.work_seconds).keys() == {"send:otlp"}


def test_request_outcomes_are_an_enum_and_unknown_ones_are_refused() -> None:
    metrics = SelfMetrics()
    grpc = ReceiverTelemetry(metrics, "grpc")
    grpc.request(RequestOutcome.PARTIAL)
    grpc.request("ok")  # the enum's values are its strings
    with pytest.raises(ValueError):
        grpc.request("fine")
    assert by_label(metrics.requests) == {("grpc", "partial"): 1, ("grpc", "ok"): 1}


def test_a_rejection_names_its_metric_a_known_code_and_tells_the_sender_in_words() -> None:
    why = rejection("DCGM_FI_DEV_GPU_UTIL", "out_of_range", "value outside [0, 100]")
    assert why.text == "DCGM_FI_DEV_GPU_UTIL value outside [0, 100]" and why.reason in REASONS
    with pytest.raises(ValueError, match="unknown rejection reason"):
        rejection("DCGM_FI_DEV_GPU_UTIL", "value outside [0, 100]", "")
    assert describe(Counter({why: 3, rejection("", "internal_error", "boom"): 1})) == \
        "3 DCGM_FI_DEV_GPU_UTIL value outside [0, 100]; 1 boom"


def test_only_the_telemetry_module_binds_label_values() -> None:
    """Components count through their bound handles (telemetry.py): no `.labels(...)` elsewhere."""
    import ast

    from layering import modules

    binding = [f"{module}:{node.lineno}" for module, path in modules().items() if module != "otelgpu.telemetry"
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "labels"]
    assert binding == []


def test_the_series_of_known_label_values_exist_from_the_start_at_zero() -> None:
    """A failure's first count is then an increase that `increase()` and the alerts see."""
    from prometheus_client import generate_latest

    metrics = SelfMetrics()
    IntervalTelemetry(metrics), DurabilityTelemetry(metrics), KubeTelemetry(metrics, "pods")
    ReceiverTelemetry(metrics, "grpc"), ExporterTelemetry(metrics, "otlp")
    text = generate_latest(metrics.registry).decode()
    for line in ('otelgpu_interval_errors_total{scope="whole"} 0.0', 'otelgpu_intervals_ahead_total{outcome="redone"} 0.0',
                 'otelgpu_checkpoint_errors_total{reason="write"} 0.0', 'otelgpu_wal_corruptions_total{where="tail"} 0.0',
                 'otelgpu_kube_lists_total{reason="gone",resource="pods"} 0.0',
                 'otelgpu_receiver_connections_refused_total{reason="memory_limit",transport="grpc"} 0.0',
                 'otelgpu_export_outbox_errors_total{exporter="otlp",reason="corrupt"} 0.0',
                 'otelgpu_export_snapshots_dropped_total{exporter="otlp",reason="shutdown"} 0.0'):
        assert line in text


def test_bound_handles_refuse_values_outside_their_enum_and_hold_work_computed_ahead() -> None:
    metrics = SelfMetrics()
    intervals, kube = IntervalTelemetry(metrics), KubeTelemetry(metrics, "nodes")
    with pytest.raises(ValueError):
        intervals.failed("everything")
    with pytest.raises(ValueError):
        kube.failed(KubeVerb.WATCH, "sad")
    with pytest.raises(ValueError):
        ReceiverTelemetry(metrics, "http").refused("tired")
    with pytest.raises(ValueError):
        ExporterTelemetry(metrics, "otlp").outbox_error("gone missing")
    kube.failed("list", KubeReason.FORBIDDEN)
    with metrics.held() as pending:
        intervals.failed(IntervalScope.NODE)
    assert by_label(metrics.interval_errors) == {}  # held until the work is kept
    metrics.apply(pending)
    assert by_label(metrics.interval_errors) == {"node": 1}
    assert by_label(metrics.kube_errors) == {("nodes", "list", "forbidden"): 1}
    with pytest.raises(RuntimeError), intervals.timed(WorkStep.CLOSE):
        raise RuntimeError("a close that failed still spent its time")
    assert "close" in by_label(metrics.work_seconds)


@pytest.mark.parametrize("status, reason", [(401, "unauthorized"), (403, "forbidden"), (404, "not_found"),
                                            (410, "gone"), (429, "throttled"), (500, "server_error"),
                                            (422, "invalid"), (0, "connection")])
def test_a_kubernetes_api_status_has_one_reason_code(status: int, reason: str) -> None:
    from kubernetes.client.exceptions import ApiException

    from otelgpu.enrich.kube.reflector import reason_of

    assert reason_of(ApiException(status=status)) is KubeReason(reason)
