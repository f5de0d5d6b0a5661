"""OTLP/HTTP receiver: `POST /v1/metrics`, protobuf or JSON, optionally gzip-compressed.

Answers as the OTLP/HTTP specification asks: 200 with an ExportMetricsServiceResponse (partial_success
when points were rejected), 400 for an undecodable body, 413 for a too-large one, 503 with Retry-After
when the queue is full, and a google.rpc.Status body on errors, each in the request's content type.
An unsupported Content-Type gets 400 (through errors.status_for, like every other bad request) rather
than 415: both tell the sender never to retry, and the status mapping stays in one place. Its error
body is JSON, since the sender's format is unknown.

Connections, request read deadlines and idle keep-alive connections are bounded by
otelgpu.receiver.connections (`receiver.http.max_connections`, `read_timeout_seconds`,
`idle_timeout_seconds`); bodies by `max_body_bytes`, after gunzip too (gzip is inflated with ISA-L;
a body whose gzip trailer declares more than the limit is refused before any of it is inflated).
"""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any, Optional

import grpc
from google.protobuf import json_format
from isal import isal_zlib
from google.protobuf.message import Message
from google.rpc import status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from otelgpu.config import HttpReceiverConfig
from otelgpu.errors import ConfigError, OtelgpuError, PermanentError, RetryableError, status_for
from otelgpu.receiver.connections import Connection, ConnectionGate, LimitedHTTPServer
from otelgpu.receiver.ingest import Consumer, Request, answer
from otelgpu.telemetry import SelfMetrics

log = logging.getLogger(__name__)

PATH = "/v1/metrics"
PROTOBUF, JSON = "application/x-protobuf", "application/json"
# Routing answers, outside the error taxonomy: no sender should retry them either.
_NOT_FOUND = status_pb2.Status(code=grpc.StatusCode.NOT_FOUND.value[0], message=f"not found; OTLP metrics go to {PATH}")
_NOT_POST = status_pb2.Status(code=grpc.StatusCode.UNIMPLEMENTED.value[0], message=f"use POST {PATH}")


def _inflate(body: bytes, limit: int) -> bytes:
    """gunzip `body` (all members) with ISA-L, refusing output beyond `limit` bytes without
    producing it. A gzip body declares its size (ISIZE, the last four bytes, modulo 2**32): one
    declaring more than `limit` is refused before anything is inflated; one that lies about it is
    still cut off at `limit`."""
    if body[:3] == b"\x1f\x8b\x08" and len(body) >= 18 and int.from_bytes(body[-4:], "little") > limit:
        raise PermanentError(f"decompressed body exceeds {limit} bytes (declared size)", too_large=True)
    out = bytearray()
    while body:
        d = isal_zlib.decompressobj(wbits=16 + isal_zlib.MAX_WBITS)
        try:
            out += d.decompress(body, limit + 1 - len(out))
        except isal_zlib.error as exc:
            raise PermanentError(f"invalid gzip body: {exc}") from None
        if len(out) > limit or d.unconsumed_tail:
            raise PermanentError(f"decompressed body exceeds {limit} bytes", too_large=True)
        if not d.eof:
            raise PermanentError("truncated gzip body")
        body = d.unused_data
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


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the Collector's exporter expects
    timeout = None  # the connection's own deadlines apply instead (see Connection.recv_into)
    receiver: "HttpReceiver"  # set on the per-receiver subclass

    def __init__(self, request: socket.socket, client_address: Any, server: Any, conn: Connection) -> None:
        self.conn = conn
        super().__init__(request, client_address, server)  # serves the connection to its end

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        self.rfile = self.conn.reader()

    def handle_one_request(self) -> None:
        if not self.conn.next_request():  # evicted while idle, or the receiver is stopping
            self.close_connection = True
            return
        super().handle_one_request()

    def parse_request(self) -> bool:
        # The request line may have come from the read buffer without a recv: start the deadline here too.
        if not self.conn.request_started():
            self.close_connection = True
            return False
        return super().parse_request()

    def do_POST(self) -> None:
        if self.path.split("?")[0] != PATH:
            return self._other_method()
        media = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        outcome, body, err = self.receiver.handle_export(self, media)
        if err is None:
            return self._finish(outcome, 200, media, body)
        status = status_for(err)
        msg = status_pb2.Status(code=status.grpc_code.value[0], message=str(err))
        headers = {}
        if isinstance(err, RetryableError):
            headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
        self._finish(outcome, status.http_status, media if media in (PROTOBUF, JSON) else JSON, msg, headers)

    def _other_method(self) -> None:
        self.close_connection = True  # the body, if any, stays unread and must not pass for a request
        if self.path.split("?")[0] != PATH:
            return self._finish("invalid", 404, JSON, _NOT_FOUND)
        self._finish("invalid", 405, JSON, _NOT_POST, {"Allow": "POST"})

    def __getattr__(self, name: str) -> Any:
        # The stdlib dispatches to do_<METHOD> and answers 501 when absent; every method but POST gets 405.
        if name.startswith("do_"):
            return self._other_method
        raise AttributeError(name)

    def _finish(self, outcome: str, code: int, media: str, msg: Message, headers: Optional[dict] = None) -> None:
        self.receiver.metrics.count("requests", ("http", outcome))
        data = json_format.MessageToJson(msg, indent=None).encode() if media == JSON else msg.SerializeToString()
        self.conn.answering()
        self.send_response(code)
        self.send_header("Content-Type", media)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s " + format, self.address_string(), *args)


