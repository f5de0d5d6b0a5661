"""OTLP/gRPC receiver: `opentelemetry.proto.collector.metrics.v1.MetricsService/Export`.

The wire contract (docs/pipeline.md, "Receiving OTLP"):
- success: an empty ExportMetricsServiceResponse; some points rejected: `partial_success`;
- overload (RetryableError): UNAVAILABLE carrying google.rpc.RetryInfo, so senders back off and retry;
- undecodable request: INVALID_ARGUMENT (never retried); anything unexpected: INTERNAL, logged and
  counted, and the server keeps serving (a crash would turn the sender's retries into a crash loop).
Every status comes from otelgpu.errors.status_for.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from otelgpu.config import GrpcReceiverConfig
from otelgpu.errors import ConfigError, OtelgpuError, PermanentError, RetryableError, status_for
from otelgpu.receiver.ingest import Consumer, answer
from otelgpu.telemetry import SelfMetrics

log = logging.getLogger(__name__)

SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"
# opentelemetry-python's OTLP exporter reads the delay from this trailer, not from the RetryInfo
# inside grpc-status-details-bin (which is what the Collector's Go exporter reads): send both.
RETRY_INFO_TRAILER = "google.rpc.retryinfo-bin"


class _AbortStatus(grpc.Status):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple) -> None:
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata


def retry_status(err: RetryableError, code: Optional[grpc.StatusCode] = None) -> grpc.Status:
    """UNAVAILABLE (or `code`) with a RetryInfo detail whose delay is `err.retry_after_s`."""
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(round(err.retry_after_s * 1e9))
    info = error_details_pb2.RetryInfo(retry_delay=delay)
    detail = any_pb2.Any()
    detail.Pack(info)
    code = code or status_for(err).grpc_code
    base = rpc_status.to_status(status_pb2.Status(code=code.value[0], message=str(err), details=[detail]))
    trailers = tuple(base.trailing_metadata) + ((RETRY_INFO_TRAILER, info.SerializeToString()),)
    return _AbortStatus(base.code, base.details, trailers)


class GrpcReceiver:
    def __init__(self, config: GrpcReceiverConfig, consumer: Consumer, metrics: SelfMetrics) -> None:
        self.config = config
        self.consumer = consumer
        self.metrics = metrics
        self.port: Optional[int] = None
        self._server: Optional[grpc.Server] = None
        self._executor: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        self._stopped = False

    def start(self) -> None:
        cfg = self.config
        self._executor = ThreadPoolExecutor(max_workers=cfg.max_concurrent_requests, thread_name_prefix="otlp-grpc")
        server = grpc.server(
            self._executor,
            options=[
                ("grpc.max_receive_message_length", cfg.max_recv_msg_size_mib * 1024 * 1024),
                # Without this a second process could bind the same port and silently share traffic.
                ("grpc.so_reuseport", 0),
            ],
        )
        # Registered by hand with a bytes-in handler rather than add_MetricsServiceServicer_to_server:
        # grpcio answers a request it cannot deserialize with INTERNAL, and the OTLP contract asks
        # for INVALID_ARGUMENT, so the request is parsed here.
        handler = grpc.unary_unary_rpc_method_handler(
            self._export, request_deserializer=None,
            response_serializer=ExportMetricsServiceResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Export": handler}),))
        try:
            self.port = server.add_insecure_port(cfg.endpoint)
        except RuntimeError as exc:
            self._executor.shutdown(wait=False)
            raise ConfigError([f"receiver.grpc.endpoint: cannot listen on {cfg.endpoint}: {exc}"]) from exc
        server.start()
        self._server = server
        log.info("OTLP/gRPC receiver listening on port %d", self.port)

    def shutdown(self, grace: float = 5.0) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        if self._server is not None:
            # Lets in-flight Exports finish for up to `grace` seconds; new ones are refused.
            self._server.stop(grace).wait()
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    def _export(self, raw: bytes, context: grpc.ServicerContext) -> ExportMetricsServiceResponse:
        outcome, response, failure = self._handle(raw)
        self.metrics.count("requests", ("grpc", outcome))
        if failure is None:
            return response
        if isinstance(failure, RetryableError):
            context.abort_with_status(retry_status(failure))
        context.abort(status_for(failure).grpc_code, str(failure))
        raise AssertionError("unreachable: abort raises")  # pragma: no cover

    def _handle(self, raw: bytes) -> tuple[str, ExportMetricsServiceResponse, Optional[OtelgpuError]]:
        """(outcome, response, error to answer with instead of the response)."""
        empty = ExportMetricsServiceResponse()
        try:
            request = ExportMetricsServiceRequest.FromString(raw)
        except DecodeError as exc:
            return "invalid", empty, PermanentError(f"undecodable ExportMetricsServiceRequest: {exc}")
        return answer(self.consumer, request, "gRPC")
