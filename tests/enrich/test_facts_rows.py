"""kube-state-metrics rows applied once per series: an interval repeats each series once per scrape,
and `KsmFacts.update` applies only the last of rows that differ in nothing but their timestamp.
The facts must come out exactly as if every row had been applied one by one."""

from __future__ import annotations

import dataclasses
import json
import math
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otelgpu.enrich.factrows import share
from otelgpu.enrich.facts import KsmFacts, last_of_each, last_of_each_reference, latest
from otelgpu.receiver.decode import PointBatch
from otelgpu.receiver.interner import Interner
from otelgpu.receiver.schema import Metric

NS = 10**9

# A small world, so rows keep meeting the same objects and fields from different series.
_POD = st.fixed_dictionaries({"namespace": st.sampled_from(["ml", "web"]), "pod": st.sampled_from(["a", "b", "c"])})
_ROWS = {
    Metric.POD_INFO: st.fixed_dictionaries({"node": st.sampled_from(["n1", "n2", ""]),
                                            "created_by_kind": st.sampled_from(["ReplicaSet", "Job"]),
                                            "created_by_name": st.sampled_from(["r1", "j1"]),
                                            "uid": st.sampled_from(["u1", "u2"])}),
    Metric.POD_LABELS: st.fixed_dictionaries({"label_team": st.sampled_from(["x", "y"])}),
    Metric.POD_ANNOTATIONS: st.fixed_dictionaries({"annotation_model": st.sampled_from(["m1", "m2"])}),
    Metric.POD_PHASE: st.fixed_dictionaries({"phase": st.sampled_from(["Running", "Pending"])}),
    Metric.POD_REQUESTS: st.fixed_dictionaries({"resource": st.sampled_from(["nvidia_com_gpu", "cpu"]),
                                                "container": st.sampled_from(["main", "side"]),
                                                "node": st.sampled_from(["n1", "n2"])}),
}
_OTHER = {
    Metric.NODE_LABELS: st.fixed_dictionaries({"node": st.sampled_from(["n1", "n2"]),
                                               "label_pool": st.sampled_from(["p1", "p2"])}),
    Metric.NODE_CAPACITY: st.fixed_dictionaries({"node": st.sampled_from(["n1", "n2"]),
                                                 "resource": st.sampled_from(["nvidia_com_gpu", "cpu"])}),
    Metric.NAMESPACE_LABELS: st.fixed_dictionaries({"namespace": st.sampled_from(["ml", "web"]),
                                                    "label_team": st.sampled_from(["x", "y"])}),
    Metric.REPLICASET_OWNER: st.fixed_dictionaries({"namespace": st.just("ml"), "replicaset": st.just("r1"),
                                                    "owner_kind": st.sampled_from(["Deployment", "<none>"]),
                                                    "owner_name": st.sampled_from(["d1", "<none>"]),
                                                    "owner_is_controller": st.sampled_from(["true", "false"])}),
}


@st.composite
def _row(draw: st.DrawFn) -> tuple[int, dict[str, str], float, bool]:
    metric = draw(st.sampled_from(sorted(_ROWS) + sorted(_OTHER)))
    labels = draw(_ROWS[metric]) if metric in _ROWS else draw(_OTHER[metric])
    if metric in _ROWS:
        labels = {**draw(_POD), **labels}
    stale = draw(st.booleans().filter(lambda b: b) if draw(st.integers(0, 7)) == 0 else st.just(False))
    value = math.nan if stale else draw(st.sampled_from([0.0, -0.0, 1.0, 2.0, 0.5]))
    return int(metric), labels, value, stale


@st.composite
def _scrapes(draw: st.DrawFn) -> list[tuple[int, int, dict[str, str], float, bool]]:
    """Scrapes repeating a state that changes a little between them, rows in time order."""
    state = draw(st.lists(_row(), min_size=1, max_size=12))
    rows = []
    for k in range(draw(st.integers(1, 5))):
        if draw(st.booleans()):
            state = state + draw(st.lists(_row(), max_size=3))
        if draw(st.booleans()) and len(state) > 1:
            state = state[1:]
        order = draw(st.permutations(range(len(state))))
        same_time = draw(st.booleans())  # a Collector resending a scrape: the same rows, same time
        for i in order:
            rows.append((k * 15 * NS if not same_time else 0, *state[i]))
    return sorted(rows, key=lambda r: r[0])