class _Server(LimitedHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # Mostly clients that hung up mid-answer; the stdlib would print a traceback to stderr.
        log.debug("OTLP/HTTP connection from %s failed", client_address, exc_info=True)


class HttpReceiver:
    def __init__(self, config: HttpReceiverConfig, consumer: Consumer, metrics: SelfMetrics, max_body_bytes: int) -> None:
        self.config = config
        self.consumer = consumer
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.port: Optional[int] = None
        self._server: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._stopped = False

    def start(self) -> None:
        host, _, port = self.config.endpoint.rpartition(":")
        handler = type("Handler", (_Handler,), {"receiver": self})
        c = self.config
        gate = ConnectionGate(c.max_connections, c.read_timeout_seconds, c.idle_timeout_seconds, self.metrics)
        try:
            server = _Server((host, int(port)), handler, gate)
        except OSError as exc:
            raise ConfigError([f"receiver.http.endpoint: cannot listen on {self.config.endpoint}: {exc}"]) from exc
        self._server, self.port = server, server.server_address[1]
        # serve_forever notices shutdown() only between polls: keep the poll short so stopping is quick.
        self._thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="otlp-http", daemon=True)
        self._thread.start()
        log.info("OTLP/HTTP receiver listening on port %d", self.port)

    def shutdown(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        if self._server is not None:
            self._server.shutdown()  # only after serve_forever started: it would wait forever otherwise
            self._server.server_close()
            self._server.gate.close()  # idle keep-alive connections would otherwise wait out their timeout

    def connections(self) -> dict[str, int]:
        """Open connections by state: `idle` (between requests), `reading` (a request under way) or
        `closed` (cut off, its thread ending)."""
        return self._server.gate.states() if self._server else {}

    def handle_export(self, req: BaseHTTPRequestHandler, media: str) -> tuple[str, Message, Optional[OtelgpuError]]:
        """(outcome, response body, error to answer with instead)."""
        empty = ExportMetricsServiceResponse()
        try:
            request = _parse(self._read_body(req, media), media)
        except PermanentError as err:
            return "invalid", empty, err
        return answer(self.consumer, request, "HTTP")

    def _read_body(self, req: BaseHTTPRequestHandler, media: str) -> bytes:
        length = req.headers.get("Content-Length")
        if not length or not length.isdigit():
            req.close_connection = True  # the unread body would be taken for the next request
            raise PermanentError("Content-Length required")
        if int(length) > self.max_body_bytes:
            req.close_connection = True
            raise PermanentError(f"body exceeds {self.max_body_bytes} bytes", too_large=True)
        body = req.rfile.read(int(length))
        if media not in (PROTOBUF, JSON):
            raise PermanentError(f"unsupported Content-Type {media!r}; use {PROTOBUF} or {JSON}")
        encoding = req.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding == "gzip":
            return _inflate(body, self.max_body_bytes)
        if encoding != "identity":
            raise PermanentError(f"unsupported Content-Encoding {encoding!r}")
        return body
