"""Delivery of cost snapshots, one path out per exporter as the Collector's exporterhelper chains
it: the queue (`queue.py`: bound, merge, persistence) -> retry (the shared backoff) -> the sender,
drained by a thread of its own. At a stop the retry is shut down first, so the queue flushes
without waiting out backoffs: each snapshot still queued is sent once (the one whose retry was
waiting too), until the first that fails or the deadline; what is left stays in the directory for
the next start, or without one is given up and counted."""

from __future__ import annotations

import logging
import random
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from otelgpu.core.backoff import Backoff
from otelgpu.exporter.columns import Point, Points
from otelgpu.exporter.config import DeliveryConfig
from otelgpu.exporter.outbox import Outbox
from otelgpu.exporter.queue import Entry, SnapshotQueue
from otelgpu.exporter.sending import DELIVERED, Progress, Sender, SendResult
from otelgpu.heap import give_back
from otelgpu.telemetry import ExporterTelemetry, SelfMetrics

__all__ = ["DELIVERED", "Delivery", "Progress", "SendResult", "Sender"]

log = logging.getLogger(__name__)

MAX_SERVER_DELAY_S = 300.0  # a RetryInfo or Retry-After delay longer than this is cut to it


class Retry:
    """After a retryable failure, the wait before the same snapshot goes again: the server's delay
    (RetryInfo, Retry-After; cut at MAX_SERVER_DELAY_S) or the shared exponential backoff with
    jitter, started again by a success. `shutdown()` ends every wait and every retry after it."""

    def __init__(self, backoff: Backoff, cond: threading.Condition) -> None:
        self.backoff, self._cond = backoff, cond
        self.stopped = False

    def delay(self, result: SendResult) -> float:
        told = result.retry_after  # the server knows best; only absurd delays are cut
        return self.backoff.next(None if told is None else min(max(told, 0.0), MAX_SERVER_DELAY_S))

    def wait(self, delay: float) -> bool:
        """Under the lock: wait `delay`; False when shut down (no retry)."""
        end = time.monotonic() + delay
        while not self.stopped and (left := end - time.monotonic()) > 0:
            self._cond.wait(left)  # shutdown() wakes this
        return not self.stopped

    def shutdown(self) -> None:
        """Under the lock."""
        self.stopped = True
        self._cond.notify_all()