def _batch(strings: Interner, rows: list[tuple[int, int, dict[str, str], float, bool]]) -> PointBatch:
    keys, vals, off = [], [], [0]
    for _, _, labels, _, _ in rows:
        for k, v in labels.items():
            keys.append(strings.code(k))
            vals.append(strings.code(v))
        off.append(len(keys))
    n = len(rows)
    none = np.full(n, -1, np.int32)
    return PointBatch(np.array([r[1] for r in rows], np.int16), np.array([r[0] for r in rows], np.int64),
                      np.array([r[3] for r in rows], np.float64), np.array([r[4] for r in rows], bool), none, none,
                      np.array(off, np.int64), np.array(keys, np.int32), np.array(vals, np.int32))


def _canonical(facts: KsmFacts) -> dict:
    """The facts as comparable values, in no particular order (new objects, and the keys of a
    node's capacity or a pod's requests, may be met in another order)."""
    def plain(key: object, obj: object) -> str:
        d = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        for name in ("requests", "capacity"):
            if name in d:
                d[name] = sorted([list(k) if isinstance(k, tuple) else k, v] for k, v in d[name].items())
        return json.dumps([key, d], sort_keys=True)

    return {name: sorted(plain(k, o) for k, o in getattr(facts, name).items())
            for name in ("pods", "nodes", "namespaces", "owners")}


@settings(max_examples=300, deadline=None)
@given(_scrapes())
def test_once_per_series_is_the_same_as_row_by_row(rows):
    strings = Interner()
    batch = _batch(strings, rows)
    at_once, one_by_one = KsmFacts(strings, ttl_ns=NS), KsmFacts(strings, ttl_ns=NS)
    assert at_once.update(batch) == len(rows)
    for i in range(len(rows)):
        one_by_one.update(batch.select(np.array([i])))
    assert _canonical(at_once) == _canonical(one_by_one)


@settings(max_examples=300, deadline=None)
@given(_scrapes(), _scrapes())
def test_a_mark_puts_back_every_fact_that_rows_after_it_change(before, after):
    """An interval computed ahead applies its rows, then may be put back: requests, labels and
    every other fact come back as they were, though the pods' objects were copied, not their
    dicts; applied again, the rows give what they give without the mark."""
    strings = Interner()
    facts, plain = KsmFacts(strings, ttl_ns=NS), KsmFacts(strings, ttl_ns=NS)
    later = [(t + 100 * NS, *row) for t, *row in after]  # newer than every row before
    for each in (facts, plain):
        each.update(_batch(strings, before))
    kept = _canonical(facts)
    undo = facts.mark()
    facts.update(_batch(strings, later))
    undo()
    assert _canonical(facts) == kept
    facts.update(_batch(strings, later))
    plain.update(_batch(strings, later))
    assert _canonical(facts) == _canonical(plain)


def test_pods_share_their_request_keys_and_quantities_and_a_zero_keeps_its_sign():
    strings = Interner()
    facts = KsmFacts(strings, ttl_ns=NS)

    def request(t: int, pod: str, resource: str, quantity: float) -> tuple:
        labels = {"namespace": "ml", "pod": pod, "container": "main", "resource": resource}
        return t * NS, int(Metric.POD_REQUESTS), labels, quantity, False

    facts.update(_batch(strings, [request(0, "a", "cpu", 4.0), request(0, "b", "cpu", 4.0),
                                  request(0, "a", "memory", 0.0)]))
    a, b = facts.pods[("ml", "a")], facts.pods[("ml", "b")]
    (key_a, cpu_a), = [(k, v) for k, v in a.requests.items() if k[1] == "cpu"]
    (key_b, cpu_b), = b.requests.items()
    assert key_a is key_b and cpu_a is cpu_b and cpu_a == 4.0
    facts.update(_batch(strings, [request(1, "a", "memory", -0.0)]))
    assert math.copysign(1.0, facts.pods[("ml", "a")].requests[("main", "memory")]) == -1.0


