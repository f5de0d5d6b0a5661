"""Hands closed intervals to the exporters in the order that keeps the data-path promises.

With a checkpoint directory, each interval's snapshot is first *staged* with every exporter (written
to its persisted queue, not yet sendable), then the checkpoint is written (the commit point: the
cumulative state, the facts and the write-ahead log position), and only then are the snapshots
*released* to be sent. So what an exporter has delivered is never ahead of what a restarted process
continues from (a counter never goes backwards), a snapshot staged by a process that died before
its checkpoint is dropped at the next start (that interval is recomputed from the log instead), and
a committed one is delivered after a restart with the same timestamps and values. Without a
checkpoint directory, snapshots go straight to the in-memory queues.

If staging or the checkpoint write fails (disk full, read-only volume), nothing is released: the
snapshots wait and the next interval tries again, so exports pause rather than run ahead of what
is durable; the failure is logged and counted.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from otelgpu.checkpoint import Checkpoint
from otelgpu.exporter.delivery import Delivery
from otelgpu.exporter.columns import Point, merge
from otelgpu.telemetry import SelfMetrics
from otelgpu.wal import Position, Wal

log = logging.getLogger(__name__)


class Committer:
    def __init__(self, deliveries: list[Delivery], checkpoint: Optional[Checkpoint], wal: Optional[Wal],
                 metrics: SelfMetrics) -> None:
        self.deliveries, self.checkpoint, self.wal, self.metrics = deliveries, checkpoint, wal, metrics
        self._unstaged: dict[str, list[tuple[int, list[Point]]]] = {d.name: [] for d in deliveries}
        self._through = 0  # end of the newest interval handed over

    def add(self, end_ns: int, snapshot: list[Point]) -> None:
        self._through = end_ns
        for d in self.deliveries:
            waiting = self._unstaged[d.name]
            waiting.append((end_ns, snapshot))
            if len(waiting) > d.config.queue_size:  # a disk that stays broken must not grow memory
                (_, older), (end, newer) = waiting[0], waiting[1]
                waiting[:2] = [(end, merge(older, newer))]

    def commit(self, state: Callable[[], dict[str, Any]], replay_from: Position) -> bool:
        """Stage, checkpoint, release. Returns False when something had to wait."""
        if self.checkpoint is None:
            for d in self.deliveries:
                for end_ns, snapshot in self._unstaged[d.name]:
                    d.stage(snapshot, end_ns)
                self._unstaged[d.name].clear()
                d.release(self._through)
            return True
        if not self._stage():
            return False
        if not self.checkpoint.save(state()):
            return False
        self.metrics.interval_checkpointed.set(self._through / 1e9)
        for d in self.deliveries:
            d.release(self._through)
        if self.wal is not None:
            self.wal.rotate()
            self.metrics.wal_segments_removed.inc(self.wal.truncate_before(replay_from))
        return True

    def _stage(self) -> bool:
        ok = True
        for d in self.deliveries:
            waiting = self._unstaged[d.name]
            while waiting:
                end_ns, snapshot = waiting[0]
                try:
                    d.stage(snapshot, end_ns)
                except OSError as exc:
                    self.metrics.checkpoint_errors.labels("stage").inc()
                    log.error("%s: snapshot of the interval ending %d not persisted (%s); exports wait until "
                              "the checkpoint directory takes writes again", d.name, end_ns, exc)
                    ok = False
                    break
                waiting.pop(0)
        return ok
