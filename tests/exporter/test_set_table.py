"""The cost store's snapshots give their attribute sets as pair ids (`SetTable`), never as a tuple
per set: merged, written as OTLP and kept in the queue's attribute log, they give what the same
points with their sets as tuples give."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otelgpu.core import grouping
from otelgpu.core.attrs import attrs_of
from otelgpu.exporter import attrtable, snapshot
from otelgpu.exporter import store as store_module
from otelgpu.exporter.attrtable import AttrTable
from otelgpu.exporter.columns import Points, SetCodes, SetTable, merge
from otelgpu.exporter.otlp import PAIRS_KEPT, RequestWriter, requests_reference
from otelgpu.exporter.remote_write import SeriesWriter
from otelgpu.exporter.store import CostStore, cost_metrics

SPECS = cost_metrics()
T0, MIN = 1_700_000_000 * 10**9, 60 * 10**9
POOL = [attrs_of({"pod": f"p{p}", "team": t, "node": n}) for p in range(4) for t in ("x", "y") for n in ("n1", "")]


@st.composite
def histories(draw) -> list[Points]:  # noqa: ANN001
    """A store's snapshots over a few intervals: sums of sets drawn from a pool, so that series end
    when left out two intervals in a row and their sets come back later under new serials, and
    activity gauges keyed by sets that sums also have."""
    store = CostStore()
    out = []
    for k in range(draw(st.integers(1, 6))):
        held = draw(st.lists(st.sampled_from(POOL), max_size=8, unique=True))
        sums = {"allocated": {a: float(draw(st.integers(0, 9))) for a in held},
                "held": {a: 60.0 for a in held[:3]}}
        gauges = {"activity": {a: 0.5 for a in draw(st.lists(st.sampled_from(POOL), max_size=4, unique=True))}}
        out.append(store.record(T0 + k * MIN, T0 + (k + 1) * MIN, sums, gauges))
    return out


def plain(points: Points) -> Points:
    """The same points, their sets as tuples (as a snapshot read back from disk has them)."""
    return Points.of(list(points))


def rows(points) -> list[tuple]:  # noqa: ANN001
    """The points as tuples (NaN as a string: ended points compare equal)."""
    return [(p.metric, p.attrs, p.start_ns, p.time_ns, "nan" if math.isnan(p.value) else p.value, p.ended)
            for p in points]


def by_series(points) -> dict:  # noqa: ANN001
    """Each series' points in order."""
    out: dict = {}
    for row in rows(points):
        out.setdefault(row[:2], []).append(row[2:])
    return out


def test_a_set_table_reads_as_its_sets() -> None:
    sets = [attrs_of({"pod": "a", "team": "x"}), attrs_of({"pod": "b"})]
    pairs = [kv for s in sets for kv in s]
    codes = [np.array([0, 1], np.uint32).tobytes(), np.array([2], np.uint32).tobytes()]
    gauge = attrs_of({"node": "n1"})
    table = SetTable(codes, pairs, np.array([5, 9]), [gauge])
    assert list(table) == [*sets, gauge] and len(table) == 3
    assert table[-1] == gauge and table[1] == sets[1] and table[0:2] == sets
    assert table.with_plain([()])[3] == () and len(table) == 3
    with pytest.raises(IndexError):
        table[3]
    with pytest.raises(ValueError):
        SetTable(codes, pairs, np.array([5]))


@settings(max_examples=150, deadline=None)
@given(histories())
def test_store_snapshots_hold_their_sets_as_pair_ids_and_merge_as_by_value(snapshots):
    for points in snapshots:
        assert isinstance(points.attrs, SetTable) and all(isinstance(c, bytes) for c in points.attrs.codes)
    merged = snapshots[0]
    reference = plain(snapshots[0])
    for newer in snapshots[1:]:  # as an exporter's queue merges them in an outage, oldest first
        merged = merge(merged, newer)
        reference = merge(reference, plain(newer))
        assert isinstance(merged.attrs, SetTable) or not len(merged)
        assert by_series(merged) == by_series(reference)
    for older, newer in zip(snapshots, snapshots[1:]):  # a snapshot read back from disk, then a new one
        assert by_series(merge(plain(older), newer)) == by_series(merge(plain(older), plain(newer)))