def test_pods_of_a_workload_share_their_maps_and_a_pod_that_changes_gets_its_own():
    strings = Interner()
    facts = KsmFacts(strings, ttl_ns=NS)

    def pod_rows(t: int, pod: str, team: str, memory: float) -> list[tuple]:
        who = {"namespace": "ml", "pod": pod}
        return [(t * NS, int(Metric.POD_LABELS), {**who, "label_team": team}, 1.0, False),
                (t * NS, int(Metric.POD_ANNOTATIONS), who, 1.0, False),
                (t * NS, int(Metric.POD_REQUESTS), {**who, "container": "main", "resource": "cpu"}, 4.0, False),
                (t * NS, int(Metric.POD_REQUESTS), {**who, "container": "main", "resource": "memory"}, memory, False)]

    facts.update(_batch(strings, pod_rows(0, "a", "x", 2.0) + pod_rows(0, "b", "x", 2.0) + pod_rows(0, "c", "y", 0.0)))
    a, b, c = (facts.pods[("ml", name)] for name in "abc")
    assert a.labels is b.labels and a.annotations is b.annotations is c.annotations and a.requests is b.requests
    assert c.labels is not a.labels and c.labels == {"label_team": "y"} and a.labels == {"label_team": "x"}
    assert c.requests is not a.requests  # a zero quantity: not taken as equal to anything

    facts.update(_batch(strings, pod_rows(1, "b", "z", 2.0)))  # relabelled: its own map, a's as it was
    assert facts.pods[("ml", "b")].labels == {"label_team": "z"} and a.labels == {"label_team": "x"}

    back = KsmFacts(strings, ttl_ns=NS)
    back.restore(facts.state())
    a, b, c = (back.pods[("ml", name)] for name in "abc")
    assert a.requests is b.requests and a.annotations is c.annotations and a.labels is not b.labels
    assert _canonical(back) == _canonical(facts)


@settings(max_examples=300, deadline=None)
@given(_scrapes(), st.randoms(use_true_random=False))
def test_the_kernel_matches_its_reference(rows, rnd):
    strings = Interner()
    batch = _batch(strings, rows)
    subset = np.array(sorted(rnd.sample(range(len(rows)), rnd.randint(0, len(rows)))), np.int64)
    want = last_of_each_reference(subset, batch)
    got = last_of_each(subset, batch.metric, batch.value.view(np.int64), batch.stale, batch.attr_off,
                       batch.attr_key, batch.attr_val)
    assert got.tolist() == want.tolist()


def test_repeated_scrapes_apply_one_row_per_series():
    strings = Interner()
    one = [(0, int(Metric.POD_LABELS), {"namespace": "ml", "pod": "a", "label_team": "x"}, 1.0, False),
           (0, int(Metric.POD_PHASE), {"namespace": "ml", "pod": "a", "phase": "Running"}, 1.0, False)]
    rows = [(t * NS, *r[1:]) for t in range(4) for r in one]
    rows[5] = (rows[5][0], rows[5][1], rows[5][2], 0.0, False)  # the phase series, once with another value
    batch = _batch(strings, rows)
    keep = last_of_each(np.arange(len(rows)), batch.metric, batch.value.view(np.int64), batch.stale,
                        batch.attr_off, batch.attr_key, batch.attr_val)
    assert np.flatnonzero(keep).tolist() == [5, 6, 7]  # the last of each, the odd value kept
    facts = KsmFacts(strings, ttl_ns=NS)
    facts.update(batch)
    pod = facts.pods[("ml", "a")]
    assert pod.labels == {"label_team": "x"} and pod.phase == "Running" and pod.seen_ns == 3 * NS


def test_labels_in_another_order_are_another_row():
    strings = Interner()
    a = {"namespace": "ml", "pod": "a", "label_team": "x"}
    b = {"label_team": "x", "pod": "a", "namespace": "ml"}
    batch = _batch(strings, [(0, int(Metric.POD_LABELS), a, 1.0, False), (NS, int(Metric.POD_LABELS), b, 1.0, False)])
    rows = np.arange(2)
    args = (batch.metric, batch.value.view(np.int64), batch.stale, batch.attr_off, batch.attr_key, batch.attr_val)
    assert last_of_each(rows, *args).tolist() == [True, True]  # not deduplicated: still exact


def test_rows_out_of_time_order_are_all_applied():
    """Late rows applied at once come in arrival order. There the last of a series is not the one
    that counts: here the first row is the newest, and applying only the last repeat of it would
    let the row in between win."""
    strings = Interner()
    x = (int(Metric.POD_LABELS), {"namespace": "ml", "pod": "a", "label_team": "x"}, 1.0, False)
    y = (int(Metric.POD_LABELS), {"namespace": "ml", "pod": "a", "label_team": "y"}, 1.0, False)
    facts = KsmFacts(strings, ttl_ns=NS)
    facts.update(_batch(strings, [(3 * NS, *x), (2 * NS, *y), (NS, *x)]))
    assert facts.pods[("ml", "a")].labels == {"label_team": "x"} and facts.pods[("ml", "a")].seen_ns == 3 * NS


