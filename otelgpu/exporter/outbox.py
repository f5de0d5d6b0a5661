"""An exporter's persisted queue: one directory, one file per snapshot, like the Collector's
persistent sending queue.

`<end_ns, 20 digits>.snap` holds a snapshot (`snapshot.py`'s format), so the lexical order of the
names is the interval order; `<end_ns>.progress` how much of it the receiver already accepted;
`attrs.log` the attribute sets the snapshots refer to, each once (`attrtable.py`).
Once written, a snapshot's columns need not stay in memory: `write` returns what to keep of it
(`OnDisk`: its tables and each point's attribute set) and `read_back` gives its points again.
Every write goes to a temporary file, is fsynced, renamed into place, and the directory is fsynced,
so a crash leaves the old file or the new one, never a mix. A file that cannot be read at start is
renamed aside (`<name>.rejected`), logged and counted; the start goes on without it."""

from __future__ import annotations

import logging
import os
import re
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from otelgpu.errors import ConfigError
from otelgpu.exporter.attrtable import AttrTable
from otelgpu.core.attrs import Attrs
from otelgpu.core.files import sync_directory, write_whole
from otelgpu.exporter.columns import Points
from otelgpu.exporter.snapshot import SnapshotFormatError, decode, encode_parts, read_columns
from otelgpu.exporter.store import Point
from otelgpu.telemetry import ExporterTelemetry, OutboxError, SelfMetrics

log = logging.getLogger(__name__)

_SNAP = re.compile(r"^(\d{20})\.snap$")
_PROGRESS = struct.Struct("<8sQI")  # magic, items accepted, CRC32 of the two before
_PROGRESS_MAGIC = b"OGPUPROG"


@dataclass(frozen=True)
class Recovered:
    end_ns: int
    points: list[Point]
    done: int  # items of it the receiver had accepted (Progress.done)
    absorbed: tuple[int, ...] = ()


@dataclass(frozen=True)
class OnDisk:
    """What a queue keeps in memory of a snapshot its outbox holds: the tables and each point's
    attribute set (the file has the set's id in the attribute log); `Outbox.read_back` gives the
    points again. At 100,000 GPUs a snapshot's columns are some 60 MiB, its `aset` 8."""

    metrics: tuple[str, ...]
    attrs: Sequence[Attrs]
    aset: np.ndarray

    @classmethod
    def of(cls, points: Points) -> OnDisk:
        return cls(points.metrics, points.attrs, points.aset)

    def __len__(self) -> int:
        return len(self.aset)


