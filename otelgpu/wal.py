"""The write-ahead log: every accepted batch is appended and made durable before its request is
answered, so an acknowledged point survives `kill -9` at any instant.

As in Prometheus' TSDB (tsdb/wlog): numbered segment files of records, each record its payload's
length and CRC32 ahead of the payload; a new segment after each checkpoint, so whole segments the
checkpoint no longer needs are deleted; replay on start, stopping at a torn or corrupt record (the
tail a crash left half written) and continuing in a fresh segment. Group commit: a request waits
until an fsync has covered its record, and one fsync covers every record appended meanwhile, so
concurrent requests share the cost of the disk flush.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import threading
import zlib
from pathlib import Path
from typing import Iterator, Optional

from otelgpu.core.files import sync_directory
from otelgpu.telemetry import DurabilityTelemetry, SelfMetrics, WalCorruption

log = logging.getLogger(__name__)

Position = tuple[int, int]  # (segment number, byte offset)
_HEAD = struct.Struct("<II")  # payload length, CRC32 of the payload
_SEGMENT = re.compile(r"^\d{8}$")
MAX_RECORD = 1 << 31


class Wal:
    def __init__(self, directory: Path, metrics: SelfMetrics, segment_bytes: int = 64 << 20) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.telemetry = DurabilityTelemetry(metrics)
        self.segment_bytes = segment_bytes
        self._cond = threading.Condition()
        self._syncing = False
        existing = self.segments()
        self._segment = (existing[-1] + 1) if existing else 1  # never append after a crash's torn tail
        self._file = self._open(self._segment)
        self._offset = 0
        self._synced: Position = (self._segment, 0)

    def segments(self) -> list[int]:
        return sorted(int(p.name) for p in self.directory.iterdir() if _SEGMENT.match(p.name))

    def _open(self, segment: int):  # noqa: ANN202 - a binary file object
        file = open(self.directory / f"{segment:08d}", "ab", buffering=0)
        self._fsync_dir()
        return file

    def _fsync_dir(self) -> None:
        sync_directory(self.directory)

    @property
    def position(self) -> Position:
        with self._cond:
            return (self._segment, self._offset)

    def append(self, payload: bytes) -> tuple[Position, Position]:
        """Write one record (not yet durable: see sync). Returns its (start, end) positions."""
        record = _HEAD.pack(len(payload), zlib.crc32(payload)) + payload
        with self._cond:
            if self._offset and self._offset + len(record) > self.segment_bytes:
                self._rotate()
            start = (self._segment, self._offset)
            try:
                self._file.write(record)
            except OSError:
                self._file.truncate(self._offset)  # no half record for later ones to follow
                raise
            self._offset += len(record)
            return start, (self._segment, self._offset)

    def sync(self, upto: Position) -> None:
        """Return once everything up to `upto` is on disk. One caller runs the fsync for all who
        wait; the others wait for it (group commit). Raises OSError if the disk fails."""
        with self._cond:
            while self._synced < upto:
                if self._syncing:
                    self._cond.wait()
                    continue
                self._syncing = True
                target, file = (self._segment, self._offset), self._file
                self._cond.release()
                try:
                    os.fdatasync(file.fileno())
                finally:
                    self._cond.acquire()
                    self._syncing = False
                    self._cond.notify_all()
                self._synced = max(self._synced, target)
                self.telemetry.wal_fsyncs.inc()

    def rotate(self) -> Position:
        """Start a new segment (after a checkpoint, so the older ones can go). Returns its start."""
        with self._cond:
            if self._offset:
                self._rotate()
            return (self._segment, 0)

    def _rotate(self) -> None:
        while self._syncing:  # the fsync in progress holds the old file
            self._cond.wait()
        os.fdatasync(self._file.fileno())
        self._file.close()
        self._synced = max(self._synced, (self._segment, self._offset))
        self._segment += 1
        self._file = self._open(self._segment)
        self._offset = 0

    def truncate_before(self, position: Position) -> int:
        """Delete the segments wholly before `position`; returns how many."""
        removed = 0
        for segment in self.segments():
            if segment < position[0] and segment != self._segment:
                (self.directory / f"{segment:08d}").unlink(missing_ok=True)
                removed += 1
        return removed

    def replay(self, start: Position) -> Iterator[tuple[Position, Position, bytes]]:
        """Records from `start` in log order, as (start, end, payload), up to the first torn or
        corrupt record, which is logged and counted (the rest of that segment is unreadable)."""
        for segment in self.segments():
            if segment < start[0] or segment >= self._segment:
                continue
            data = (self.directory / f"{segment:08d}").read_bytes()
            at = start[1] if segment == start[0] else 0
            while at < len(data):
                problem = self._bad_record(data, at)
                if problem:
                    self.telemetry.wal_corrupt(WalCorruption.TAIL if segment == self._segment - 1 else WalCorruption.SEGMENT)
                    log.error("write-ahead log segment %08d: %s at byte %d; the %d bytes after it are not replayed",
                              segment, problem, at, len(data) - at)
                    break
                size, _ = _HEAD.unpack_from(data, at)
                end = at + _HEAD.size + size
                yield (segment, at), (segment, end), data[at + _HEAD.size:end]
                at = end

    @staticmethod
    def _bad_record(data: bytes, at: int) -> Optional[str]:
        if at + _HEAD.size > len(data):
            return "torn record header"
        size, crc = _HEAD.unpack_from(data, at)
        if size >= MAX_RECORD or at + _HEAD.size + size > len(data):
            return "torn record"
        if zlib.crc32(data[at + _HEAD.size:at + _HEAD.size + size]) != crc:
            return "checksum mismatch"
        return None

    def close(self) -> None:
        with self._cond:
            while self._syncing:
                self._cond.wait()
            try:
                os.fdatasync(self._file.fileno())
            finally:
                self._file.close()
