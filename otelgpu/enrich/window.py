"""Intervals on data time.

Everything a batch brings (DCGM samples, pod phases and use, kube-state-metrics facts) waits in the
interval its timestamp falls in until the watermark passes that interval's end plus the lateness
allowance; then the interval closes with exactly what was stamped inside it, so a fact that changed
after an interval ended never rewrites it. What waits is folded as it arrives, to what the close
reads of it: DCGM samples into one row per label combination and timestamp (enrich/steps.py),
kube-state-metrics rows to each series' last; so a resent batch adds nothing to what an interval
holds. A sample for an interval already closed is counted as late.

The watermark is the data time the cluster as a whole has reached: each scrape target's newest
timestamp is kept, and the watermark is the one a majority of targets has reached (the median,
rounded towards the older; the target itself when there is one). It is recomputed from the targets
on every batch, so it can move back: one target with a skewed clock, or a few hostile ones, cannot
drag it ahead, not even when they arrive before the rest of the cluster (nothing closes then, since
intervals close in order and only up to the watermark). A target not heard from for `silence_s` of
the receive clock (a node removed, a Collector gone) stops counting, so a fleet that shrinks does not
hold the watermark back for longer than that.

Once the first interval has closed, every later interval closes in turn, even one no data fell in
(a dcgm-exporter outage, only Kubernetes API facts): the money of the nodes known then is still
computed. A gap longer than `max_gap_intervals` (a long stop) is skipped and reported instead of
being invented from facts that old.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import numpy as np
from sortedcontainers import SortedList

from otelgpu.core.state import nothing_to_undo
from otelgpu.enrich.factrows import RENEW_OWN, FactRows, FactTable, latest_rows, share
from otelgpu.enrich.facts import latest
from otelgpu.enrich.samples import Samples
from otelgpu.enrich.steps import LabelTable, Steps
from otelgpu.enrich.usage import PodSamples
from otelgpu.receiver.decode import PointBatch, empty_batch

NS = 1_000_000_000
FOLD_ROWS = 8192  # an open interval's samples and facts are folded once they are this many rows (see _Folded;
# `attribution.fold_rows` in the configuration)
Position = tuple[int, int]  # write-ahead log (segment, offset)


@dataclass(frozen=True)
class Interval:
    index: int
    start_ns: int
    end_ns: int
    steps: Steps  # DCGM samples, folded (enrich/steps.py)
    pods: PodSamples
    fact_rows: FactRows = field(default_factory=lambda: FactRows.whole(empty_batch()))  # enrich/factrows.py
    version: int = 0  # parts added to the interval while it was open

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / NS

    @property
    def facts(self) -> PointBatch:
        """The kube-state-metrics rows, each series' last, in time order: built at each read, so
        that only what reads them holds them (the close applies them, then computes)."""
        return self.fact_rows.batch()

    @property
    def samples(self) -> Samples:
        """Every DCGM sample of the interval, the framebuffer's too (`Steps.unpack`)."""
        return self.steps.unpack()


class _Folded:
    """Parts of one kind waiting in an open interval, folded into one (`fold`) whenever they have
    grown by `grow` times what the last fold left and are at least `fold_rows`: what the interval
    holds stays within `grow` times what its fold leaves, and folding costs time in proportion to
    the rows added (each row is folded some grow / (grow - 1) times)."""

    def __init__(self, fold: Callable[[list], Any], grow: float = 2.0) -> None:
        self.parts: list = []
        self._fold = fold
        self._grow = grow
        self._rows = self._folded = 0

    def add(self, part: Any, fold_rows: int) -> Any:
        """The parts folded, if they were now; None otherwise."""
        self.parts.append(part)
        self._rows += len(part)
        if self._rows < max(fold_rows, self._grow * self._folded):
            return None
        self.parts = [self._fold(self.parts)]
        self._rows = self._folded = len(self.parts[0])
        return self.parts[0]

    def whole(self) -> Any:
        """The parts folded into one, kept so: an interval computed ahead and then closed folds
        them once."""
        if not self.parts:
            return self._fold(self.parts)
        if self._rows != self._folded or len(self.parts) > 1:  # anything added since the last fold
            self.parts = [self._fold(self.parts)]
            self._rows = self._folded = len(self.parts[0])
        return self.parts[0]

    def __bool__(self) -> bool:
        return bool(self.parts)


