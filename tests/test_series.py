"""Series hygiene: detail levels trade dimensions for active series without changing any total,
series end when their holder is gone, timestamps only grow."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from cluster import Cluster, Node, Pod, Unit
from support import feed, make_config, offline_pipeline

from otelgpu.attribution.models import Packed
from otelgpu.checkpoint import texts_of
from otelgpu.core.attrs import Extended, with_attrs
from otelgpu.core.byvalue import ByValue
from otelgpu.enrich.attributes import SeriesAttributes
from otelgpu.errors import ConfigError
from otelgpu.exporter.columns import Points
from otelgpu.exporter.store import CostStore
from otelgpu.telemetry import total

A100 = "NVIDIA A100-SXM4-40GB"


def cluster() -> Cluster:
    node = Node("gpu-1", "p4d.24xlarge", 96, 1152, units=[Unit(f"GPU-{i}", A100) for i in range(4)],
                capacity={"nvidia_com_gpu": 4})
    rs = {"pod-template-hash": "7d4b9c"}
    pods = [Pod("ml", f"serve-7d4b9c-{s}", "gpu-1", labels={"team": "nlp", **rs}, gpu=("nvidia_com_gpu", 1),
                holds=(f"GPU-{i}",), activity=a, owner=("ReplicaSet", "serve-7d4b9c")) for i, (s, a) in enumerate((("abcde", 0.2), ("fghij", 0.8)))]
    pods.append(Pod("ml", "train", "gpu-1", labels={"team": "vision"}, gpu=("nvidia_com_gpu", 1), holds=("GPU-2",),
                    activity=0.5, end_s=900))
    return Cluster([node], pods)


def run(**series):
    p = offline_pipeline(make_config(attribution__interval_seconds=300,
                                     attribution__cost_models=["request", "scad"],
                                     attribution__prices__gpu_hour_by_gpu_model={A100: 12.0},
                                     **{f"series__{k}": v for k, v in series.items()}))
    feed(p, *cluster().scrapes(60, 3600))
    p.close_due()
    return p


def test_detail_levels_keep_every_total() -> None:
    pod, workload, namespace = run(), run(detail="workload"), run(detail="namespace")
    for metric in ("allocated", "effective", "waste", "unused", "idle", "capacity", "held"):
        by = ("cost_model", "team", "resource")
        assert workload.store.totals(metric, by) == pytest.approx(pod.store.totals(metric, by))
        assert namespace.store.totals(metric, by) == pytest.approx(pod.store.totals(metric, by))
    live = {p: len(p.store.points()) for p in (pod, workload, namespace)}
    assert live[pod] > live[workload] >= live[namespace]
    assert {dict(pt.attrs).get("workload_name") for pt in workload.store.points()} >= {"serve"}
    for pt in workload.store.points():
        assert "pod" not in dict(pt.attrs)
    assert all("workload_name" not in dict(pt.attrs) for pt in namespace.store.points())
    # The two serve replicas' activity merges weighted by their cost: (0.2 + 0.8) / 2.
    (activity,) = [pt.value for pt in workload.store.points()
                   if pt.metric == "activity" and dict(pt.attrs).get("workload_name") == "serve"]
    assert activity == pytest.approx(0.5)


def test_dropping_more_attributes() -> None:
    p = run(drop_attributes=["node", "instance_type", "gpu_model"])
    assert all(not {"node", "instance_type", "gpu_model"} & set(dict(pt.attrs)) for pt in p.store.points())
    assert p.store.totals("allocated", ("team",)) == pytest.approx(run().store.totals("allocated", ("team",)))


def test_model_attributes_cannot_be_dropped() -> None:
    with pytest.raises(ConfigError, match="series.drop_attributes: cost_model cannot be dropped"):
        make_config(series__drop_attributes=["cost_model", "pod"])


def test_a_finished_pod_s_series_end_and_keep_their_total() -> None:
    p = run()
    assert p.store.series_ended > 0 and total(p.metrics.series_ended) == p.store.series_ended
    assert all(dict(pt.attrs).get("pod") != "train" for pt in p.store.points())  # not exported any more
    # ...yet its cost stays in the run's totals (three intervals at $12/h under request).
    assert p.store.totals("allocated", ("pod",), {"cost_model": "request", "resource": "gpu"})[("train",)] == \
        pytest.approx(3 * 12.0 * 300 / 3600)


def test_timestamps_only_grow() -> None:
    store = CostStore()
    store.record(0, 10, {"allocated": {(("pod", "a"),): 1.0}}, {})
    with pytest.raises(ValueError, match="strictly increase"):
        store.record(0, 10, {"allocated": {(("pod", "a"),): 1.0}}, {})
    snapshot = store.record(10, 20, {}, {})
    assert [p.time_ns for p in snapshot] == [20] and not math.isnan(snapshot[0].value)


def test_a_queued_snapshot_keeps_its_attributes_when_the_store_reuses_their_slot() -> None:
    """A series ends, a new pod's series takes the freed attribute-set slot: a snapshot still
    waiting in an export queue reads the old series' attributes, not the new one's."""
    store = CostStore(end_after_intervals=1)
    old, new = (("pod", "old"), ("team", "a")), (("pod", "new"), ("team", "b"))
    held = store.record(0, 60, {"allocated": {old: 1.0}}, {})
    ended = store.record(60, 120, {}, {})
    store.record(120, 180, {"allocated": {new: 2.0}}, {})
    assert [(p.attrs, p.value) for p in held] == [(old, 1.0)]
    assert [(p.attrs, p.ended) for p in ended] == [(old, True)]
    assert [(p.attrs, p.value, p.start_ns) for p in store.points()] == [(new, 2.0, 120)]


def _series(k: int) -> tuple[tuple[str, str], ...]:
    """Series k's attributes: its own pod, a team and a node shared with others (some not ASCII,
    one not even valid UTF-8: a lone surrogate)."""
    return tuple(sorted({"pod": f"p{k}" + ("é" if k % 4 == 0 else ""), "team": f"t{k % 3}",
                         "node": f"n{k % 2}" + ("\ud800" if k == 7 else "")}.items()))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sets(st.integers(0, 11), max_size=12), min_size=1, max_size=10))
def test_the_store_keeps_exactly_the_strings_and_sets_of_its_live_series(intervals: list[set[int]]) -> None:
    """Series come and go in batches (many end in one interval, sharing their pairs and strings):
    the store's tables must hold every pair and string a live series uses, and no other."""
    store = CostStore(end_after_intervals=1)
    for i, keys in enumerate(intervals):
        store.record(i * 60, (i + 1) * 60, {"allocated": {_series(k): 1.0 for k in keys},
                                            "held": {_series(k): 2.0 for k in keys if k % 2}}, {})
        live = {p.attrs for p in store.points()}
        assert live == {_series(k) for k in keys}
        assert sorted(store._sets.indexed(), key=repr) == sorted(live, key=repr)
        assert set(store._sets._pairs.keys()) == {kv for attrs in live for kv in attrs}
        table = store._sets.table([])  # the checkpoint's pairs: the live ones, released ones empty
        text = texts_of(table["strings"], table["string_ends"])
        listed = [(text[k], text[v]) for k, v in table["pair_strings"].tolist()]
        assert {kv for kv in listed if kv != ("", "")} == {kv for attrs in live for kv in attrs}
        assert sorted(text) == sorted({x for kv in listed for x in kv})  # each string once, none unused
        again = CostStore()
        again.restore(store.state())
        assert sorted(again.points(), key=repr) == sorted(store.points(), key=repr)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(("put", "remove", "find")), st.integers(0, 40)), max_size=200),
       st.sampled_from((hash, lambda v: 0, lambda v: v % 5, lambda v: -v)), st.sampled_from((1, 3, 1 << 15)))