class Delivery:
    """One exporter's path out: its queue, its retry, its sender, and the thread that drains them.

    The head snapshot is sent until it is delivered or refused for good: a retryable failure waits
    (`Retry`), then the same snapshot goes again, resuming after what the receiver accepted
    (`Progress`). A snapshot refused for good (a backend that takes no sample older than its
    window, Prometheus's "out of bounds", AMP's too) is carried into the next one (`queue.py`).

    With a `directory`, every snapshot is a file there before it can be sent, and stays until it is
    delivered or refused: `recover()` queues a dead run's snapshots again, `close()` leaves what its
    flush did not deliver for the next start. `stage()` then `release()` let the pipeline commit its
    own checkpoint between persisting a snapshot and letting it go. `stage`, `persist`, `release`,
    `put` and `recover` are called from one thread (the pipeline's).

    Each snapshot is one interval of `interval_s` (or several merged): the exporter's lag gauge,
    otelgpu_exporter_delivered_timestamp_seconds, is the start of the oldest snapshot still waiting,
    or with none waiting the newest interval end released, so it stops while the path is down and
    catches up as the queue drains."""

    def __init__(self, sender: Sender, config: DeliveryConfig, metrics: SelfMetrics,
                 random: Callable[[], float] = random.random, directory: str | Path | None = None, *,
                 interval_s: float) -> None:
        self.sender = sender
        self.config = config
        self.telemetry = ExporterTelemetry(metrics, sender.name)
        outbox = Outbox(directory, sender.name, metrics) if directory is not None else None
        self.queue = SnapshotQueue(self.telemetry, sender.specs, config.queue_size, int(interval_s * 1e9), outbox,
                                   self._start)
        self._cond = self.queue.cond
        backoff = Backoff(config.backoff_initial_seconds, config.backoff_max_seconds, 0.5, random)  # 50-150 %
        self.retry = Retry(backoff, self._cond)
        self._deadline: Optional[float] = None  # monotonic time by which the flush at a stop gives up
        self._thread = threading.Thread(target=self._run, name=f"otelgpu-export-{sender.name}", daemon=True)
        self._started = self._closed = False

    @property
    def name(self) -> str:
        return self.sender.name

    def recover(self, committed_ns: int) -> int:
        """At start: queue the directory's committed snapshots again (`SnapshotQueue.recover`)."""
        return self.queue.recover(committed_ns)

    def add(self, points: Sequence[Point], end_ns: int) -> bool:
        """Queue one interval's snapshot, not sendable before `release()`; returns whether every
        snapshot queued is persisted (one the disk refused waits in memory, unsendable, for
        `persist()`). ValueError when `end_ns` is not after every released snapshot."""
        return self.queue.add(points, end_ns)

    def stage(self, points: Sequence[Point], end_ns: int) -> None:
        """`add`, raising OSError when the snapshot could not be persisted (it stays queued)."""
        if not self.add(points, end_ns):
            raise OSError(f"{self.name}: snapshot ending {end_ns} not persisted")

    def persist(self) -> bool:
        """Whether every snapshot queued is persisted, after writing those that wait to be."""
        return self.queue.persist()

    def release(self, through_ns: int) -> None:
        self.queue.release(through_ns)

    def put(self, points: Sequence[Point]) -> None:
        """Queue one interval's snapshot, sendable at once (stage and release; its end is its
        newest point's time); never blocks on the network."""
        if points:
            points = Points.of(points)
            end_ns = int(points.time_ns.max())
            self.stage(points, end_ns)
            self.release(end_ns)

    def start(self) -> None:
        """Nothing to do: the thread starts once there is something to send."""

    def shutdown(self, deadline: Optional[float] = None) -> None:
        """`close()` by `deadline` (default: the configured shutdown timeout); once only."""
        if not self._closed:
            self.close(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _start(self) -> None:
        """Under the lock: start the thread once there is something to send."""
        if not self._started:
            self._started = True
            self._thread.start()

    @property
    def depth(self) -> int:
        with self._cond:
            return len(self.queue)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no released snapshot waits (tests, benchmarks)."""
        end = time.monotonic() + timeout
        with self._cond:
            while self.queue.sendable() or self.queue.in_flight:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self.queue.sendable() and self._deadline is None:
                    self._cond.wait()
                if not self.queue.sendable() or self._past_deadline():
                    return
                head = self.queue.head()
                flushing = self.retry.stopped  # the stop's one attempt at each snapshot
            if not self.queue.read_back(head):  # in flight: its file is read outside the lock
                continue  # set aside and counted: the next one
            result = self._send(head)
            with self._cond:
                if result.ok or not result.retryable:
                    self.retry.backoff.reset()
                elif flushing:
                    return  # the flush stops at the first failure
                else:
                    self._retry_wait(result)  # a stop ends the wait: the flush sends the head once more
            if result.ok:
                del head  # the snapshot and its requests, once nothing else holds them
                give_back()

    def _send(self, head: Entry) -> SendResult:
        """One attempt at the head snapshot, and the queue told how it went."""
        with self.telemetry.export_operation(len(head.snapshot)) as operation:
            result = self.sender.send(head.snapshot, head.progress)
            if result.ok and self.queue.outbox is not None:
                self.queue.outbox.delete(head.end_ns)  # still in flight: nothing merges it meanwhile
            with self._cond:  # counted as the queue learns of it: waiting for the queue sees the counts
                operation.finished(result)
                self.queue.sent(head, result)
        if not result.ok and not result.retryable:
            log.error("%s export refused (%s): each series' last value goes again with the next snapshot, "
                      "stamped at its time: %s", self.name, result.reason, result.detail)
        return result

    def _retry_wait(self, result: SendResult) -> None:
        """Under the lock, after a retryable failure: wait for the retry, or for a stop."""
        if self.retry.stopped:
            return
        delay = self.retry.delay(result)
        attempt = self.retry.backoff.attempt
        if attempt == 1 or attempt % 10 == 0:
            log.warning("%s export failed (%s: %s), attempt %d, retrying in %.1f s", self.name,
                        result.reason, result.detail, attempt, delay)
        self.retry.wait(delay)

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def finish_by(self, deadline: float) -> None:
        """Begin the stop, in the Collector's order: the retry is shut down first, so the queue
        flushes (each snapshot sent once, until one fails) until it is delivered or `deadline`
        (time.monotonic()) comes; returns at once, so several exporters flush side by side before
        `close()`."""
        with self._cond:
            self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)
            self.retry.shutdown()

    def close(self, timeout: Optional[float] = None) -> int:
        """Flush what is released within `timeout` (default: the configured shutdown timeout, or
        the deadline given to `finish_by`), then stop the sender. Returns the snapshots left
        undelivered: with a directory they stay there for the next start (counted as persisted),
        without one they are given up (counted with reason `shutdown`)."""
        timeout = self.config.shutdown_timeout_seconds if timeout is None else timeout
        self._closed = True
        self.finish_by(time.monotonic() + timeout)
        if self._started:
            self._thread.join(max(0.0, self._deadline - time.monotonic()) + 1.0)  # type: ignore[operator]
        with self._cond:
            left, carry = self.queue.take_all()
            if self.queue.outbox is not None:
                self.telemetry.snapshots_persisted.inc(len(left))
            else:
                for e in left:
                    self.telemetry.gave_up(len(e.snapshot))
                if carry is not None:  # with a directory, the refused files stay for the next start
                    self.telemetry.gave_up(len(carry))
        if left and self.queue.outbox is not None:
            log.warning("%s: %d snapshot(s) not delivered before the shutdown deadline stay in %s for the next start",
                        self.name, len(left), self.queue.outbox.directory)
        elif left:
            log.error("%s: %d snapshot(s) not delivered before the shutdown deadline", self.name, len(left))
        self.sender.close()
        return len(left)
