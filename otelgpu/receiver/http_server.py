"""OTLP/HTTP receiver: `POST /v1/metrics`, protobuf or JSON, optionally gzip-compressed.

Answers as the OTLP/HTTP specification asks: 200 with an ExportMetricsServiceResponse (partial_success
when points were rejected), 400 for an undecodable body, 413 for a too-large one, 503 with Retry-After
when the queue is full, and a google.rpc.Status body on errors, each in the request's content type.
An unsupported Content-Type gets 400 (through errors.status_for, like every other bad request) rather
than 415: both tell the sender never to retry, and the status mapping stays in one place. Its error
body is JSON, since the sender's format is unknown.

Served by otelgpu.httpserver (asyncio and h11), which bounds what a client can hold: at most
`receiver.http.max_connections` connections (the one waiting longest for a request makes room, or
else the one whose body arrives slowest if slower than 64 KiB/s, else 503 with Retry-After);
`idle_timeout_seconds` to wait for a request (keep-alive, TLS handshake and the whole header
block; 408 where a request had begun); `read_timeout_seconds` for the whole body after its
headers (408), and as long again for the answer to be taken; each refusal and cut counted in
`receiver_connections_refused{transport="http", reason}`. HTTP that cannot be parsed is answered
400 (431 for a header block over 64 KiB, 501 for a transfer coding other than chunked) and counted
as requests{outcome="invalid"}; a client that half-closes after its request still gets its answer. Requests are refused from their headers, before any body is read, without a valid bearer
token (`auth`: 401, counted as requests{outcome="unauthenticated"}), without a Content-Length or a
chunked body (400), or beyond `max_body_bytes` (413) or the memory limiter's budget (503, see
otelgpu/memory.py); bodies are limited after gunzip too (gzip is inflated with ISA-L; a
body whose gzip trailer declares more than the limit is refused before any of it is inflated, and
the declared size is reserved before it is). Requests are handled by a few worker threads,
whatever the number of connections. `tls` gives TLS or mutual TLS, rotated files used for new
connections (otelgpu.tls).
"""

from __future__ import annotations

import json
import logging
import math
import threading
from typing import Optional

import grpc
from google.protobuf import json_format
from isal import isal_zlib
from google.protobuf.message import Message
from google.rpc import status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from otelgpu import httpserver
from otelgpu.core.lifecycle import grace
from otelgpu.core.settings import split_endpoint
from otelgpu.errors import ConfigError, OtelgpuError, PermanentError, Refusal, RetryableError, status_for
from otelgpu.memory import MemoryLimiter, Ticket, cost
from otelgpu.receiver.config import HttpReceiverConfig
from otelgpu.receiver.ingest import Consumer, Request, answer, refused
from otelgpu.telemetry import ReceiverTelemetry, RequestOutcome, SelfMetrics
from otelgpu.tls import server_security

log = logging.getLogger(__name__)

PATH = "/v1/metrics"
PROTOBUF, JSON = "application/x-protobuf", "application/json"
# Routing answers, outside the error taxonomy: no sender should retry them either.
_NOT_FOUND = status_pb2.Status(code=grpc.StatusCode.NOT_FOUND.value[0], message=f"not found; OTLP metrics go to {PATH}")
_NOT_POST = status_pb2.Status(code=grpc.StatusCode.UNIMPLEMENTED.value[0], message=f"use POST {PATH}")
# The server's own refusals (401, 503 at a limit, 500), as google.rpc.Status codes.
_CODES = {401: grpc.StatusCode.UNAUTHENTICATED, 503: grpc.StatusCode.UNAVAILABLE, 500: grpc.StatusCode.INTERNAL}
WORKERS = 4  # threads decoding requests; with the queue, every connection may have one waiting
# The server's own refusals that answer 503 "retry later"; its other reasons are connections it cut.
_RETRY_LATER = frozenset({Refusal.CONNECTION_LIMIT, Refusal.CONCURRENT_REQUESTS, Refusal.MEMORY_LIMIT,
                          Refusal.BYTES_IN_FLIGHT})


def declared_size(body: bytes) -> Optional[int]:
    """The decompressed size a gzip body declares (ISIZE, its last four bytes), if it is gzip."""
    return int.from_bytes(body[-4:], "little") if body[:3] == b"\x1f\x8b\x08" and len(body) >= 18 else None