@settings(max_examples=200, deadline=None)
@given(_scrapes(), st.integers(1, 5))
def test_rows_applied_a_chunk_at_a_time_are_applied_as_all_at_once(rows, chunk):
    from otelgpu.enrich import facts as module

    strings = Interner()
    batch = _batch(strings, rows)
    whole, chunked = KsmFacts(strings, ttl_ns=NS), KsmFacts(strings, ttl_ns=NS)
    whole.update(batch)
    default, module.APPLY_CHUNK = module.APPLY_CHUNK, chunk
    try:
        chunked.update(batch)
    finally:
        module.APPLY_CHUNK = default
    for name in ("pods", "nodes", "namespaces", "owners"):  # the same facts, met in the same order
        assert list(getattr(whole, name).items()) == list(getattr(chunked, name).items())


@settings(max_examples=300, deadline=None)
@given(_scrapes(), st.randoms(use_true_random=False))
def test_rows_folded_as_they_arrive_apply_as_all_of_them_at_the_close(rows, rnd):
    """An open interval folds its rows (`latest`) as batches arrive, in any order and resent;
    at its close what is left, in time order, makes the same facts, met in the same order, as
    every row it was sent."""
    from otelgpu.receiver.decode import PointBatch as Batch

    strings = Interner()
    arrival = rnd.sample(rows, len(rows)) + rnd.sample(rows, rnd.randint(0, len(rows)))  # any order, some resent
    batches = [_batch(strings, arrival[lo:lo + 3]) for lo in range(0, len(arrival), 3)]
    every = Batch.concat(batches)
    every = every.select(np.argsort(every.time_ns, kind="stable"))  # as the close ordered them before folding
    folded: list = []
    for batch in batches:
        folded = [latest(Batch.concat(folded + [batch]))] if rnd.random() < 0.5 else folded + [batch]
    at_close = latest(Batch.concat(folded))
    assert len(at_close) <= len(every)
    want, got = KsmFacts(strings, ttl_ns=NS), KsmFacts(strings, ttl_ns=NS)
    want.update(every)
    got.update(at_close)
    for name in ("pods", "nodes", "namespaces", "owners"):
        assert list(getattr(want, name).items()) == list(getattr(got, name).items())
    assert want.reported_ns == got.reported_ns


def _phases_facts(batch: PointBatch, strings: Interner) -> tuple[dict, dict]:
    """The facts of every kube-state-metrics row of `batch`, and those of the rows `fact_rows`
    keeps, each with the newest pod row applied."""
    from otelgpu.enrich.facts import fact_rows
    from otelgpu.receiver.schema import is_ksm

    every, kept = KsmFacts(strings, ttl_ns=NS), KsmFacts(strings, ttl_ns=NS)
    every.update(batch.select(is_ksm(batch.metric)))
    kept.update(batch.select(fact_rows(batch)))
    return ({**_canonical(every), "reported": [every.reported_ns]},
            {**_canonical(kept), "reported": [kept.reported_ns]})


def test_the_facts_leave_out_only_the_phases_a_pod_is_not_in_of_a_real_scrape():
    """kube-state-metrics as the Collector's prometheus receiver sends it (shared fixture): the
    facts keep every row but kube_pod_status_phase's 0s, and come out the same as from every row."""
    from support import otlp_fixture

    from otelgpu.enrich.facts import fact_rows
    from otelgpu.receiver.decode import decode_reference
    from otelgpu.receiver.schema import is_ksm

    strings = Interner()
    batch = decode_reference(otlp_fixture("otlp_ksm_scrape_collector_v0.142.json"), strings)
    kept = fact_rows(batch)
    phase = batch.metric == Metric.POD_PHASE
    assert (phase & (batch.value == 0.0)).sum() >= 4 * (phase & (batch.value == 1.0)).sum() > 0  # 4 in 5
    assert kept.tolist() == (is_ksm(batch.metric) & ~(phase & (batch.value == 0.0))).tolist()
    every, some = _phases_facts(batch, strings)
    assert some == every and every["pods"]


