"""OTLP/gRPC limits against real clients: Exports beyond the admitted number are refused with
UNAVAILABLE and RetryInfo (not grpcio's bare RESOURCE_EXHAUSTED, which the Collector drops), idle
connections are closed, and old ones are rotated without failing an RPC."""

from __future__ import annotations

import threading

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from support import eventually

from otelgpu.receiver.grpc_server import RETRY_INFO_TRAILER
from otelgpu.receiver.ingest import Taken
from otelgpu.telemetry import by_label

from .helpers import VLLM


class Blocking:
    """A consumer that holds every worker until released, as a stalled pipeline would."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self._lock = threading.Lock()
        self.entered = 0

    def consume(self, request: ExportMetricsServiceRequest) -> Taken:
        with self._lock:
            self.entered += 1
        assert self.release.wait(30), "never released"
        return Taken(0, 0, "")


class StateLog:
    """A channel's connectivity states, in order."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.states: list[grpc.ChannelConnectivity] = []
        self.channel = channel
        before = set(threading.enumerate())
        channel.subscribe(self.states.append, try_to_connect=False)
        self._pollers = set(threading.enumerate()) - before  # grpcio's polling thread, started above

    def went_idle_after_ready(self) -> bool:
        s = list(self.states)
        return grpc.ChannelConnectivity.READY in s and grpc.ChannelConnectivity.IDLE in s[s.index(
            grpc.ChannelConnectivity.READY):]

    def close(self) -> None:
        # Closing a channel under a live subscription makes grpcio's polling thread raise: let it end first.
        self.channel.unsubscribe(self.states.append)
        eventually(lambda: not any(t.is_alive() for t in self._pollers))
        self.channel.close()


@pytest.fixture
def watched():
    logs: list[StateLog] = []

    def watch(port: int) -> StateLog:
        logs.append(StateLog(grpc.insecure_channel(f"127.0.0.1:{port}")))
        return logs[-1]

    yield watch
    for log in logs:
        log.close()


def test_exports_beyond_the_limit_get_unavailable_with_retry_info_at_once(grpc_receiver, metrics, otel_request):
    consumer = Blocking()
    receiver = grpc_receiver(consumer, max_concurrent_requests=10, max_queued_requests=2)
    with grpc.insecure_channel(f"127.0.0.1:{receiver.port}") as channel:
        export = metrics_service_pb2_grpc.MetricsServiceStub(channel).Export
        request = otel_request(VLLM)
        try:
            admitted = [export.future(request, timeout=30) for _ in range(12)]
            eventually(lambda: consumer.entered == 10 and receiver.requests_in_flight == 12)
            # every worker is held: the refusal comes from its own thread, not from the worker queue
            with pytest.raises(grpc.RpcError) as caught:
                export(request, timeout=10)
        finally:
            consumer.release.set()
        err = caught.value
        assert err.code() == grpc.StatusCode.UNAVAILABLE  # retried by the Collector; RESOURCE_EXHAUSTED is not
        status = rpc_status.from_call(err)
        info = error_details_pb2.RetryInfo()
        assert status is not None and status.details[0].Unpack(info)
        assert info.retry_delay.ToTimedelta().total_seconds() == 1.0
        assert error_details_pb2.RetryInfo.FromString(dict(err.trailing_metadata())[RETRY_INFO_TRAILER]) == info
        assert by_label(metrics.receiver_connections_refused)[("grpc", "concurrent_requests")] == 1
        assert all(f.result() == ExportMetricsServiceResponse() for f in admitted)
        assert by_label(metrics.requests)[("grpc", "ok")] == 12 and consumer.entered == 12
        eventually(lambda: receiver.requests_in_flight == 0)
        assert export(request, timeout=10) == ExportMetricsServiceResponse()


def test_idle_connection_is_closed(grpc_receiver, watched, make_ingest, otel_request):
    receiver = grpc_receiver(make_ingest(), max_connection_idle_seconds=0.2, max_connection_age_seconds=None)
    log = watched(receiver.port)
    stub = metrics_service_pb2_grpc.MetricsServiceStub(log.channel)
    assert stub.Export(otel_request(VLLM), timeout=10) == ExportMetricsServiceResponse()
    eventually(log.went_idle_after_ready, timeout=10)  # the server's GOAWAY, with no RPC under way
    assert stub.Export(otel_request(VLLM), timeout=10) == ExportMetricsServiceResponse()  # reconnects


def test_old_connection_is_rotated_without_failing_an_export(grpc_receiver, watched, make_ingest, otel_request):
    receiver = grpc_receiver(make_ingest(), max_connection_idle_seconds=None, max_connection_age_seconds=0.3,
                             max_connection_age_grace_seconds=5)
    log = watched(receiver.port)
    stub = metrics_service_pb2_grpc.MetricsServiceStub(log.channel)
    answers: list[ExportMetricsServiceResponse] = []

    def busy_and_rotated() -> bool:
        # never idle: an Export each time round, so only the connection's age can close it
        answers.append(stub.Export(otel_request(VLLM), timeout=10))
        return log.went_idle_after_ready()

    eventually(busy_and_rotated, timeout=10)
    assert stub.Export(otel_request(VLLM), timeout=10) == ExportMetricsServiceResponse()
    assert len(answers) > 1 and all(a == ExportMetricsServiceResponse() for a in answers)
