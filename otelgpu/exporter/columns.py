"""One interval's cost points as columns: what the store hands the exporters.

A `Points` is a sequence of `Point` to every reader that iterates or indexes it (the readable
paths, the tests), and six arrays to the fast ones (the snapshot file, the OTLP writer): each
point's metric (an index into `metrics`), attribute set (an index into `attrs`, where each
distinct set appears once: the metrics of a pod share theirs), start and end time, value and
whether it ends its series. No `Point` object exists unless a reader asks for one.

The cost store's snapshots give their attribute sets as a `SetTable`: each set the ids of its
pairs (`SetCodes`: a run of one array each), built as a tuple only where a reader asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Callable, Collection, Iterator, Mapping, Optional, Sequence, overload

import numpy as np

from otelgpu.core.attrs import Attrs, BuiltOnRead
from otelgpu.core.grouping import RUN_SETS, gather_runs, group_ids


def set_of(code: bytes, pairs: Sequence[tuple[str, str]]) -> Attrs:
    """The set whose pair ids `code` holds (uint32 in native order), of `pairs` by id."""
    return tuple(map(pairs.__getitem__, memoryview(code).cast("I")))


def code_of(attrs: Attrs, ids: Mapping[tuple[str, str], int]) -> Optional[bytes]:
    """The ids of a set's pairs (uint32), `ids` giving each pair's; None where a pair has none."""
    try:
        return np.fromiter(map(ids.__getitem__, attrs), np.uint32, len(attrs)).tobytes()
    except KeyError:
        return None


class SetCodes(Sequence[bytes]):
    """Sets as the ids of their pairs (uint32), each a run of one array: set i is
    `ids[start[i]:start[i] + count[i]]`, read as bytes (`[i]`) or many at once (`joined`). Where
    a bytes object each took some 40 bytes besides its ids (22 MiB for the 570,000 sets of
    100,000 GPUs), a set takes 8. What a table refers to is never written again: the store's
    sets (`_AttrSets`) write a new set's ids after the last run and pack the live ones into a
    new array, so every table handed out reads the sets it was given."""

    __slots__ = ("ids", "start", "count")

    def __init__(self, ids: np.ndarray, start: np.ndarray, count: np.ndarray) -> None:
        if len(start) != len(count):
            raise ValueError("a table of sets needs a start and a count per set")
        self.ids, self.start, self.count = ids, start, count

    @classmethod
    def of(cls, codes: Sequence[bytes]) -> SetCodes:
        """The sets of these pair ids (bytes of uint32 each), end to end."""
        count = np.fromiter(map(len, codes), np.int64, len(codes)) // 4
        start = np.zeros(len(codes), np.int64)
        np.cumsum(count[:-1], out=start[1:])
        # joined into a bytearray: a writable array, of the type the OTLP writer's kernel is compiled for
        return cls(np.frombuffer(bytearray().join(codes), np.uint32), start, count.astype(np.int32))

    def __len__(self) -> int:
        return len(self.start)

    def __getitem__(self, at: int) -> bytes:  # type: ignore[override] - sets are read one by one or `joined`
        begin = int(self.start[at])
        return self.ids[begin:begin + int(self.count[at])].tobytes()

    def __iter__(self) -> Iterator[bytes]:
        ids = self.ids
        return (ids[begin:begin + n].tobytes() for begin, n in zip(self.start.tolist(), self.count.tolist()))

    def joined(self, sets: np.ndarray, out: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
        """The pair ids of `sets` end to end (uint32; written into `out` when given), and how
        many each set has."""
        count = self.count[sets].astype(np.int64)
        return gather_runs(self.ids, self.start[sets], count, out), count

    def used_pairs(self, sets: np.ndarray, pairs: int) -> np.ndarray:
        """The ids of the pairs `sets` use, each once, ascending (`pairs`: how many ids there are):
        their ids read RUN_SETS sets at a time, never all at once."""
        present = np.zeros(pairs, bool)
        for lo in range(0, len(sets), RUN_SETS):
            present[self.joined(sets[lo:lo + RUN_SETS])[0]] = True
        return np.flatnonzero(present)


class SetTable(BuiltOnRead):
    """Attribute sets as the cost store keeps them: set i < len(codes) is the pairs whose ids
    `codes[i]` holds (uint32 in native order, into `pairs`), and `serials[i]` is a number no other
    set of the process had (equal serials: equal sets; a set forgotten and met again has a new
    one); the sets after them are `plain` tuples (the gauges'). A set is built only when read
    (`[i]`): the OTLP writer lays points out from the pair ids, the queue's attribute log finds
    sets by serial. `serial_of` (the store's) gives the serial of the store's live set equal to a
    plain one, -1 if none."""

    __slots__ = ("codes", "pairs", "serials", "plain", "serial_of")

    def __init__(self, codes: SetCodes | Sequence[bytes], pairs: list[tuple[str, str]], serials: np.ndarray,
                 plain: Optional[list[Attrs]] = None, serial_of: Optional[Callable[[Attrs], int]] = None) -> None:
        if len(serials) != len(codes):
            raise ValueError("an attribute set table needs a serial per set")
        self.codes = codes if isinstance(codes, SetCodes) else SetCodes.of(codes)
        self.pairs, self.serials = pairs, serials
        self.plain: list[Attrs] = [] if plain is None else plain
        self.serial_of = serial_of

    def __len__(self) -> int:
        return len(self.codes) + len(self.plain)

    def _built(self, at: int) -> Attrs:
        if at >= len(self.codes):
            return self.plain[at - len(self.codes)]
        return set_of(self.codes[at], self.pairs)

    def __iter__(self) -> Iterator[Attrs]:
        pairs = self.pairs
        return chain((set_of(code, pairs) for code in self.codes), self.plain)

    def with_plain(self, more: Sequence[Attrs]) -> SetTable:
        """These sets, then `more` (as plain sets)."""
        return SetTable(self.codes, self.pairs, self.serials, [*self.plain, *more], self.serial_of)

@dataclass(frozen=True)
class Point:
    metric: str  # key into store.cost_metrics()
    attrs: Attrs
    start_ns: int
    time_ns: int
    value: float  # NaN when `ended`
    ended: bool = False  # the series' last point: OTLP flag NO_RECORDED_VALUE, a stale marker after remote write


class Points(Sequence[Point]):
    __slots__ = ("metrics", "attrs", "metric", "aset", "start_ns", "time_ns", "value", "ended")

    def __init__(self, metrics: Sequence[str], attrs: Sequence[Attrs], metric: np.ndarray, aset: np.ndarray,
                 start_ns: np.ndarray, time_ns: np.ndarray, value: np.ndarray, ended: np.ndarray) -> None:
        self.metrics = tuple(metrics)
        self.attrs: Sequence[Attrs] = attrs if isinstance(attrs, (list, SetTable)) else list(attrs)
        self.metric, self.aset = metric.astype(np.uint16, copy=False), aset.astype(np.uint32, copy=False)
        self.start_ns, self.time_ns = start_ns.astype(np.int64, copy=False), time_ns.astype(np.int64, copy=False)
        self.value, self.ended = value.astype(np.float64, copy=False), ended.astype(bool, copy=False)

    @classmethod
    def of(cls, points: Sequence[Point]) -> Points:
        """Columns of any sequence of points (a `Points` is returned as it is)."""
        if isinstance(points, Points):
            return points
        if not points:
            return cls.empty()
        metrics: dict[str, int] = {}
        attrs: dict[Attrs, int] = {}
        metric = np.array([metrics.setdefault(p.metric, len(metrics)) for p in points], np.uint16)
        aset = np.array([attrs.setdefault(p.attrs, len(attrs)) for p in points], np.uint32)
        return cls(list(metrics), list(attrs), metric, aset, np.array([p.start_ns for p in points], np.int64),
                   np.array([p.time_ns for p in points], np.int64), np.array([p.value for p in points], np.float64),
                   np.array([p.ended for p in points], bool))

    @classmethod
    def empty(cls) -> Points:
        zeros = np.zeros(0, np.int64)
        return cls((), [], zeros, zeros, zeros, zeros, zeros.astype(np.float64), zeros.astype(bool))

    def __len__(self) -> int:
        return len(self.metric)

    @overload
    def __getitem__(self, index: int) -> Point: ...

    @overload
    def __getitem__(self, index: slice) -> Points: ...

    def __getitem__(self, index):  # noqa: ANN001, ANN204
        if isinstance(index, slice):
            return self.take(np.arange(len(self))[index])
        return Point(self.metrics[self.metric[index]], self.attrs[self.aset[index]], int(self.start_ns[index]),
                     int(self.time_ns[index]), float(self.value[index]), bool(self.ended[index]))

    def __iter__(self) -> Iterator[Point]:
        metrics, attrs = self.metrics, self.attrs
        for m, a, s, t, v, e in zip(self.metric.tolist(), self.aset.tolist(), self.start_ns.tolist(),
                                    self.time_ns.tolist(), self.value.tolist(), self.ended.tolist()):
            yield Point(metrics[m], attrs[a], s, t, v, e)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"Points({len(self)} points, {len(self.attrs)} attribute sets)"

    def used_sets(self) -> np.ndarray:
        """The indices of the attribute sets the points use, ascending: a mark per set, where a
        sort of the points' sets (`np.unique`) held a copy of the column."""
        used = np.zeros(len(self.attrs), bool)
        used[self.aset] = True
        return np.flatnonzero(used)

    def take(self, rows: np.ndarray) -> Points:
        """These rows, in this order (the tables are shared)."""
        return Points(self.metrics, self.attrs, self.metric[rows], self.aset[rows], self.start_ns[rows],
                      self.time_ns[rows], self.value[rows], self.ended[rows])

    def series(self) -> tuple[np.ndarray, np.ndarray]:
        """Each point's series id (same metric and attributes) and each series' first row."""
        return group_ids(self.metric, self.aset)

    @staticmethod
    def concat(parts: Sequence[Points]) -> Points:
        """The points of all parts in order, over one metric table and one attribute table: sets
        equal by value are one set, or, where a part's sets are the store's (`SetTable`), sets of
        the same serial (`_concat_coded`)."""
        parts = [p for p in parts if len(p)]
        if len(parts) > 1 and any(isinstance(p.attrs, SetTable) for p in parts):
            return _concat_coded(parts)
        attrs: dict[Attrs, int] = {}

        def place(table: Sequence[Attrs]) -> np.ndarray:  # each part's set -> its index in the one table
            return np.array([attrs.setdefault(a, len(attrs)) for a in table], np.uint32)

        return _joined(parts, lambda part: place(part.attrs), lambda: list(attrs))

    @staticmethod
    def stack(parts: Sequence[Points]) -> Points:
        """The points of all parts in order, their attribute tables laid end to end (a table
        several parts share, once) without looking for sets equal across tables: no set is
        hashed. The same points as `concat`; a set may then sit at two indices, so it is for
        parts whose series cannot meet (the store's sums and its gauges: other metrics), and
        `concat` (which `merge` uses) for snapshots whose series can. A first table that is the
        store's stays pair ids; the others' sets follow it as tuples."""
        first: list[SetTable] = []
        attrs: list[Attrs] = []
        placed: dict[int, np.ndarray] = {}  # id of a part's table -> its sets' indices in the joined one

        def place(table: Sequence[Attrs]) -> np.ndarray:
            if id(table) not in placed:
                if not placed and isinstance(table, SetTable):
                    first.append(table)
                    placed[id(table)] = np.arange(len(table), dtype=np.uint32)
                else:
                    at = (len(first[0]) if first else 0) + len(attrs)
                    placed[id(table)] = np.arange(at, at + len(table), dtype=np.uint32)
                    attrs.extend(table)
            return placed[id(table)]

        return _joined(parts, lambda part: place(part.attrs), lambda: first[0].with_plain(attrs) if first else attrs)


def _joined(parts: Sequence[Points], place: Callable[[Points], np.ndarray],
            table: Callable[[], Sequence[Attrs]]) -> Points:
    """The parts' points in order; `place` maps each part's attribute table into the joined one
    (called once per part with points, in order), which `table` gives once every part is placed."""
    parts = [p for p in parts if len(p)]
    if len(parts) <= 1:
        return parts[0] if parts else Points.empty()
    metrics: dict[str, int] = {}
    m_cols, a_cols = [], []
    for p in parts:
        m_map = np.array([metrics.setdefault(m, len(metrics)) for m in p.metrics], np.uint16)
        m_cols.append(m_map[p.metric])
        a_cols.append(place(p)[p.aset])
    return Points(list(metrics), table(), np.concatenate(m_cols), np.concatenate(a_cols),
                  *(np.concatenate([getattr(p, c) for p in parts]) for c in ("start_ns", "time_ns", "value", "ended")))


def _concat_coded(parts: list[Points]) -> Points:
    """`Points.concat` of parts some of whose tables are the store's: each of the store's sets is
    placed once by its serial; a set of a plain table (a snapshot read back from disk) is the
    store's set of equal pairs if one is placed, else a plain set placed by value, as are a store
    table's own plain sets (its gauges'). Only the sets the points use are placed. The pair ids
    are the first store table's, or of pairs added after them where another table's pairs are
    not the same list."""
    joined = _CodedTable(next(p.attrs for p in parts if isinstance(p.attrs, SetTable)))
    used = [np.unique(p.aset) for p in parts]
    maps = [joined.place_coded(p.attrs, u) for p, u in zip(parts, used)]  # all of them before any plain set
    for part, mapping, u in zip(parts, maps, used):
        joined.place_plain(part.attrs, u, mapping)
    table, at = joined.table(maps), iter(maps)
    return _joined(parts, lambda part: next(at), lambda: table)


class _CodedTable:
    """The one attribute table `_concat_coded` builds: the store's sets, then the plain ones."""

    def __init__(self, first: SetTable) -> None:
        self._pairs = first.pairs  # copied before a pair is added: a snapshot's list is shared
        self._serial_of = first.serial_of
        self._pair_ids: Optional[dict[tuple[str, str], int]] = None
        self._codes: list[bytes] = []
        self._serials: list[int] = []
        self._by_serial: dict[int, int] = {}
        self._by_codes: Optional[dict[bytes, int]] = None
        self._plain: dict[Attrs, int] = {}
        self._plain_at: list[np.ndarray] = []  # per part, which of its sets are plain (placed by rank)

    def place_coded(self, table: Sequence[Attrs], used: np.ndarray) -> np.ndarray:
        """The index in the joined table of each of the table's used store sets (0 for the others)."""
        mapping = np.zeros(len(table), np.int64)
        coded = used[used < len(table.codes)] if isinstance(table, SetTable) else used[:0]
        if len(coded):
            remap = self._remap(table, coded)
            for at, serial in zip(coded.tolist(), table.serials[coded].tolist()):
                index = self._by_serial.get(serial)
                if index is None:
                    index = self._by_serial[serial] = len(self._codes)
                    code = table.codes[at]
                    self._codes.append(code if remap is None else remap[np.frombuffer(code, np.uint32)].tobytes())
                    self._serials.append(serial)
                mapping[at] = index
        return mapping

    def place_plain(self, table: Sequence[Attrs], used: np.ndarray, mapping: np.ndarray) -> None:
        """Place the table's used plain sets into `mapping` (by rank among the plain sets until
        `table()` moves them after the store's)."""
        plain = used[used >= len(table.codes)] if isinstance(table, SetTable) else used
        ranked = []
        for at in plain.tolist():
            attrs = table[at]
            index = self._coded_equal(attrs) if not isinstance(table, SetTable) else -1
            if index >= 0:
                mapping[at] = index
            else:
                mapping[at] = self._plain.setdefault(attrs, len(self._plain))
                ranked.append(at)
        self._plain_at.append(np.array(ranked, np.int64))

    def _coded_equal(self, attrs: Attrs) -> int:
        """The placed store set equal to `attrs`, -1 if none."""
        if self._by_codes is None:
            self._by_codes = {code: i for i, code in enumerate(self._codes)}
            self._own_pairs()
        code = code_of(attrs, self._pair_ids)
        return self._by_codes.get(code, -1) if code is not None else -1

    def _own_pairs(self) -> None:
        if self._pair_ids is None:
            self._pairs = list(self._pairs)
            self._pair_ids = {}
            for i, kv in enumerate(self._pairs):  # a released pair's id holds ("", ""): the first id of a pair wins
                self._pair_ids.setdefault(kv, i)

    def _remap(self, table: SetTable, coded: np.ndarray) -> Optional[np.ndarray]:
        """The joined table's id of each of `table`'s pairs that its `coded` sets use (None: its
        pairs are the joined table's)."""
        if table.pairs is self._pairs:
            return None
        self._own_pairs()
        remap = np.zeros(len(table.pairs), np.uint32)
        for i in table.codes.used_pairs(coded, len(table.pairs)).tolist():
            kv = table.pairs[i]
            index = self._pair_ids.get(kv)
            if index is None:
                index = self._pair_ids[kv] = len(self._pairs)
                self._pairs.append(kv)
            remap[i] = index
        return remap

    def table(self, maps: list[np.ndarray]) -> SetTable:
        """The joined table; each part's plain sets in `maps` move after the store's sets."""
        for mapping, plain in zip(maps, self._plain_at):
            mapping[plain] += len(self._codes)
        return SetTable(self._codes, self._pairs, np.array(self._serials, np.int64), list(self._plain), self._serial_of)


def merge(older: Sequence[Point], newer: Sequence[Point]) -> Points:
    """`snapshot.merge` on columns: the two snapshots as one, each series' points in order and the
    series in order of first appearance. Of a series the newer snapshot has, a cumulative value
    superseded by a later value with the same start time is dropped, ended points and the value
    before each are kept; a series only the older one has is kept as it is."""
    older, newer = Points.of(older), Points.of(newer)
    both = Points.concat([older, newer])
    n_point = len(both)
    if not n_point:
        return both
    sid, first = both.series()
    in_newer = np.zeros(len(first), dtype=bool)
    in_newer[sid[len(older):]] = True
    order = np.lexsort((np.arange(n_point), first[sid]))  # by series' first appearance, then position
    s_sid, s_start, s_ended = sid[order], both.start_ns[order], both.ended[order]
    keep = ~in_newer[s_sid]
    keep[-1] = True
    keep[:-1] |= (s_sid[:-1] != s_sid[1:]) | s_ended[:-1] | s_ended[1:] | (s_start[1:] != s_start[:-1])
    return both.take(order[keep])


def last_of_each(points: Sequence[Point], metrics: Collection[str]) -> Points:
    """Of the series of these `metrics` (the cumulative sums: a gauge's old value means nothing at
    another time), each one's last value and, where its last point is its end, that end too, in
    that order: what a refused snapshot must still get delivered (see `restamped`)."""
    columns = Points.of(points)
    wanted = np.array([m in metrics for m in columns.metrics], bool)
    columns = columns.take(np.flatnonzero(wanted[columns.metric]))
    if not len(columns):
        return columns
    sid, first = columns.series()
    rows = np.arange(len(columns))
    last = np.full(len(first), -1, np.int64)
    np.maximum.at(last, sid, rows)
    last_value = np.full(len(first), -1, np.int64)
    np.maximum.at(last_value, sid[~columns.ended], rows[~columns.ended])
    ends = last[columns.ended[last]]
    keep = np.concatenate([last_value[last_value >= 0], ends])
    return columns.take(keep[np.lexsort((keep, first[sid[keep]]))])


def restamped(points: Points, at_ns: int) -> Points:
    """`last_of_each`'s points moved to a time a backend takes: values 1 ms before `at_ns`, ends
    at `at_ns` (Prometheus keeps one sample per millisecond), start times as they were."""
    time_ns = np.where(points.ended, at_ns, at_ns - 1_000_000).astype(np.int64)
    return Points(points.metrics, points.attrs, points.metric, points.aset, points.start_ns,
                  np.maximum(time_ns, points.start_ns), points.value, points.ended)