def test_a_phase_row_is_left_out_only_when_it_is_a_value_other_than_1():
    from otelgpu.enrich.facts import fact_rows

    strings = Interner()
    pod = {"namespace": "ml", "pod": "a"}
    rows = [(0, int(Metric.POD_PHASE), {**pod, "phase": "Running"}, 1.0, False),
            (0, int(Metric.POD_PHASE), {**pod, "phase": "Pending"}, 0.0, False),
            (NS, int(Metric.POD_PHASE), {**pod, "phase": "Running"}, math.nan, True),  # the pod ends
            (NS, int(Metric.POD_PHASE), {**pod, "phase": "Pending"}, math.nan, True),
            (0, int(Metric.POD_LABELS), {**pod, "label_team": "x"}, 1.0, False),
            (0, int(Metric.GPU_UTIL), {"UUID": "GPU-1"}, 0.0, False)]  # not kube-state-metrics
    assert fact_rows(_batch(strings, rows)).tolist() == [True, False, True, True, True, False]


@st.composite
def _ksm_scrapes(draw: st.DrawFn) -> list[tuple[int, int, dict[str, str], float, bool]]:
    """Scrapes as kube-state-metrics writes them: each pod reported has one kube_pod_status_phase
    series per phase, 1 for its phase and 0 for the others, beside its other series; a pod gone
    has staleness markers on all of them at the first scrape without it; phases change."""
    phases = ["Pending", "Running", "Succeeded", "Failed", "Unknown"]
    pods = [("ml", name) for name in "abcd"]
    rows: list = []
    alive: dict[tuple[str, str], str] = {}
    for k in range(draw(st.integers(1, 5))):
        t = k * 15 * NS
        for key in pods:
            ns, name = key
            here = draw(st.booleans()) if key in alive else draw(st.integers(0, 2)) > 0
            ident = {"namespace": ns, "pod": name, "uid": f"{name}-{draw(st.integers(0, 1))}"}
            if not here:
                if alive.pop(key, None) is not None:  # its series end
                    rows += [(t, int(Metric.POD_PHASE), {**ident, "phase": p}, math.nan, True) for p in phases]
                    rows.append((t, int(Metric.POD_LABELS), {**ident, "label_team": "x"}, math.nan, True))
                continue
            alive[key] = draw(st.sampled_from(phases))
            extra = [(m, draw(_ROWS[m])) for m in draw(st.lists(st.sampled_from(sorted(_ROWS)), max_size=2))]
            series = [(int(Metric.POD_PHASE), {**ident, "phase": p}, 1.0 if p == alive[key] else 0.0) for p in phases]
            series += [(int(Metric.POD_LABELS), {**ident, "label_team": draw(st.sampled_from("xy"))}, 1.0)]
            series += [(int(m), {**labels, **ident}, 1.0) for m, labels in extra if m != Metric.POD_PHASE]  # one uid
            order = draw(st.permutations(range(len(series))))
            rows += [(t, series[i][0], series[i][1], series[i][2], False) for i in order]
    return rows


@settings(max_examples=300, deadline=None)
@given(_ksm_scrapes())
def test_the_facts_of_a_pods_phase_are_the_same_without_the_phases_it_is_not_in(rows):
    strings = Interner()
    every, some = _phases_facts(_batch(strings, rows), strings)
    assert some == every


@settings(max_examples=300, deadline=None)
@given(_scrapes(), st.integers(0, 12), st.integers(1, 5))
def test_an_intervals_fact_rows_read_a_piece_at_a_time_give_the_facts_of_their_batch(rows, in_table, piece):
    """`update` of an interval's fact rows (each series' last, some referring to a table the
    intervals share, the rest their own), read `piece` rows at a time, gives the facts of the same
    rows as one batch."""
    from otelgpu.enrich import facts as facts_module
    from otelgpu.enrich.factrows import FactTable

    strings = Interner()
    kept = latest(_batch(strings, rows))
    table = FactTable(kept.select(np.arange(min(in_table, len(kept)))))  # a table that holds some of them
    folded, _ = share(kept, table)
    assert len(folded.own) == len(kept) - len(table)
    whole, pieces = KsmFacts(strings, ttl_ns=NS), KsmFacts(strings, ttl_ns=NS)
    whole.update(kept)
    patch = facts_module.FACT_PIECE
    facts_module.FACT_PIECE = piece
    try:
        assert pieces.update(folded) == len(kept)
    finally:
        facts_module.FACT_PIECE = patch
    assert _canonical(pieces) == _canonical(whole)


