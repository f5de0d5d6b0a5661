"""Intervals on data time: samples wait in their interval until the watermark passes its end
plus the lateness allowance; a resent batch is deduplicated when the interval closes; a sample
for an interval already closed is counted as late."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from otelgpu.enrich.samples import Samples
from otelgpu.enrich.usage import PodSamples

NS = 1_000_000_000


@dataclass(frozen=True)
class Interval:
    index: int
    start_ns: int
    end_ns: int
    samples: Samples
    pods: PodSamples

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / NS


class Windows:
    def __init__(self, interval_s: int, lateness_s: int) -> None:
        self.dt_ns = interval_s * NS
        self.lateness_ns = lateness_s * NS
        self.watermark_ns = 0
        self.closed_through = -1  # highest interval index already closed
        self._open: dict[int, tuple[list[Samples], list[PodSamples]]] = {}

    def add(self, samples: Samples, newest_ns: int, pods: PodSamples | None = None) -> int:
        """Buffer `samples` (DCGM) and `pods` (phases and use); `newest_ns` is the newest timestamp
        of the whole batch. Returns how many samples were late (their interval had already closed)."""
        self.watermark_ns = max(self.watermark_ns, newest_ns)
        late = 0
        for slot, part in ((0, samples), (1, pods)):
            if part is None or not len(part):
                continue
            idx = part.time_ns // self.dt_ns
            on_time = idx > self.closed_through
            n_late = int((~on_time).sum())
            if n_late:
                late += n_late
                part, idx = part.take(np.flatnonzero(on_time)), idx[on_time]
            for i in np.unique(idx):
                self._open.setdefault(int(i), ([], []))[slot].append(part.take(np.flatnonzero(idx == i)))
        return late

    def due(self, flush: bool = False) -> list[Interval]:
        """Intervals whose end plus lateness the watermark has passed (all of them when flushing)."""
        ready = sorted(i for i in self._open if flush or (i + 1) * self.dt_ns + self.lateness_ns <= self.watermark_ns)
        out = []
        for i in ready:
            dcgm, pods = self._open.pop(i)
            out.append(Interval(i, i * self.dt_ns, (i + 1) * self.dt_ns,
                                Samples.concat(dcgm) if dcgm else Samples.empty(),
                                PodSamples.concat(pods) if pods else PodSamples.empty()))
            self.closed_through = max(self.closed_through, i)
        return out

    def resume_after(self, time_ns: int) -> None:
        """Continue a run whose intervals were counted up to `time_ns` (a checkpoint): intervals
        starting before it count as closed, their samples as late."""
        self.closed_through = max(self.closed_through, -(-time_ns // self.dt_ns) - 1)
        self.watermark_ns = max(self.watermark_ns, time_ns)

    @property
    def open_intervals(self) -> int:
        return len(self._open)

