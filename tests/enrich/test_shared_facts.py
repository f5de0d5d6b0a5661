"""The open intervals' kube-state-metrics rows as times and rows of a table they share
(enrich/factrows.py). Whatever the batching, churn, folds and renewals, an interval must close with
the very batch it would have closed with had it kept every row whole: each series' last row, in
time order; a steady cluster's two open intervals must hold its rows once; and a compaction of the
interner must rewrite a shared table once, however many parts and intervals read it."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otelgpu.enrich import window
from otelgpu.enrich.factrows import FactRows, FactTable, carry, find_reference, latest_rows, share
from otelgpu.enrich.facts import latest
from otelgpu.enrich.samples import Samples
from otelgpu.enrich.usage import PodSamples
from otelgpu.enrich.window import NS, Windows
from otelgpu.receiver.decode import PointBatch, empty_batch
from otelgpu.receiver.schema import Metric

COLUMNS = ("metric", "time_ns", "value", "stale", "resource_node", "resource_pod", "attr_off", "attr_key", "attr_val")
METRICS = [int(Metric.POD_INFO), int(Metric.POD_PHASE), int(Metric.POD_LABELS), int(Metric.NODE_LABELS)]

# A row's content: metric, value, staleness, scrape target (node, pod codes), labels (key, value codes)
content = st.tuples(st.sampled_from(METRICS), st.sampled_from([1.0, 0.0, -2.5, np.nan]), st.booleans(),
                    st.integers(-1, 2), st.integers(-1, 2),
                    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=3))


def batch_of(rows: list[tuple]) -> PointBatch:
    """A batch of (time, content) rows."""
    off = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([len(c[5]) for _, c in rows], out=off[1:])
    pairs = [kv for _, c in rows for kv in c[5]]
    return PointBatch(np.array([c[0] for _, c in rows], np.int16), np.array([t for t, _ in rows], np.int64),
                      np.array([c[1] for _, c in rows], np.float64), np.array([c[2] for _, c in rows], bool),
                      np.array([c[3] for _, c in rows], np.int32), np.array([c[4] for _, c in rows], np.int32), off,
                      np.array([k for k, _ in pairs], np.int32), np.array([v for _, v in pairs], np.int32))


def identical(a: PointBatch, b: PointBatch) -> bool:
    """The same rows bit for bit, columns and their types."""
    return all(getattr(a, c).dtype == getattr(b, c).dtype and
               np.array_equal(getattr(a, c).view(np.uint8), getattr(b, c).view(np.uint8)) for c in COLUMNS)


def untimed(table: PointBatch, rows: PointBatch) -> bool:
    """A table's rows: `rows`' columns, the very arrays, but for the times, which it keeps none
    of (a column of zeros that takes no memory: a row's time is its FactRows')."""
    return (all(getattr(table, c) is getattr(rows, c) for c in COLUMNS if c != "time_ns")
            and table.time_ns.strides == (0,) and len(table.time_ns) == len(rows) and not table.time_ns.any())


def one_changed(row: tuple, field: int, rng) -> tuple:  # noqa: ANN001 - a Random
    """`row` with one field of its content changed (field 5: a label's value or one more label,
    6: a label's key)."""
    out = list(row)
    if field in (5, 6):
        key, value = row[5][-1] if row[5] else (0, 0)
        out[5] = row[5][:-1] + [(key + (field == 6), value + (field == 5))] if row[5] else [(0, 0)]
    elif field == 1:
        out[1] = -0.0 if row[1] == 0.0 and not np.signbit(row[1]) else 0.0  # the same number, other bits
    elif field == 2:
        out[2] = not row[2]
    else:
        out[field] = row[field] + rng.choice([1, -1])
    return tuple(out)


@settings(max_examples=300, deadline=None)
@given(st.lists(content, max_size=12), st.lists(content, max_size=12), st.randoms(use_true_random=False))
def test_a_table_finds_each_row_of_equal_content_as_the_reference_does(table_rows, others, rng):
    """Equal but for its time: found; any other difference (a value's bits, staleness, target,
    a label, the labels' order or count): not."""
    table = batch_of([(1, c) for c in table_rows])
    others = others + [one_changed(c, rng.choice([0, 1, 2, 3, 4, 5, 6]), rng) for c in table_rows]
    mixed = [(7, c) for c in table_rows + others]
    rng.shuffle(mixed)
    rows = batch_of(mixed)
    found = FactTable(table).find(rows)
    assert found.tolist() == find_reference(table, rows).tolist()


@st.composite
def scrapes(draw: st.DrawFn) -> list[list[tuple]]:
    """kube-state-metrics scrapes of a small cluster over three intervals, every 10 s: each scrape
    resends every series, some change between scrapes (churn), and each comes in pieces."""
    series = draw(st.lists(content, min_size=1, max_size=10))
    out = []
    for t in range(5, 170, 10):
        for i in draw(st.sets(st.integers(0, len(series) - 1), max_size=3)):
            series[i] = draw(content)  # a value or a label that changed
        rows = [(t * NS + draw(st.integers(0, 3)), c) for c in series]
        cut = draw(st.integers(0, len(rows)))
        out += [rows[:cut], rows[cut:]]
    return [piece for piece in out if piece]


@settings(max_examples=150, deadline=None)
@given(scrapes(), st.integers(1, 12))
def test_an_interval_closes_with_each_series_last_row_whatever_it_shared(pieces, fold_rows):
    windows = Windows(60, 30, fold_rows=fold_rows)
    for piece in pieces:
        windows.add(Samples.empty(), empty_batch(), PodSamples.empty(), batch_of(piece))
    windows.watermark_ns = 10**6 * NS
    closed = windows.due(flush=True)
    assert [i.index for i in closed] == [0, 1, 2]
    for interval in closed:
        mine = [row for piece in pieces for row in piece if row[0] // (60 * NS) == interval.index]
        assert identical(interval.facts, latest(batch_of(mine)))


def pod_rows(pods: int, time_ns: int) -> PointBatch:
    """kube_pod_info of `pods` pods: namespace and pod labels (codes 0, and 1..pods)."""
    return batch_of([(time_ns, (int(Metric.POD_INFO), 1.0, False, -1, -1, [(0, 0), (1, p)]))
                     for p in range(1, pods + 1)])


def test_two_open_intervals_of_a_steady_cluster_hold_its_rows_once(monkeypatch: pytest.MonkeyPatch):
    """Scrapes every 10 s into an interval that waits for its lateness while the next takes rows:
    the newer interval's rows refer to the table the older one's fold left, so the rows held whole
    are one copy of the cluster's series, and each row of either interval costs its time and a
    number beside it."""
    pods, piece = 400, 50
    folds = []  # what each fold's `latest_rows` gave: a steady cluster's parts all refer to the table
    monkeypatch.setattr(window, "latest_rows", lambda *args: folds.append(latest_rows(*args)) or folds[-1])
    windows = Windows(60, 30, fold_rows=1)
    for t in range(5, 90, 10):
        rows = pod_rows(pods, t * NS)
        for start in range(0, pods, piece):
            part = rows.select(np.arange(start, start + piece))
            windows.add(Samples.empty(), empty_batch(), PodSamples.empty(), part)
    assert sorted(windows._open) == [0, 1]
    tables = windows._fact_tables()
    assert sum(map(len, tables.values())) <= pods + piece
    rows = [part for slot in windows._open.values() for part in slot.facts.parts]
    assert sum(map(len, rows)) >= 2 * pods  # both intervals hold every series
    windows.watermark_ns = 10**6 * NS
    first, second = windows.due(flush=True)
    assert identical(first.facts, pod_rows(pods, 55 * NS)) and identical(second.facts, pod_rows(pods, 85 * NS))
    fast = [f is not None for f in folds]  # the first scrape's folds make the table
    assert len(fast) > 20 and True in fast[:len(fast) // 4] and all(fast[fast.index(True):])


def test_a_compaction_rewrites_a_shared_table_once():
    pods = 100
    windows = Windows(60, 30, fold_rows=1)
    for t in (10, 20, 70):
        rows = pod_rows(pods, t * NS)
        for half in np.array_split(np.arange(pods), 4):
            windows.add(Samples.empty(), empty_batch(), PodSamples.empty(), rows.select(half))
    shared = {id(part.shared) for slot in windows._open.values() for part in slot.facts.parts if len(part.shared)}
    assert len(shared) == 1  # both intervals' parts read one table
    order = np.arange(pods + 1)[::-1].copy()
    assert len(windows.codes()) == len(PointBatch.CODES) * len(windows._fact_tables())  # each table's once
    windows.remap(np.concatenate([order, [-1]]).astype(np.int32))
    windows.watermark_ns = 10**6 * NS
    back = np.concatenate([order, [-1]]).astype(np.int32)  # the same map undoes itself
    for interval, t in zip(windows.due(flush=True), (20, 70)):
        facts = interval.facts
        facts.remap(back)
        assert identical(facts, pod_rows(pods, t * NS))


def test_rows_refer_to_a_table_where_it_holds_them_and_are_kept_whole_where_not():
    table = FactTable(pod_rows(4, 1))
    mixed = PointBatch.concat([pod_rows(6, 9).select(np.array([5, 0, 4, 3]))])
    rows, kept = share(mixed, table)
    assert kept is table and rows.row.tolist() == [4, 0, 5, 3] and len(rows.own) == 2
    assert identical(rows.batch(), mixed)
    renewed, new = share(mixed, table, fold=True)  # half of it is not in the table: renewed
    assert new is not table and identical(renewed.batch(), mixed)
    assert untimed(new.batch, mixed)
    some = pod_rows(9, 3)  # one row in nine not in the table: renewed only where no other interval reads it
    table = FactTable(some.select(np.arange(8)))
    rows, kept = share(some, table, fold=True)
    assert kept is table and len(rows.own) == 1
    rows, new = share(some, table, fold=True, alone=True)
    assert new is not table and untimed(new.batch, some) and len(rows.own) == 0
    assert identical(rows.batch(), some)
    whole = FactRows.whole(mixed)
    assert whole.batch() is mixed


@settings(max_examples=300, deadline=None)
@given(st.lists(content, max_size=10), st.lists(st.lists(st.tuples(st.integers(0, 9), content), max_size=8), max_size=5),
       st.randoms(use_true_random=False))
def test_a_fold_from_the_rows_places_is_the_fold_of_the_rows(table_rows, pieces, rng):
    """`latest_rows` of parts that refer to a table (their rows at any times, some of the table's
    content, some not; a part none of whose rows the table holds refers to no table) gives the
    rows `latest` keeps of the parts' rows end to end, bit for bit, referring to the table as
    `share` would; it declines parts that refer to another table."""
    table = FactTable(latest(batch_of([(1, c) for c in table_rows])))
    reused = [(t, table_rows[t % len(table_rows)]) if table_rows and rng.random() < 0.5 else (t, c) for t, c in
              [(t, c) for piece in pieces for t, c in piece]]
    at, parts = 0, []
    for piece in pieces:
        rows = batch_of(reused[at:at + len(piece)])
        at += len(piece)
        parts.append(share(rows, table)[0])
    folded = latest_rows(parts, table)
    if not parts or any(part.shared is not table.batch and len(part.shared) for part in parts):
        assert folded is None
        return
    reference = latest(PointBatch.concat([part.batch() for part in parts]))
    assert identical(folded.batch(), reference)
    found = table.find(reference)
    assert folded.row.tolist() == np.where(found >= 0, found, len(table) + np.cumsum(found < 0) - 1).tolist()
    assert identical(folded.own, reference.select(found < 0)) and folded.shared is table.batch



def test_a_fold_of_parts_that_refer_to_another_table_builds_the_rows():
    """Parts that refer to a table the fold is not given (one renewed since they came) are folded
    from their rows; parts with no table are folded from their places with those that refer to it."""
    old, new = FactTable(pod_rows(6, 1)), FactTable(pod_rows(4, 2))
    stale = share(pod_rows(6, 3), old)[0]
    assert stale.shared is old.batch and latest_rows([stale], new) is None
    fresh, whole = share(pod_rows(4, 5), new)[0], FactRows.whole(pod_rows(6, 7).select(np.array([5, 4])))
    folded = latest_rows([fresh, whole], new)
    assert folded is not None and folded.shared is new.batch and len(folded.own) == 2
    assert identical(folded.batch(), latest(PointBatch.concat([fresh.batch(), whole.batch()])))

def test_a_steady_fold_builds_the_places_of_its_rows_not_the_rows():
    """A fold of a steady cluster's rows (each series resent, every row in the shared table) holds
    under half of what building the rows held: their labels are read where they stand."""
    pods = 50_000
    labelled = [(t, (int(Metric.POD_LABELS), 1.0, False, -1, -1, [(k, p + k) for k in range(6)]))
                for t, p in ((5 * NS, p) for p in range(pods))]
    table = FactTable(batch_of(labelled))
    parts = [share(batch_of([(t + 10 * NS, c) for t, c in labelled]), table)[0]]
    again = batch_of([(t + 20 * NS, c) for t, c in labelled])
    parts += [share(again.select(rows), table)[0] for rows in np.array_split(np.arange(pods), 8)[:3]]
    peaks = []
    for fold in (lambda: latest_rows(parts, table), lambda: share(window._latest(parts), table, fold=True)[0]):
        fold()  # its kernels loaded
        tracemalloc.start()
        try:
            rows = fold()
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert identical(rows.batch(), latest(PointBatch.concat([part.batch() for part in parts])))
    assert peaks[0] < peaks[1] / 2


def test_places_carried_into_a_renewed_table():
    """A place the old table's rows had becomes the row's place in the new table; a row the new
    table does not hold (-1 in the map), a place -1 and a place beyond the old table (a row held
    beside it) become -1."""
    moved = np.array([3, -1, 0], np.int32)  # the old table's rows 0, 1, 2 in the new one
    assert carry(np.array([-1, 0, 1, 2, 3, 7], np.int32), moved).tolist() == [-1, 3, -1, 0, -1, -1]
    assert carry(np.array([0, 5], np.int32), np.zeros(0, np.int32)).tolist() == [-1, -1]