# Objects whose rows repeat what the last update applied to them (enrich/repeats.py): only their
# times move. The facts must come out exactly as if every row had been applied again.

@st.composite
def _intervals(draw: st.DrawFn) -> list[tuple[list, str, list, list]]:
    """A cluster's intervals, its state changing a little between them (objects come, go, change
    a field or the order of their series), and what happens at each one's update: nothing, the
    update put back (its mark) and done again, facts forgotten after it, rows applied apart (late
    ones, or newer than the next interval's), the checkpoint of two intervals before restored, the
    interner compacted between the update and its redo. An interval's rows are folded as they
    come, each fold of the rows so far (which may renew the table the intervals share)."""
    state = draw(st.lists(_row(), min_size=1, max_size=10))
    out = []
    for k in range(draw(st.integers(2, 6))):
        if draw(st.booleans()):
            state = state + draw(st.lists(_row(), max_size=2))
        if draw(st.integers(0, 2)) == 0 and len(state) > 1:
            state = state[:-1] if draw(st.booleans()) else state[1:]
        if draw(st.integers(0, 2)) == 0:
            state = [*state[:-1], draw(_row())]
        rows = []
        for scrape in range(draw(st.integers(1, 2))):
            order = draw(st.permutations(range(len(state)))) if draw(st.integers(0, 3)) == 0 else range(len(state))
            rows += [(k * 60 * NS + scrape * 15 * NS, *state[i]) for i in order]
        event = draw(st.sampled_from(["", "", "", "undo", "expire", "late", "restore", "compact"]))
        when = k * 60 * NS + draw(st.sampled_from([-5, 100])) * NS  # before the interval, or past the next one's rows
        late = [(when, *row) for row in draw(st.lists(_row(), max_size=3))]
        folds = sorted(draw(st.lists(st.integers(1, len(rows)), max_size=3)))  # the rows folded so far, each time
        out.append((rows, event, late, folds))
    return out


def _replayed(intervals: list[tuple[list, str, list, list]], repeats: bool, alone: bool, spill: bool) -> list:
    """The facts after each interval's update, its rows referring to a table the intervals share
    as the open intervals keep them; without `repeats`, every row applied each time. `spill`: a
    mark keeps the facts encoded, as with a checkpoint directory, and puts them back decoded."""
    strings = Interner()
    strings.code("dropped at a compaction")  # every code after it moves
    facts = KsmFacts(strings, ttl_ns=30 * NS)
    facts.spill = (lambda state: state) if spill else None
    table, seen, states = None, [], []
    for k, (rows, event, late, folds) in enumerate(intervals):
        for cut in [*folds, len(rows)]:
            folded, table = share(latest(_batch(strings, rows[:cut])), table, fold=True, alone=alone)

        def update() -> int:
            if not repeats:
                facts.repeats.forget(0)
            return facts.update(folded)

        undo = facts.mark()
        used = update()
        if event == "compact":  # the rows' tables rewritten in place, as the open intervals' are
            remap = strings.compact(np.concatenate([a for b in folded.tables() for a in b.codes()]))
            for b in {id(b): b for b in folded.tables()}.values():
                b.remap(remap)
            table = None
        if event in ("compact", "undo"):
            undo()
            used = update()
        elif event == "expire":
            facts.expire(k * 60 * NS + 45 * NS)
        elif event == "late" and late:
            facts.update(_batch(strings, late))
        elif event == "restore" and len(states) >= 2:
            facts.restore(states[-2])
        states.append(facts.state())
        seen.append((used, _canonical(facts), list(facts.pods), facts.reported_ns))
    return seen


@settings(max_examples=300, deadline=None)
@given(_intervals(), st.booleans(), st.booleans())
def test_objects_whose_rows_repeat_come_out_as_if_every_row_were_applied_again(intervals, alone, spill):
    assert _replayed(intervals, True, alone, spill) == _replayed(intervals, False, alone, spill)