def test_values_found_by_value_as_a_dict_finds_them(ops: list[tuple[str, int]], hash_of, piece: int) -> None:
    """`ByValue` against a dict: values put, removed (their index reused) and looked up, one at a
    time and many at once (a piece at a time), with hashes that collide all the time and negative
    ones, in a table that starts at 4 slots and is rebuilt as values come and go."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("otelgpu.core.byvalue.FIND_PIECE", piece)
        _found_as_a_dict_finds_them(ops, hash_of)


def test_values_found_many_at_once_hold_a_piece_of_them_at_a_time() -> None:
    """What a look-up of many values at once builds per value (the hashes, the slots probed, the
    values compared) is held for a piece of them at a time: 300,000 sets of pairs looked up take
    under 20 bytes each at the peak, 8 of them the answer (the store looks up 1.5 million parts
    at once at 100,000 GPUs: all at once, some 150 MiB)."""
    values = [(("pod", f"p{i}"), ("team", "a")) for i in range(300_000)]
    table = ByValue(values)
    table.put_all(range(0, len(values), 2), [hash(v) for v in values[::2]])
    wanted = [tuple(v) for v in values]  # equal, not the same objects
    tracemalloc.start()
    try:
        found = table.find_all(wanted)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert found.tolist() == [i if i % 2 == 0 else -1 for i in range(len(values))]
    assert peak < 20 * len(values)


def _found_as_a_dict_finds_them(ops: list[tuple[str, int]], hash_of) -> None:  # noqa: ANN001
    values: list = []
    free: list[int] = []
    table, reference = ByValue(values, hash_of, least=4), {}
    for op, value in ops:
        if op == "put" and value not in reference:
            index = free.pop() if free else len(values)
            if index == len(values):
                values.append(None)
            values[index] = value
            table.put(index, hash_of(value))
            reference[value] = index
        elif op == "remove" and value in reference:
            index = reference.pop(value)
            table.remove(index)
            values[index] = None
            free.append(index)
        assert table.find(value) == reference.get(value, -1)
        assert table.find_all([value, value + 1]).tolist() == [table.find(value), table.find(value + 1)]
    assert sorted(table.indices()) == sorted(reference.values())
    assert all(table.find(v) == i for v, i in reference.items())
    assert table.find_all(list(range(42))).tolist() == [reference.get(v, -1) for v in range(42)]


POOL = [(), (("a", "1"),), (("a", "1"), ("b", "2")), (("a", "2"), ("b", "2")), (("b", "2"), ("c", "3")),
        (("a", "1"), ("c", "3"), ("d", "4")), (("e", "5"),)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, len(POOL) - 1), max_size=8)), max_size=25))
def test_sets_added_and_found_many_at_once_are_counted_as_one_by_one(steps: list[tuple[bool, list[int]]]) -> None:
    """The store's sets added all at once (`add_all`: a set twice among them, equal sets as
    distinct objects, the empty set; a few sets and pairs at a time) and released: each live set
    keeps one index, found by value one at a time or all at once, counted by its users; the pairs
    are those of the live sets, each counted by the sets that have it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("otelgpu.core.byvalue.FIND_PIECE", 3)
        patch.setattr("otelgpu.exporter.store.SETS_AT_ONCE", 2)
        _counted_as_one_by_one(steps)


