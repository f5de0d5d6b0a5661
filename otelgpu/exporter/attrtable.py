"""The attribute sets an exporter's persisted queue refers to, each written once.

A snapshot file holds, per point, the id of its attribute set; the sets live in `attrs.log` beside
the snapshots. A set is appended the first time a snapshot uses it, and the appends are fsynced
before that snapshot is written, so a snapshot on disk never refers to a set that is not. The
series of a cluster change little from one interval to the next: a snapshot adds the sets of new
pods only, where writing every set into every snapshot would rewrite tens of MiB a minute.

A record: id, payload length and the CRC32 of both and the payload (little-endian u32 each), then
the set as JSON pairs. At start the log is read up to its first damaged record and cut there: a
crash tore that append, and no snapshot refers to what it held (a snapshot referring to a set the
log lost is refused as corrupt, counted and set aside). Once the log holds more than twice the sets
the snapshots on disk use (and a floor), it is rewritten with only those: a new file, fsynced and
renamed over the old one, so a crash leaves one or the other.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys
import zlib
from array import array
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Optional, Sequence

import numpy as np

from otelgpu.core.attrs import Attrs, pair
from otelgpu.core.files import write_whole
from otelgpu.exporter.columns import SetTable

_RECORD = struct.Struct("<III")  # id, payload bytes, CRC32 of id, length and payload
COMPACT_FROM = 4096  # sets: below this a log is never rewritten
_RECORDS_WRITTEN = 4096  # records joined per write


def _record(number: int, attrs: Attrs) -> bytes:
    payload = json.dumps(attrs, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
    head = struct.pack("<II", number, len(payload))
    return _RECORD.pack(number, len(payload), zlib.crc32(payload, zlib.crc32(head))) + payload


def _parse(data: bytes | mmap.mmap) -> tuple[dict[int, Attrs], int, tuple[np.ndarray, np.ndarray]]:
    """The sets of a log's bytes, the length of its undamaged part, and each record's id and
    where it ends in it (in the order of the log: a record starts where the one before ends)."""
    sets: dict[int, Attrs] = {}
    ids, ends = array("I"), array("q")
    at = 0
    while at + _RECORD.size <= len(data):
        number, size, crc = _RECORD.unpack_from(data, at)
        payload = data[at + _RECORD.size:at + _RECORD.size + size]
        if len(payload) != size or crc != zlib.crc32(payload, zlib.crc32(struct.pack("<II", number, size))):
            break
        try:
            pairs = json.loads(payload.decode("utf-8", "surrogatepass"))
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in pairs):
                break
            attrs = tuple(pair((sys.intern(k), sys.intern(v))) for k, v in pairs)  # a key repeats in every set
        except (ValueError, TypeError):
            break
        sets[number] = attrs
        at += _RECORD.size + size
        ids.append(number)
        ends.append(at)
    return sets, at, (np.frombuffer(ids, np.uint32).copy(), np.frombuffer(ends, np.int64).copy())


def _parsed(path: Path) -> tuple[dict[int, Attrs], int, tuple[np.ndarray, np.ndarray], int]:
    """`_parse` of the log at `path` (none: empty) and its size, read through a mapping of the file:
    its pages are the page cache's, where a copy of the log (some 350 MB at 100,000 GPUs) would
    be the process's own memory at a start."""
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if not size:
                return (*_parse(b""), 0)
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return (*_parse(data), size)
    except FileNotFoundError:
        return (*_parse(b""), 0)


