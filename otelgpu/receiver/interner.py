"""String interning: label keys and values become small integer codes once, at decode time.

The table is compacted once it has grown well past what is in use (pods, label values and nodes
that are gone): the single consumer of decoded batches keeps only the codes that queued batches
and open intervals still hold, renumbers them and rewrites those arrays (`compact`, run by
`Ingest.compact_strings`, the table's one owner). `epoch`
counts compactions, so a batch decoded across one is recognised and decoded again."""

from __future__ import annotations

import threading
from typing import ClassVar, Protocol

import numpy as np

from otelgpu.core.byvalue import ByValue


class HoldsCodes(Protocol):
    """What keeps arrays of codes beyond a batch (the open intervals): a compaction rewrites them."""

    def codes(self) -> list[np.ndarray]: ...

    def remap(self, table: np.ndarray) -> None: ...


class Coded:
    """Columns of interned codes (named in `CODES`) that a compaction rewrites."""

    CODES: ClassVar[tuple[str, ...]] = ()

    def codes(self) -> list[np.ndarray]:
        return [getattr(self, name) for name in self.CODES]

    def remap(self, table: np.ndarray) -> None:
        """Rewrite the codes with the table `Interner.compact` returned."""
        for name in self.CODES:
            setattr(self, name, table[getattr(self, name)])


class Interner:
    """A thread-safe table of strings. Code -1 means "absent".

    A string's code is its place in a list, found by the string through an index of the codes
    in two arrays (`ByValue`): a dict of the strings took some 60 bytes a string more (its entry,
    its slot and an int object per code: 27 MiB for the 441,000 strings of 100,000 GPUs)."""

    def __init__(self) -> None:
        self._strings: list[str] = []
        self._codes = ByValue(self._strings)
        self._lock = threading.Lock()
        self.epoch = 0  # compactions so far: codes of different epochs must never meet

    def code(self, text: str) -> int:
        found = self._codes.find(text)
        if found < 0:
            with self._lock:
                found = self._codes.find(text)
                if found < 0:
                    found = len(self._strings)
                    self._strings.append(text)
                    self._codes.put(found, hash(text))
        return found

    def find(self, text: str) -> int:
        """The code of `s` if it is interned, else -1 (never adds)."""
        return self._codes.find(text)

    def string(self, code: int) -> str:
        return self._strings[code] if code >= 0 else ""

    def strings(self) -> list[str]:
        return self._strings

    def texts(self, codes: np.ndarray) -> np.ndarray:
        """The strings of `codes` as an array of objects, code -1 reading "": each distinct code
        looked up once (no copy of the whole table: at 100,000 GPUs an array of it took some 20 MiB)."""
        distinct, inverse = np.unique(codes, return_inverse=True)
        text = np.empty(len(distinct), dtype=object)
        text[:] = [self.string(c) for c in distinct.tolist()]
        return text[inverse.reshape(-1)]

    def compact(self, used: np.ndarray) -> np.ndarray:
        """Keep only the strings whose codes are in `used`, renumbered in their order. Returns the
        remap table: `remap[old]` is the new code of a kept string, -1 for a dropped one, and
        `remap[-1]` is -1, so `remap[codes]` rewrites an array of codes, absent ones included. The
        caller must rewrite every array of codes still in use, and nothing may decode meanwhile
        with the old codes (see Ingest.paused)."""
        with self._lock:
            keep = np.unique(used[used >= 0]) if len(used) else np.zeros(0, np.int64)
            remap = np.full(len(self._strings) + 1, -1, np.int32)
            remap[keep] = np.arange(len(keep), dtype=np.int32)
            strings = [self._strings[i] for i in keep.tolist()]
            codes = ByValue(strings)
            for i, text in enumerate(strings):
                codes.put(i, hash(text))
            self._strings, self._codes = strings, codes
            self.epoch += 1
            return remap

    def __len__(self) -> int:
        return len(self._strings)