def _counted_as_one_by_one(steps: list[tuple[bool, list[int]]]) -> None:
    sets = CostStore()._sets
    users: dict[tuple, int] = {}
    index: dict[tuple, int] = {}
    for add, picks in steps:
        chosen = [tuple(map(tuple, map(list, POOL[k]))) for k in picks]  # copies: equal, not the same objects
        if add:
            got = sets.add_all(chosen).tolist()
            for attrs, at in zip(chosen, got):
                assert index.setdefault(attrs, at) == at
                users[attrs] = users.get(attrs, 0) + 1
        else:
            live = [attrs for attrs in chosen if users.get(attrs)][:1]
            chosen = live * min(2, users[live[0]]) if live else []  # one set, let go of twice when it can be
            sets.release([index[attrs] for attrs in chosen])
            for attrs in chosen:
                users[attrs] -= 1
                if not users[attrs]:
                    del users[attrs], index[attrs]
        assert sets.find_all(POOL).tolist() == [index.get(attrs, -1) for attrs in POOL]
        assert [sets.find(attrs) for attrs in POOL] == [index.get(attrs, -1) for attrs in POOL]
        assert all(sets.value(at) == attrs and sets._users[at] == users[attrs] for attrs, at in index.items())
        pairs = sets._pairs
        assert sorted(pairs.keys()) == sorted({kv for attrs in users for kv in attrs})
        assert all(pairs._refs[pairs.find(kv)] == sum(kv in attrs for attrs in users) for kv in pairs.keys())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sets(st.integers(0, 11), max_size=12), min_size=2, max_size=8), st.integers(1, 7))
