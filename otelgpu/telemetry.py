"""The sidecar's own counters: every point received, rejected (by reason), late or ignored, every
request by outcome, every interval computed and every export failure. Thread-safe."""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager
from typing import Iterator


class SelfMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()  # `held`: counts of work that may be dropped
        self.points_received = 0  # points of consumed metrics, accepted by decode
        self.points_ignored = 0  # points of metrics otelgpu does not consume
        self.points_late = 0  # accepted, but their interval had already closed
        self.points_rejected: Counter[str] = Counter()  # by reason
        self.requests: Counter[tuple[str, str]] = Counter()  # (transport, outcome)
        # Connections (HTTP) or RPCs (gRPC) the receivers refused or cut off: (transport, reason)
        self.receiver_connections_refused: Counter[tuple[str, str]] = Counter()
        self.intervals_computed = 0
        self.exports: Counter[str] = Counter()  # snapshots delivered, by exporter
        self.export_failures: Counter[tuple[str, str]] = Counter()  # failed attempts, (exporter, reason)
        self.export_snapshots_dropped: Counter[tuple[str, str]] = Counter()  # given up, (exporter, reason)
        self.export_points_undeliverable: Counter[tuple[str, str]] = Counter()  # their points
        self.export_points_rejected: Counter[str] = Counter()  # refused in a partial success, by exporter
        self.export_series_rejected: Counter[tuple[str, str]] = Counter()  # left out by an exporter, (exporter, reason)
        self.export_snapshots_merged: Counter[str] = Counter()  # merged in a full queue, by exporter
        self.export_queue: dict[str, int] = {}  # exporter -> snapshots waiting (a gauge)
        self.export_snapshots_recovered: Counter[str] = Counter()  # found on disk at start and queued, by exporter
        self.export_snapshots_persisted: Counter[str] = Counter()  # left on disk at shutdown, by exporter
        self.export_outbox_errors: Counter[tuple[str, str]] = Counter()  # persisted queue, (exporter, reason)
        self.series_ended = 0  # series ended with a NO_RECORDED_VALUE point
        self.series_active: dict[str, int] = {}  # "cost" -> live series in the store (a gauge)
        self.checkpoints_written = 0
        self.checkpoint_errors: Counter[str] = Counter()  # by reason
        self.unpriced_gpu_seconds = 0.0  # GPU time for which no price was found
        self.gpu_seconds_without_device_data = 0.0  # GPU nodes known only from kube-state-metrics
        self.price_reloads = 0  # price file changes applied
        self.price_reload_failures = 0  # price file changes refused (previous prices kept)
        self.scad_request_fallbacks: Counter[str] = Counter()  # pod-intervals charged on requests, by resource
        self.tag_values_capped: Counter[tuple[str, str]] = Counter()  # (tag, length | distinct)
        self.kube_events: Counter[tuple[str, str]] = Counter()  # (resource, event type)
        self.kube_lists: Counter[tuple[str, str]] = Counter()  # (resource, initial | gone | reconnect)
        self.kube_errors: Counter[tuple[str, str, str]] = Counter()  # (resource, verb, reason)
        self.kube_objects: dict[str, int] = {}  # resource -> objects held now (a gauge)
        self.kube_synced: dict[str, int] = {}  # resource -> 1 once listed, 0 while relisting
        self.wal_fsyncs = 0  # group commits of the write-ahead log
        self.wal_records_replayed = 0  # log records replayed at start
        self.wal_segments_removed = 0  # log segments a checkpoint made unnecessary
        self.wal_errors: Counter[str] = Counter()  # log writes that failed, by error
        self.wal_corruptions: Counter[str] = Counter()  # torn or corrupt records at replay (tail | segment | record)
        self.intervals_skipped = 0  # intervals of gaps too long to fill
        self.interner_compactions = 0  # string table compactions (strings of things gone released)
        self.requests_decoded_by_reference = 0  # requests the columnar decoder left to protobuf
        self.interval_errors: Counter[str] = Counter()  # intervals (whole) and nodes (node) that failed to compute
        self.gpu_seconds_lost = 0.0  # GPU time of nodes that could not be costed at all
        # Intervals computed ahead of their close (all their data in), by what became of it: used,
        # redone (something they read changed before the close), failed (computed at the close)
        self.intervals_ahead: Counter[str] = Counter()
        # Wall seconds spent per step of an interval's way out: ahead (computed before its close,
        # used or not), close (facts, join, attribution, cost series), commit (staging, checkpoint)
        # and send:<exporter> (every attempt, not the backoff)
        self.work_seconds: Counter[str] = Counter()
        self.tls_reload_errors: Counter[str] = Counter()  # changed certificate files that could not be used, by server

    def add(self, name: str, amount: float = 1) -> None:
        if self._held(("add", name, amount)):
            return
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def count(self, name: str, key: object, amount: float = 1) -> None:
        if self._held(("count", name, key, amount)):
            return
        with self._lock:
            getattr(self, name)[key] += amount

    def set(self, name: str, key: str, value: int) -> None:
        if self._held(("set", name, key, value)):
            return
        with self._lock:
            getattr(self, name)[key] = value

    @contextmanager
    def held(self) -> Iterator[list[tuple]]:
        """What this thread counts in the block is kept in the list yielded instead of counted:
        `apply` it once the work it describes is kept, or drop it. Other threads count as usual."""
        pending: list[tuple] = []
        self._local.pending = pending
        try:
            yield pending
        finally:
            self._local.pending = None

    def apply(self, pending: list[tuple]) -> None:
        for op, *args in pending:
            getattr(self, op)(*args)

    def _held(self, op: tuple) -> bool:
        pending = getattr(self._local, "pending", None)
        if pending is None:
            return False
        pending.append(op)
        return True

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return {
                "points_received": self.points_received,
                "points_ignored": self.points_ignored,
                "points_late": self.points_late,
                "points_rejected": dict(self.points_rejected),
                "requests": dict(self.requests),
                "receiver_connections_refused": dict(self.receiver_connections_refused),
                "intervals_computed": self.intervals_computed,
                "export_failures": dict(self.export_failures),
                "exports": dict(self.exports),
                "export_snapshots_dropped": dict(self.export_snapshots_dropped),
                "export_points_undeliverable": dict(self.export_points_undeliverable),
                "export_points_rejected": dict(self.export_points_rejected),
                "export_series_rejected": dict(self.export_series_rejected),
                "export_snapshots_merged": dict(self.export_snapshots_merged),
                "export_queue": dict(self.export_queue),
                "export_snapshots_recovered": dict(self.export_snapshots_recovered),
                "export_snapshots_persisted": dict(self.export_snapshots_persisted),
                "export_outbox_errors": dict(self.export_outbox_errors),
                "series_ended": self.series_ended,
                "series_active": dict(self.series_active),
                "checkpoints_written": self.checkpoints_written,
                "checkpoint_errors": dict(self.checkpoint_errors),
                "unpriced_gpu_seconds": self.unpriced_gpu_seconds,
                "gpu_seconds_without_device_data": self.gpu_seconds_without_device_data,
                "price_reloads": self.price_reloads,
                "price_reload_failures": self.price_reload_failures,
                "scad_request_fallbacks": dict(self.scad_request_fallbacks),
                "tag_values_capped": dict(self.tag_values_capped),
                "kube_events": dict(self.kube_events),
                "kube_lists": dict(self.kube_lists),
                "kube_errors": dict(self.kube_errors),
                "kube_objects": dict(self.kube_objects),
                "kube_synced": dict(self.kube_synced),
                "wal_fsyncs": self.wal_fsyncs,
                "wal_records_replayed": self.wal_records_replayed,
                "wal_segments_removed": self.wal_segments_removed,
                "wal_errors": dict(self.wal_errors),
                "wal_corruptions": dict(self.wal_corruptions),
                "intervals_skipped": self.intervals_skipped,
                "interner_compactions": self.interner_compactions,
                "requests_decoded_by_reference": self.requests_decoded_by_reference,
                "interval_errors": dict(self.interval_errors),
                "intervals_ahead": dict(self.intervals_ahead),
                "gpu_seconds_lost": self.gpu_seconds_lost,
                "work_seconds": dict(self.work_seconds),
                "tls_reload_errors": dict(self.tls_reload_errors),
            }
