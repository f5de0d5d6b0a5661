"""Snapshots as columns (`Points`): the same points as the readable lists, merged as the
reference merges them, written to and read from a snapshot file unchanged."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from otelgpu.exporter import snapshot
from otelgpu.exporter.columns import Point, Points, merge
from otelgpu.exporter.otlp import RequestWriter, requests_reference
from otelgpu.core.attrs import attrs_of
from otelgpu.exporter.store import cost_metrics

SPECS = cost_metrics()
series_attrs = st.sampled_from([attrs_of({"pod": p, "team": t}) for p in "abc" for t in ("x", "")])


@st.composite
def chains(draw) -> list[Point]:  # noqa: ANN001
    """Snapshot points: each series' points in time order, a start time that changes only after an
    ended point, as the store writes them."""
    out, t = [], 10
    for metric, attrs in draw(st.lists(st.tuples(st.sampled_from(["allocated", "idle", "activity"]), series_attrs),
                                       max_size=8, unique=True)):
        start = draw(st.integers(1, 9))
        for _ in range(draw(st.integers(1, 4))):
            t += draw(st.integers(1, 5))
            ended = draw(st.booleans())
            out.append(Point(metric, attrs, start, t, math.nan if ended else float(draw(st.integers(0, 99))), ended))
            if ended:
                start = t + 1
    return out


def same(a, b) -> bool:  # noqa: ANN001 - NaN-aware equality of point lists
    return len(a) == len(b) and all(
        (x.metric, x.attrs, x.start_ns, x.time_ns, x.ended) == (y.metric, y.attrs, y.start_ns, y.time_ns, y.ended)
        and (x.value == y.value or (math.isnan(x.value) and math.isnan(y.value))) for x, y in zip(a, b))


@settings(max_examples=300, deadline=None)
@given(chains(), chains())
def test_merge_on_columns_is_the_reference_merge(older, newer):
    want = snapshot.flatten(snapshot.merge(snapshot.snapshot_of(older), snapshot.snapshot_of(newer)))
    assert same(list(merge(older, newer)), want)
    assert same(list(merge(Points.of(older), Points.of(newer))), want)


@settings(max_examples=200, deadline=None)
@given(chains(), st.lists(st.integers(0, 2**63 - 1), max_size=3))
def test_a_snapshot_file_gives_back_its_points(points, absorbed):
    for given_as in (points, Points.of(points)):
        got = snapshot.decode(snapshot.encode(given_as, 99, absorbed))
        assert same(list(got.points), points) and got.end_ns == 99 and got.absorbed == tuple(absorbed)
        assert isinstance(got.points, Points)


@settings(max_examples=100, deadline=None)
@given(chains(), chains())
def test_points_that_use_part_of_their_tables_write_the_reference_requests(first, second):
    """A slice keeps its snapshot's whole attribute table: sets it does not use are not written."""
    both = Points.concat([Points.of(first), Points.of(second)])
    part = both[len(first):]
    assert len(part.attrs) >= len({p.attrs for p in second})
    want = [r.SerializeToString() for r in requests_reference(second, SPECS, "c", 3)]
    assert list(RequestWriter(SPECS, "c").requests(part, 3)) == want


def test_points_behave_as_a_sequence_of_points():
    pts = [Point("allocated", (("pod", "a"),), 1, 5, 2.5), Point("idle", (), 5, 5, 1.0),
           Point("allocated", (("pod", "a"),), 1, 6, math.nan, True)]
    cols = Points.of(pts)
    assert len(cols) == 3 and cols[1] == pts[1] and same(list(cols[1:]), pts[1:]) and same(list(cols), pts)
    assert cols[:2] == pts[:2] and cols[:2] != pts[1:] and len(cols.attrs) == 2
    ids, first = cols.series()
    assert ids.tolist() == [0, 1, 0] and first.tolist() == [0, 1]
    assert list(cols.take(np.array([2, 0])))[1] == pts[0]
    assert len(Points.of([])) == 0 and same(list(Points.concat([Points.empty(), cols])), pts)


@settings(max_examples=200, deadline=None)
@given(st.lists(chains(), max_size=4), st.data())
def test_stacked_parts_are_the_concatenated_points(parts, data):
    """`stack` skips looking for equal sets across tables: the points are `concat`'s all the same,
    a table shared by several parts counted once."""
    columns = [Points.of(p) for p in parts]
    if columns and data.draw(st.booleans()):  # two parts over one table, as the store's kept and ended sums
        shared = columns[0]
        columns.append(shared.take(np.arange(len(shared))[::-1]))
    stacked = Points.stack(columns)
    assert same(list(stacked), list(Points.concat(columns)))
    given = [c for c in columns if len(c)]
    if len(given) > 1:  # each table once, shared or not, none of them searched for equal sets
        assert len(stacked.attrs) == sum({id(c.attrs): len(c.attrs) for c in given}.values())