class AttrTable:
    """The log's sets by id, found by the serial of a store's set (`SetTable`) or by value.

    A set of the store is found by its serial (two sorted arrays): no tuple is kept for it. A set
    given as a tuple (a gauge's, a snapshot read back from disk) is found by value, and so is a
    set of the log read at start until a store's set of equal value names it by its serial. A
    compaction copies the records it keeps from the log as they are (each id's place in it is
    kept), so nothing needs a set's tuple to rewrite it. Not thread-safe: the outbox serialises
    its calls."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._ids: dict[Attrs, int] = {}
        self._serials = np.zeros(0, np.int64)  # the store's sets' serials, ascending
        self._serial_ids = np.zeros(0, np.uint32)  # the id of each
        # each record in the log, in its order: its set's id, and where it ends (it starts where
        # the one before ends): 12 bytes a record, some 7 MiB at 100,000 GPUs
        self._record_ids, self._ends = np.zeros(0, np.uint32), np.zeros(0, np.int64)
        self._next = 0
        self._size = 0  # bytes of the log known good: appends go after them
        self._loaded = False
        self._adopt = False  # the next `ids` keys the sets it meets by the caller's tuples

    def __len__(self) -> int:
        return len(self._ends)

    def load(self) -> tuple[dict[int, Attrs], int]:
        """Read the log (at start; `ids` does if nothing did): its sets by id, and how many damaged bytes
        were cut from its end. Raises OSError when it cannot be read or cut."""
        sets, good, (record_ids, ends), size = _parsed(self.path)
        if good < size:
            os.truncate(self.path, good)
        self._ids = {attrs: i for i, attrs in sets.items()}
        self._serials, self._serial_ids = np.zeros(0, np.int64), np.zeros(0, np.uint32)
        self._record_ids, self._ends = record_ids, ends
        self._next = max(sets, default=-1) + 1
        self._size = good
        self._loaded = self._adopt = True
        return sets, size - good

    def ids(self, sets: Sequence[Attrs], used: Optional[np.ndarray] = None) -> np.ndarray:
        """The id of each of `sets` (of those at `used`, when given), the new ones appended and
        fsynced first. Raises OSError when the log cannot be written; the sets stay unknown then,
        and the next call writes them again."""
        if not self._loaded:
            self.load()  # ids go on after those of an earlier run's log
        used = np.arange(len(sets)) if used is None else np.asarray(used, np.int64)
        out = np.empty(len(used), np.uint32)
        coded = used < len(sets.codes) if isinstance(sets, SetTable) else np.zeros(len(used), bool)
        fresh: list[int] = []  # where in `sets` each set new to the log is, in the order of their ids
        named, matched = self._coded_ids(sets, used, np.flatnonzero(coded), out, fresh)
        plain = self._plain_ids(sets, used, np.flatnonzero(~coded), out, fresh, named)
        self._append(sets, fresh)
        self._name(named)
        for attrs in matched:
            self._ids.pop(attrs, None)
        self._ids.update(plain)
        return out

    def _coded_ids(self, sets: SetTable, used: np.ndarray, at: np.ndarray, out: np.ndarray,
                   fresh: list[int]) -> tuple[dict[int, int], list[Attrs]]:
        """Into `out[at]`, the ids of these store sets: by serial, else by value (a set of the log
        read at start, or a gauge's of equal value), else new (`fresh`). Returns the serials newly
        named (serial -> id) and the sets found by value (no longer to be kept by it)."""
        serials = sets.serials[used[at]] if len(at) else np.zeros(0, np.int64)
        found = self._by_serial(serials)
        out[at[found >= 0]] = found[found >= 0]
        named: dict[int, int] = {}
        matched = []
        for k, serial in zip(at[found < 0].tolist(), serials[found < 0].tolist()):
            attrs = sets[int(used[k])]  # built to be looked up, and let go
            number = self._ids.get(attrs)
            if number is None:
                number = self._fresh(fresh, int(used[k]))
            else:
                matched.append(attrs)
            out[k] = named[serial] = number
        return named, matched

    def _plain_ids(self, sets: Sequence[Attrs], used: np.ndarray, at: np.ndarray, out: np.ndarray,
                   fresh: list[int], named: dict[int, int]) -> dict[Attrs, int]:
        """Into `out[at]`, the ids of these sets given as tuples: by value, else by the serial of
        the store's set of equal value, else new (`fresh`). Returns them by value."""
        self._adopt_tuples(sets, used[at])
        serial_of = sets.serial_of if isinstance(sets, SetTable) else None
        plain: dict[Attrs, int] = {}
        for k in at.tolist():
            attrs = sets[int(used[k])]
            number = plain.get(attrs, self._ids.get(attrs))
            if number is None and serial_of is not None:  # a gauge's set that the store has for a sum
                number = self._serial_id(serial_of(attrs), named)
            if number is None:
                number = self._fresh(fresh, int(used[k]))
            out[k] = plain[attrs] = number
        return plain

    def _fresh(self, fresh: list[int], index: int) -> int:
        """The id the set at `index` gets, new to the log: appended with this call's others."""
        fresh.append(index)
        return self._next + len(fresh) - 1

    def _adopt_tuples(self, sets: Sequence[Attrs], plain: np.ndarray) -> None:
        """Once after a load: the log's tuples equal to these plain sets are replaced by them."""
        if self._adopt:
            self._adopt = False
            for i in plain.tolist():
                attrs = sets[i]
                number = self._ids.pop(attrs, None)
                if number is not None:
                    self._ids[attrs] = number

    def _serial_id(self, serial: int, named: dict[int, int]) -> Optional[int]:
        """The id of the store's set of this serial (named so in this call or before), None if none."""
        if serial < 0:
            return None
        number = named.get(serial)
        if number is None:
            found = int(self._by_serial(np.array([serial], np.int64))[0])
            number = found if found >= 0 else None
        return number

    def _by_serial(self, serials: np.ndarray) -> np.ndarray:
        """The id of each serial, -1 for one not named yet."""
        if not len(self._serials):
            return np.full(len(serials), -1, np.int64)
        at = np.minimum(np.searchsorted(self._serials, serials), len(self._serials) - 1)
        return np.where(self._serials[at] == serials, self._serial_ids[at].astype(np.int64), -1)

    def _name(self, named: dict[int, int]) -> None:
        """The store's sets of these serials have these ids from now on."""
        if named:
            serials = np.concatenate([self._serials, np.fromiter(named, np.int64, len(named))])
            ids = np.concatenate([self._serial_ids, np.fromiter(named.values(), np.uint32, len(named))])
            order = np.argsort(serials, kind="stable")
            self._serials, self._serial_ids = serials[order], ids[order]

    def _append(self, sets: Sequence[Attrs], fresh: list[int]) -> None:
        """Append the records of these sets (their ids follow the log's last), a few MiB written at
        a time, and fsync them. Raises OSError; nothing is known of them then."""
        if not fresh:
            return
        lengths = np.empty(len(fresh), np.int64)
        with open(self.path, "ab") as file:
            if file.tell() != self._size:
                file.truncate(self._size)  # the rest of an append that failed half way
            chunk: list[bytes] = []
            for k, index in enumerate(fresh):
                chunk.append(_record(self._next + k, sets[index]))
                lengths[k] = len(chunk[-1])
                if len(chunk) == _RECORDS_WRITTEN:
                    file.write(b"".join(chunk))
                    chunk.clear()
            file.write(b"".join(chunk))
            file.flush()
            os.fsync(file.fileno())
        self._record_ids = np.concatenate([self._record_ids, np.arange(self._next, self._next + len(fresh),
                                                                       dtype=np.uint32)])
        self._ends = np.concatenate([self._ends, self._size + np.cumsum(lengths)])
        self._size += int(lengths.sum())
        self._next += len(fresh)

    def known(self, sets: Iterable[Attrs]) -> np.ndarray:
        """The ids of those of these sets the log holds (the others are left out)."""
        ids = [self._ids.get(attrs) for attrs in sets]
        return np.array([i for i in ids if i is not None], np.uint32)

    def compact(self, used: Sequence[int] | np.ndarray) -> bool:
        """Rewrite the log with only the sets of these ids, when it holds more than twice as many
        (and more than COMPACT_FROM): their records copied as they are. Returns whether it did.
        Raises OSError; the log is unchanged then. (The outbox hands its snapshots' ids as one
        array: as a list, at 100,000 GPUs some 20 MiB of Python ints a snapshot, at each write.)"""
        keep = np.unique(np.asarray(used, np.int64))
        if len(self._ends) <= max(COMPACT_FROM, 2 * len(keep)):
            return False
        kept = np.isin(self._record_ids, keep)
        starts = np.concatenate([np.zeros(1, np.int64), self._ends[:-1]])[kept]
        lengths = self._ends[kept] - starts
        with open(self.path, "rb") as file:
            write_whole(self.path, _copied(file, starts, lengths))
        self._record_ids, self._ends = self._record_ids[kept], np.cumsum(lengths)
        self._size = int(lengths.sum())
        kept_ids = set(keep.tolist())
        self._ids = {attrs: i for attrs, i in self._ids.items() if i in kept_ids}
        named = np.isin(self._serial_ids, keep)
        self._serials, self._serial_ids = self._serials[named], self._serial_ids[named]
        return True


def _copied(file: BinaryIO, starts: np.ndarray, lengths: np.ndarray, chunk: int = 1 << 22) -> Iterator[bytes]:
    """The bytes of these spans of `file`, in their order, read a few MiB at a time: adjacent
    spans are read as one."""
    at, size = -1, 0
    for offset, length in zip(starts.tolist(), lengths.tolist()):
        if offset == at + size and size + length <= chunk:
            size += length
            continue
        if size:
            file.seek(at)
            yield file.read(size)
        at, size = offset, length
    if size:
        file.seek(at)
        yield file.read(size)
