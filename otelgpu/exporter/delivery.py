"""Delivery of cost snapshots: what a sender reports for one attempt, and the bounded queue
that retries it with backoff."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

from otelgpu.config import DeliveryConfig
from otelgpu.exporter.store import Attrs, Point
from otelgpu.telemetry import SelfMetrics

log = logging.getLogger(__name__)

MAX_SERVER_DELAY_S = 300.0  # a RetryInfo or Retry-After delay longer than this is cut to it


@dataclass(frozen=True)
class SendResult:
    """Outcome of one attempt to deliver a snapshot.

    ok: delivered. Otherwise `retryable` says whether the same snapshot may be sent again (OTLP
    UNAVAILABLE, HTTP 429 and 5xx, connection errors) and `retry_after` carries the server's own
    delay when it gave one (gRPC RetryInfo, HTTP Retry-After), in seconds. `reason` is a short,
    fixed label for counting (`unavailable`, `http_429`, `http_400`, `connection`, ...), `detail`
    the server's message for the log."""

    ok: bool
    retryable: bool = False
    reason: str = ""
    detail: str = ""
    retry_after: Optional[float] = None


DELIVERED = SendResult(ok=True)


class Sender(Protocol):
    name: str  # exporter label in the self-metrics: "otlp", "remote_write"

    def send(self, points: Sequence[Point]) -> SendResult:
        """One attempt to deliver these points (one snapshot). Must not raise."""

    def close(self) -> None:
        """Release connections; a send in progress may fail."""


Key = tuple[str, Attrs]
Snapshot = dict[Key, list[Point]]  # points of each series, in time order


def snapshot_of(points: Sequence[Point]) -> Snapshot:
    out: Snapshot = {}
    for p in points:
        out.setdefault((p.metric, p.attrs), []).append(p)
    return out


def merge(older: Snapshot, newer: Snapshot) -> Snapshot:
    """Two snapshots as one, losing no money: a series' cumulative value superseded by a later
    value of the same series (same start time) is dropped; ended points, and the last value before
    each of them, are kept, as is a series that only the older snapshot has."""
    out: Snapshot = dict(older)
    for key, points in newer.items():
        chain = out.get(key, []) + points
        out[key] = [p for i, p in enumerate(chain)
                    if p.ended or i + 1 == len(chain) or chain[i + 1].ended or chain[i + 1].start_ns != p.start_ns]
    return out


def flatten(snapshot: Snapshot) -> list[Point]:
    return [p for points in snapshot.values() for p in points]