def _forty_pods(k: int, phase_of_p7: str) -> list:
    """Interval k's scrape of 40 running pods, pod p7 (first) in `phase_of_p7`: a phase and a
    labels row each."""
    rows = []
    for p in [7, *(p for p in range(40) if p != 7)]:
        ident = {"namespace": "ml", "pod": f"p{p}", "uid": f"u{p}"}
        rows += [(k * 60 * NS, int(Metric.POD_PHASE), {**ident, "phase": phase_of_p7 if p == 7 else "Running"},
                  1.0, False), (k * 60 * NS, int(Metric.POD_LABELS), {**ident, "label_team": "x"}, 1.0, False)]
    return rows


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of rows of each `_apply_rows` call from now on."""
    applied: list[int] = []
    apply_rows = KsmFacts._apply_rows
    monkeypatch.setattr(KsmFacts, "_apply_rows", lambda self, rows: (applied.append(len(rows)),
                                                                     apply_rows(self, rows))[1])
    return applied


def test_a_steady_cluster_applies_only_the_rows_of_the_objects_that_changed(monkeypatch):
    """Of 40 pods whose rows come back each interval, one changes phase: its rows are applied,
    the other pods' times move. Its new row is kept whole beside the table the intervals share
    (which lacks it) and is applied each time, as a row no table holds. Each pod's phase and
    time are as the rows say."""
    strings = Interner()
    facts = KsmFacts(strings, ttl_ns=600 * NS)
    applied = _counted(monkeypatch)
    table = None
    for k, phase in enumerate(["Pending", "Pending", "Running", "Running"]):
        applied.clear()
        folded, table = share(latest(_batch(strings, _forty_pods(k, phase))), table, fold=True)
        assert facts.update(folded) == 80
        assert sum(applied) == [80, 0, 2, 2][k]
        assert facts.pods[("ml", "p7")].phase == phase and facts.pods[("ml", "p3")].phase == "Running"
        assert {p.seen_ns for p in facts.pods.values()} == {k * 60 * NS} == {facts.reported_ns}


@pytest.mark.parametrize("held, applied_rows", [(True, 2), (False, 72)])
def test_objects_repeat_across_the_renewals_of_the_table_between_two_updates(monkeypatch, held, applied_rows):
    """A fold renews the table the intervals share when it lacks some of the fold's rows (more than
    an eighth while another interval reads it), and the folds of one interval may renew it several
    times (each of the rows so far). The places the last update read are carried into the table
    the next one reads. While the rows the last update read are held (by the interval that waits
    for its lateness), each renewal finds them all: of 40 pods, only the one that changed has its
    rows applied. Once they are not, a renewal carries over what the one before it had: the 4
    pods the first fold held repeat, the others are applied."""
    strings = Interner()
    facts = KsmFacts(strings, ttl_ns=600 * NS)
    applied = _counted(monkeypatch)
    first, table = share(latest(_batch(strings, _forty_pods(0, "Pending"))), None, fold=True)
    facts.update(first)
    kept = [first] if held else []
    del first
    batches = [weakref.ref(table.batch)]
    for cut in (10, 40, 80):  # each fold lacks rows of its table, which no other interval reads: each renews it
        folded, table = share(latest(_batch(strings, _forty_pods(1, "Running")[:cut])), table, fold=True,
                              alone=True)
        batches.append(weakref.ref(table.batch))
    assert len({id(b) for b in batches}) == 4 and len(kept) == held
    batches.clear()
    applied.clear()
    assert facts.update(folded) == 80
    assert sum(applied) == applied_rows
    assert facts.pods[("ml", "p7")].phase == "Running" and {p.seen_ns for p in facts.pods.values()} == {60 * NS}


def test_a_row_the_last_update_held_beside_the_table_matches_no_row_of_a_renewed_one(monkeypatch):
    """Pod p7's row is new in interval 1 and kept beside the table; in interval 2 it changes again
    and a fold renews the table with it first. Its row there is not the one applied before: p7 is
    applied, not taken as a repeat."""
    strings = Interner()
    facts = KsmFacts(strings, ttl_ns=600 * NS)
    applied = _counted(monkeypatch)
    table = None
    for k, phase in enumerate(["Pending", "Running", "Failed"]):
        folded, table = share(latest(_batch(strings, _forty_pods(k, phase))), table, fold=True, alone=k == 2)
        assert len(folded.own) == (k == 1)
        applied.clear()
        facts.update(folded)
        assert facts.pods[("ml", "p7")].phase == phase
    assert sum(applied) == 2
