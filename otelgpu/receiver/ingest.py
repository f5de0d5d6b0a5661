"""The receivers' consumer: decode a request, then hand the batch to the pipeline through a
bounded queue. A full queue answers "retry later" instead of blocking the sender."""

from __future__ import annotations

import logging
import queue
import threading
from contextlib import contextmanager
from typing import Iterator, NamedTuple, Optional, Protocol, Sequence, Union

import numpy as np

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsPartialSuccess,
    ExportMetricsServiceResponse,
)

from otelgpu.errors import OtelgpuError, PermanentError, Refusal, RetryableError
from otelgpu.receiver.columnar import ColumnarDecoder
from otelgpu.receiver.decode import PointBatch, decode_reference
from otelgpu.receiver.interner import HoldsCodes, Interner
from otelgpu.receiver.limits import Limits
from otelgpu.memory import MemoryLimiter, Ticket
from otelgpu.receiver.record import encode_batch
from otelgpu.receiver.rejection import describe
from otelgpu.telemetry import DurabilityTelemetry, IngestTelemetry, ReceiverTelemetry, RequestOutcome, SelfMetrics
from otelgpu.wal import Wal


Request = Union[bytes, ExportMetricsServiceRequest]


class Taken(NamedTuple):
    accepted: int  # points taken into the pipeline
    rejected: int  # points refused (the request's partial success)
    message: str  # why they were refused; empty when none were


class Consumer(Protocol):
    def consume(self, request: Request) -> Taken:
        """Take one request, as its protobuf bytes or as a message.

        Raises RetryableError when the sidecar cannot take it now, PermanentError when the bytes
        are not a request.
        """


log = logging.getLogger(__name__)

Answer = tuple[RequestOutcome, ExportMetricsServiceResponse, Optional[OtelgpuError]]


def refused(telemetry: ReceiverTelemetry, reason: Refusal) -> None:
    """Count one request answered "retry later" (gRPC UNAVAILABLE, HTTP 503): every such answer is
    counted once in requests{outcome="unavailable"} and once by its reason."""
    telemetry.request(RequestOutcome.UNAVAILABLE)
    telemetry.refused(reason)


def answer(consumer: Consumer, request: Request, telemetry: ReceiverTelemetry,
           ticket: Optional[Ticket] = None) -> Answer:
    """Hand `request` to `consumer`: (outcome, response, error to answer with instead), shared by
    both transports so they keep one contract. `ticket`: the bytes the request reserved, given
    back once it is answered."""
    empty = ExportMetricsServiceResponse()
    try:
        accepted, rejected, message = consumer.consume(request)
    except RetryableError as err:
        telemetry.refused(err.reason)
        return RequestOutcome.UNAVAILABLE, empty, err.with_traceback(None)
    except PermanentError as err:
        return RequestOutcome.INVALID, empty, err.with_traceback(None)
    except Exception as exc:  # never let one bad request take the server down
        log.exception("OTLP/%s export failed", telemetry.transport)
        return RequestOutcome.ERROR, empty, OtelgpuError(f"internal error: {type(exc).__name__}")
    finally:
        if ticket is not None:
            ticket.release()
    telemetry.accepted_points.inc(accepted)
    telemetry.refused_points.inc(rejected)
    if rejected > 0:
        partial = ExportMetricsPartialSuccess(rejected_data_points=rejected, error_message=message)
        return RequestOutcome.PARTIAL, ExportMetricsServiceResponse(partial_success=partial), None
    return RequestOutcome.OK, empty, None