class Delivery:
    """A bounded queue of snapshots in front of one sender, drained by a thread of its own.

    The head snapshot is sent until it is delivered or refused for good: retryable failures wait
    the server's delay (RetryInfo, Retry-After) or an exponential backoff with jitter, then the same
    snapshot goes again. The cumulative series make this lossless: while the path is down, newer
    snapshots queue; when `queue_size` are waiting the two oldest not in flight are merged (newest
    value per series), so an outage costs time resolution, never money. A snapshot refused for good
    (a non-retryable answer) is dropped and counted with its points; the next snapshot carries the
    same series again. `close()` sends what is queued until its deadline, then counts the rest as
    undeliverable (a checkpoint keeps the values for the next start)."""

    def __init__(self, sender: Sender, config: DeliveryConfig, metrics: SelfMetrics,
                 random: Callable[[], float] = random.random) -> None:
        self.sender = sender
        self.config = config
        self.metrics = metrics
        self._random = random
        self._queue: deque[Snapshot] = deque()
        self._cond = threading.Condition()
        self._in_flight = False
        self._deadline: Optional[float] = None  # monotonic time by which close() gives up
        self._thread = threading.Thread(target=self._run, name=f"otelgpu-export-{sender.name}", daemon=True)
        self._started = False

    @property
    def name(self) -> str:
        return self.sender.name

    def put(self, points: Sequence[Point]) -> None:
        """Queue one interval's snapshot; never blocks on the network. The first one starts the
        sending thread."""
        if not points:
            return
        with self._cond:
            if not self._started:
                self._started = True
                self._thread.start()
            self._queue.append(snapshot_of(points))
            if len(self._queue) > self.config.queue_size:
                i = 1 if self._in_flight else 0
                self._queue[i] = merge(self._queue[i], self._queue[i + 1])
                del self._queue[i + 1]
                self.metrics.count("export_snapshots_merged", self.name)
            self.metrics.set("export_queue", self.name, len(self._queue))
            self._cond.notify_all()

    @property
    def depth(self) -> int:
        with self._cond:
            return len(self._queue)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until the queue is empty (tests, benchmarks)."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._in_flight:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _backoff(self, attempt: int, result: SendResult) -> float:
        c = self.config
        if result.retry_after is not None:  # the server knows best; only absurd delays are cut
            return min(max(result.retry_after, 0.0), MAX_SERVER_DELAY_S)
        base = min(c.backoff_initial_seconds * 2 ** min(attempt - 1, 30), c.backoff_max_seconds)
        return base * (0.5 + self._random())  # jitter: 50 % to 150 % of the step

    def _run(self) -> None:
        attempt = 0
        while True:
            with self._cond:
                while not self._queue and self._deadline is None:
                    self._cond.wait()
                if not self._queue or self._past_deadline():
                    return
                head = self._queue[0]
                self._in_flight = True
            points = flatten(head)
            result = self.sender.send(points)
            with self._cond:
                self._in_flight = False
                if result.ok:
                    self._queue.popleft()
                    attempt = 0
                    self.metrics.count("exports", self.name)
                elif not result.retryable:
                    self._queue.popleft()
                    attempt = 0
                    self._give_up(points, result.reason)
                    log.error("%s export refused (%s), not retried; the next interval resends the series: %s",
                              self.name, result.reason, result.detail)
                else:
                    attempt += 1
                    delay = self._backoff(attempt, result)
                    if attempt == 1 or attempt % 10 == 0:
                        log.warning("%s export failed (%s: %s), attempt %d, retrying in %.1f s", self.name,
                                    result.reason, result.detail, attempt, delay)
                self.metrics.set("export_queue", self.name, len(self._queue))
                if not result.ok:
                    self.metrics.count("export_failures", (self.name, result.reason or "unknown"))
                self._cond.notify_all()
                if result.retryable and not result.ok:
                    end = time.monotonic() + delay
                    while (left := min(end, self._deadline or end) - time.monotonic()) > 0:
                        self._cond.wait(left)  # close() wakes this: its deadline may come sooner

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _give_up(self, points: Sequence[Point], reason: str) -> None:
        self.metrics.count("export_snapshots_dropped", (self.name, reason))
        self.metrics.count("export_points_undeliverable", (self.name, reason), len(points))

    def finish_by(self, deadline: float) -> None:
        """Stop once the queue is delivered or at `deadline` (time.monotonic()), whichever comes
        first; returns at once, so several exporters can drain side by side before `close()`."""
        with self._cond:
            self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)
            self._cond.notify_all()

    def close(self, timeout: Optional[float] = None) -> int:
        """Deliver what is queued within `timeout` (default: the configured shutdown timeout, or
        the deadline given to `finish_by`), then stop. Returns the snapshots left undelivered
        (counted with reason `shutdown`)."""
        timeout = self.config.shutdown_timeout_seconds if timeout is None else timeout
        self.finish_by(time.monotonic() + timeout)
        if self._started:
            self._thread.join(max(0.0, self._deadline - time.monotonic()) + 1.0)  # type: ignore[operator]
        with self._cond:
            left = list(self._queue)
            self._queue.clear()
            for snapshot in left:
                self._give_up(flatten(snapshot), "shutdown")
            self.metrics.set("export_queue", self.name, 0)
        if left:
            log.error("%s: %d snapshot(s) not delivered before the shutdown deadline", self.name, len(left))
        self.sender.close()
        return len(left)
