"""One interval's snapshot of the cost series: merged when a queue is full, and encoded as a
compact binary file for the persisted queue. `merge` here works on points grouped by series, the
readable reference of `columns.merge`, which the queues use.

The file: a fixed header (magic, format version, table length, point count), a JSON table with the
snapshot's end time, the ends of the snapshots merged into it and its metric keys, then six
little-endian columns (metric index, attribute set, start_ns, time_ns, value, ended) and a CRC32 of
everything before it. Format 2 gives each point's attribute set as an id in the queue's attribute
log (`attrtable.py`), where each set is written once; format 1, still read, lists the snapshot's
distinct sets in the table and indexes them. Values keep their exact bits (NaN of an ended point
included), points their order, so a decoded snapshot is the one that was written."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any, Iterator, Mapping, NamedTuple, Optional, Sequence

import numpy as np

from otelgpu.core.attrs import Attrs
from otelgpu.exporter.columns import Point, Points
from otelgpu.telemetry import OutboxError

Key = tuple[str, Attrs]
Snapshot = dict[Key, list[Point]]  # points of each series, in time order

MAGIC = b"OGPUSNAP"
VERSION = 2  # written; 1 is read too
_HEADER = struct.Struct("<8sHHIQ")  # magic, version, reserved, table bytes, points
_CRC = struct.Struct("<I")
_COLUMNS = (np.dtype("<u2"), np.dtype("<u4"), np.dtype("<i8"), np.dtype("<i8"), np.dtype("<f8"), np.dtype("u1"))
_POINT_BYTES = sum(d.itemsize for d in _COLUMNS)


def snapshot_of(points: Sequence[Point]) -> Snapshot:
    out: Snapshot = {}
    for p in points:
        out.setdefault((p.metric, p.attrs), []).append(p)
    return out


def merge(older: Snapshot, newer: Snapshot) -> Snapshot:
    """Two snapshots as one, losing no money: a series' cumulative value superseded by a later
    value of the same series (same start time) is dropped; ended points, and the last value before
    each of them, are kept, as is a series that only the older snapshot has."""
    out: Snapshot = dict(older)
    for key, points in newer.items():
        chain = out.get(key, []) + points
        out[key] = [p for i, p in enumerate(chain)
                    if p.ended or i + 1 == len(chain) or chain[i + 1].ended or chain[i + 1].start_ns != p.start_ns]
    return out


def flatten(snapshot: Snapshot) -> list[Point]:
    return [p for points in snapshot.values() for p in points]


class SnapshotFormatError(ValueError):
    """Bytes that are not a snapshot this version can read; `reason` is `corrupt` or `incompatible`."""

    def __init__(self, reason: OutboxError, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class SnapshotFile(NamedTuple):
    end_ns: int
    points: Points
    absorbed: tuple[int, ...]  # ends of the snapshots merged into this one: their files are redundant


def encode(points: Sequence[Point], end_ns: int, absorbed: Sequence[int] = (),
           set_ids: Optional[np.ndarray] = None) -> bytes:
    """Format 2 with `set_ids` (per entry of the points' attribute table, its id in the queue's
    attribute log), else format 1, which carries the sets itself."""
    return b"".join(encode_parts(points, end_ns, absorbed, set_ids))


def encode_parts(points: Sequence[Point], end_ns: int, absorbed: Sequence[int] = (),
                 set_ids: Optional[np.ndarray] = None) -> Iterator[bytes | memoryview]:
    """`encode`'s bytes in pieces, made as they are read and the checksum last: each column a
    run of points at a time (`PIECE_POINTS`), as views of the points' own arrays where their
    type is the file's, the attribute sets mapped to the log's ids run by run. Written piece by
    piece, a snapshot is not copied whole (at 100,000 GPUs some 60 MiB, which joining the pieces
    and appending the checksum held three times at once), nor is its column of log ids built
    whole (8 MiB, while the snapshot is staged)."""
    packed = Points.of(points)
    head = {"end_ns": end_ns, "absorbed": list(absorbed), "metrics": list(packed.metrics)}
    if set_ids is not None:
        version, aset_of = 2, np.asarray(set_ids, np.uint32)
    else:
        sets = packed.used_sets()
        aset_of = np.zeros(len(packed.attrs), np.uint32)
        aset_of[sets] = np.arange(len(sets), dtype=np.uint32)
        version = 1
        head["attrs"] = [packed.attrs[i] for i in sets.tolist()]
    table = json.dumps(head, separators=(",", ":")).encode()
    crc = 0
    for piece in _pieces(packed, version, table, aset_of):
        crc = zlib.crc32(piece, crc)
        yield piece
    yield _CRC.pack(crc)


PIECE_POINTS = 1 << 16  # points of a column in one piece of a snapshot's file


def _pieces(packed: Points, version: int, table: bytes, aset_of: np.ndarray) -> Iterator[bytes | memoryview]:
    """The file's header, table and columns (the attribute sets through `aset_of`), a piece at a time."""
    yield _HEADER.pack(MAGIC, version, 0, len(table), len(packed))
    yield table
    columns = (packed.metric, packed.aset, packed.start_ns, packed.time_ns, packed.value, packed.ended)
    for j, (column, dtype) in enumerate(zip(columns, _COLUMNS)):
        for at in range(0, len(packed), PIECE_POINTS):
            run = column[at:at + PIECE_POINTS]
            yield memoryview(np.ascontiguousarray(aset_of[run] if j == 1 else run, dtype=dtype)).cast("B")