def test_a_plan_looked_up_ahead_records_as_the_lookup_at_the_close_and_a_stale_one_is_ignored(
        intervals: list[set[int]], stale_at: int) -> None:
    """An interval computed ahead looks its series' rows up then; should anything be recorded
    between (it never is in the pipeline), the plan's rows would be wrong and must not be used."""
    def sums(keys: set[int]) -> dict:
        return {"allocated": {_series(k): 1.0 + k for k in keys}, "held": {_series(k): 2.0 for k in keys if k % 2}}

    planned, plain = CostStore(end_after_intervals=1), CostStore(end_after_intervals=1)
    early = None
    for i, keys in enumerate(intervals):
        plan = early if i == stale_at else planned.plan(sums(keys))  # early: made before the last record
        if i + 1 == stale_at and i + 1 < len(intervals):
            early = planned.plan(sums(intervals[i + 1]))
        expected = plain.record(i * 60, (i + 1) * 60, sums(keys), {})
        assert list(map(repr, planned.record(i * 60, (i + 1) * 60, sums(keys), {}, plan))) == list(map(repr, expected))


def test_a_plan_keeps_the_numbers_of_its_parts_but_not_the_sets_it_looked_up_by_them() -> None:
    """A plan is held from the computation ahead to the close; the sets the look-ups found by
    their parts (16 bytes a set named by parts, some 9 MiB at 100,000 GPUs) serve no look-up then."""
    store = CostStore()
    bases = [_series(k) for k in range(2000)]
    named = Extended(bases, EXTRAS[:2], np.repeat(np.arange(2000), 2), np.tile(np.arange(2), 2000))

    def sums() -> dict:
        return {"allocated": Packed.columns(named, np.ones(len(named)))}

    twin = CostStore()
    for each in (store, twin):
        each.record(0, 60, sums(), {})  # the sets are named by their parts from now on
    plan = store.plan(sums())
    assert (plan.rows["allocated"] >= 0).all()  # every series found
    held = sum(a.nbytes for value in plan.parts.values() if isinstance(value, tuple)
               for a in value if isinstance(a, np.ndarray))
    assert held <= 8 * (len(bases) + 2)  # each part's number
    assert list(map(repr, store.record(60, 120, sums(), {}, plan))) == list(map(repr, twin.record(60, 120, sums(), {})))


EXTRAS = ((), (("cost_model", "request"),), (("cost_model", "scad"), ("resource", "cpu")), (("team", "override"),))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 3), st.booleans()), max_size=12),
                min_size=1, max_size=8), st.integers(1, 2))