def _inflate(body: bytes, limit: int) -> bytes:
    """gunzip `body` (all members) with ISA-L, refusing output beyond `limit` bytes without
    producing it. A gzip body declares its size (ISIZE, the last four bytes, modulo 2**32): one
    declaring more than `limit` is refused before anything is inflated; one that lies about it is
    still cut off at `limit`."""
    if (declared_size(body) or 0) > limit:
        raise PermanentError(f"decompressed body exceeds {limit} bytes (declared size)", too_large=True)
    out = bytearray()
    while body:
        inflater = isal_zlib.decompressobj(wbits=16 + isal_zlib.MAX_WBITS)
        try:
            out += inflater.decompress(body, limit + 1 - len(out))
        except isal_zlib.error as exc:
            raise PermanentError(f"invalid gzip body: {exc}") from None
        if len(out) > limit or inflater.unconsumed_tail:
            raise PermanentError(f"decompressed body exceeds {limit} bytes", too_large=True)
        if not inflater.eof:
            raise PermanentError("truncated gzip body")
        body = inflater.unused_data
    return bytes(out)


def _parse(body: bytes, media: str) -> Request:
    """A JSON body as a message; a protobuf body stays bytes, for the columnar decoder."""
    if media != JSON:
        return body
    request = ExportMetricsServiceRequest()
    try:
        doc = json.loads(body)
        if not isinstance(doc, dict):  # json_format would take `[]` for an empty request
            raise PermanentError("OTLP/JSON body must be an object")
        # Unknown fields are ignored, as the OTLP/JSON specification asks of receivers.
        json_format.ParseDict(doc, request, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, RecursionError) as exc:
        raise PermanentError(f"undecodable ExportMetricsServiceRequest: {exc}") from None
    return request


