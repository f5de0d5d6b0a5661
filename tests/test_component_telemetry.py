"""Each component's handle on the self-metrics, its labels bound once: an export operation counts
the attempt by how it went (an exception is a failure), request outcomes are an enum, and every
rejection a decoder makes names its metric and one of the fixed reason codes."""

from __future__ import annotations

from collections import Counter

import pytest

from otelgpu.exporter.sending import DELIVERED, SendResult
from otelgpu.receiver.rejection import REASONS, describe, rejection
from otelgpu.telemetry import ExporterTelemetry, ReceiverTelemetry, RequestOutcome, SelfMetrics, by_label


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
