"""The OTLP/gRPC receiver against real clients: raw stubs, a raw channel, and the SDK's OTLP exporter."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)
from opentelemetry.sdk.metrics.export import (
    Gauge, Metric, MetricExportResult, MetricsData, NumberDataPoint, ResourceMetrics, ScopeMetrics,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from support import poll

from otelgpu.errors import ConfigError
from otelgpu.receiver.config import GrpcReceiverConfig
from otelgpu.receiver.grpc_server import RETRY_INFO_TRAILER, SERVICE, GrpcReceiver
from otelgpu.telemetry import by_label, total

from .helpers import DCGM1, KSM, VLLM, Exploding, drain_points, padded, refusals_counted, spoil_dcgm

MiB = 1024 * 1024


def stub(port: int, **kwargs: object) -> metrics_service_pb2_grpc.MetricsServiceStub:
    return metrics_service_pb2_grpc.MetricsServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}", **kwargs))


def sdk_data(value: float) -> MetricsData:
    point = NumberDataPoint(
        attributes={"UUID": "GPU-0f5e", "gpu": "0", "pod": "trainer-0", "namespace": "ml"},
        start_time_unix_nano=0, time_unix_nano=time.time_ns(), value=value,
    )
    metric = Metric("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "", "1", Gauge([point]))
    scope = ScopeMetrics(InstrumentationScope("test"), [metric], "")
    return MetricsData([ResourceMetrics(Resource({"service.name": "dcgm-exporter"}), [scope], "")])


@pytest.mark.parametrize(("name", "consumed", "ignored"), [(DCGM1, 36, 5), (KSM, 88, 28), (VLLM, 2, 12)])
def test_fixture_requests_are_accepted_gzip(grpc_receiver, make_ingest, otel_request, metrics, name, consumed, ignored):
    ingest = make_ingest()
    receiver = grpc_receiver(ingest)
    response = stub(receiver.port).Export(otel_request(name), compression=grpc.Compression.Gzip, timeout=5)
    assert response == ExportMetricsServiceResponse()
    assert drain_points(ingest) == consumed
    assert (total(metrics.points_received), total(metrics.points_ignored)) == (consumed, ignored)
    assert by_label(metrics.requests)[("grpc", "ok")] == 1
    assert by_label(metrics.receiver_accepted_points) == {("otlp", "grpc"): consumed + ignored}
    assert not by_label(metrics.receiver_refused_points)


def test_rejected_points_give_partial_success_and_the_rest_is_queued(grpc_receiver, make_ingest, otel_request, metrics):
    ingest = make_ingest()
    request = otel_request(DCGM1)
    spoil_dcgm(request)
    response = stub(grpc_receiver(ingest).port).Export(request, timeout=5)
    assert response.partial_success.rejected_data_points == 2
    assert "missing label UUID" in response.partial_success.error_message
    assert "DCGM_FI_PROF_GR_ENGINE_ACTIVE value outside [0, 1]" in response.partial_success.error_message
    assert drain_points(ingest) == 34
    assert by_label(metrics.requests)[("grpc", "partial")] == 1
    assert by_label(metrics.receiver_refused_points) == {("otlp", "grpc"): 2}
    assert by_label(metrics.receiver_accepted_points)[("otlp", "grpc")] == 34 + total(metrics.points_ignored)


def test_full_queue_is_unavailable_with_retry_info(grpc_receiver, make_ingest, otel_request, metrics):
    ingest = make_ingest(queue_size=1, retry_after_s=2.5)
    client = stub(grpc_receiver(ingest).port)
    client.Export(otel_request(DCGM1), timeout=5)  # fills the queue; nothing drains it
    with pytest.raises(grpc.RpcError) as caught:
        client.Export(otel_request(DCGM1), timeout=5)
    err = caught.value
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    status = rpc_status.from_call(err)
    assert status is not None and len(status.details) == 1
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info)
    assert info.retry_delay.ToTimedelta().total_seconds() == 2.5
    # the trailer opentelemetry-python's exporter reads
    trailer = dict(err.trailing_metadata())[RETRY_INFO_TRAILER]
    assert error_details_pb2.RetryInfo.FromString(trailer) == info
    assert by_label(metrics.requests)[("grpc", "unavailable")] == 1
    assert ingest.depth == 1


@pytest.mark.parametrize("garbage", [b"not a protobuf", b"\x0a\x10truncated"])
def test_undecodable_request_is_invalid_argument(grpc_receiver, make_ingest, metrics, garbage):
    receiver = grpc_receiver(make_ingest())
    channel = grpc.insecure_channel(f"127.0.0.1:{receiver.port}")
    export = channel.unary_unary(f"/{SERVICE}/Export", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as caught:
        export(garbage, timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert by_label(metrics.requests)[("grpc", "invalid")] == 1


def test_message_over_the_limit_is_refused_and_under_it_accepted(grpc_receiver, make_ingest, otel_request):
    small_limit = grpc_receiver(make_ingest(), max_recv_msg_size_mib=1)
    with pytest.raises(grpc.RpcError) as caught:
        stub(small_limit.port).Export(padded(otel_request(DCGM1), 2 * MiB), timeout=5)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    ingest = make_ingest()
    default_limit = grpc_receiver(ingest)  # 64 MiB, far above grpcio's own 4 MiB default
    request = padded(otel_request(DCGM1), 5 * MiB)
    assert request.ByteSize() > 4 * MiB
    assert stub(default_limit.port).Export(request, timeout=5) == ExportMetricsServiceResponse()
    assert drain_points(ingest) == 36


def test_consumer_bug_is_internal_and_the_server_keeps_serving(grpc_receiver, otel_request, metrics):
    consumer = Exploding()
    client = stub(grpc_receiver(consumer).port)
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as caught:
            client.Export(otel_request(VLLM), timeout=5)
        assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert consumer.calls == 2
    assert by_label(metrics.requests)[("grpc", "error")] == 2


def test_twelve_concurrent_clients_all_succeed(grpc_receiver, make_ingest, otel_request, metrics):
    ingest = make_ingest()
    port = grpc_receiver(ingest).port
    request = otel_request(DCGM1)

    def send(_: int) -> ExportMetricsServiceResponse:
        return stub(port, compression=grpc.Compression.Gzip).Export(request, timeout=10)

    with ThreadPoolExecutor(max_workers=12) as pool:
        responses = list(pool.map(send, range(12)))
    assert all(r == ExportMetricsServiceResponse() for r in responses)
    assert by_label(metrics.requests)[("grpc", "ok")] == 12
    assert drain_points(ingest) == 12 * 36


def test_sdk_exporter_succeeds_with_room_in_the_queue(grpc_receiver, make_ingest, metrics):
    from opentelemetry.exporter.otlp.proto.grpc.exporter import Compression

    ingest = make_ingest()
    receiver = grpc_receiver(ingest)
    exporter = OTLPMetricExporter(endpoint=f"127.0.0.1:{receiver.port}", insecure=True, timeout=2,
                                  compression=Compression.Gzip)
    try:
        assert exporter.export(sdk_data(0.75)) == MetricExportResult.SUCCESS
    finally:
        exporter.shutdown()
    batch = ingest.get(timeout=0)
    assert batch is not None and list(batch.value) == [0.75]


def test_a_refused_request_is_let_go_once_answered(grpc_receiver, make_ingest, otel_request):
    """A refusal kept no reference cycle with the request it refused: each held its bytes (some
    540 KB at 100,000 GPUs) until the cyclic collector ran, which is off while the sidecar closes
    an interval, when it refuses most."""
    client = stub(grpc_receiver(make_ingest(queue_size=1)).port)
    client.Export(otel_request(DCGM1), timeout=5)  # fills the queue; nothing drains it
    with refusals_counted() as alive:
        for _ in range(5):
            with pytest.raises(grpc.RpcError):
                client.Export(otel_request(DCGM1), timeout=5)
        assert poll(lambda: alive() == 0), f"{alive()} refusals wait for the cyclic collector"


def test_sdk_exporter_honours_retry_info_then_fails_on_a_full_queue(grpc_receiver, make_ingest, otel_request, metrics):
    from opentelemetry.exporter.otlp.proto.grpc.exporter import Compression

    ingest = make_ingest(queue_size=1, retry_after_s=0.1)
    receiver = grpc_receiver(ingest)
    stub(receiver.port).Export(otel_request(DCGM1), timeout=5)  # fill the queue
    exporter = OTLPMetricExporter(endpoint=f"127.0.0.1:{receiver.port}", insecure=True, timeout=2,
                                  compression=Compression.Gzip)
    started = time.monotonic()
    try:
        assert exporter.export(sdk_data(0.5)) == MetricExportResult.FAILURE
    finally:
        exporter.shutdown()
    # 6 attempts 0.1 s apart: the exporter used our RetryInfo (its own backoff, 1 s then 2 s,
    # would give up after 2 attempts within the 2 s timeout).
    assert by_label(metrics.requests)[("grpc", "unavailable")] == 6
    assert time.monotonic() - started < 2


def test_lifecycle_and_shutdown_twice(make_ingest, metrics, otel_request):
    receiver = GrpcReceiver(GrpcReceiverConfig(endpoint="127.0.0.1:0"), make_ingest(), metrics)
    receiver.start()
    assert receiver.port
    assert stub(receiver.port).Export(otel_request(VLLM), timeout=5) == ExportMetricsServiceResponse()
    receiver.shutdown(time.monotonic() + 0.5)
    receiver.shutdown(time.monotonic() + 0.5)
    never_started = GrpcReceiver(GrpcReceiverConfig(endpoint="127.0.0.1:0"), make_ingest(), metrics)
    never_started.shutdown()
    never_started.shutdown()


def test_a_taken_port_is_a_config_error(grpc_receiver, make_ingest, metrics):
    taken = grpc_receiver(make_ingest()).port
    second = GrpcReceiver(GrpcReceiverConfig(endpoint=f"127.0.0.1:{taken}"), make_ingest(), metrics)
    with pytest.raises(ConfigError, match="receiver.grpc.endpoint"):
        second.start()
    second.shutdown()