def test_series_named_by_their_parts_or_by_value_record_the_same(intervals: list[list[tuple[int, int, bool]]],
                                                                 end_after: int) -> None:
    """The cost models name their series by parts (a base set and the attributes added to it, as
    `Extended`), and the store finds those series by the parts' numbers; series given as sets
    (restored, projected, the tenants'), or named by other parts than before (an extra that
    replaces a base's attribute), by value. Fed either way, a store records the same points, a
    plan made ahead included, and each set named by parts is found by them in the next interval."""
    by_parts, by_value = CostStore(end_after_intervals=end_after), CostStore(end_after_intervals=end_after)
    for i, named in enumerate(intervals):
        bases = [tuple(list(_series(k))) for k in range(10)]  # new objects each interval, as the join makes
        chosen: dict[tuple, tuple[int, int, bool]] = {}
        for k, e, as_parts in named:  # parts that make a set already chosen are left out: sets are distinct
            chosen.setdefault(with_attrs(bases[k], dict(EXTRAS[e])), (k, e, as_parts))
        parts = list(chosen.values())
        extended = Extended(bases, EXTRAS, np.array([k for k, _, _ in parts], np.int64),
                            np.array([e for _, e, _ in parts], np.int64))
        values = np.arange(1.0, len(parts) + 1)
        mixed = {"allocated": Packed.columns(extended, values),
                 "held": {with_attrs(bases[k], dict(EXTRAS[e])): 2.0 for k, e, as_parts in parts if not as_parts}}
        plain = {m: dict(series.items()) for m, series in mixed.items()}
        plan = by_parts.plan(mixed) if i % 2 else None
        got = by_parts.record(i * 60, (i + 1) * 60, mixed, {}, plan)
        assert list(map(repr, got)) == list(map(repr, by_value.record(i * 60, (i + 1) * 60, plain, {})))
        assert by_parts.active_series() == by_value.active_series()
        again = Extended([tuple(list(b)) for b in bases], EXTRAS, extended.base, extended.extra)
        assert by_parts._sets.find_named(again, {}).tolist() == [by_parts._sets.find(s) for s in extended]


def test_an_ended_sets_parts_are_forgotten() -> None:
    """A set that ends lets its parts go: what named only it is forgotten, and its index, given to
    a new set, is not found by the old parts."""
    store = CostStore(end_after_intervals=1)
    bases = [_series(1), _series(2)]
    both = Extended(bases, EXTRAS, np.array([0, 1]), np.array([1, 1]))
    store.record(0, 60, {"allocated": Packed.columns(both, np.ones(2))}, {})
    assert store._sets.find_named(both, {}).tolist() == [0, 1]
    store.record(60, 120, {"allocated": Packed.columns(Extended(bases, EXTRAS, np.array([1]), np.array([1])),
                                                       np.ones(1))}, {})  # the first set ends
    assert store._sets._bases.find(bases[0]) == -1 and store._sets._bases.find(bases[1]) >= 0
    other = Extended([_series(3), bases[1]], EXTRAS, np.array([0, 1]), np.array([2, 1]))
    store.record(120, 180, {"allocated": Packed.columns(other, np.ones(2))}, {})
    assert store._sets.find(other[0]) == 0  # the index the ended set left
    assert store._sets.find_named(both, {}).tolist() == [-1, 1]
    assert store._sets.find_named(other, {}).tolist() == [0, 1]


METRICS = ("allocated", "held", "waste")


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 7), st.sampled_from(METRICS), st.booleans()), max_size=16),
                min_size=1, max_size=10), st.integers(1, 3))