def decode(data: bytes, sets: Optional[Mapping[int, Attrs]] = None) -> SnapshotFile:
    """The snapshot in a file's bytes, a format 2 one with its queue's attribute `sets` by id;
    SnapshotFormatError saying why they are unusable."""
    if len(data) < _HEADER.size + _CRC.size or data[:len(MAGIC)] != MAGIC:
        raise SnapshotFormatError(OutboxError.CORRUPT, "not an otelgpu snapshot (bad header)")
    _, version, _, table_len, n_point = _HEADER.unpack_from(data)
    if version not in (1, 2):
        raise SnapshotFormatError(OutboxError.INCOMPATIBLE,
                                  f"format v{version} is not readable by this otelgpu (reads v1 and v2)")
    if _CRC.unpack_from(data, len(data) - _CRC.size)[0] != zlib.crc32(memoryview(data)[:-_CRC.size]):
        raise SnapshotFormatError(OutboxError.CORRUPT, "checksum mismatch: the file is truncated or altered")
    at = _HEADER.size + table_len
    if at + n_point * _POINT_BYTES + _CRC.size != len(data):
        raise SnapshotFormatError(OutboxError.CORRUPT, f"length {len(data)} does not match {n_point} points")
    end_ns, absorbed, metrics, attrs = _table(data[_HEADER.size:at], version == 1)
    columns = []
    for dtype in _COLUMNS:
        columns.append(np.frombuffer(data, dtype=dtype, count=n_point, offset=at).copy())
        at += n_point * dtype.itemsize
    if version == 2:
        ids, columns[1] = np.unique(columns[1], return_inverse=True)
        columns[1] = columns[1].reshape(-1)
        known = sets or {}
        missing = [i for i in ids.tolist() if i not in known]
        if missing:
            raise SnapshotFormatError(OutboxError.CORRUPT, f"refers to {len(missing)} attribute set(s) not in the queue's "
                                                 f"attribute log (id {missing[0]})")
        attrs = [known[i] for i in ids.tolist()]
    if n_point and (int(columns[0].max()) >= len(metrics) or int(columns[1].max()) >= len(attrs)):
        raise SnapshotFormatError(OutboxError.CORRUPT, "a point refers to a metric or attribute set not in the table")
    return SnapshotFile(end_ns, Points(metrics, attrs, *columns), absorbed)