class Ingest:
    """With a write-ahead log, a request is answered only once its accepted points are on disk:
    the batch is appended to the log and queued under one lock (so the log's order is the order
    the pipeline processes them in), then the request waits for the group commit."""

    def __init__(self, strings: Interner, queue_size: int, retry_after_s: float, metrics: SelfMetrics,
                 limits: Optional[Limits] = None, wal: Optional[Wal] = None,
                 memory: Optional[MemoryLimiter] = None) -> None:
        self.strings = strings
        # A queued batch keeps its size reserved in the receivers' budget until it is taken out.
        self.memory = memory or MemoryLimiter.unlimited()
        self.retry_after_s = retry_after_s
        self.telemetry, self.durability = IngestTelemetry(metrics), DurabilityTelemetry(metrics)
        self.limits = limits or Limits()
        self.wal = wal
        self.columnar = ColumnarDecoder(strings, self.limits)
        self._queue: queue.Queue[PointBatch] = queue.Queue(maxsize=queue_size)
        self._order = threading.Lock()

    def consume(self, request: Request) -> Taken:
        if self._queue.full():  # decide before decoding: an overloaded sidecar should not work more
            raise RetryableError("otelgpu queue is full", self.retry_after_s)
        raw = request if isinstance(request, bytes) else request.SerializeToString()
        batch = self._decode(raw)
        # A request of `up` alone (every target it scraped down) has no points but moves its
        # targets' clocks, so that intervals close while they are down: it is queued too.
        while (len(batch) or batch.sources) and not self._enqueue(batch):  # the interner was compacted meanwhile
            batch = self._decode(raw)
        if len(batch):
            self.telemetry.received.inc(len(batch))
        for why, n in batch.rejected.items():
            self.telemetry.rejected(why.metric, why.reason, n)
        self.telemetry.ignored.inc(batch.ignored)
        return Taken(len(batch) + batch.ignored, batch.rejected_count, describe(batch.rejected))

    def _decode(self, raw: bytes) -> PointBatch:
        """The columnar decoder's batch; the reference decoder's where protobuf must read the bytes."""
        batch = self.columnar.decode(raw)
        if batch is None:
            self.telemetry.decoded_by_reference.inc()
            try:
                request = ExportMetricsServiceRequest.FromString(raw)
            except DecodeError as exc:
                raise PermanentError(f"undecodable ExportMetricsServiceRequest: {exc}") from None
            batch = decode_reference(request, self.strings, self.limits)
        return batch

    def _enqueue(self, batch: PointBatch) -> bool:
        """Log (when durable) and queue `batch`; returns once it is safe to answer. False, with
        nothing logged or queued, when its codes are from before a compaction of the interner."""
        payload = encode_batch(batch, self.strings) if self.wal is not None else b""
        with self._order:
            if batch.epoch != self.strings.epoch:
                return False
            if self._queue.full():  # the sender retries the whole request: nothing of it is kept
                raise RetryableError("otelgpu queue is full", self.retry_after_s)
            if self.wal is not None:
                try:
                    batch.wal = self.wal.append(payload)
                except OSError as exc:
                    self._disk_failed(exc)
            self.memory.hold(batch.nbytes)
            self._queue.put_nowait(batch)  # cannot be full: only this lock's holder puts
        if self.wal is not None and batch.wal is not None:
            try:
                self.wal.sync(batch.wal[1])
            except OSError as exc:  # queued already: the resend is deduplicated
                self._disk_failed(exc)
        return True

    def compact_strings(self, holders: Sequence[HoldsCodes]) -> int:
        """Forget the strings that neither the queued batches nor `holders` (what the consumer
        keeps of earlier batches) refer to, and rewrite every code that stays. The string table is
        this stage's: its receivers intern, and none queues meanwhile (a request decoded with the
        old codes is decoded again). Run by the consumer, between two batches. Returns the strings
        kept."""
        with self._paused() as waiting:
            arrays = [a for h in holders for a in h.codes()] + [a for b in waiting for a in b.codes()]
            table = self.strings.compact(np.concatenate(arrays) if arrays else np.zeros(0, np.int32))
            for b in waiting:
                b.remap(table)
            for h in holders:
                h.remap(table)
        return len(self.strings)

    @contextmanager
    def _paused(self) -> Iterator[list[PointBatch]]:
        """Nothing is queued while inside; yields the batches waiting in the queue (only the
        consumer takes batches out, so they stay while it is inside)."""
        with self._order:
            with self._queue.mutex:
                waiting = list(self._queue.queue)
            yield waiting

    def _disk_failed(self, exc: OSError) -> None:
        self.durability.wal_failed(exc)
        log.error("write-ahead log not written (%s): answering 'retry later'", exc)
        raise RetryableError(f"write-ahead log unavailable: {exc.strerror or exc}", self.retry_after_s,
                             reason=Refusal.WAL) from exc

    def get(self, timeout: Optional[float]) -> Optional[PointBatch]:
        try:
            batch = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        self.memory.unhold(batch.nbytes)
        return batch

    def task_done(self) -> None:
        self._queue.task_done()

    def join(self) -> None:
        """Wait until every queued batch has been processed."""
        self._queue.join()

    @property
    def depth(self) -> int:
        return self._queue.qsize()
