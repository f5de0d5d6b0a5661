"""A decoded batch as bytes for the write-ahead log, and back.

Codes are process-local, so a record carries its own string table: the distinct strings its rows
use, once each, and the rows refer to them by position. Replaying a record interns them again.
Layout (little-endian): version u8, counts (rows, label entries, strings, sources) u32 x 4, string
lengths u32[], string bytes, then the columns as raw arrays.
"""

from __future__ import annotations

import struct

import numpy as np

from otelgpu.core.grouping import first_seen
from otelgpu.receiver.decode import PointBatch
from otelgpu.receiver.interner import Interner

VERSION = 1
_HEAD = struct.Struct("<BIIII")


class RecordError(ValueError):
    """Bytes that are not a batch record this version can read."""


def encode_batch(batch: PointBatch, strings: Interner) -> bytes:
    columns = (batch.attr_key, batch.attr_val, batch.resource_node, batch.resource_pod)
    codes, local = first_seen(np.concatenate(columns))  # the codes the rows use, each once; where each row's is
    key, val, node, pod = np.split(local, np.cumsum([len(c) for c in columns[:-1]]))
    lengths, blob = _string_table(list(map(strings.strings().__getitem__, codes.tolist())) + list(batch.sources))
    parts = [
        _HEAD.pack(VERSION, len(batch), len(batch.attr_key), len(codes), len(batch.sources)),
        lengths, blob,
        batch.metric.astype("<i2").tobytes(), batch.time_ns.astype("<i8").tobytes(),
        batch.value.astype("<f8").tobytes(), batch.stale.astype(np.uint8).tobytes(),
        node.astype("<i4").tobytes(), pod.astype("<i4").tobytes(), np.diff(batch.attr_off).astype("<u4").tobytes(),
        key.astype("<i4").tobytes(), val.astype("<i4").tobytes(),
        np.array(list(batch.sources.values()), dtype="<i8").tobytes(),
    ]
    return b"".join(parts)


def _string_table(text: list[str]) -> tuple[bytes, bytes]:
    """The strings' UTF-8 lengths (u32 each) and their bytes end to end: encoded at once where
    every one is ASCII (the lengths are then their lengths in characters), else one by one."""
    blob = "".join(text).encode()
    lengths = np.fromiter(map(len, text), "<u4", len(text))
    if len(blob) != int(lengths.sum()):  # some character takes more than a byte
        encoded = [t.encode() for t in text]
        blob, lengths = b"".join(encoded), np.fromiter(map(len, encoded), "<u4", len(encoded))
    return lengths.tobytes(), blob


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = memoryview(data), 0

    def take(self, n_bytes: int) -> memoryview:
        if self.at + n_bytes > len(self.data):
            raise RecordError("record is shorter than its counts say")
        out = self.data[self.at:self.at + n_bytes]
        self.at += n_bytes
        return out

    def array(self, dtype: str, count: int) -> np.ndarray:
        size = np.dtype(dtype).itemsize
        return np.frombuffer(self.take(size * count), dtype=dtype).copy()


def decode_batch(data: bytes, strings: Interner) -> PointBatch:
    """The batch a record holds, its strings interned in `strings`. RecordError if malformed."""
    reader = _Reader(data)
    version, n_point, na, ns, nsrc = _HEAD.unpack(reader.take(_HEAD.size))
    if version != VERSION:
        raise RecordError(f"record version {version}, this otelgpu reads {VERSION}")
    lengths = reader.array("<u4", ns + nsrc)
    blob = bytes(reader.take(int(lengths.sum())))
    bounds = [0] + np.cumsum(lengths.astype(np.int64)).tolist()
    try:
        text = [blob[a:b].decode() for a, b in zip(bounds, bounds[1:])]
    except UnicodeDecodeError as exc:
        raise RecordError(f"string table is not UTF-8: {exc}") from None
    codes = np.array([strings.code(s) for s in text[:ns]] + [-1], dtype=np.int32)  # [-1]: local -1 -> -1

    def codes_of(col: np.ndarray) -> np.ndarray:
        if len(col) and (col.min() < -1 or col.max() >= ns):
            raise RecordError("label reference outside the string table")
        return codes[col]

    metric, time_ns, value = reader.array("<i2", n_point), reader.array("<i8", n_point), reader.array("<f8", n_point)
    stale = reader.array("u1", n_point).astype(bool)
    node, pod = codes_of(reader.array("<i4", n_point)), codes_of(reader.array("<i4", n_point))
    counts = reader.array("<u4", n_point).astype(np.int64)
    off = np.concatenate([np.zeros(1, np.int64), np.cumsum(counts)])
    if off[-1] != na:
        raise RecordError("label counts do not add up")
    key, val = codes_of(reader.array("<i4", na)), codes_of(reader.array("<i4", na))
    newest = reader.array("<i8", nsrc)
    if reader.at != len(reader.data):
        raise RecordError("trailing bytes after the record")
    return PointBatch(metric, time_ns, value, stale, node, pod, off, key, val,
                      sources=dict(zip(text[ns:], newest.tolist())))


def warm_up() -> str:
    """Compile (or load from numba's cache) the records' kernel; returns how (otelgpu.core.jit.how_loaded)."""
    from otelgpu.core.jit import how_loaded

    first_seen(np.zeros(1, np.int32))
    return how_loaded(first_seen)