def read_columns(path: Path, end_ns: int, metrics: Sequence[str], n_point: int,
                 sets: bool = True) -> list[Optional[np.ndarray]]:
    """The columns of the snapshot file at `path`, each read into an array of its own (the file is
    never held whole) and checked against its checksum. SnapshotFormatError when the file is not
    the snapshot ending `end_ns` of `n_point` points of these `metrics`; OSError when it cannot be
    read. The attribute sets' column comes as the file has it: ids that only the queue's attribute
    log (format 2) or the file's table (format 1) resolve; without `sets`, it is only checked (None).
    The time and `ended` columns, read a piece at a time, are one value read as a column
    (`np.broadcast_to`, read-only) when every point has it, as an interval's snapshot does: some
    12 MiB fewer while a snapshot of 100,000 GPUs is sent."""
    with open(path, "rb") as file:
        head = file.read(_HEADER.size)
        if len(head) < _HEADER.size or head[:len(MAGIC)] != MAGIC:
            raise SnapshotFormatError(OutboxError.CORRUPT, "not an otelgpu snapshot (bad header)")
        _, version, _, table_len, points = _HEADER.unpack(head)
        table = file.read(table_len)
        if version not in (1, 2) or len(table) != table_len:
            raise SnapshotFormatError(OutboxError.CORRUPT, f"not a readable snapshot (format v{version}, cut short)")
        written_end, _, written_metrics, _ = _table(table, False)
        if (written_end, tuple(written_metrics), points) != (end_ns, tuple(metrics), n_point):
            raise SnapshotFormatError(OutboxError.CORRUPT, f"holds the snapshot ending {written_end} of {points} "
                                      f"points, not the one ending {end_ns} of {n_point} written there")
        crc = zlib.crc32(table, zlib.crc32(head))
        columns: list[Optional[np.ndarray]] = []
        for at, dtype in enumerate(_COLUMNS):
            if at == 1 and not sets:
                _, crc = _read_pieces(file, dtype, n_point, crc)
                columns.append(None)
            elif at in _OFTEN_ONE and n_point:
                start = file.tell()
                one, crc_after = _read_pieces(file, dtype, n_point, crc)
                if one is None:  # values of their own: read again, whole
                    file.seek(start)
                    column, crc = _whole(file, dtype, n_point, crc)
                else:
                    column, crc = np.broadcast_to(one.astype(bool) if at == _ENDED else one, (n_point,)), crc_after
                columns.append(column)
            else:
                column, crc = _whole(file, dtype, n_point, crc)
                columns.append(column)
        tail = file.read(_CRC.size + 1)
    if len(tail) != _CRC.size or _CRC.unpack(tail)[0] != crc:
        raise SnapshotFormatError(OutboxError.CORRUPT, "checksum mismatch: the file is truncated or altered")
    return columns


_TIME, _ENDED = 3, 5
_OFTEN_ONE = (_TIME, _ENDED)  # the columns every point of an interval's snapshot has one value of
_PIECE = 1 << 20  # bytes of a column read at a time where it is not read whole


def _whole(file: Any, dtype: np.dtype, n_point: int, crc: int) -> tuple[np.ndarray, int]:
    """The column at the file's position, read into an array, and the checksum with it."""
    column = np.empty(n_point, dtype)
    if file.readinto(memoryview(column).cast("B")) != column.nbytes:
        raise SnapshotFormatError(OutboxError.CORRUPT, "cut short")
    return column, zlib.crc32(column, crc)


def _read_pieces(file: Any, dtype: np.dtype, n_point: int, crc: int) -> tuple[Optional[np.ndarray], int]:
    """The column at the file's position read a piece at a time: its value as a 0-d array when
    every point has that one (None otherwise), and the checksum with it."""
    left, one = n_point * dtype.itemsize, None
    same = n_point > 0
    while left:
        piece = file.read(min(left, _PIECE // dtype.itemsize * dtype.itemsize))
        if not piece:
            raise SnapshotFormatError(OutboxError.CORRUPT, "cut short")
        crc, left = zlib.crc32(piece, crc), left - len(piece)
        if same:
            values = np.frombuffer(piece, dtype)
            one = values[:1].copy().reshape(()) if one is None else one
            same = bool((values == one).all())
    return (one if same else None), crc


def _table(raw: bytes, with_attrs: bool) -> tuple[int, tuple[int, ...], list[str], list[Attrs]]:
    try:
        table: Any = json.loads(raw)
        end_ns, absorbed = int(table["end_ns"]), tuple(int(e) for e in table["absorbed"])
        metrics = [str(m) for m in table["metrics"]]
        attrs = [tuple((k, v) for k, v in a) for a in table["attrs"]] if with_attrs else []
    except (ValueError, TypeError, KeyError) as exc:
        raise SnapshotFormatError(OutboxError.CORRUPT, f"bad table: {exc!r}") from None
    if not all(isinstance(k, str) and isinstance(v, str) for a in attrs for k, v in a):
        raise SnapshotFormatError(OutboxError.CORRUPT, "bad table: an attribute is not a pair of strings")
    return end_ns, absorbed, metrics, attrs