class HttpReceiver:
    def __init__(self, config: HttpReceiverConfig, consumer: Consumer, metrics: SelfMetrics, max_body_bytes: int,
                 memory: Optional[MemoryLimiter] = None) -> None:
        self.config = config
        self.memory = memory or MemoryLimiter.unlimited()
        self.consumer = consumer
        self.metrics = metrics
        self.telemetry = ReceiverTelemetry(metrics, "http")
        self.max_body_bytes = max_body_bytes
        self.port: Optional[int] = None
        self._server: Optional[httpserver.BoundedServer] = None
        self._lock = threading.Lock()
        self._started = self._stopped = False

    def start(self) -> None:
        with self._lock:
            if self._started or self._stopped:
                return
            self._started = True
        config = self.config
        host, port = split_endpoint(config.endpoint)
        tls, tokens, security = server_security(config, "receiver.http", self.metrics)
        limits = httpserver.Limits(max_connections=config.max_connections, header_timeout_s=config.idle_timeout_seconds,
                                   body_timeout_s=config.read_timeout_seconds,
                                   write_timeout_s=config.read_timeout_seconds,
                                   max_body_bytes=self.max_body_bytes, workers=WORKERS, queued=config.max_connections)
        server = httpserver.BoundedServer("otlp-http", host, port, self._handle, limits, screen=self._screen,
                                          error=self._error, refused=self._refused, tls=tls, tokens=tokens,
                                          memory=self.memory)
        try:
            server.start()
        except OSError as exc:
            raise ConfigError([f"receiver.http.endpoint: cannot listen on {config.endpoint}: {exc}"]) from exc
        self._server, self.port = server, server.port
        log.info("OTLP/HTTP receiver listening on %s (port %d, %s)", config.endpoint, self.port, security)

    def shutdown(self, deadline: Optional[float] = None) -> None:
        """Stop accepting and close idle connections; requests under way are answered until
        `deadline` (default: 5 s from now)."""
        with self._lock:
            if self._stopped or not self._started:
                return
            self._stopped = True
        if self._server is not None:
            self._server.stop(grace(deadline, 5.0))

    def connections(self) -> dict[str, int]:
        """Open connections by state: `idle` (waiting for a request: keep-alive, TLS handshake or
        headers under way), `reading` (a body arriving) or `busy` (decoding, or answering)."""
        return self._server.connections() if self._server else {}

    def _refused(self, reason: Refusal) -> None:
        if reason is Refusal.UNAUTHENTICATED:
            self.telemetry.request(RequestOutcome.UNAUTHENTICATED)
        elif reason is Refusal.MALFORMED:  # HTTP the server could not parse, answered 400, 431 or 501
            self.telemetry.request(RequestOutcome.INVALID)
        elif reason in _RETRY_LATER:
            refused(self.telemetry, reason)
        else:
            self.telemetry.refused(reason)

    def _screen(self, request: httpserver.Request) -> Optional[httpserver.Response]:
        """From the headers, before the body is read: wrong path or method, no Content-Length or too large."""
        if request.path != PATH:
            return self._answer(RequestOutcome.INVALID, 404, JSON, _NOT_FOUND)
        if request.method != "POST":
            return self._answer(RequestOutcome.INVALID, 405, JSON, _NOT_POST, {"Allow": "POST"})
        if httpserver.chunked(request.headers):  # read within the same size limit as it arrives
            return None
        length = httpserver.content_length(request.headers.get("Content-Length"))
        if length is None:
            return self._failed(RequestOutcome.INVALID, _media(request), PermanentError("Content-Length or chunked body required"))
        if length > self.max_body_bytes:
            return self._failed(RequestOutcome.INVALID, _media(request),
                                PermanentError(f"body exceeds {self.max_body_bytes} bytes", too_large=True))
        return None

    def _handle(self, request: httpserver.Request) -> httpserver.Response:
        """On a worker: decode and hand to the consumer."""
        media = _media(request)
        outcome, body, err = self.handle_export(request.body, request.headers.get("Content-Encoding"), media,
                                                request.ticket)
        if err is None:
            return self._answer(outcome, 200, media, body)
        return self._failed(outcome, media, err)

    def _failed(self, outcome: RequestOutcome, media: str, err: OtelgpuError) -> httpserver.Response:
        status = status_for(err)
        msg = status_pb2.Status(code=status.grpc_code.value[0], message=str(err))
        headers = {}
        if isinstance(err, RetryableError):
            headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
        return self._answer(outcome, status.http_status, media if media in (PROTOBUF, JSON) else JSON, msg, headers)

    def _answer(self, outcome: RequestOutcome, code: int, media: str, msg: Message,
                headers: Optional[dict[str, str]] = None) -> httpserver.Response:
        self.telemetry.request(outcome)
        return _response(code, media, msg, headers)

    def _error(self, status: int, message: str, request: Optional[httpserver.Request]) -> httpserver.Response:
        """The server's own refusals, as google.rpc.Status in the request's content type (JSON if unknown)."""
        code = _CODES.get(status, grpc.StatusCode.INVALID_ARGUMENT)
        media = _media(request) if request is not None else JSON
        return _response(status, media if media in (PROTOBUF, JSON) else JSON,
                         status_pb2.Status(code=code.value[0], message=message))

    def handle_export(self, body: bytes, encoding: Optional[str], media: str,
                      ticket: Optional[Ticket] = None) -> tuple[RequestOutcome, Message, Optional[OtelgpuError]]:
        """(outcome, response body, error to answer with instead). `ticket`: the body's bytes,
        reserved; what inflating and decoding it will take is reserved too before either begins."""
        empty = ExportMetricsServiceResponse()
        try:
            if ticket is not None:
                inflated = declared_size(body) if (encoding or "").strip().lower() == "gzip" else None
                ticket.grow(cost(len(body), inflated) - len(body))
            request = _parse(self._unpack(body, encoding, media), media)
        except PermanentError as err:
            return RequestOutcome.INVALID, empty, err
        except RetryableError as err:  # the request is counted by its outcome where it is answered
            self.telemetry.refused(err.reason)
            return RequestOutcome.UNAVAILABLE, empty, err
        return answer(self.consumer, request, self.telemetry)

    def _unpack(self, body: bytes, encoding: Optional[str], media: str) -> bytes:
        if media not in (PROTOBUF, JSON):
            raise PermanentError(f"unsupported Content-Type {media!r}; use {PROTOBUF} or {JSON}")
        encoding = (encoding or "identity").strip().lower()
        if encoding == "gzip":
            return _inflate(body, self.max_body_bytes)
        if encoding != "identity":
            raise PermanentError(f"unsupported Content-Encoding {encoding!r}")
        return body


def _media(request: httpserver.Request) -> str:
    return request.headers.get("Content-Type", "").split(";")[0].strip().lower()


def _response(code: int, media: str, msg: Message, headers: Optional[dict[str, str]] = None) -> httpserver.Response:
    data = json_format.MessageToJson(msg, indent=None).encode() if media == JSON else msg.SerializeToString()
    return httpserver.Response(code, data, {"Content-Type": media, **(headers or {})})
