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
import os
import struct
import sys
import zlib
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from otelgpu.core.attrs import Attrs, pair
from otelgpu.core.files import write_whole

_RECORD = struct.Struct("<III")  # id, payload bytes, CRC32 of id, length and payload
COMPACT_FROM = 4096  # sets: below this a log is never rewritten


def _record(number: int, attrs: Attrs) -> bytes:
    payload = json.dumps(attrs, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
    head = struct.pack("<II", number, len(payload))
    return _RECORD.pack(number, len(payload), zlib.crc32(payload, zlib.crc32(head))) + payload


def _parse(data: bytes) -> tuple[dict[int, Attrs], int]:
    """The sets of a log's bytes and the length of its undamaged part."""
    sets: dict[int, Attrs] = {}
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
    return sets, at


class AttrTable:
    """Not thread-safe: the outbox serialises its calls."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._ids: dict[Attrs, int] = {}
        self._next = 0
        self._size = 0  # bytes of the log known good: appends go after them
        self._loaded = False
        self._adopt = False  # the next `ids` keys the sets it meets by the caller's tuples

    def __len__(self) -> int:
        return len(self._ids)

    def load(self) -> tuple[dict[int, Attrs], int]:
        """Read the log (at start; `ids` does if nothing did): its sets by id, and how many damaged bytes
        were cut from its end. Raises OSError when it cannot be read or cut."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        sets, good = _parse(data)
        if good < len(data):
            os.truncate(self.path, good)
        self._ids = {attrs: i for i, attrs in sets.items()}
        self._next = max(sets, default=-1) + 1
        self._size = good
        self._loaded = self._adopt = True
        return sets, len(data) - good

    def ids(self, sets: Sequence[Attrs]) -> np.ndarray:
        """Each set's id, the new ones appended and fsynced first. Raises OSError when the log
        cannot be written; the sets stay unknown then, and the next call writes them again."""
        if not self._loaded:
            self.load()  # ids go on after those of an earlier run's log
        out = np.empty(len(sets), np.uint32)
        new: dict[Attrs, int] = {}
        if self._adopt:  # the tuples read from the log, replaced by the live ones equal to them
            self._adopt = False
            for attrs in sets:
                number = self._ids.pop(attrs, None)
                if number is not None:
                    self._ids[attrs] = number
        known = self._ids.get
        for k, attrs in enumerate(sets):
            number = known(attrs)
            if number is None:
                number = new.get(attrs)
                if number is None:
                    number = new[attrs] = self._next + len(new)
            out[k] = number
        if new:
            data = b"".join(_record(i, attrs) for attrs, i in new.items())
            with open(self.path, "ab") as file:
                if file.tell() != self._size:
                    file.truncate(self._size)  # the rest of an append that failed half way
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            self._size += len(data)
            self._next += len(new)
            self._ids.update(new)
        return out

    def known(self, sets: Iterable[Attrs]) -> np.ndarray:
        """The ids of those of these sets the log holds (the others are left out)."""
        ids = [self._ids.get(attrs) for attrs in sets]
        return np.array([i for i in ids if i is not None], np.uint32)

    def compact(self, used: Iterable[int]) -> bool:
        """Rewrite the log with only the sets of these ids, when it holds more than twice as many
        (and more than COMPACT_FROM). Returns whether it did. Raises OSError; the log is unchanged then."""
        keep = set(used)
        if len(self._ids) <= max(COMPACT_FROM, 2 * len(keep)):
            return False
        kept = {attrs: i for attrs, i in self._ids.items() if i in keep}
        data = b"".join(_record(i, attrs) for attrs, i in kept.items())
        write_whole(self.path, [data])
        self._ids, self._size = kept, len(data)
        return True