@settings(max_examples=100, deadline=None)
@given(histories(), st.integers(1, 7))
def test_the_writer_lays_store_sets_out_from_their_pair_ids(snapshots, max_points):
    writer, reader_of_tuples = RequestWriter(SPECS, "c1"), RequestWriter(SPECS, "c1")
    merged = snapshots[0]
    for points in [*snapshots, *(merged := merge(merged, s) for s in snapshots[1:])]:
        got = list(writer.requests(points, max_points))
        assert got == list(reader_of_tuples.requests(plain(points), max_points))
        want = [r.SerializeToString() for r in requests_reference(plain(points), SPECS, "c1", max_points)]
        assert got == want


@settings(max_examples=60, deadline=None)
@given(histories())
def test_remote_write_knows_store_sets_by_serial_and_writes_what_their_tuples_give(snapshots):
    by_serial, by_tuple = SeriesWriter(SPECS, "c1", {}), SeriesWriter(SPECS, "c1", {})
    for points in snapshots:  # one writer each, as an exporter keeps it: its cache of label sets in use
        got, rejected = by_serial.requests(points, 0, 5)
        want, rejected_too = by_tuple.requests(plain(points), 0, 5)
        assert list(got) == list(want) and rejected == rejected_too
        used = np.unique(points.aset)
        coded = used[used < len(points.attrs.codes)]
        assert sorted(k for k in by_serial._sets if isinstance(k, int)) == sorted(points.attrs.serials[coded].tolist())
        assert sum(isinstance(k, tuple) for k in by_serial._sets) == len(used) - len(coded)  # the gauges' alone


def test_past_its_bound_the_writer_starts_afresh_with_store_sets(monkeypatch) -> None:
    monkeypatch.setattr("otelgpu.exporter.otlp.PAIRS_KEPT", 5)
    assert PAIRS_KEPT > 5
    store = CostStore()
    writer = RequestWriter(SPECS, "c1")
    for k in range(3):
        sets = POOL[4 * k:4 * k + 6]
        points = store.record(T0 + k * MIN, T0 + (k + 1) * MIN, {"allocated": dict.fromkeys(sets, 1.0)},
                              {"activity": {POOL[-1]: 0.5}})
        want = [r.SerializeToString() for r in requests_reference(plain(points), SPECS, "c1")]
        assert list(writer.requests(points)) == want


def test_a_writer_started_afresh_by_a_gauges_pairs_lays_out_the_store_sets_again(monkeypatch) -> None:
    """The writer keeps its ids of a store table's pairs while the store hands the same list (no
    pair came or went); a gauge's new pairs that make it start afresh leave those ids naming
    nothing: the store's sets are looked up again."""
    sums = {"allocated": dict.fromkeys(POOL[:2], 1.0)}  # 3 distinct pairs (a node of "" is none)
    monkeypatch.setattr("otelgpu.exporter.otlp.PAIRS_KEPT", 4)
    store = CostStore()
    writer = RequestWriter(SPECS, "c1")
    first = store.record(T0, T0 + MIN, sums, {})
    second = store.record(T0 + MIN, T0 + 2 * MIN, sums, {"activity": {attrs_of({"gpu": "0", "model": "m"}): 0.5}})
    assert second.attrs.pairs is first.attrs.pairs
    for points in (first, second, first):
        want = [r.SerializeToString() for r in requests_reference(plain(points), SPECS, "c1")]
        assert list(writer.requests(points)) == want
    assert writer._afresh == 2  # the gauge's 2 pairs beside the 3, then the 3 again


