"""A real in-process OTLP/gRPC MetricsService that stores what it accepts and can be scripted to
fail as a Collector does."""

from __future__ import annotations

import gzip
import threading
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional, Sequence

import grpc
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsPartialSuccess,
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from otelgpu.errors import RetryableError
from otelgpu.exporter.otlp import NO_RECORDED_VALUE
from otelgpu.exporter.store import MetricSpec, Point
from otelgpu.receiver.grpc_server import retry_status

SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"


@dataclass
class Received:
    request: ExportMetricsServiceRequest
    gzipped: bool
    metadata: dict[str, str]


@dataclass(frozen=True)
class Answer:
    """A scripted answer: a gRPC status (with RetryInfo when `retry_after` is set), or a partial
    success rejecting `rejected` points."""

    code: grpc.StatusCode = grpc.StatusCode.OK
    retry_after: float | None = None
    rejected: int = 0
    message: str = "scripted"


@dataclass
class MetricsSink:
    """Stores every ExportMetricsServiceRequest it accepts; `script` answers the next calls first
    (a failed call stores nothing). Per-message decompression is switched off on the server, so the
    handler sees the bytes as sent and can tell whether the client used gzip."""

    endpoint: str = ""
    received: list[Received] = field(default_factory=list)
    script: list[Answer] = field(default_factory=list)
    calls: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def export(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        gzipped = raw[:2] == b"\x1f\x8b"  # a protobuf request cannot start with 0x1f (wire type 7)
        request = ExportMetricsServiceRequest.FromString(gzip.decompress(raw) if gzipped else raw)
        with self._lock:
            self.calls += 1
            answer = self.script.pop(0) if self.script else Answer()
            if answer.code is grpc.StatusCode.OK:
                self.received.append(Received(request, gzipped, dict(context.invocation_metadata())))
        if answer.code is not grpc.StatusCode.OK:
            if answer.retry_after is not None:
                context.abort_with_status(retry_status(RetryableError(answer.message, answer.retry_after), answer.code))
            context.abort(answer.code, answer.message)
        if answer.rejected:
            return ExportMetricsServiceResponse(partial_success=ExportMetricsPartialSuccess(
                rejected_data_points=answer.rejected, error_message=answer.message)).SerializeToString()
        return b""  # an empty ExportMetricsServiceResponse: full success


@contextmanager
def serve_sink(sink: MetricsSink, port: int = 0, credentials: Optional[grpc.ServerCredentials] = None) -> Iterator[int]:
    """A gRPC server for `sink` on `port` (0: any free one) while the block runs, over TLS with
    `credentials`; yields the port."""
    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Export": grpc.unary_unary_rpc_method_handler(sink.export)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[handler],
                         options=[("grpc.per_message_decompression", 0), ("grpc.so_reuseport", 0)])
    port = (server.add_secure_port(f"127.0.0.1:{port}", credentials) if credentials
            else server.add_insecure_port(f"127.0.0.1:{port}"))
    server.start()
    sink.endpoint = f"127.0.0.1:{port}"
    try:
        yield port
    finally:
        server.stop(grace=None).wait()


Row = tuple[str, tuple[tuple[str, str], ...], int, int, Optional[float]]  # metric key, attrs, start, time, value


def _row(metric: str, attrs: Sequence[tuple[str, str]], start: int, t: int, value: Optional[float]) -> Row:
    return (metric, tuple(sorted(attrs)), start, t, value)


def as_sent(points: Sequence[Point], specs: Mapping[str, MetricSpec]) -> list[Row]:
    """What OTLP carries of the points, sorted: gauges have no start time, ended points no value."""
    return sorted(_row(p.metric, p.attrs, p.start_ns if specs[p.metric].kind == "sum" else 0, p.time_ns,
                       None if p.ended else p.value) for p in points)


def received_rows(sink: MetricsSink, specs: Mapping[str, MetricSpec]) -> list[list[Row]]:
    """Each accepted request's points, as as_sent() writes them."""
    key = {spec.name: k for k, spec in specs.items()}
    out = []
    for r in sink.received:
        rows = []
        for m in r.request.resource_metrics[0].scope_metrics[0].metrics:
            for dp in (m.sum.data_points if m.HasField("sum") else m.gauge.data_points):
                value = None if dp.flags & NO_RECORDED_VALUE else dp.as_double
                attrs = [(kv.key, kv.value.string_value) for kv in dp.attributes]
                rows.append(_row(key[m.name], attrs, dp.start_time_unix_nano, dp.time_unix_nano, value))
        out.append(sorted(rows))
    return out
