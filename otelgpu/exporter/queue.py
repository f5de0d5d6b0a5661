"""One exporter's queue of cost snapshots: the only queue between an interval's close and its
sender, bounded, merging, and persisted in a directory of its own (`outbox.py`) when there is one.

A snapshot goes through three states. *Added*, it is in the queue and written to the directory;
should the disk refuse it (full, read-only), it waits in memory, unpersisted, and `persist()`
writes it later, oldest first. *Persisted*, it waits for the pipeline's checkpoint. *Released*
(`release`), it may be sent. So what an exporter has delivered is never ahead of what a restarted
process continues from. A persisted snapshot's columns wait in its file, not in memory (`OnDisk`):
the exporter's thread reads the head's back to send it (`read_back`), a merge the pair it merges;
so neither the checkpoint written after a close nor an outage's queue holds them (at 100,000 GPUs
some 60 MiB a snapshot). One whose file no longer reads back is set aside and counted.

The queue holds at most `size` snapshots: past it, the two oldest that nothing was sent of (both
released, or both still unpersisted) and that lie in one calendar month are merged (newest value
per series), so an outage costs time resolution, never money, and moves no money into another
month's bill (unless it lasts more months than the queue holds snapshots). A snapshot the backend
refused for good is carried: each of its cumulative series' last value, and its end marker where
it ended, goes into the next released snapshot, stamped at that one's end (the value 1 ms
before), where a newer value of the same series supersedes it.

The pipeline's thread adds, persists and releases; the exporter's thread takes the head and says
how its send went (`sent`); both under `cond`."""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from otelgpu.core.months import month_ending, one_month
from otelgpu.exporter.columns import Point, Points, last_of_each, merge, restamped
from otelgpu.exporter.outbox import OnDisk, Outbox
from otelgpu.exporter.sending import Progress, SendResult
from otelgpu.exporter.store import MetricSpec
from otelgpu.telemetry import ExporterTelemetry, OutboxError

log = logging.getLogger(__name__)


@dataclass
class Entry:
    end_ns: int
    snapshot: Points | OnDisk  # OnDisk once persisted, until read back
    progress: Progress
    persisted: bool  # in the directory (always, without one)
    released: bool  # sendable: the pipeline's checkpoint holds its interval
    from_ns: int  # the data time it covers from: its interval's start, or the oldest one merged into it


