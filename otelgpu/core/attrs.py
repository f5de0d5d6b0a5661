"""A series' attributes as its key: sorted (key, value) pairs, each pair one shared tuple.

Every stage speaks of series this way: enrich tags holdings with them, the cost models key their
sums by them, the store and the exporters write them."""

from __future__ import annotations

from abc import abstractmethod
from typing import Iterator, Mapping, Optional, Sequence, overload

import numpy as np

Attrs = tuple[tuple[str, str], ...]  # sorted (key, value) pairs


class Shared:
    """Each value once, so that what holds equal values holds one object: the value kept equal to
    the one given (that one itself when it is new). Bounded: past `kept` values it starts afresh,
    and values kept before are merely not shared."""

    def __init__(self, kept: int) -> None:
        self._kept = kept
        self._known: dict = {}

    def __call__(self, value):  # noqa: ANN001, ANN204 - any hashable value; the kept one is returned
        return self.by(value, value)

    def by(self, key, value):  # noqa: ANN001, ANN201 - what equal keys name: the first value given for it
        """The value kept under a key equal to `key`; `value`, kept under it, when there is none."""
        known = self._known.get(key)
        if known is None:
            if len(self._known) >= self._kept:
                self._known.clear()
            known = self._known.setdefault(key, value)
        return known


# Each (key, value) pair once: the sets of every series share their pairs instead of holding
# copies (at 10,000 GPUs, some 17,000 distinct pairs where the sets would hold 1.1 million).
pair = Shared(65_536)


def attrs_of(pairs: Mapping[str, str]) -> Attrs:
    """A series' attributes as its key: sorted, empty values dropped."""
    return tuple(sorted(pair(kv) for kv in pairs.items() if kv[1] != ""))


def with_attrs(attrs: Attrs, extra: Mapping[str, str]) -> Attrs:
    """`attrs` with the keys of `extra` added or replaced (`attrs_of({**dict(attrs), **extra})`).
    The pairs `extra` leaves alone are the very tuples of `attrs`."""
    if not extra:
        return attrs
    kept = [kv for kv in attrs if kv[0] not in extra and kv[1] != ""]
    return tuple(sorted(kept + [pair(kv) for kv in extra.items() if kv[1] != ""]))


class BuiltOnRead(Sequence[Attrs]):
    """Attribute sets built only where one is read: a subclass builds set `at` (`_built`, 0 <= at <
    len), this reads them by index, negative ones too, or by slice."""

    __slots__ = ()

    @overload
    def __getitem__(self, at: int) -> Attrs: ...

    @overload
    def __getitem__(self, at: slice) -> list[Attrs]: ...

    def __getitem__(self, at: int | slice) -> Attrs | list[Attrs]:
        if isinstance(at, slice):
            return [self[k] for k in range(*at.indices(len(self)))]
        at = int(at)
        if at < 0:
            at += len(self)
        if not 0 <= at < len(self):
            raise IndexError("attribute set index out of range")
        return self._built(at)

    @abstractmethod
    def _built(self, at: int) -> Attrs:
        """Set `at`, built."""


def _indices(at: np.ndarray, below: int) -> np.ndarray:
    """Indices below `below` in the narrowest type that holds them: an interval's series name
    their extra, one of a few, in a byte (at 100,000 GPUs 2 million series, held from the
    computation ahead to the close)."""
    narrow = next(t for t in (np.uint8, np.uint16, np.int32, np.int64) if below <= np.iinfo(t).max + 1)
    return np.asarray(at).astype(narrow, copy=False)


class Extended(BuiltOnRead):
    """Attribute sets named by their parts: set i is `bases[base[i]]` with the attributes of
    `extras[extra[i]]` added or replaced (`with_attrs`). The cost models name their series this
    way (a holding's set and the attributes a model adds), so no set is built that nothing reads:
    the store finds a series by its parts, and a set is built only when one is read (`[i]`)."""

    def __init__(self, bases: Sequence[Attrs], extras: Sequence[Attrs], base: np.ndarray, extra: np.ndarray) -> None:
        self.bases, self.extras = bases, extras
        self.base, self.extra = _indices(base, len(bases)), _indices(extra, len(extras))

    def __len__(self) -> int:
        return len(self.base)

    def _built(self, at: int) -> Attrs:
        return with_attrs(self.bases[int(self.base[at])], dict(self.extras[int(self.extra[at])]))

    def label(self, key: str) -> Iterator[str]:
        """Each set's value of label `key` ("" where it has none), read from its parts: an
        extra's value replaces its base's (`with_attrs`). Only the bases whose value is read are
        looked into: the cost models' series share the interval's list of every set."""
        extra_values = [dict(attrs).get(key) for attrs in self.extras]  # None: the base's stays
        keeps = np.array([value is None for value in extra_values], bool)
        read = np.unique(self.base[keeps[self.extra]]).tolist()
        base_values = {b: dict(self.bases[b]).get(key, "") for b in read}
        return (base_values[b] if extra_values[e] is None else extra_values[e]
                for b, e in zip(self.base.tolist(), self.extra.tolist()))

    def __iter__(self) -> Iterator[Attrs]:
        bases, extras = self.bases, [dict(e) for e in self.extras]
        return (with_attrs(bases[b], extras[e]) for b, e in zip(self.base.tolist(), self.extra.tolist()))


def named_sets(series: Mapping[Attrs, float]) -> Optional[Extended]:
    """The sets of `series` by their parts, when it names them so (the cost models' `Packed`)."""
    named = getattr(series, "named", None)
    return named() if named is not None else None
