"""OTLP/gRPC receiver: `opentelemetry.proto.collector.metrics.v1.MetricsService/Export`.

The wire contract (docs/pipeline.md, "Receiving OTLP"):
- success: an empty ExportMetricsServiceResponse; some points rejected: `partial_success`;
- overload (RetryableError): UNAVAILABLE carrying google.rpc.RetryInfo, so senders back off and retry;
- undecodable request: INVALID_ARGUMENT (never retried); anything unexpected: INTERNAL, logged and
  counted, and the server keeps serving (a crash would turn the sender's retries into a crash loop).
Every status comes from otelgpu.errors.status_for.

Limits (`receiver.grpc`): `max_concurrent_requests` workers run Exports and `max_queued_requests`
more may wait for one. Beyond that, or with the process at its memory limiter's soft limit
(otelgpu/memory.py), an Export is refused at once, before its message is read, with
UNAVAILABLE and RetryInfo. grpcio's own `maximum_concurrent_rpcs` is not set: its answer is a bare
RESOURCE_EXHAUSTED, which the Collector drops for good, and which otelgpu could not count. Refusals
run on threads of their own (grpcio's `experimental_thread_pool`), so they never wait behind busy
workers. An admitted Export reserves, before its message is read, the bytes of the largest of the
last requests, and what it really takes once it is read: beyond the budget of bytes in flight it
is refused the same way. Every refusal is counted once in `requests{transport="grpc",
outcome="unavailable"}` and once by its reason in `receiver_connections_refused`. Unread Exports
hold little: flow-control windows are not grown by bandwidth probing. HTTP/2's own limit on
concurrent streams is left unset: a stream beyond it is reset (RST_STREAM), which the sender sees
as an UNAVAILABLE with no RetryInfo that otelgpu never answered nor counted. Idle and old
connections are closed by gRPC itself (`grpc.max_connection_idle_ms`, `grpc.max_connection_age_ms`
with its grace), the latter so that senders reconnect and spread over replicas added since.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse

from otelgpu.core.lifecycle import grace
from otelgpu.core.settings import listen_address
from otelgpu.errors import ConfigError, Refusal, RetryableError, status_for
from otelgpu.memory import MemoryLimiter, cost
from otelgpu.receiver.config import GrpcReceiverConfig
from otelgpu.receiver.ingest import Consumer, answer, refused
from otelgpu.telemetry import ReceiverTelemetry, RequestOutcome, SelfMetrics
from otelgpu.tls import BearerTokens, server_security

log = logging.getLogger(__name__)

SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"
# opentelemetry-python's OTLP exporter reads the delay from this trailer, not from the RetryInfo
# inside grpc-status-details-bin (which is what the Collector's Go exporter reads): send both.
RETRY_INFO_TRAILER = "google.rpc.retryinfo-bin"
EXPORT = f"/{SERVICE}/Export"
BUSY_RETRY_AFTER_S = 1.0  # a worker frees as soon as one Export is answered
REFUSING_THREADS = 2
EXPECTED_FIRST_BYTES = 4 << 20  # before any request was seen: a few Collector batches of 8,192 points


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


class _Workers(ThreadPoolExecutor):
    """The Export workers; `pending` counts the Exports queued or running."""

    def __init__(self, max_workers: int) -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix="otlp-grpc")
        self._count_lock = threading.Lock()
        self.pending = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        with self._count_lock:
            self.pending += 1
        try:
            future = super().submit(fn, *args, **kwargs)
        except BaseException:
            self._done(None)
            raise
        future.add_done_callback(self._done)  # also when the sender cancelled while it waited
        return future

    def _done(self, _: Optional[Future]) -> None:
        with self._count_lock:
            self.pending -= 1


class _Admission(grpc.GenericRpcHandler):
    """Picks the handler of each new RPC on grpcio's polling thread, before any worker sees it or
    its message is read: UNAUTHENTICATED without a valid bearer token (`auth`), UNAVAILABLE beyond
    the limit on Exports or with the process at its memory limit."""

    def __init__(self, workers: _Workers, limit: int, export: grpc.RpcMethodHandler,
                 refuse: Callable[[RetryableError], grpc.RpcMethodHandler], memory: MemoryLimiter,
                 tokens: Optional[BearerTokens] = None,
                 unauthenticated: Optional[grpc.RpcMethodHandler] = None) -> None:
        self._workers, self._limit, self._export, self._refuse = workers, limit, export, refuse
        self._memory, self._tokens, self._unauthenticated = memory, tokens, unauthenticated

    def service(self, details: grpc.HandlerCallDetails) -> Optional[grpc.RpcMethodHandler]:
        if details.method != EXPORT:  # type: ignore[attr-defined]
            return None
        if self._tokens is not None:
            metadata = dict(details.invocation_metadata or ())  # type: ignore[attr-defined]
            if not self._tokens.check(metadata.get("authorization")):
                return self._unauthenticated
        if self._workers.pending >= self._limit:
            return self._refuse(RetryableError(f"more than {self._limit} concurrent Exports; retry later",
                                               BUSY_RETRY_AFTER_S, reason=Refusal.CONCURRENT_REQUESTS))
        try:
            self._memory.check()
        except RetryableError as err:
            return self._refuse(err)
        return self._export


class _Sizes:
    """The sizes of the last `keep` requests: the largest is what the next one is expected to take
    (`first` before any was seen)."""

    def __init__(self, first: int, most: int, keep: int = 16) -> None:
        self._recent: deque[int] = deque(maxlen=keep)
        self._first, self._most = first, most

    def expected(self) -> int:
        return min(max(self._recent, default=self._first), self._most)

    def seen(self, nbytes: int) -> None:
        self._recent.append(nbytes)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


class GrpcReceiver:
    def __init__(self, config: GrpcReceiverConfig, consumer: Consumer, metrics: SelfMetrics,
                 memory: Optional[MemoryLimiter] = None) -> None:
        self.config = config
        self.consumer = consumer
        self.metrics = metrics
        self.telemetry = ReceiverTelemetry(metrics, "grpc")
        self.memory = memory or MemoryLimiter.unlimited()
        self._sizes = _Sizes(EXPECTED_FIRST_BYTES, config.max_recv_msg_size_mib << 20)
        self.port: Optional[int] = None
        self._server: Optional[grpc.Server] = None
        self._executor: Optional[_Workers] = None
        self._refusals: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        self._started = self._stopped = False

    @property
    def requests_in_flight(self) -> int:
        """Exports admitted and not yet answered: running, or queued for a worker."""
        return self._executor.pending if self._executor else 0

    def start(self) -> None:
        with self._lock:
            if self._started or self._stopped:
                return
            self._started = True
        cfg = self.config
        tls, tokens, security = server_security(cfg, "receiver.grpc", self.metrics)  # ConfigError before anything runs
        admitted = cfg.max_concurrent_requests + cfg.max_queued_requests
        self._executor = _Workers(cfg.max_concurrent_requests)
        self._refusals = ThreadPoolExecutor(max_workers=REFUSING_THREADS, thread_name_prefix="otlp-grpc-refuse")
        server = grpc.server(self._executor, options=self._options())
        # Registered by hand with a bytes-in handler rather than add_MetricsServiceServicer_to_server:
        # grpcio answers a request it cannot deserialize with INTERNAL, and the OTLP contract asks
        # for INVALID_ARGUMENT; and the columnar decoder reads the bytes themselves.
        # Request-streaming on this side (a unary call is a stream of one message), so that the
        # message is read only once its bytes are reserved (_export).
        export = grpc.stream_unary_rpc_method_handler(
            self._export, request_deserializer=None,
            response_serializer=ExportMetricsServiceResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers((_Admission(self._executor, admitted, export, self._refusal_handler,
                                                    self.memory, tokens, self._unauthenticated_handler()),))
        address = listen_address(cfg.endpoint)
        try:
            if tls is not None:
                self.port = server.add_secure_port(address, tls.grpc_credentials())
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError as exc:
            self.shutdown(time.monotonic())
            raise ConfigError([f"receiver.grpc.endpoint: cannot listen on {cfg.endpoint}: {exc}"]) from exc
        except ConfigError:
            self.shutdown(time.monotonic())
            raise
        server.start()
        self._server = server
        log.info("OTLP/gRPC receiver listening on %s (port %d, %s)", cfg.endpoint, self.port, security)

    def _options(self) -> list[tuple[str, int]]:
        cfg = self.config
        options = [
            ("grpc.max_receive_message_length", cfg.max_recv_msg_size_mib * 1024 * 1024),
            # Without this a second process could bind the same port and silently share traffic.
            ("grpc.so_reuseport", 0),
            # No flow-control windows grown by bandwidth probing: an Export not yet read (waiting for
            # a worker, or for room in the memory budget) then holds at most the initial window of
            # its bytes in gRPC's buffers, not megabytes. 32 concurrent 16 MiB Exports peaked at
            # 430-450 MiB with it off, 510-665 with it on.
            ("grpc.http2.bdp_probe", 0),
        ]
        if cfg.max_connection_idle_seconds is not None:
            options.append(("grpc.max_connection_idle_ms", _ms(cfg.max_connection_idle_seconds)))
        if cfg.max_connection_age_seconds is not None:
            options.append(("grpc.max_connection_age_ms", _ms(cfg.max_connection_age_seconds)))
            options.append(("grpc.max_connection_age_grace_ms", _ms(cfg.max_connection_age_grace_seconds)))
        return options

    def _refusal_handler(self, err: RetryableError) -> grpc.RpcMethodHandler:
        def refuse(requests: Any, context: grpc.ServicerContext) -> None:
            refused(self.telemetry, err.reason)
            context.abort_with_status(retry_status(err))

        # Request-streaming, so the refusal never waits for the message; on a thread of its own, so
        # it never waits behind busy workers either.
        refuse.experimental_thread_pool = self._refusals  # type: ignore[attr-defined]
        return grpc.stream_unary_rpc_method_handler(refuse)

    def _unauthenticated_handler(self) -> grpc.RpcMethodHandler:
        def refuse(requests: Any, context: grpc.ServicerContext) -> None:
            self.telemetry.request(RequestOutcome.UNAUTHENTICATED)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "a bearer token this receiver accepts is required "
                          "(authorization: Bearer <token>)")

        refuse.experimental_thread_pool = self._refusals  # type: ignore[attr-defined]
        return grpc.stream_unary_rpc_method_handler(refuse)

    def shutdown(self, deadline: Optional[float] = None) -> None:
        """Refuse new Exports; those in flight finish until `deadline` (default: 5 s from now)."""
        with self._lock:
            if self._stopped or not self._started:
                return
            self._stopped = True
        if self._server is not None:
            self._server.stop(grace(deadline, 5.0)).wait()
        for pool in (self._executor, self._refusals):
            if pool is not None:
                pool.shutdown(wait=False)

    def _export(self, messages: Iterator[bytes], context: grpc.ServicerContext) -> ExportMetricsServiceResponse:
        """gRPC tells a message's size only once it is read: the bytes of the largest of the last
        few requests are reserved before this one is read, and what it really takes once it is."""
        try:
            ticket = self.memory.admit(cost(self._sizes.expected()))
        except RetryableError as err:
            refused(self.telemetry, err.reason)
            context.abort_with_status(retry_status(err))
        try:
            raw = next(messages, b"")
            self._sizes.seen(len(raw))
            ticket.resize(cost(len(raw)))
        except RetryableError as err:
            ticket.release()
            refused(self.telemetry, err.reason)
            context.abort_with_status(retry_status(err))
        except BaseException:  # the sender went away while its message was read
            ticket.release()
            raise
        outcome, response, failure = answer(self.consumer, raw, self.telemetry, ticket)
        self.telemetry.request(outcome)
        if failure is None:
            return response
        if isinstance(failure, RetryableError):
            context.abort_with_status(retry_status(failure))
        context.abort(status_for(failure).grpc_code, str(failure))
        raise AssertionError("unreachable: abort raises")  # pragma: no cover
