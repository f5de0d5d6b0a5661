"""Intervals on data time.

Everything a batch brings (DCGM samples, pod phases and use, kube-state-metrics facts) waits in the
interval its timestamp falls in until the watermark passes that interval's end plus the lateness
allowance; then the interval closes with exactly what was stamped inside it, so a fact that changed
after an interval ended never rewrites it. A resent batch is deduplicated when the interval closes;
a sample for an interval already closed is counted as late.

The watermark is the data time the cluster as a whole has reached: each scrape target's newest
timestamp is kept, and the watermark is the second newest of them (the newest when there is one
target), so one target with a skewed clock or one hostile point cannot drag it ahead and make
everyone else's data late. Once the first interval has closed, every later interval closes in turn,
even one no data fell in (a dcgm-exporter outage, only Kubernetes API facts): the money of the
nodes known then is still computed. A gap longer than `max_gap_intervals` (a long stop) is skipped
and reported instead of being invented from facts that old.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from otelgpu.enrich.samples import Samples
from otelgpu.enrich.usage import PodSamples
from otelgpu.receiver.decode import PointBatch, empty_batch

NS = 1_000_000_000
Position = tuple[int, int]  # write-ahead log (segment, offset)


@dataclass(frozen=True)
class Interval:
    index: int
    start_ns: int
    end_ns: int
    samples: Samples
    pods: PodSamples
    facts: PointBatch = field(default_factory=empty_batch)  # kube-state-metrics rows, in time order

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / NS


@dataclass
class _Open:
    samples: list[Samples] = field(default_factory=list)
    pods: list[PodSamples] = field(default_factory=list)
    facts: list[PointBatch] = field(default_factory=list)
    first_record: Optional[Position] = None  # earliest log record that put rows here


class Windows:
    def __init__(self, interval_s: int, lateness_s: int, max_gap_intervals: int = 10) -> None:
        self.dt_ns = interval_s * NS
        self.lateness_ns = lateness_s * NS
        self.max_gap = max_gap_intervals
        self.watermark_ns = 0
        self.closed_through = -1  # highest interval index already closed
        self.skipped = 0  # intervals of long gaps not computed
        self._sources: dict[str, int] = {}  # scrape target -> newest timestamp, while ahead of the watermark
        self._open: dict[int, _Open] = {}

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
                getattr(self._slot(int(i), record), slot).append(part.take(np.flatnonzero(idx == i)))
        late_facts = empty_batch()
        if facts is not None and len(facts):
            idx = facts.time_ns // self.dt_ns
            on_time = idx > self.closed_through
            late_facts = facts.select(~on_time)
            for i in np.unique(idx[on_time]):
                self._slot(int(i), record).facts.append(facts.select(idx == i))
        return late, late_facts

    def _slot(self, i: int, record: Optional[Position]) -> _Open:
        slot = self._open.setdefault(i, _Open())
        if record is not None and (slot.first_record is None or record < slot.first_record):
            slot.first_record = record
        return slot

    def _advance(self, sources: dict[str, int]) -> None:
        for src, t in sources.items():
            if t > self._sources.get(src, 0):
                self._sources[src] = t
        newest = sorted(self._sources.values(), reverse=True)
        if newest:
            self.watermark_ns = max(self.watermark_ns, newest[1] if len(newest) > 1 else newest[0])
        # Targets behind the watermark can no longer move it: forget them (bounded memory). Those at
        # it stay: they are what outvotes a lone target ahead in a later batch.
        self._sources = {s: t for s, t in self._sources.items() if t >= self.watermark_ns}

    def due(self, flush: bool = False) -> list[Interval]:
        """Intervals whose end plus lateness the watermark has passed (all of them when flushing),
        and, once an interval has closed, the empty intervals after each one (at most `max_gap`
        in a row; longer gaps are skipped and counted in `skipped`)."""
        last_due = (self.watermark_ns - self.lateness_ns) // self.dt_ns - 1
        data = sorted(i for i in self._open if flush or i <= last_due)
        ready = list(data)
        if self.closed_through >= 0 and not flush:
            anchors = [self.closed_through] + data
            for a, b in zip(anchors, anchors[1:] + [last_due + 1]):
                stop = min(b, a + 1 + self.max_gap)
                ready.extend(range(a + 1, stop))
                self.skipped += max(b - stop, 0)
        out = []
        for i in sorted(ready):
            slot = self._open.pop(i, _Open())
            facts = PointBatch.concat(slot.facts) if slot.facts else empty_batch()
            facts = facts.select(np.argsort(facts.time_ns, kind="stable"))
            out.append(Interval(i, i * self.dt_ns, (i + 1) * self.dt_ns,
                                Samples.concat(slot.samples) if slot.samples else Samples.empty(),
                                PodSamples.concat(slot.pods) if slot.pods else PodSamples.empty(), facts))
            self.closed_through = max(self.closed_through, i)
        return out

    def replay_from(self) -> Optional[Position]:
        """The earliest log record whose rows still wait in an open interval."""
        firsts = [s.first_record for s in self._open.values() if s.first_record is not None]
        return min(firsts) if firsts else None

    def resume_after(self, time_ns: int, watermark_ns: int = 0) -> None:
        """Continue a run whose intervals were counted up to `time_ns` (a checkpoint): intervals
        starting before it count as closed, their samples as late."""
        self.closed_through = max(self.closed_through, -(-time_ns // self.dt_ns) - 1)
        self.watermark_ns = max(self.watermark_ns, time_ns, watermark_ns)

    @property
    def open_intervals(self) -> int:
        return len(self._open)
