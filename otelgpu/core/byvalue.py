"""Values found by their index's hash: a dict's lookup without a dict (see `ByValue`)."""

from __future__ import annotations

import operator
from array import array
from typing import Callable, Optional, Sequence

import numpy as np


FIND_PIECE = 1 << 15  # values `find_all` probes for at once


class ByValue:
    """The index of each of a list's values, found by the value (`find`): an open-addressing
    table of indices keyed by the values' hashes, in two arrays. A dict took some 60 bytes a value
    (its entry, its slot and an int object for the index: 35 MiB for the 570,000 attribute sets
    of 100,000 GPUs); this takes 12-20. Readable reference: a dict (tests/test_series.py).

    `find` takes no lock: under the interpreter's lock each read of the arrays is whole, a table
    grown anew is filled before it replaces the old one, so a probe that races a `put` misses the
    value being put at worst (a caller that must not miss it looks again under its own lock), and
    a value is only ever found where it is equal."""

    EMPTY, GONE = -1, -2  # a slot never used; one whose value was removed (probes go on past it)

    def __init__(self, values: list, hash_of: Callable[[object], int] = hash, least: int = 1024) -> None:
        self._values = values  # what the indices refer to: a value must stay there while indexed
        self._hash_of = hash_of
        self._least = least  # slots at the least (a power of two)
        self._hashes = array("q")  # [index] the hash of the value indexed there
        self._slots = array("i", [self.EMPTY]) * least
        self._live = self._used = 0  # indices in the table; slots not EMPTY

    def find(self, value: object, hashed: Optional[int] = None) -> int:
        """The index of the value equal to `value`; -1 if none is indexed."""
        hashed = self._hash_of(value) if hashed is None else hashed
        slots, hashes, values, mask = self._slots, self._hashes, self._values, len(self._slots) - 1
        at = hashed & mask
        while (index := slots[at]) != self.EMPTY:
            if index >= 0 and hashes[index] == hashed and values[index] == value:
                return index
            at = (at + 1) & mask
        return -1

    def find_all(self, values: Sequence) -> np.ndarray:
        """`find` of each of `values` (int64, -1 where none is indexed), probing for all of them at
        once: numpy over the slots, and the equality of each hash's match compared in one pass,
        FIND_PIECE values at a time (what a probe builds per value, some 100 bytes, is held for a
        piece only: the store looks up 1.5 million parts at once at 100,000 GPUs). The caller
        keeps the table from changing meanwhile (its lock, or its one thread)."""
        if len(values) <= FIND_PIECE:
            return self._find_piece(values)
        return np.concatenate([self._find_piece(values[at:at + FIND_PIECE])
                               for at in range(0, len(values), FIND_PIECE)])

    def _find_piece(self, values: Sequence) -> np.ndarray:
        hashed = np.fromiter(map(self._hash_of, values), np.int64, len(values))
        slots, hashes = np.frombuffer(self._slots, np.intc), np.frombuffer(self._hashes, np.int64)  # no copies
        out = np.full(len(values), -1, np.int64)
        pending, at = np.arange(len(values)), hashed & (len(slots) - 1)
        while len(pending):
            index = slots[at]
            match = np.flatnonzero(index >= 0)
            match = match[hashes[index[match]] == hashed[pending[match]]]
            equal = np.fromiter(map(operator.eq, [self._values[i] for i in index[match].tolist()],
                                    [values[k] for k in pending[match].tolist()]), bool, len(match))
            out[pending[match[equal]]] = index[match[equal]]
            going = index != self.EMPTY  # past a GONE slot or a value of another: on to the next slot
            going[match[equal]] = False
            pending, at = pending[going], (at[going] + 1) & (len(slots) - 1)
        return out

    def put(self, index: int, hashed: int) -> None:
        """Index `index` (its value not indexed yet), whose value's hash is `hashed`."""
        self.put_all([index], [hashed])

    def put_all(self, indices: Sequence[int], hashed: Sequence[int]) -> None:
        """`put` of each index with its hash: the table grown once for them all."""
        top = max(indices, default=-1)
        if top >= len(self._hashes):
            self._hashes.extend([0] * (top + 1 - len(self._hashes)))
        if 2 * (self._used + len(indices)) > len(self._slots):
            self._rebuild(max(self._least, 1 << (3 * (self._live + len(indices))).bit_length()))
        for index, value_hash in zip(indices, hashed):
            self._hashes[index] = value_hash
            self._place(index, value_hash)

    def remove(self, index: int) -> None:
        """Index `index` no more (it is indexed)."""
        mask = len(self._slots) - 1
        at = self._hashes[index] & mask
        while self._slots[at] != index:
            if self._slots[at] == self.EMPTY:
                raise KeyError(index)
            at = (at + 1) & mask
        self._slots[at] = self.GONE
        self._live -= 1

    def indices(self) -> list[int]:
        """Every index in the table."""
        return [index for index in self._slots if index >= 0]

    def _place(self, index: int, hashed: int, slots: Optional[array] = None) -> None:
        """Put `index` in the first free slot of its probe in `slots` (the table's by default)."""
        slots = self._slots if slots is None else slots
        mask = len(slots) - 1
        at = hashed & mask
        while slots[at] >= 0:
            at = (at + 1) & mask
        self._used += slots[at] == self.EMPTY
        slots[at] = index
        self._live += 1

    def _rebuild(self, size: int) -> None:
        """`size` slots (a power of two), the live indices placed again and no slot GONE. The new
        slots are filled before they replace the old: a `find` meanwhile reads whole tables only."""
        live = self.indices()
        slots = array("i", [self.EMPTY]) * size
        self._live = self._used = 0
        for index in live:
            self._place(index, self._hashes[index], slots)
        self._slots = slots