class SnapshotQueue:
    def __init__(self, telemetry: ExporterTelemetry, specs: Mapping[str, MetricSpec], size: int, interval_ns: int,
                 outbox: Optional[Outbox], on_sendable: Callable[[], None]) -> None:
        self.name, self.size, self.telemetry, self.outbox = telemetry.exporter, size, telemetry, outbox
        self._sums = [key for key, spec in specs.items() if spec.kind == "sum"]
        self._interval_ns = interval_ns
        self._on_sendable = on_sendable  # under the lock, whenever a snapshot may be sent
        self.cond = threading.Condition()
        self.in_flight = False  # the head is being sent: nothing merges it meanwhile
        self._entries: deque[Entry] = deque()
        self._carry: Optional[Points] = None  # refused snapshots' last points, for the next snapshot
        self._carry_ends: list[int] = []  # their files, deleted once the carry is in another one's
        self._newest_released = -1  # interval ends must increase: file names sort in interval order
        self._released_through = 0  # every interval ending by then was handed over, empty ones included
        telemetry.queue_capacity.set(size)
        telemetry.queue_size.set(0)

    def recover(self, committed_ns: int) -> int:
        """At start, before anything is added: queue the directory's snapshots that end at or
        before `committed_ns`, oldest first, and delete newer ones (added by a run that died before
        its checkpoint committed them; the pipeline computes them again). Returns how many."""
        if self.outbox is None:
            return 0
        with self.cond:
            if self._entries:
                raise RuntimeError("recover() must come before any snapshot is added")
        found, uncommitted = self.outbox.recover(committed_ns)
        with self.cond:
            for r in found:  # a merged one covers the snapshots it absorbed too
                start = min((r.end_ns, *r.absorbed)) - self._interval_ns
                self._entries.append(Entry(r.end_ns, OnDisk.of(Points.of(r.points)), self._progress(r.end_ns, r.done),
                                           True, True, start))
                self._newest_released = r.end_ns
            self._released_through = committed_ns
            self.telemetry.snapshots_recovered.inc(len(found))
            self._changed()
        if found or uncommitted:
            log.info("%s: %d undelivered snapshot(s) recovered from %s, %d uncommitted one(s) deleted",
                     self.name, len(found), self.outbox.directory, uncommitted)
        return len(found)

    def add(self, points: Sequence[Point], end_ns: int) -> bool:
        """Queue one interval's snapshot, not sendable before `release()`, and persist what waits
        to be. Returns whether everything is persisted. ValueError when `end_ns` is not after
        every released snapshot; a snapshot of the same or a later end that was not released is
        replaced."""
        if not points:
            return self.persist()
        with self.cond:
            if end_ns <= self._newest_released:
                raise ValueError(f"snapshot ending {end_ns} is not after the last one released "
                                 f"({self._newest_released})")
            replaced = [e for e in self._entries if e.end_ns >= end_ns]
            for e in replaced:
                self._entries.remove(e)
            self._entries.append(Entry(end_ns, Points.of(points), self._progress(end_ns), self.outbox is None, False,
                                       end_ns - self._interval_ns))
        if self.outbox is not None:
            for e in replaced:
                if e.persisted and e.end_ns != end_ns:  # the same end's file is written over
                    self.outbox.delete(e.end_ns)
        persisted = self.persist()
        with self.cond:
            self._changed()
        return persisted

    def persist(self) -> bool:
        """Write the snapshots that wait in memory, oldest first. False when the disk still
        refuses one (it and those after it wait for the next try)."""
        if self.outbox is None:
            return True
        with self.cond:  # as merges write: none may take a snapshot being written
            for e in [e for e in self._entries if not e.persisted]:
                try:
                    e.snapshot = self.outbox.write(e.end_ns, e.snapshot)
                except OSError as exc:
                    self.telemetry.outbox_error(OutboxError.WRITE)
                    log.error("%s: snapshot ending %d not persisted: %s", self.name, e.end_ns, exc)
                    return False
                e.persisted = True
        return True

    def read_back(self, entry: Entry) -> bool:
        """Read `entry`'s points back from its file if they wait there (the head, whose send
        holds them till it leaves the queue; a pair to merge). False when the file no longer
        reads: it is set aside, its points counted as undeliverable, and it leaves the queue
        (the next snapshot holds each live series' cumulative value again). Under the lock, or
        on the exporter's thread for the head it holds in flight."""
        kept = entry.snapshot
        if not isinstance(kept, OnDisk):
            return True
        assert self.outbox is not None
        try:
            entry.snapshot = self.outbox.read_back(entry.end_ns, kept)
            return True
        except (OSError, ValueError) as exc:  # SnapshotFormatError is a ValueError
            self.outbox.set_aside(entry.end_ns, exc)
        with self.cond:
            at = next((i for i, e in enumerate(self._entries) if e is entry), None)
            if at is not None:
                del self._entries[at]
            self.telemetry.unreadable(len(kept))
            head = at == 0
            if head and self.in_flight:
                self.in_flight = False
                self._changed()
        return False

    def release(self, through_ns: int) -> None:
        """Persisted snapshots ending at or before `through_ns` become sendable; every interval
        ending by then was handed over (an interval without series adds nothing)."""
        with self.cond:
            for e in self._entries:
                if not e.released and e.persisted and e.end_ns <= through_ns:
                    e.released = True
                    self._newest_released = e.end_ns
            self._released_through = max(self._released_through, through_ns)
            self._changed()

    def _progress(self, end_ns: int, done: int = 0) -> Progress:
        if self.outbox is None:
            return Progress(done)
        outbox = self.outbox

        def persist(accepted: int) -> None:  # on the sending thread, inside sender.send(): must not raise
            try:
                outbox.save_progress(end_ns, accepted)
            except OSError as exc:
                self.telemetry.outbox_error(OutboxError.WRITE)
                log.error("%s: progress of snapshot %d not persisted (a restart resends its part): %s",
                          self.name, end_ns, exc)
        return Progress(done, persist)

    # The exporter's thread, under `cond`.

    def sendable(self) -> bool:
        return bool(self._entries) and self._entries[0].released

    def head(self) -> Entry:
        """The snapshot to send next (`sendable()` first); it is in flight until `sent`."""
        self.in_flight = True
        return self._entries[0]

    def sent(self, head: Entry, result: SendResult) -> None:
        """How sending `head` went: delivered or refused for good, it leaves the queue (refused,
        its series' last points are carried); a retryable failure keeps it at the head."""
        self.in_flight = False
        if result.ok or not result.retryable:
            if self._entries and self._entries[0] is head:  # close() may have given up on it
                self._entries.popleft()
        if not result.ok and not result.retryable:
            last = last_of_each(head.snapshot, self._sums)
            self._carry = last if self._carry is None else last_of_each(merge(self._carry, last), self._sums)
            self._carry_ends.append(head.end_ns)
            self.telemetry.snapshots_carried.inc()
        self._changed()

    def __len__(self) -> int:
        return len(self._entries)

    def take_all(self) -> tuple[list[Entry], Optional[Points]]:
        """Empty the queue (a stop): what was left, and the carry not placed."""
        left, carry = list(self._entries), self._carry
        self._entries.clear()
        self.telemetry.queue_size.set(0)
        return left, carry

    def _changed(self) -> None:
        """Under the lock: place what refused snapshots carry, bound the queue, report how far
        delivery has come, wake the exporter's thread."""
        self._place_carry()
        self._bound()
        if self.sendable():
            self._on_sendable()
        self.telemetry.queue_size.set(len(self._entries))
        through = self._entries[0].from_ns if self._entries else self._released_through
        if through > 0:  # nothing handed over yet: no figure
            self.telemetry.delivered_through.set(through / 1e9)
        self.cond.notify_all()

    def _mergeable(self, index: int) -> bool:
        """Whether snapshots i and i + 1 may be merged: nothing was sent of either, and both are
        released (and i is not in flight) or both wait in memory unpersisted."""
        older, newer = self._entries[index], self._entries[index + 1]
        if older.progress.done or newer.progress.done:
            return False
        if newer.released:
            return not (index == 0 and self.in_flight)
        return not older.persisted and not newer.persisted

    def _to_merge(self) -> Optional[int]:
        """The older of the two oldest snapshots that may be merged and cover one calendar month
        together, so that each month's bill reads its own money (a merged snapshot stamps its
        series' values at its end). Across months only when the queue holds more months than
        snapshots it may (an outage of months); otherwise a month's pair that may not be merged
        yet (in flight, not released) will be, and the queue waits over its bound till then."""
        entries = self._entries
        mergeable = [i for i in range(len(entries) - 1) if self._mergeable(i)]
        within = (i for i in mergeable if one_month(entries[i].from_ns, entries[i + 1].end_ns))
        index = next(within, None)
        if index is None and mergeable and len({month_ending(e.end_ns) for e in entries}) > self.size:
            index = mergeable[0]
        return index

    def _bound(self) -> None:
        """Merge two snapshots (`_to_merge`) while more than `size` wait. On disk the merged
        snapshot replaces the newer file before the older one goes, naming it as absorbed: after a
        crash in between, recover() deletes the older file."""
        entries = self._entries
        while len(entries) > self.size:
            index = self._to_merge()
            if index is None:  # only persisted unreleased or started snapshots: nothing may be merged yet
                return
            older, newer = entries[index], entries[index + 1]
            if not (self.read_back(older) and self.read_back(newer)):
                continue  # gone from the queue: it may be within its bound now
            merged: Points | OnDisk = merge(older.snapshot, newer.snapshot)
            if self.outbox is not None and newer.persisted:
                try:
                    merged = self.outbox.write(newer.end_ns, merged, absorbed=(older.end_ns,))
                except OSError as exc:
                    self.telemetry.outbox_error(OutboxError.WRITE)
                    log.error("%s: merged snapshot not persisted, queue stays over its bound: %s", self.name, exc)
                    self._leave_on_disk(older, newer)
                    return
                self.outbox.delete(older.end_ns)
            newer.snapshot, newer.from_ns = merged, older.from_ns
            del entries[index]
            self.telemetry.snapshots_merged.inc()

    def _leave_on_disk(self, *entries: Entry) -> None:
        """Let go of the points read back for a merge that was not written: their files hold them."""
        for e in entries:
            if e.persisted and self.outbox is not None and isinstance(e.snapshot, Points):
                e.snapshot = OnDisk.of(e.snapshot)

    def _place_carry(self) -> None:
        """Merge the carry into the oldest released snapshot nothing was sent of, stamped at its
        end. On disk the merged snapshot replaces that file, naming the refused ones as absorbed,
        before their files go (as `_bound` does)."""
        if self._carry is None:
            return
        target = next((e for i, e in enumerate(self._entries) if e.released and e.progress.done == 0
                       and not (i == 0 and self.in_flight)), None)
        if target is None:  # until the next snapshot is released; on disk the refused files stay
            return
        if not self.read_back(target):
            self._place_carry()  # it left the queue: the next one
            return
        merged: Points | OnDisk = merge(restamped(self._carry, target.end_ns), target.snapshot)
        if self.outbox is not None:
            try:
                merged = self.outbox.write(target.end_ns, merged, absorbed=tuple(self._carry_ends))
            except OSError as exc:
                self.telemetry.outbox_error(OutboxError.WRITE)
                log.error("%s: carried points not persisted, kept for the next snapshot: %s", self.name, exc)
                self._leave_on_disk(target)
                return
            for end_ns in self._carry_ends:
                self.outbox.delete(end_ns)
        target.snapshot = merged
        self._carry, self._carry_ends = None, []
