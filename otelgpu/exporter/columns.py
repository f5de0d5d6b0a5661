"""One interval's cost points as columns: what the store hands the exporters.

A `Points` is a sequence of `Point` to every reader that iterates or indexes it (the readable
paths, the tests), and six arrays to the fast ones (the snapshot file, the OTLP writer): each
point's metric (an index into `metrics`), attribute set (an index into `attrs`, where each
distinct set appears once: the metrics of a pod share theirs), start and end time, value and
whether it ends its series. No `Point` object exists unless a reader asks for one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Iterator, Sequence, overload

import numpy as np

from otelgpu.core.attrs import Attrs
from otelgpu.core.grouping import group_ids

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
        self.metrics, self.attrs = tuple(metrics), attrs if isinstance(attrs, list) else list(attrs)
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

    def take(self, rows: np.ndarray) -> Points:
        """These rows, in this order (the tables are shared)."""
        return Points(self.metrics, self.attrs, self.metric[rows], self.aset[rows], self.start_ns[rows],
                      self.time_ns[rows], self.value[rows], self.ended[rows])

    def series(self) -> tuple[np.ndarray, np.ndarray]:
        """Each point's series id (same metric and attributes) and each series' first row."""
        return group_ids(self.metric, self.aset)

    @staticmethod
    def concat(parts: Sequence[Points]) -> Points:
        """The points of all parts in order, over one metric table and one attribute table."""
        attrs: dict[Attrs, int] = {}

        def place(table: list[Attrs]) -> np.ndarray:  # each part's set -> its index in the one table
            return np.array([attrs.setdefault(a, len(attrs)) for a in table], np.uint32)

        return _joined(parts, place, lambda: list(attrs))

    @staticmethod
    def stack(parts: Sequence[Points]) -> Points:
        """The points of all parts in order, their attribute tables laid end to end (a table
        several parts share, once) without looking for sets equal across tables: no set is
        hashed. The same points as `concat`; a set may then sit at two indices, so it is for
        parts whose series cannot meet (the store's sums and its gauges: other metrics), and
        `concat` (which `merge` uses) for snapshots whose series can."""
        attrs: list[Attrs] = []
        placed: dict[int, np.ndarray] = {}  # id of a part's table -> its sets' indices in the joined one

        def place(table: list[Attrs]) -> np.ndarray:
            if id(table) not in placed:
                placed[id(table)] = np.arange(len(attrs), len(attrs) + len(table), dtype=np.uint32)
                attrs.extend(table)
            return placed[id(table)]

        return _joined(parts, place, lambda: attrs)


def _joined(parts: Sequence[Points], place: Callable[[list[Attrs]], np.ndarray],
            table: Callable[[], list[Attrs]]) -> Points:
    """The parts' points in order; `place` maps a part's attribute table into the joined one,
    which `table` gives once every part is placed."""
    parts = [p for p in parts if len(p)]
    if len(parts) <= 1:
        return parts[0] if parts else Points.empty()
    metrics: dict[str, int] = {}
    m_cols, a_cols = [], []
    for p in parts:
        m_map = np.array([metrics.setdefault(m, len(metrics)) for m in p.metrics], np.uint16)
        m_cols.append(m_map[p.metric])
        a_cols.append(place(p.attrs)[p.aset])
    return Points(list(metrics), table(), np.concatenate(m_cols), np.concatenate(a_cols),
                  *(np.concatenate([getattr(p, c) for p in parts]) for c in ("start_ns", "time_ns", "value", "ended")))


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