def _log_round_trip(table: AttrTable, log, points: Points, end_ns: int) -> np.ndarray:  # noqa: ANN001
    """Write `points`' sets through `table`, then read the snapshot back with a fresh read of the log."""
    used = np.unique(points.aset)
    set_ids = np.zeros(len(points.attrs), np.uint32)
    set_ids[used] = table.ids(points.attrs, used)
    read = snapshot.decode(snapshot.encode(points, end_ns, (), set_ids), AttrTable(log).load()[0])
    assert rows(read.points) == rows(points)
    return set_ids[used]


@settings(max_examples=60, deadline=None)
@given(histories(), st.integers(0, 5))
def test_the_attribute_log_knows_store_sets_by_serial_and_keeps_no_tuple_of_them(tmp_path_factory, snapshots, restart_at):
    log = tmp_path_factory.mktemp("log") / "attrs.log"
    table = AttrTable(log)
    ids_of: dict = {}
    gauges_given: set = set()
    for k, points in enumerate(snapshots):
        if k == restart_at:  # a new process: the store's sets of the log are met by value once
            table = AttrTable(log)
            table.load()
        ids = _log_round_trip(table, log, points, T0 + (k + 1) * MIN)
        used = np.unique(points.aset).tolist()
        for attrs, number in zip([points.attrs[i] for i in used], ids.tolist()):
            ids_of.setdefault(attrs, set()).add(number)
        coded = {points.attrs[i] for i in used if i < len(points.attrs.codes)}
        gauges = {points.attrs[i] for i in used if i >= len(points.attrs.codes)}
        gauges_given |= gauges
        assert not (coded - gauges_given) & set(table._ids), "a live store set kept as a tuple"
        if k < restart_at:
            assert set(table._ids) <= gauges_given
    records = AttrTable(log).load()[0]
    assert len(records) == len(table)
    # a set has one id as long as it lives; met again under a new serial it may get another
    assert all(records[i] == attrs for attrs, numbers in ids_of.items() for i in numbers)


def test_a_compaction_copies_the_records_it_keeps_and_store_sets_are_still_found(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(attrtable, "COMPACT_FROM", 1)
    log = tmp_path / "attrs.log"
    store, table = CostStore(end_after_intervals=1), AttrTable(log)
    first = store.record(T0, T0 + MIN, {"allocated": dict.fromkeys(POOL[:10], 1.0)}, {})
    _log_round_trip(table, log, first, T0 + MIN)
    second = store.record(T0 + MIN, T0 + 2 * MIN, {"allocated": dict.fromkeys(POOL[8:12], 1.0)},
                          {"activity": {POOL[0]: 0.5}})
    kept = _log_round_trip(table, log, second, T0 + 2 * MIN)  # the ends of POOL[:8] and the four live sums
    before = AttrTable(log).load()[0]
    third = store.record(T0 + 2 * MIN, T0 + 3 * MIN, {"allocated": dict.fromkeys(POOL[8:12], 1.0)}, {})
    live = table.ids(third.attrs, np.unique(third.aset))
    assert len(live) == 5 and len(table) == 13  # the four sums, the gauge's end; ten sets, two more, the gauge's
    assert table.compact(live.tolist())
    after = AttrTable(log).load()[0]
    assert after == {i: before[i] for i in live.tolist()} and len(table) == 5
    assert table.ids(third.attrs, np.unique(third.aset)).tolist() == live.tolist()  # by serial, nothing appended
    assert log.stat().st_size == sum(len(attrtable._record(i, a)) for i, a in after.items())
    assert not set(kept.tolist()) - set(before)


def test_a_gauge_whose_set_a_sum_has_too_shares_its_record(tmp_path) -> None:
    log = tmp_path / "attrs.log"
    store, table = CostStore(), AttrTable(log)
    points = store.record(T0, T0 + MIN, {"held": dict.fromkeys(POOL[:3], 60.0)}, {"activity": {POOL[1]: 0.5}})
    ids = _log_round_trip(table, log, points, T0 + MIN)
    assert len(ids) == 4 and len(set(ids.tolist())) == 3 and len(table) == 3  # one record per distinct set
    assert list(table._ids) == [POOL[1]]  # the gauge's tuple, which the store holds anyway


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.sampled_from(POOL), max_size=8, unique=True), min_size=1, max_size=8))
def test_a_snapshot_keeps_its_sets_whatever_comes_or_goes_after_it(helds):
    """Snapshots share one table of sets until a set comes or goes: each still reads, once later
    intervals have added and ended series, as it did when it was recorded."""
    store, snapshots, read = CostStore(), [], []
    for k, held in enumerate(helds):
        points = store.record(T0 + k * MIN, T0 + (k + 1) * MIN, {"allocated": {a: float(k) for a in held}},
                              {"activity": {a: 0.5 for a in held[:2]}})
        snapshots.append(points)
        read.append(rows(points))
    assert [rows(points) for points in snapshots] == read