def test_each_metric_of_a_set_lives_and_ends_on_its_own(intervals: list[list[tuple[int, str, bool]]],
                                                        end_after: int) -> None:
    """A set's sums end one metric at a time (a pod's waste stops while its allocation goes on),
    and come back: each (metric, set) is a series of its own, and
    its total is the sum of its increments since it (re)started, as a plain dict keeps them."""
    pool = {k: _series(k) for k in range(8)}
    store = CostStore(end_after_intervals=end_after)
    kept: dict[tuple[str, tuple], list[float]] = {}  # (metric, set) -> [value, intervals quiet]
    for i, named in enumerate(intervals):
        sums: dict[str, dict[tuple, float]] = {m: {} for m in METRICS}
        for k, metric, copy in named:
            sums[metric][tuple(list(pool[k])) if copy else pool[k]] = 1.0 + k + i / 8
        got = {(p.metric, p.attrs): p.value for p in store.record(i * 60, (i + 1) * 60, sums, {}) if not p.ended}
        for series in kept.values():
            series[1] += 1
        for metric, values in sums.items():
            for attrs, value in values.items():
                series = kept.setdefault((metric, attrs), [0.0, 0])
                series[0] += value
                series[1] = 0
        kept = {key: series for key, series in kept.items() if series[1] < end_after}
        assert got == {key: series[0] for key, series in kept.items()}


class _Checked(CostStore):
    """A store whose every snapshot is also built the reference way, and held to it."""

    def _snapshot(self, rows, end_ns, table, after):  # noqa: ANN001, ANN202
        want = _plain(self._snapshot_reference(rows, end_ns, list(table), after))
        got = super()._snapshot(rows, end_ns, table, after)
        assert _plain(got) == want
        self.checked += 1
        return got


def _plain(points) -> list[tuple]:  # noqa: ANN001 - points as comparable tuples (an ended point's NaN left out)
    return [(p.metric, p.attrs, p.start_ns, p.time_ns, None if p.ended else p.value, p.ended) for p in points]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.lists(st.tuples(st.integers(0, 7), st.sampled_from(METRICS)), max_size=12),
                          st.sets(st.integers(0, 7), max_size=6)), min_size=1, max_size=8), st.integers(1, 3))
def test_a_snapshot_taken_straight_into_its_columns_is_the_stacked_parts(
        intervals: list[tuple[list[tuple[int, str]], set[int]]], end_after: int) -> None:
    """Sums that go on, end and come back, gauges that come and go: every snapshot `record`
    takes straight into its columns is the one its parts stacked give."""
    pool = {k: _series(k) for k in range(8)}
    store = _Checked(end_after_intervals=end_after)
    store.checked = 0
    for i, (named, gauged) in enumerate(intervals):
        sums: dict[str, dict[tuple, float]] = {m: {} for m in METRICS}
        for k, metric in named:
            sums[metric][pool[k]] = 1.0 + k + i / 8
        store.record(i * 60, (i + 1) * 60, sums, {"activity": {pool[k]: k / 8 for k in gauged}})
    assert store.checked == len(intervals)


def test_the_points_of_a_snapshot_all_at_its_end_hold_one_time_not_a_column() -> None:
    """Every point of an interval's snapshot is at its end: read as a column, held as one number
    (8 bytes a point fewer from the record to the send); a part at another time, which `record`
    never hands it, gets a column of its own."""
    store = _Checked()
    store.checked = 0
    pod = _series(1)
    snapshot = store.record(0, 60, {"allocated": {pod: 1.0}, "held": {pod: 2.0}}, {"activity": {pod: 0.5}})
    assert snapshot.time_ns.strides == (0,) and snapshot.time_ns.tolist() == [60, 60, 60]
    earlier = Points(store.metric_keys, [pod], np.zeros(1), np.zeros(1), np.zeros(1), np.full(1, 30), np.ones(1),
                     np.zeros(1, bool))
    mixed = store._snapshot(np.zeros(0, np.int64), 60, store._table(), [earlier])
    assert mixed.time_ns.strides == (8,) and mixed.time_ns.tolist() == [30] and store.checked == 2


class _Renumbering(CostStore):
    BORN_LIMIT = 3  # the creation numbers renumbered before nearly every new series
    renumbered = 0

    def _renumber_births(self) -> None:
        super()._renumber_births()
        self.renumbered += 1


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 7), st.sampled_from(METRICS)), max_size=12), min_size=1,
                max_size=10), st.integers(1, 3))