@dataclass
class _Open:
    # DCGM samples, as steps (enrich/steps.py). Each scrape adds rows of its own timestamps, and a
    # fold merges only the rows of resends and the parts' label tables: folded when doubled.
    samples: _Folded = field(default_factory=lambda: _Folded(Steps.merge))
    pods: list[PodSamples] = field(default_factory=list)
    # kube-state-metrics rows, each series' last of them (enrich/facts.py `latest`), as times and
    # rows of a table the intervals share (enrich/factrows.py). Each scrape resends every series,
    # so a fold leaves about the series' count: folded when grown by a quarter, an interval holds
    # at most 1.25 times that where it held twice (and folds each row five times where twice).
    facts: _Folded = field(default_factory=lambda: _Folded(lambda parts: FactRows.whole(_latest(parts)), 1.25))
    first_record: Optional[Position] = None  # earliest log record that put rows here
    version: int = 0  # parts added so far

    def parts(self) -> list:  # Steps, PodSamples and FactRows alike: len
        return [*self.samples.parts, *self.pods, *self.facts.parts]


def _latest(parts: list[FactRows]) -> PointBatch:
    """The parts' rows, each series' last (`latest`), as a batch of their own."""
    return latest(PointBatch.concat([part.batch() for part in parts]))


class Windows:
    key = "windows"  # its checkpoint entry (core/state.py)

    def __init__(self, interval_s: int, lateness_s: int, max_gap_intervals: int = 10,
                 clock: Callable[[], float] = time.monotonic, fold_rows: Optional[int] = None) -> None:
        self.dt_ns = interval_s * NS
        self.lateness_ns = lateness_s * NS
        self.max_gap = max_gap_intervals
        self.silence_s = float(interval_s + lateness_s)
        self.clock = clock  # the receive clock, in seconds
        self.fold_rows = FOLD_ROWS if fold_rows is None else fold_rows
        self.watermark_ns = 0
        self.closed_through = -1  # highest interval index already closed
        self.closed_ns = 0  # the time through which intervals count as closed (a checkpoint's, or the last close's end)
        self.skipped = 0  # intervals of long gaps not computed
        self._sources = _Sources()  # scrape target -> newest timestamp, last heard
        self._open: dict[int, _Open] = {}
        # The label combinations the last fold of samples left: new parts that bring none other
        # refer to its table (enrich/steps.py `Steps.sharing`)
        self._labels: Optional[LabelTable] = None
        # The kube-state-metrics rows a fold of facts last renewed the table with: new rows of the
        # same content refer to it (enrich/factrows.py)
        self._facts: Optional[FactTable] = None

    def add(self, samples: Samples, batch: PointBatch, pods: Optional[PodSamples] = None,
            facts: Optional[PointBatch] = None) -> tuple[int, PointBatch]:
        """Buffer one decoded batch's parts: DCGM `samples`, `pods` (phases and use) and `facts`
        (kube-state-metrics rows); `batch` gives the targets' newest timestamps and the log record.
        Returns (samples late, fact rows of intervals already closed): those facts are newer than
        nothing the next interval will use, so the caller applies them at once."""
        self._advance(batch.sources)
        record = batch.wal[0] if batch.wal else None
        late = 0
        for slot, part in (("samples", samples), ("pods", pods)):
            if part is None or not len(part):
                continue
            idx = part.time_ns // self.dt_ns
            on_time = idx > self.closed_through
            late += int((~on_time).sum())
            for i in np.unique(idx[on_time]):
                rows = part.take(np.flatnonzero(idx == i))
                if slot == "samples":
                    self._add_steps(self._slot(int(i), record), Steps.of(rows))
                else:
                    self._slot(int(i), record).pods.append(rows)
        late_facts = empty_batch()
        if facts is not None and len(facts):
            idx = facts.time_ns // self.dt_ns
            on_time = idx > self.closed_through
            late_facts = facts.select(~on_time)
            for i in np.unique(idx[on_time]):
                rows, self._facts = share(facts.select(idx == i), self._facts)
                self._slot(int(i), record).facts.add(rows, self.fold_rows)
        return late, late_facts

    def _fold_facts(self, parts: list[FactRows]) -> FactRows:
        """The parts' rows folded (each series' last), referring to the table they renew or to the
        one the open intervals share."""
        table = self._facts
        alone = table is None or not any(part.shared is table.batch for slot in self._open.values()
                                         if slot.facts.parts is not parts for part in slot.facts.parts)
        folded = latest_rows(parts, table)  # without building the rows, when every part refers to the table
        if folded is not None and not (len(folded.own) and (alone or len(folded.own) * RENEW_OWN > len(folded))):
            return folded
        rows, self._facts = share(folded.batch() if folded is not None else _latest(parts), table, fold=True,
                                  alone=alone)
        return rows

    def _add_steps(self, slot: _Open, steps: Steps) -> None:
        if self._labels is not None:
            steps = steps.sharing(self._labels)
        folded = slot.samples.add(steps, self.fold_rows)
        if folded is not None and (self._labels is None or folded.labels is not self._labels.labels):
            self._labels = LabelTable(folded.labels)

    def _slot(self, index: int, record: Optional[Position]) -> _Open:
        slot = self._open.get(index)
        if slot is None:
            slot = self._open[index] = _Open(facts=_Folded(self._fold_facts, 1.25))
        slot.version += 1
        if record is not None and (slot.first_record is None or record < slot.first_record):
            slot.first_record = record
        return slot

    def _advance(self, sources: dict[str, int]) -> None:
        now = self.clock()
        self._sources.update(sources, now)
        self._sources.forget_silent(now - self.silence_s)
        if len(self._sources):
            self.watermark_ns = self._sources.median()

    def due(self, flush: bool = False, computed: frozenset[int] = frozenset()) -> list[Interval]:
        """Intervals whose end plus lateness the watermark has passed, and, once an interval has
        closed, the empty intervals after each one (at most `max_gap` in a row; longer gaps are
        skipped and counted in `skipped`). Flushing (a stop) also closes the intervals the cluster
        has begun: up to the newest timestamp of a target no more than an interval plus the
        lateness ahead of the watermark (a target scraped more often than the rest). Intervals only
        targets further ahead have reached stay open (see `ahead`). Intervals in `computed` (already
        computed) close without their parts: no samples, pod samples or facts are built."""
        ready, skipped = self._ready(flush)
        self.skipped += skipped
        out = []
        for i in ready:
            out.append(self._interval(i, self._open.pop(i, _Open()), bare=i in computed))
            self.closed_through = max(self.closed_through, i)
            self.closed_ns = max(self.closed_ns, (i + 1) * self.dt_ns)
        return out

    def due_indices(self, flush: bool = False) -> list[int]:
        """The intervals `due` would close now, in order; nothing changes."""
        return self._ready(flush)[0]

    def _ready(self, flush: bool) -> tuple[list[int], int]:
        last_due = (self.watermark_ns - self.lateness_ns) // self.dt_ns - 1
        if flush:
            near = [t for t in self._sources.newest().tolist() if t <= self.watermark_ns + self.dt_ns + self.lateness_ns]
            last_due = max(last_due, max(near, default=self.watermark_ns) // self.dt_ns)
        data = sorted(i for i in self._open if i <= last_due)
        ready, skipped = list(data), 0
        if self.closed_through >= 0 and not flush:
            anchors = [self.closed_through] + data
            for a, b in zip(anchors, anchors[1:] + [last_due + 1]):
                stop = min(b, a + 1 + self.max_gap)
                ready.extend(range(a + 1, stop))
                skipped += max(b - stop, 0)
        return sorted(ready), skipped

    def _interval(self, index: int, slot: _Open, bare: bool = False) -> Interval:
        """Interval `i` of `slot`'s parts; `bare`: without them (computed already)."""
        if bare:
            return Interval(index, index * self.dt_ns, (index + 1) * self.dt_ns, Steps.empty(), PodSamples.empty(),
                            version=slot.version)
        return Interval(index, index * self.dt_ns, (index + 1) * self.dt_ns,
                        slot.samples.whole() if slot.samples else Steps.empty(),
                        PodSamples.concat(slot.pods) if slot.pods else PodSamples.empty(),
                        slot.facts.whole() if slot.facts else FactRows.whole(empty_batch()), slot.version)

    def next_complete(self) -> Optional[int]:
        """The index of the interval that closes next if it is complete before its close: every
        earlier one is closed, and every scrape target has sent data stamped past its end (a target
        sends in time order, so only a resend or a straggler can still add to it before the
        watermark passes its end plus the lateness). None otherwise."""
        if not self._open or not len(self._sources):
            return None
        index = min(self._open)
        if self.closed_through >= 0 and index != self.closed_through + 1:
            return None  # intervals no data fell in close first, and change what this one reads
        end = (index + 1) * self.dt_ns
        if int(self._sources.newest().min()) < end or self.watermark_ns - self.lateness_ns >= end:
            return None  # not complete yet, or it closes now anyway
        return index

    def version_of(self, index: int) -> Optional[int]:
        """Open interval `i`'s version (parts added so far); None if it is not open."""
        slot = self._open.get(index)
        return slot.version if slot is not None else None

    def peek(self, index: int) -> Interval:
        """Open interval `i` as it would close now; it stays open."""
        return self._interval(index, self._open[index])

    def codes(self) -> list[np.ndarray]:
        """The arrays of interned string codes the open intervals hold (a table parts share, once)."""
        tables = {id(part.labels): part for slot in self._open.values() for part in slot.samples.parts}
        return [a for part in tables.values() for a in part.codes()] + \
            [a for part in [*self._fact_tables().values(), *(p for s in self._open.values() for p in s.pods)]
             for a in part.codes()]

    def remap(self, table: np.ndarray) -> None:
        """Rewrite those codes after the interner was compacted (`Interner.compact`); parts that
        shared a table share its rewrite. New parts share a table again from the next fold on."""
        done: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for slot in self._open.values():
            for part in slot.samples.parts:
                part.remap(table, done)
            for part in slot.pods:
                part.remap(table)
        for rows in self._fact_tables().values():
            rows.remap(table)
        self._labels = self._facts = None

    def _fact_tables(self) -> dict[int, PointBatch]:
        """The batches of rows the open intervals' facts read, each once (tables they share)."""
        return {id(b): b for slot in self._open.values() for part in slot.facts.parts for b in part.tables()}

    def ahead(self) -> int:
        """Rows waiting in open intervals (after a flush: those only targets ahead of the cluster reached)."""
        return sum(len(part) for slot in self._open.values() for part in slot.parts())

    def replay_from(self) -> Optional[Position]:
        """The earliest log record whose rows still wait in an open interval."""
        firsts = [s.first_record for s in self._open.values() if s.first_record is not None]
        return min(firsts) if firsts else None

    def resume_after(self, time_ns: int, watermark_ns: int = 0) -> None:
        """Continue a run whose intervals were counted up to `time_ns` (a checkpoint): intervals
        starting before it count as closed, their samples as late."""
        self.closed_through = max(self.closed_through, -(-time_ns // self.dt_ns) - 1)
        self.closed_ns = max(self.closed_ns, time_ns)
        self.watermark_ns = max(self.watermark_ns, time_ns, watermark_ns)

    def state(self) -> dict[str, int]:
        return {"watermark_ns": self.watermark_ns, "closed_ns": self.closed_ns}

    def restore(self, state: Mapping[str, Any] | None) -> None:
        """Continue after a checkpoint's intervals (`resume_after`); None: nothing closed yet."""
        self.closed_through, self.closed_ns, self.watermark_ns = -1, 0, 0
        if state is not None:
            self.resume_after(int(state["closed_ns"]), int(state.get("watermark_ns", 0)))

    def mark(self) -> Callable[[], None]:
        """Nothing to put back: computing an interval ahead only reads the windows."""
        return nothing_to_undo

    def expire(self, end_ns: int) -> None:
        """Nothing: an interval's parts go with its close."""

    @property
    def open_intervals(self) -> int:
        return len(self._open)


class _Sources:
    """Per scrape target, its newest timestamp and when it was last heard from: a batch updates its
    own targets (a cluster has thousands; a batch names a few). The newest timestamps are also kept
    in order, so the watermark is read in the time of a batch's own targets, not of the cluster's
    (`median`; `median_reference` sorts them all); the silence check looks at every target only
    once the oldest time one was heard is older than the cutoff."""

    def __init__(self) -> None:
        self._index: dict[str, int] = {}
        self._newest = np.zeros(0, np.int64)
        self._heard = np.zeros(0, np.float64)
        self._ordered = SortedList()  # every target's newest timestamp
        self._heard_from = math.inf  # no target was last heard before this

    def __len__(self) -> int:
        return len(self._index)

    def update(self, sources: dict[str, int], now: float) -> None:
        for src, newest in sources.items():
            newest = int(newest)
            index = self._index.get(src)
            if index is None:
                index = self._index[src] = len(self._index)
                if index == len(self._newest):
                    self._newest = np.concatenate([self._newest, np.zeros(max(16, index), np.int64)])
                    self._heard = np.concatenate([self._heard, np.zeros(max(16, index), np.float64)])
                self._newest[index] = newest
                self._ordered.add(newest)
            elif newest > self._newest[index]:
                self._ordered.remove(int(self._newest[index]))
                self._ordered.add(newest)
                self._newest[index] = newest
            self._heard[index] = now
            self._heard_from = min(self._heard_from, now)

    def forget_silent(self, heard_before: float) -> None:
        """Forget the targets last heard before `heard_before`."""
        if heard_before <= self._heard_from:
            return  # times heard only grow: none is older than the oldest was
        before = len(self._index)
        keep = self._heard[:before] >= heard_before
        if not keep.all():
            names = [src for src, i in sorted(self._index.items(), key=lambda kv: kv[1]) if keep[i]]
            self._index = {src: i for i, src in enumerate(names)}
            self._newest, self._heard = self._newest[:before][keep], self._heard[:before][keep]
            self._ordered = SortedList(self._newest.tolist())
        self._heard_from = float(self._heard[:len(self._index)].min()) if len(self._index) else math.inf

    def newest(self) -> np.ndarray:
        return self._newest[:len(self._index)]

    def median(self) -> int:
        """The targets' newest timestamp the older half has reached: the median, the older of the
        two middle ones for an even number of targets (at least one target)."""
        return int(self._ordered[(len(self._ordered) - 1) // 2])

    def median_reference(self) -> int:
        """`median`, from the newest timestamps themselves."""
        newest = self.newest()
        middle = len(newest) - 1 - len(newest) // 2  # sorted newest first, the middle one
        return int(np.partition(newest, middle)[middle])
