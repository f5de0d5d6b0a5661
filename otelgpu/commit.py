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
snapshots wait in each exporter's one queue (in memory where the disk refused them, bounded and
merged there like the rest) and the next interval tries again, so exports pause rather than run
ahead of what is durable; the failure is logged and counted.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from otelgpu.checkpoint import Checkpoint
from otelgpu.exporter.columns import Point
from otelgpu.exporter.delivery import Delivery
from otelgpu.telemetry import CheckpointError, DurabilityTelemetry, SelfMetrics
from otelgpu.wal import Position, Wal

log = logging.getLogger(__name__)


class Committer:
    def __init__(self, deliveries: list[Delivery], checkpoint: Optional[Checkpoint], wal: Optional[Wal],
                 metrics: SelfMetrics) -> None:
        self.deliveries, self.checkpoint, self.wal, self.metrics = deliveries, checkpoint, wal, metrics
        self.durability = DurabilityTelemetry(metrics)
        self._through = 0  # end of the newest interval handed over

    def add(self, end_ns: int, snapshot: list[Point]) -> None:
        """Stage one closed interval's snapshot with every exporter (its queue persists it, or
        keeps it in memory while the disk refuses)."""
        self._through = end_ns
        for d in self.deliveries:
            d.add(snapshot, end_ns)

    def commit(self, state: Callable[[], dict[str, Any]], replay_from: Position) -> bool:
        """Persist, checkpoint, release. Returns False when something had to wait."""
        if self.checkpoint is None:
            for d in self.deliveries:
                d.release(self._through)
            return True
        if not self._persisted():
            return False
        if not self.checkpoint.save(state()):
            return False
        self.metrics.interval_checkpointed.set(self._through / 1e9)
        for d in self.deliveries:
            d.release(self._through)
        if self.wal is not None:
            self.wal.rotate()
            self.durability.wal_segments_removed.inc(self.wal.truncate_before(replay_from))
        return True

    def _persisted(self) -> bool:
        ok = True
        for d in self.deliveries:
            if not d.persist():
                self.durability.checkpoint_failed(CheckpointError.STAGE)
                log.error("%s: snapshots not persisted; exports wait until the checkpoint directory takes writes "
                          "again", d.name)
                ok = False
        return ok
