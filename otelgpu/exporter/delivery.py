"""Delivery of cost snapshots: the bounded queue in front of one sender that retries with backoff,
in memory or persisted in a directory of its own (`outbox.py`)."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from otelgpu.config import DeliveryConfig
from otelgpu.core.backoff import Backoff
from otelgpu.exporter.outbox import Outbox
from otelgpu.exporter.sending import DELIVERED, Progress, Sender, SendResult
from otelgpu.exporter.columns import Point, Points, last_of_each, merge, restamped
from otelgpu.heap import give_back
from otelgpu.telemetry import SelfMetrics

__all__ = ["DELIVERED", "Delivery", "Progress", "SendResult", "Sender"]

log = logging.getLogger(__name__)

MAX_SERVER_DELAY_S = 300.0  # a RetryInfo or Retry-After delay longer than this is cut to it


@dataclass
class _Entry:
    end_ns: int
    snapshot: Points
    progress: Progress
    released: bool  # sendable; staged snapshots wait for the pipeline's checkpoint
    from_ns: int  # the data time it covers from: its interval's start, or the oldest one merged into it


class Delivery:
    """A bounded queue of snapshots in front of one sender, drained by a thread of its own.

    The head snapshot is sent until it is delivered or refused for good: retryable failures wait
    the server's delay (RetryInfo, Retry-After) or an exponential backoff with jitter, then the same
    snapshot goes again, resuming after what the receiver accepted (`Progress`). The cumulative
    series make this lossless: while the path is down, newer snapshots queue; when more than
    `queue_size` are waiting the two oldest that nothing was sent of are merged (newest value per
    series), so an outage costs time resolution, never money. A snapshot refused for good (a
    non-retryable answer: a backend that takes no sample older than its window, Prometheus's "out
    of bounds", AMP's too) is carried, not dropped: each of its cumulative series' last value, and
    its end marker where it ended, goes into the next snapshot, stamped at that one's end (the value 1 ms
    before), where a newer value of the same series supersedes it. A series that ended is in no
    later snapshot: without this its last increments were lost.

    With a `directory`, every snapshot is a file there before it can be sent, and stays until it is
    delivered or refused: `recover()` queues a dead run's snapshots again, `close()` leaves what its
    deadline did not deliver for the next start. `stage()` then `release()` let the pipeline commit
    its own checkpoint between persisting a snapshot and letting it go. Without a directory,
    `close()` counts what is left as undeliverable. `stage`, `release`, `put` and `recover` are
    called from one thread (the pipeline's).

    Each snapshot is one interval of `interval_s` (or several merged): the exporter's lag gauge,
    otelgpu_exporter_delivered_timestamp_seconds, is the start of the oldest snapshot still waiting,
    or with none waiting the newest interval end released, so it stops while the path is down and
    catches up as the queue drains."""

    def __init__(self, sender: Sender, config: DeliveryConfig, metrics: SelfMetrics,
                 random: Callable[[], float] = random.random, directory: str | Path | None = None, *,
                 interval_s: float) -> None:
        self.sender = sender
        self.config = config
        self.metrics = metrics
        self._retry = Backoff(config.backoff_initial_seconds, config.backoff_max_seconds, 0.5, random)  # 50-150 %
        self._interval_ns = int(interval_s * 1e9)
        self._outbox = Outbox(directory, sender.name, metrics) if directory is not None else None
        self._queue: deque[_Entry] = deque()
        self._carry: Optional[Points] = None  # refused snapshots' last points, for the next snapshot
        self._carry_ends: list[int] = []  # their files, deleted once the carry is in another one's
        self._cond = threading.Condition()
        self._in_flight = False
        self._newest_released = -1  # interval ends must increase: file names sort in interval order
        self._released_through = 0  # every interval ending by then was handed over, empty ones included
        self._deadline: Optional[float] = None  # monotonic time by which close() gives up
        self._thread = threading.Thread(target=self._run, name=f"otelgpu-export-{sender.name}", daemon=True)
        self._started = False
        metrics.exporter_queue_capacity.labels(sender.name).set(config.queue_size)
        metrics.exporter_queue_size.labels(sender.name).set(0)

    @property
    def name(self) -> str:
        return self.sender.name

    def recover(self, committed_ns: int) -> int:
        """At start, before anything is staged: queue the directory's snapshots that end at or
        before `committed_ns`, oldest first, and delete newer ones (staged by a run that died before
        its checkpoint committed them; the pipeline computes them again). Returns how many were
        queued."""
        if self._outbox is None:
            return 0
        with self._cond:
            if self._queue:
                raise RuntimeError("recover() must come before any snapshot is staged")
        found, uncommitted = self._outbox.recover(committed_ns)
        with self._cond:
            for r in found:  # a merged one covers the snapshots it absorbed too
                start = min((r.end_ns, *r.absorbed)) - self._interval_ns
                self._queue.append(_Entry(r.end_ns, r.points, self._progress(r.end_ns, r.done), True, start))
                self._newest_released = r.end_ns
            self._released_through = committed_ns
            self.metrics.export_snapshots_recovered.labels(self.name).inc(len(found))
            self._changed()
        if found or uncommitted:
            log.info("%s: %d undelivered snapshot(s) recovered from %s, %d uncommitted one(s) deleted",
                     self.name, len(found), self._outbox.directory, uncommitted)
        return len(found)

    def stage(self, points: Sequence[Point], end_ns: int) -> None:
        """Persist (with a directory) and hold one interval's snapshot, not sendable before
        `release()`. Raises OSError when the file cannot be written (nothing is queued then), and
        ValueError when `end_ns` is not after every released snapshot. A staged snapshot of the
        same or a later end is replaced: it was never released."""
        if not points:
            return
        with self._cond:
            if end_ns <= self._newest_released:
                raise ValueError(f"snapshot ending {end_ns} is not after the last one released "
                                 f"({self._newest_released})")
            replaced = [e for e in self._queue if e.end_ns >= end_ns]
        if self._outbox is not None:
            try:
                self._outbox.write(end_ns, points)
            except OSError as exc:
                self.metrics.export_outbox_errors.labels(self.name, "write").inc()
                log.error("%s: snapshot ending %d not persisted: %s", self.name, end_ns, exc)
                raise
            for e in replaced:
                if e.end_ns != end_ns:  # the same end's file was just written over
                    self._outbox.delete(e.end_ns)
        with self._cond:
            for e in replaced:
                self._queue.remove(e)
            self._queue.append(_Entry(end_ns, Points.of(points), self._progress(end_ns), False,
                                      end_ns - self._interval_ns))
            self._changed()

    def release(self, through_ns: int) -> None:
        """Staged snapshots ending at or before `through_ns` become sendable; every interval
        ending by then was handed over (an interval without series stages nothing)."""
        with self._cond:
            for e in self._queue:
                if not e.released and e.end_ns <= through_ns:
                    e.released = True
                    self._newest_released = e.end_ns
            self._released_through = max(self._released_through, through_ns)
            self._changed()

    def put(self, points: Sequence[Point]) -> None:
        """Queue one interval's snapshot, sendable at once (stage and release; its end is its
        newest point's time); never blocks on the network."""
        if points:
            points = Points.of(points)
            end_ns = int(points.time_ns.max())
            self.stage(points, end_ns)
            self.release(end_ns)

    def _progress(self, end_ns: int, done: int = 0) -> Progress:
        if self._outbox is None:
            return Progress(done)
        outbox = self._outbox

        def persist(n: int) -> None:  # on the sending thread, inside sender.send(): must not raise
            try:
                outbox.save_progress(end_ns, n)
            except OSError as exc:
                self.metrics.export_outbox_errors.labels(self.name, "write").inc()
                log.error("%s: progress of snapshot %d not persisted (a restart resends its part): %s",
                          self.name, end_ns, exc)
        return Progress(done, persist)

    def _changed(self) -> None:
        """Under the lock: place what refused snapshots carry, bound the queue, start the thread
        once there is something to send, report how far delivery has come."""
        self._place_carry()
        self._bound()
        if self._sendable() and not self._started:
            self._started = True
            self._thread.start()
        self.metrics.exporter_queue_size.labels(self.name).set(len(self._queue))
        through = self._queue[0].from_ns if self._queue else self._released_through
        if through > 0:  # nothing handed over yet: no figure
            self.metrics.exporter_delivered.labels(self.name).set(through / 1e9)
        self._cond.notify_all()

    def _bound(self) -> None:
        """Merge the two oldest snapshots that nothing was sent of while more than `queue_size`
        wait. On disk the merged snapshot replaces the newer file before the older one goes, naming
        it as absorbed: after a crash in between, recover() deletes the older file."""
        q = self._queue
        while len(q) > self.config.queue_size:
            i = next((i for i in range(len(q) - 1) if q[i + 1].released and not (i == 0 and self._in_flight)
                      and q[i].progress.done == 0 and q[i + 1].progress.done == 0), None)
            if i is None:  # only staged or started snapshots: nothing may be merged yet
                return
            merged = merge(q[i].snapshot, q[i + 1].snapshot)
            if self._outbox is not None:
                try:
                    self._outbox.write(q[i + 1].end_ns, merged, absorbed=(q[i].end_ns,))
                except OSError as exc:
                    self.metrics.export_outbox_errors.labels(self.name, "write").inc()
                    log.error("%s: merged snapshot not persisted, queue stays over its bound: %s", self.name, exc)
                    return
                self._outbox.delete(q[i].end_ns)
            q[i + 1].snapshot, q[i + 1].from_ns = merged, q[i].from_ns
            del q[i]
            self.metrics.export_snapshots_merged.labels(self.name).inc()

    def _refused(self, head: _Entry) -> None:
        """Under the lock: `head` was refused for good; its series' last points wait for the next snapshot."""
        sums = [key for key, spec in self.sender.specs.items() if spec.kind == "sum"]
        last = last_of_each(head.snapshot, sums)
        self._carry = last if self._carry is None else last_of_each(merge(self._carry, last), sums)
        self._carry_ends.append(head.end_ns)
        self.metrics.export_snapshots_carried.labels(self.name).inc()

    def _place_carry(self) -> None:
        """Under the lock: merge the carry into the oldest released snapshot nothing was sent of,
        stamped at its end. On disk the merged snapshot replaces that file, naming the refused ones
        as absorbed, before their files go (as `_bound` does)."""
        if self._carry is None:
            return
        target = next((e for i, e in enumerate(self._queue) if e.released and e.progress.done == 0
                       and not (i == 0 and self._in_flight)), None)
        if target is None:  # until the next snapshot is released; on disk the refused files stay
            return
        merged = merge(restamped(self._carry, target.end_ns), target.snapshot)
        if self._outbox is not None:
            try:
                self._outbox.write(target.end_ns, merged, absorbed=tuple(self._carry_ends))
            except OSError as exc:
                self.metrics.export_outbox_errors.labels(self.name, "write").inc()
                log.error("%s: carried points not persisted, kept for the next snapshot: %s", self.name, exc)
                return
            for end_ns in self._carry_ends:
                self._outbox.delete(end_ns)
        target.snapshot = merged
        self._carry, self._carry_ends = None, []

    def _sendable(self) -> bool:
        return bool(self._queue) and self._queue[0].released

    @property
    def depth(self) -> int:
        with self._cond:
            return len(self._queue)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no released snapshot waits (tests, benchmarks)."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._sendable() or self._in_flight:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._sendable() and self._deadline is None:
                    self._cond.wait()
                if not self._sendable() or self._past_deadline():
                    return
                head = self._queue[0]
                self._in_flight = True
            points = head.snapshot
            began = time.monotonic()
            result = self.sender.send(points, head.progress)
            self.metrics.work_seconds.labels(f"send:{self.name}").inc(time.monotonic() - began)
            if result.ok and self._outbox is not None:
                self._outbox.delete(head.end_ns)  # still in flight: nothing merges it meanwhile
            with self._cond:
                self._in_flight = False
                if result.ok or not result.retryable:
                    if self._queue and self._queue[0] is head:  # close() may have given up on it
                        self._queue.popleft()
                    self._retry.reset()
                if result.ok:
                    self.metrics.exports.labels(self.name).inc()
                    self.metrics.exporter_sent_points.labels(self.name).inc(len(points))
                elif not result.retryable:
                    self._refused(head)
                    log.error("%s export refused (%s): each series' last value goes again with the next snapshot, "
                              "stamped at its time: %s", self.name, result.reason, result.detail)
                else:
                    told = result.retry_after  # the server knows best; only absurd delays are cut
                    delay = self._retry.next(None if told is None else min(max(told, 0.0), MAX_SERVER_DELAY_S))
                    if self._retry.attempt == 1 or self._retry.attempt % 10 == 0:
                        log.warning("%s export failed (%s: %s), attempt %d, retrying in %.1f s", self.name,
                                    result.reason, result.detail, self._retry.attempt, delay)
                if not result.ok:
                    self.metrics.export_failures.labels(self.name, result.reason or "unknown").inc()
                    self.metrics.exporter_send_failed_points.labels(self.name).inc(len(points))
                self._changed()
                if result.retryable and not result.ok:
                    end = time.monotonic() + delay
                    while (left := min(end, self._deadline or end) - time.monotonic()) > 0:
                        self._cond.wait(left)  # close() wakes this: its deadline may come sooner
            if result.ok:
                del head, points  # the snapshot and its requests, once nothing else holds them
                give_back()

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _give_up(self, points: Sequence[Point], reason: str) -> None:
        self.metrics.export_snapshots_dropped.labels(self.name, reason).inc()
        self.metrics.export_points_undeliverable.labels(self.name, reason).inc(len(points))

    def finish_by(self, deadline: float) -> None:
        """Stop once the queue is delivered or at `deadline` (time.monotonic()), whichever comes
        first; returns at once, so several exporters can drain side by side before `close()`."""
        with self._cond:
            self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)
            self._cond.notify_all()

    def close(self, timeout: Optional[float] = None) -> int:
        """Deliver what is released within `timeout` (default: the configured shutdown timeout, or
        the deadline given to `finish_by`), then stop. Returns the snapshots left undelivered: with
        a directory they stay there for the next start (counted as persisted), without one they are
        given up (counted with reason `shutdown`)."""
        timeout = self.config.shutdown_timeout_seconds if timeout is None else timeout
        self.finish_by(time.monotonic() + timeout)
        if self._started:
            self._thread.join(max(0.0, self._deadline - time.monotonic()) + 1.0)  # type: ignore[operator]
        with self._cond:
            left = list(self._queue)
            self._queue.clear()
            if self._outbox is not None:
                self.metrics.export_snapshots_persisted.labels(self.name).inc(len(left))
            else:
                for e in left:
                    self._give_up(e.snapshot, "shutdown")
                if self._carry is not None:  # with a directory, the refused files stay for the next start
                    self._give_up(self._carry, "shutdown")
            self.metrics.exporter_queue_size.labels(self.name).set(0)
        if left and self._outbox is not None:
            log.warning("%s: %d snapshot(s) not delivered before the shutdown deadline stay in %s for the next start",
                        self.name, len(left), self._outbox.directory)
        elif left:
            log.error("%s: %d snapshot(s) not delivered before the shutdown deadline", self.name, len(left))
        self.sender.close()
        return len(left)