class Outbox:
    def __init__(self, directory: str | Path, exporter: str, metrics: SelfMetrics) -> None:
        self.directory = Path(directory)
        self.exporter = exporter
        self.telemetry = ExporterTelemetry(metrics, exporter)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError([f"{exporter} export queue directory {str(self.directory)!r} is not usable: "
                               f"{exc}"]) from None
        self._table = AttrTable(self.directory / "attrs.log")
        self._uses: dict[int, np.ndarray] = {}  # snapshot on disk -> the attribute set ids it uses
        self._newest: np.ndarray = np.zeros(0, np.uint32)  # those of the newest one written
        self._lock = threading.Lock()  # written from the pipeline, deleted from the sending thread

    def path(self, end_ns: int, suffix: str = ".snap") -> Path:
        return self.directory / f"{end_ns:020d}{suffix}"

    def write(self, end_ns: int, points: Sequence[Point], absorbed: Sequence[int] = ()) -> OnDisk:
        """Persist a snapshot (replacing one of the same end); raises OSError when it cannot.
        `absorbed`: the ends of snapshots merged into it, whose files are deleted after this write;
        should the process die in between, recover() deletes them instead of sending them again.
        Returns what to keep in memory to read its points back."""
        columns = Points.of(points)
        used = columns.used_sets()
        with self._lock:
            ids = self._table.ids(columns.attrs, used)  # in the log before the file
            set_ids = np.zeros(len(columns.attrs), np.uint32)
            set_ids[used] = ids
            self._write(self.path(end_ns), encode_parts(columns, end_ns, absorbed, set_ids))
            self._uses[end_ns] = self._newest = ids
            self._compact()
        return OnDisk.of(columns)

    def read_back(self, end_ns: int, kept: OnDisk) -> Points:
        """The points of the snapshot ending `end_ns` that `write` (or `recover`) left `kept`:
        its columns read from its file, checked against the checksum. Raises OSError or
        SnapshotFormatError when the file is gone, unreadable or not that snapshot
        (`set_aside` it)."""
        columns = read_columns(self.path(end_ns), end_ns, kept.metrics, len(kept), sets=False)
        columns[1] = kept.aset  # the file's ids are only checked: the queue kept each point's set
        return Points(kept.metrics, kept.attrs, *columns)

    def set_aside(self, end_ns: int, exc: Exception) -> None:
        """A snapshot whose file did not read back: renamed aside (if it is there), logged and
        counted as `corrupt`."""
        self._reject(end_ns, OutboxError.CORRUPT, f"did not read back: {exc}")

    def _compact(self) -> None:
        """Rewrite the attribute log with only what the snapshots on disk and the next ones use;
        a failure is logged and counted (the log only stays larger)."""
        try:
            if self._table.compact(np.concatenate([self._newest, *self._uses.values()])):  # as ids: no int each
                self._sync_directory()
        except OSError as exc:
            self._error(OutboxError.WRITE, f"attribute log {self._table.path} not compacted: {exc}")

    def save_progress(self, end_ns: int, done: int) -> None:
        body = _PROGRESS_MAGIC + struct.pack("<Q", done)
        self._write(self.path(end_ns, ".progress"), [_PROGRESS.pack(_PROGRESS_MAGIC, done, zlib.crc32(body))])

    def delete(self, end_ns: int) -> None:
        """Remove a snapshot and its progress. A failure is logged and counted: the file comes back
        at the next start and is sent again, which repeats points but loses none."""
        try:
            # The snapshot first: a progress left behind is cleaned up at the next start, while a
            # snapshot without its progress would be sent from its start again.
            for suffix in (".snap", ".progress"):
                self.path(end_ns, suffix).unlink(missing_ok=True)
            self._sync_directory()
            with self._lock:
                self._uses.pop(end_ns, None)
        except OSError as exc:
            self._error(OutboxError.DELETE, f"could not delete {self.path(end_ns)}: {exc}")

    def recover(self, committed_ns: int) -> tuple[list[Recovered], int]:
        """The readable snapshots ending at or before `committed_ns`, oldest first, and the number
        of newer ones deleted: they were staged by a run that died before committing them."""
        found: list[Recovered] = []
        uncommitted = 0
        try:
            entries = sorted(os.listdir(self.directory))
            sets, cut = self._table.load()
        except OSError as exc:
            self._error(OutboxError.READ, f"{self.directory} is unreadable, nothing recovered: {exc}")
            return found, uncommitted
        if cut:
            self._error(OutboxError.ATTRIBUTE_LOG_CUT, f"attribute log {self._table.path}: {cut} bytes after its last "
                        "whole record removed (a write cut short)")
        for entry in entries:
            match = _SNAP.match(entry)
            if entry.endswith(".tmp"):  # a write cut short: the file it was to replace is intact
                self._unlink(self.directory / entry)
            elif match and int(match[1]) > committed_ns:
                self.delete(int(match[1]))
                uncommitted += 1
            elif match:
                recovered = self._read(int(match[1]), sets)
                if recovered is not None:
                    found.append(recovered)
        for entry in entries:  # progress whose snapshot is gone
            if entry.endswith(".progress") and not (self.directory / entry).with_suffix(".snap").exists():
                self._unlink(self.directory / entry)
        # A merge cut short: its older snapshot still here, though the merged one holds it already.
        # Sent again, its older samples would be refused by Prometheus as out of order.
        merged = {end for r in found for end in r.absorbed}
        for r in found:
            if r.end_ns in merged:
                self.delete(r.end_ns)
        return [r for r in found if r.end_ns not in merged], uncommitted

    def _read(self, end_ns: int, sets: dict[int, Attrs]) -> Recovered | None:
        path = self.path(end_ns)
        try:
            snapshot = decode(path.read_bytes(), sets)
            if snapshot.end_ns != end_ns:
                raise SnapshotFormatError(OutboxError.CORRUPT, f"holds the snapshot ending {snapshot.end_ns}, not {end_ns}")
        except (OSError, ValueError) as exc:  # SnapshotFormatError, or anything else unreadable
            reason = exc.reason if isinstance(exc, SnapshotFormatError) else OutboxError.CORRUPT
            self._reject(end_ns, reason, str(exc))
            return None
        points = snapshot.points
        with self._lock:  # a file of format 1 holds its sets itself: none of them is in the log
            self._uses[end_ns] = self._table.known(points.attrs[i] for i in np.unique(points.aset).tolist())
        return Recovered(end_ns, points, self._read_progress(end_ns), snapshot.absorbed)

    def _read_progress(self, end_ns: int) -> int:
        path = self.path(end_ns, ".progress")
        try:
            magic, done, crc = _PROGRESS.unpack(path.read_bytes())
        except FileNotFoundError:
            return 0
        except (OSError, struct.error):
            magic, done, crc = b"", 0, -1
        if magic != _PROGRESS_MAGIC or crc != zlib.crc32(magic + struct.pack("<Q", done)):
            # Sent again from its start: Prometheus may refuse the repeat as out of order (counted),
            # the next snapshot carries the same series again.
            self._error(OutboxError.CORRUPT_PROGRESS, f"{path} is unreadable; its snapshot is sent from the start")
            return 0
        return done

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            self._error(OutboxError.DELETE, f"could not delete {path}: {exc}")

    def _reject(self, end_ns: int, reason: OutboxError, message: str) -> None:
        path = self.path(end_ns)
        aside = path.with_name(path.name + ".rejected")
        try:
            os.replace(path, aside)
            self.path(end_ns, ".progress").unlink(missing_ok=True)
            where = f"moved to {aside}"
        except OSError as exc:
            where = f"could not be moved aside ({exc})"
        self._error(reason, f"snapshot {path} not sent ({reason}): {message}; {where}")

    def _error(self, reason: OutboxError, message: str) -> None:
        self.telemetry.outbox_error(reason)
        log.error("%s export queue: %s", self.exporter, message)

    def _write(self, path: Path, pieces: list[bytes | memoryview]) -> None:
        write_whole(path, pieces)

    def _sync_directory(self) -> None:
        sync_directory(self.directory)  # an unlink itself must survive a power loss