def test_sums_stay_oldest_first_when_their_creation_numbers_are_renumbered(
        intervals: list[list[tuple[int, str]]], end_after: int) -> None:
    """Snapshots list sums oldest first by a creation number that is renumbered, in its order,
    before it passes 32 bits: a store that renumbers before nearly every new series gives the
    snapshots of one that never does, as series end, come back and reuse the rows of others."""
    pool = {k: _series(k) for k in range(8)}
    plain, renumbering = CostStore(end_after_intervals=end_after), _Renumbering(end_after_intervals=end_after)
    for i, named in enumerate(intervals):
        sums: dict[str, dict[tuple, float]] = {m: {} for m in METRICS}
        for k, metric in named:
            sums[metric][pool[k]] = 1.0 + k + i / 8
        assert _plain(renumbering.record(i * 60, (i + 1) * 60, sums, {})) == _plain(plain.record(i * 60, (i + 1) * 60,
                                                                                               sums, {}))
    assert renumbering.renumbered > 0 or plain._births <= _Renumbering.BORN_LIMIT


def test_a_sum_restored_quiet_longer_than_this_run_ends_series_after_ends_at_the_next_interval() -> None:
    """A checkpoint of a run that ended series later may hold a sum quiet for more intervals than
    this run keeps (at most 10,000): it ends at the next interval, as one quiet for exactly as
    many would; a negative count is a malformed state."""
    earlier = CostStore(end_after_intervals=10_000)
    earlier.record(0, 60, {"allocated": {_series(1): 1.0, _series(2): 2.0}}, {})
    state = earlier.state()
    state["columns"]["quiet"] = np.array([70_000, 0], np.int64)
    store = CostStore(end_after_intervals=3)
    store.restore(state)
    points = store.record(60, 120, {"allocated": {_series(2): 1.0}}, {})
    assert [(p.attrs, p.ended) for p in points] == [(_series(2), False), (_series(1), True)]
    state["columns"]["quiet"] = np.array([-1, 0], np.int64)
    with pytest.raises(ValueError, match="malformed"):
        CostStore().restore(state)
    with pytest.raises(ValueError, match="end_after_intervals"):
        CostStore(end_after_intervals=10_001)


def test_the_join_names_holders_by_the_store_s_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the store holds a pod's scad series (CPU and memory, named by the pod's attributes),
    each later interval's join names the pod by the store's set rather than a copy of its own."""
    named: list = []
    holder = SeriesAttributes._holder

    def recorded(self, *args):  # noqa: ANN001, ANN202
        known = holder(self, *args)
        named.append(known[0])
        return known
    monkeypatch.setattr(SeriesAttributes, "_holder", recorded)
    node = Node("gpu-1", "p4d.24xlarge", 96, 1152, units=[Unit(f"GPU-{i}", A100) for i in range(2)],
                capacity={"nvidia_com_gpu": 2})
    pods = [Pod("ml", f"train-{i}", "gpu-1", labels={"team": "vision"}, cpu=8, memory_gib=64,
                gpu=("nvidia_com_gpu", 1), holds=(f"GPU-{i}",), activity=0.5) for i in range(2)]
    p = offline_pipeline(make_config(attribution__interval_seconds=300, attribution__cost_models=["scad"],
                                     attribution__prices__gpu_hour_by_gpu_model={A100: 12.0}))
    feed(p, *Cluster([node], pods).scrapes(60, 1800))
    p.close_due()
    pods_named = [attrs for attrs in named if dict(attrs).get("pod")]
    later = pods_named[len(pods_named) // 2:]  # intervals after the store met each pod
    # An equal copy looked up in the store gives the very object the join named the pod by.
    assert later and all(p.store.kept(tuple(list(attrs))) is attrs for attrs in later)