def test_intervals_whose_sets_stay_the_same_share_one_table() -> None:
    """An interval that adds no set and ends none (as every interval of a steady cluster) shares
    the table of the one before; a new set gives the next a table of its own."""
    store = CostStore()

    def record(k: int, held: list) -> SetTable:
        points = store.record(T0 + k * MIN, T0 + (k + 1) * MIN, {"allocated": {a: 1.0 for a in held}}, {})
        assert isinstance(points.attrs, SetTable)
        return points.attrs

    first, second, third = (record(k, POOL[:4]) for k in range(3))
    assert second.codes is first.codes and third.codes is first.codes
    fourth = record(3, POOL[:5])
    assert fourth.codes is not first.codes and len(fourth.codes) == 5 and len(first.codes) == 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.lists(st.integers(0, 2**32 - 1), max_size=9), st.integers(0, 40)), max_size=60),
       st.integers(1, 24))
def test_set_runs_read_as_a_dict_of_ids_and_a_view_as_when_it_was_taken(steps, room):
    """The store's sets' pair ids as runs of one array (`_Runs`), against a dict: a list of ids
    puts a set (a released index first, as the store reuses them), a number releases the live
    set it picks. The room is a few ids, so the live runs are packed into new arrays again and
    again; every view taken reads, at the end, the sets it was given."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(store_module, "FIRST_IDS", room)
        runs, sets, free, views = store_module._Runs(), {}, [], []
        for step in steps:
            if isinstance(step, list):
                index = free.pop() if free else len(runs)
                runs.put(index, np.array(step, np.uint32))
                sets[index] = np.array(step, np.uint32).tobytes()
            elif sets:
                index = sorted(sets)[step % len(sets)]
                assert runs.release([index]).tobytes() == sets.pop(index)
                free.append(index)
            assert all(runs[i] == code for i, code in sets.items())
            views.append((runs.view(), {i: sets.get(i, b"") for i in range(len(runs))}))
        for view, then in views:
            assert list(view) == [then[i] for i in range(len(view))]
            chosen = np.array(sorted(then), np.int64)
            ids, counts = view.joined(chosen)
            assert ids.tobytes() == b"".join(then[i] for i in chosen.tolist())
            assert counts.tolist() == [len(then[i]) // 4 for i in chosen.tolist()]
            into = np.zeros(len(ids), np.uint32)
            assert view.joined(chosen, into)[0] is into and into.tobytes() == ids.tobytes()
        live = np.array(sorted(sets), np.int64)
        assert np.asarray(runs.pieces(live)).tobytes() == b"".join(sets[i] for i in live.tolist())


def test_gathering_sets_runs_holds_a_few_thousand_sets_places_at_a_time():
    """Gathering many sets' runs (the OTLP writer's, a checkpoint's) builds the places of a few
    thousand sets' ids at a time: 200,000 sets of 20 ids (16 MiB of ids) gather with under 4 MiB
    traced besides what they fill, where their places at once would be 8 bytes an id, thrice."""
    count = np.full(200_000, 20, np.int32)
    start = (np.arange(200_000, dtype=np.int64) * 20)[::-1].copy()  # runs out of order, as after releases
    ids = np.arange(4_000_000, dtype=np.uint32)
    chosen = np.arange(0, 200_000, dtype=np.int64)
    out = np.empty(4_000_000, np.uint32)
    starts, sizes = start[chosen], count[chosen]
    tracemalloc.start()
    try:
        grouping.gather_runs(ids, starts, sizes, out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB traced"
    assert np.array_equal(out[:20], ids[start[0]:start[0] + 20]) and np.array_equal(out[-20:], ids[:20])


def test_writing_a_snapshot_copies_none_of_its_sets_pair_ids():
    """The OTLP writer reads the store's sets where they are kept (the runs' ids, through a map of
    the store's pair ids to its own): a snapshot of 200,000 sets of 20 pairs (16 MiB of pair ids)
    starts its requests with under 8 MiB traced, where a copy of the ids, mapped, took 16 more.
    Its requests are the reference's."""
    n_sets, width = 200_000, 20
    pairs = [(f"k{k}", f"v{v}") for k in range(width) for v in range(50)]
    by_set = np.arange(width, dtype=np.uint32)[None, :] * 50 + (np.arange(n_sets, dtype=np.uint32) % 50)[:, None]
    start = (np.arange(n_sets, dtype=np.uint32) * width)[::-1].copy()  # runs out of order, as after releases
    codes = SetCodes(by_set[::-1].reshape(-1).copy(), start, np.full(n_sets, width, np.int32))
    table = SetTable(codes, pairs, np.arange(n_sets, dtype=np.int64))
    rows = np.arange(n_sets)
    snapshot = Points(["allocated"], table, np.zeros(n_sets, np.uint16), rows, rows + 1, rows + 2,
                      rows.astype(np.float64), np.zeros(n_sets, bool))
    writer = RequestWriter(SPECS, "c1")
    next(writer.requests(snapshot[:10]))  # the kernel loaded
    tracemalloc.start()
    try:
        first = next(writer.requests(snapshot))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB traced"
    few = snapshot.take(np.array([0, 1, n_sets - 1, 7]))
    assert list(RequestWriter(SPECS, "c1").requests(few)) == [
        r.SerializeToString() for r in requests_reference(list(few), SPECS, "c1")]
    assert first == next(RequestWriter(SPECS, "c1").requests(snapshot[:4000]))


def test_snapshots_read_the_serials_where_the_store_keeps_them_until_a_set_comes() -> None:
    """No copy of every set's serial (8 bytes a set) is held while no set comes or goes; a set
    that takes a released one's place leaves the serials a snapshot read as they were."""
    store = CostStore()
    sets = [attrs_of({"pod": f"p{k}"}) for k in range(3)]
    first = store.record(T0, T0 + MIN, {"allocated": {a: 1.0 for a in sets}}, {})
    second = store.record(T0 + MIN, T0 + 2 * MIN, {"allocated": {a: 1.0 for a in sets}}, {})
    assert second.attrs is first.attrs and np.shares_memory(second.attrs.serials, store._sets._serial)
    read = second.attrs.serials.copy()
    for k in range(3, 7):  # p0 left out until it ends, p3.. take the places the ended ones leave
        last = store.record(T0 + (k - 1) * MIN, T0 + k * MIN,
                            {"allocated": {a: 1.0 for a in [*sets[1:], attrs_of({"pod": f"p{k}"})]}}, {})
    assert np.array_equal(second.attrs.serials, read)
    assert len(set(last.attrs.serials.tolist())) == len(last.attrs.serials)
    assert set(last.attrs.serials.tolist()) != set(read.tolist())
