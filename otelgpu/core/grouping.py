"""Ids of the distinct rows of a few integer columns: the grouping every stage does on columns
(holders of a GPU, series of a snapshot, pods of a node), with one sort and no Python per row;
`Numbering`, distinct values numbered as they are met (holders, profiles, attribute sets); and
`gather_runs`, runs of an array packed end to end (the decoder's label sets, the store's);
`first_seen`, the distinct codes of a column numbered as met, with no sort and no array the size
of the codes' range (a write-ahead log record's strings)."""

from __future__ import annotations

from typing import Callable, Generic, Hashable, Optional, TypeVar

import numpy as np

from otelgpu.core.jit import kernel

T = TypeVar("T", bound=Hashable)


class Numbering(Generic[T]):
    """Distinct values numbered in the order they were first met: `index(value)` is the number,
    `values[number]` the value. `kept`: the object to keep of a value met first (an equal one
    kept elsewhere already), the value itself by default."""

    def __init__(self, *first: T, kept: Optional[Callable[[T], T]] = None) -> None:
        self.values: list[T] = []
        self._index: dict[T, int] = {}
        self._kept = kept
        for value in first:
            self.index(value)

    def index(self, value: T) -> int:
        found = self._index.get(value)
        if found is None:
            if self._kept is not None:
                value = self._kept(value)
            found = self._index[value] = len(self.values)
            self.values.append(value)
        return found

    def __len__(self) -> int:
        return len(self.values)


def id_type(rows: int) -> type:
    """Numbers below `rows` as 4-byte integers where they fit: the interval's samples at 100,000
    GPUs are a million rows, and a dozen columns of such numbers are held at once in its join."""
    return np.int32 if rows < 2**31 else np.int64


def group_ids(*cols: np.ndarray, dtype: type = np.int64) -> tuple[np.ndarray, np.ndarray]:
    """Ids of the distinct tuples of `cols` (row-wise) and the index of each tuple's first row,
    both as `dtype` (np.int32 where the caller knows the rows fit: no 8-byte copy is made).
    Ids number the tuples in lexicographic order, as `np.unique(..., axis=0)` does
    (`group_ids_reference`): the columns are packed into as few int64 keys as their ranges allow
    and sorted once, instead of sorting rows as records."""
    n_row = len(cols[0])
    if not n_row:
        return np.zeros(0, dtype), np.zeros(0, dtype)
    # Each temporary is let go as soon as it is read: the join of 100,000 GPUs' samples groups
    # millions of rows, and what is held at once is the close's peak.
    keys = _packed(cols)
    order = np.argsort(keys[0]) if len(keys) == 1 else np.lexsort(keys[::-1])
    change = np.zeros(n_row, dtype=bool)
    change[0] = True
    while keys:
        ordered = keys.pop()[order]
        change[1:] |= ordered[1:] != ordered[:-1]
        del ordered
    starts = np.flatnonzero(change)
    ids = np.cumsum(change, dtype=dtype)
    del change
    ids -= 1
    inverse = np.empty(n_row, dtype)
    inverse[order] = ids
    del ids
    return inverse, np.minimum.reduceat(order, starts).astype(dtype, copy=False)


def group_ids_reference(*cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`group_ids` the plain way: numpy's unique rows."""
    if not len(cols[0]):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    keys = np.stack([c.astype(np.int64) for c in cols], axis=1)
    _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    return inverse.reshape(-1).astype(np.int64), first.astype(np.int64)


def _packed(cols: tuple[np.ndarray, ...]) -> list[np.ndarray]:
    """The columns as mixed-radix int64 keys, the first column most significant: comparing the
    keys in order compares the rows lexicographically."""
    keys: list[np.ndarray] = []
    key, room = None, 1
    for column in cols:
        if column.dtype.kind not in "biu" or column.dtype.itemsize == 8:  # as int64 (uint64 wraps)
            column = column.astype(np.int64, copy=False)  # narrower integers are read as they are
        lo, hi = int(column.min()), int(column.max())
        span = hi - lo + 1
        if span >= 1 << 62:  # a column of its own, as it is
            if key is not None:
                keys.append(key)
            keys.append(column)
            key, room = None, 1
            continue
        if key is not None and room * span >= 1 << 62:
            keys.append(key)
            key, room = None, 1
        if key is None:
            key = column.astype(np.int64)  # a copy
            if lo:
                key -= lo
        else:  # in place: no temporary the size of the column
            key *= span
            key += column
            if lo:
                key -= lo
        room *= span
    if key is not None:
        keys.append(key)
    return keys


RUN_SETS = 1 << 12  # runs gathered at once: three arrays of their entries' places (8 bytes each) meanwhile


def gather_runs(values: np.ndarray, starts: np.ndarray, sizes: np.ndarray,
                out: Optional[np.ndarray] = None) -> np.ndarray:
    """The runs values[starts[k]:starts[k] + sizes[k]] end to end (in `out` when given: an array of
    values' type and of their length), RUN_SETS runs at a time."""
    sizes = np.asarray(sizes, np.int64)
    out = np.empty(int(sizes.sum()), values.dtype) if out is None else out
    at = 0
    for lo in range(0, len(sizes), RUN_SETS):
        begin, size = np.asarray(starts[lo:lo + RUN_SETS], np.int64), sizes[lo:lo + RUN_SETS]
        ends = np.cumsum(size)
        taken = int(ends[-1]) if len(ends) else 0
        out[at:at + taken] = values[np.repeat(begin - (ends - size), size) + np.arange(taken, dtype=np.int64)]
        at += taken
    return out


def _first_seen_numpy(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`first_seen` in numpy's operations (one sort): what interpreted kernels run, where a loop
    per value in Python would cost far more."""
    known = values >= 0
    distinct, first, inverse = np.unique(values[known], return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # the distinct values as first met
    rank = np.empty(len(order), np.int32)
    rank[order] = np.arange(len(order), dtype=np.int32)
    place = np.full(len(values), -1, np.int32)
    place[known] = rank[inverse.reshape(-1)]
    return distinct[order], place


@kernel(interpreted=_first_seen_numpy)
def first_seen(values):  # noqa: ANN001, ANN201 - numba
    """(distinct, place): the distinct non-negative values of an integer array in the order first
    met, and each value's place among them (-1 for a negative value). One pass over an
    open-addressing table of at least twice their count: the distinct codes of a batch of some
    30,000 labels among 440,000 strings (100,000 GPUs) without sorting them or zeroing a table
    of every string (`first_seen_reference`)."""
    n = len(values)
    bits = 4
    while (1 << bits) < 2 * n:
        bits += 1
    slots = np.full(1 << bits, -1, np.int64)
    distinct = np.empty(n, values.dtype)
    place = np.empty(n, np.int32)
    count = 0
    for i in range(n):
        v = values[i]
        if v < 0:
            place[i] = -1
            continue
        at = np.int64((np.uint64(v) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(64 - bits))
        while slots[at] >= 0 and distinct[slots[at]] != v:
            at = (at + 1) & ((1 << bits) - 1)
        if slots[at] < 0:
            slots[at] = count
            distinct[count] = v
            count += 1
        place[i] = slots[at]
    return distinct[:count], place


def first_seen_reference(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`first_seen` the plain way: a dict numbering the values as met."""
    numbers: dict[int, int] = {}
    place = np.array([numbers.setdefault(v, len(numbers)) if v >= 0 else -1 for v in values.tolist()], np.int32)
    return np.array(list(numbers), values.dtype), place
