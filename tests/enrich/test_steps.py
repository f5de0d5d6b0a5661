"""DCGM samples fold into steps as they arrive (enrich/steps.py): one row per label combination,
timestamp and staleness. Unpacked at the close they must give the join exactly what the samples
themselves gave it: the same steps, holders, held seconds, activity and device memory, whatever
the batching, resends and arrival order; and an open interval folded early must close as one
folded only at its close."""

from __future__ import annotations

import tracemalloc
from functools import partial
from types import SimpleNamespace
from typing import Callable

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from otelgpu.enrich.claims import _device_memory_mib
from otelgpu.enrich.reported import Reported
from otelgpu.enrich.samples import IndexedSamples, Samples
from otelgpu.enrich import steps as steps_module
from otelgpu.enrich.steps import PRESENT_METRIC, LabelTable, Steps, _ordered, unpack_reference
from otelgpu.enrich.timeline import Readings, Tenures, dedupe, entities_of, tenures
from otelgpu.enrich.usage import PodSamples
from otelgpu.enrich.window import NS, Windows
from otelgpu.receiver.decode import PointBatch, empty_batch
from otelgpu.receiver.schema import Metric

FIELDS = ("metric", "time_ns", "value", "stale", *Samples.CODES)
DCGM = [int(m) for m in (Metric.GR_ENGINE_ACTIVE, Metric.GPU_UTIL, Metric.FB_USED, Metric.FB_FREE,
                         Metric.POWER_USAGE, Metric.ENERGY)]
code = st.integers(-1, 6)


def same(a: Samples, b: Samples) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f), equal_nan=f == "value")
               and getattr(a, f).dtype == getattr(b, f).dtype for f in FIELDS)


@st.composite
def any_samples(draw: st.DrawFn) -> Samples:
    """Samples of a few label combinations (any codes), metrics and timestamps."""
    n_sample = draw(st.integers(0, 30))
    combos = draw(st.lists(st.lists(code, min_size=10, max_size=10), min_size=1, max_size=4))
    rows = np.array([combos[draw(st.integers(0, len(combos) - 1))] for _ in range(n_sample)],
                    np.int32).reshape(n_sample, 10)
    stale = np.array(draw(st.lists(st.booleans(), min_size=n_sample, max_size=n_sample)), bool)
    values = draw(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=n_sample, max_size=n_sample))
    return Samples(np.array(draw(st.lists(st.sampled_from(DCGM), min_size=n_sample, max_size=n_sample)), np.int16),
                   np.array(draw(st.lists(st.integers(0, 3), min_size=n_sample, max_size=n_sample)), np.int64),
                   np.where(stale, np.nan, np.array(values, np.float64)), stale, *(rows[:, j].copy() for j in range(10)))


def cut(samples: Samples, cuts: list[int]) -> list[Samples]:
    bounds = [0, *sorted(min(c, len(samples)) for c in cuts), len(samples)]
    return [samples.take(np.arange(lo, hi)) for lo, hi in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None)
@given(any_samples())
def test_steps_unpack_to_their_reference(samples):
    steps = Steps.of(samples)
    assert same(steps.unpack(), unpack_reference(samples))
    assert len(steps.labels) == len({tuple(r) for r in np.stack([getattr(samples, c) for c in Samples.CODES],
                                                                  1).tolist()})


@settings(max_examples=300, deadline=None)
@given(any_samples(), st.lists(st.integers(0, 30), max_size=4))
def test_parts_merged_are_the_whole_folded_at_once(samples, cuts):
    parts = [Steps.of(part) for part in cut(samples, cuts)]
    assert same(Steps.merge(parts).unpack(), Steps.of(samples).unpack())
    assert same(Steps.merge([Steps.merge(parts[:2]), *parts[2:]]).unpack(), Steps.of(samples).unpack())


STEP_FIELDS = ("time_ns", "stale", "label", "present", "value", "labels")


def same_steps(a: Steps, b: Steps) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f), equal_nan=f == "value")
               and getattr(a, f).dtype == getattr(b, f).dtype for f in STEP_FIELDS)


@settings(max_examples=300, deadline=None)
@given(any_samples(), st.lists(st.integers(0, 30), max_size=4), st.lists(st.booleans(), max_size=30))
def test_the_merge_kernel_gives_the_reference_s_rows_bit_for_bit(samples, cuts, nan):
    """Steps.merge lays each part's cells in with a kernel; merge_reference unpacks every cell with
    numpy. Same rows, bits and first values (a NaN value sent as a value included), whole or in
    parts, parts of parts merged again."""
    value = samples.value.copy()
    value[np.flatnonzero(np.resize(np.array(nan or [False], bool), len(value)))] = np.nan
    samples = Samples(samples.metric, samples.time_ns, value, samples.stale,
                      *(getattr(samples, c) for c in Samples.CODES))
    parts = [Steps.of(part) for part in cut(samples, cuts)]
    assert same_steps(Steps.merge(parts), steps_module.merge_reference(parts))
    again = [Steps.merge(parts[:2]), *parts[2:]]
    assert same_steps(Steps.merge(again), steps_module.merge_reference(again))
    assert same_steps(Steps.merge([]), steps_module.merge_reference([]))


@settings(max_examples=100, deadline=None)
@given(any_samples(), st.permutations(range(7)), st.integers(0, 20))
def test_a_compaction_rewrites_steps_as_it_rewrites_samples(samples, order, offset):
    table = np.array([c + offset for c in order] + [-1], np.int64)  # as Interner.compact returns it: table[-1] is -1
    steps, plain = Steps.of(samples), samples.take(np.arange(len(samples)))
    steps.remap(table)
    plain.remap(table)
    assert steps.labels.dtype == np.int32
    assert same(Steps.merge([steps]).unpack(), Steps.of(plain).unpack())  # merged again: in the new codes' order


@settings(max_examples=300, deadline=None)
@given(any_samples(), st.lists(st.integers(0, 30), max_size=4), st.integers(0, 5))
def test_parts_that_share_a_fold_s_table_merge_as_parts_with_their_own(samples, cuts, folded):
    """Parts refer to the table of an earlier fold wherever it holds all their combinations; merged
    (alone, with parts of their own tables, or folded again) they unpack as the samples do."""
    parts = [Steps.of(part) for part in cut(samples, cuts)]
    known = LabelTable(Steps.merge(parts[:folded]).labels)
    shared = [part.sharing(known) for part in parts]
    for part, alike in zip(parts, shared):
        assert same(alike.unpack(), part.unpack())
        covered = {tuple(r) for r in part.labels.tolist()} <= {tuple(r) for r in known.labels.tolist()}
        assert (alike.labels is known.labels) == covered
    whole = Steps.of(samples).unpack()
    assert same(Steps.merge(shared).unpack(), whole)
    assert same(Steps.merge([Steps.merge(shared[:2]), *shared[2:]]).unpack(), whole)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(-1, 3), min_size=3, max_size=3), max_size=8),
       st.lists(st.lists(st.integers(-1, 3), min_size=3, max_size=3), max_size=8), st.booleans())
def test_a_label_table_finds_rows_by_content_and_never_takes_one_row_for_another(table, rows, collide):
    """Where every row is in the table, `find` says where; where one is not, None. With every
    fingerprint the same (colliding), it may fail to find a row but never finds a wrong one."""
    table = np.array(sorted(set(map(tuple, table))), np.int32).reshape(-1, 3)
    wanted = np.array(rows, np.int32).reshape(-1, 3)
    known = LabelTable(table)
    if collide:
        known_prints = steps_module._fingerprints
        steps_module._fingerprints = lambda labels: np.zeros(len(labels), np.uint64)
    try:
        found = known.find(wanted)
    finally:
        if collide:
            steps_module._fingerprints = known_prints
    present = {tuple(r) for r in table.tolist()}
    if found is None:
        assert collide or not all(tuple(r) in present for r in wanted.tolist())
    else:
        assert np.array_equal(table[found], wanted)
        if not collide:
            assert all(tuple(r) in present for r in wanted.tolist())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(-1, 2), min_size=2, max_size=2), max_size=6))
def test_a_table_is_ordered_when_its_rows_strictly_increase(rows):
    table = np.array(rows, np.int32).reshape(-1, 2)
    assert _ordered(table) == all(a < b for a, b in zip(map(tuple, rows), map(tuple, rows[1:])))


def test_open_intervals_keep_a_label_combination_once_and_a_compaction_keeps_it_so():
    """Two scrapes of the same devices into one interval and one into the next: once the first
    fold is made, later parts refer to its table, so the open intervals hold each combination
    once. A compaction of the interner rewrites that table once for every part that shares it,
    and the intervals close as they would have."""
    devices = [(metric, 10 * NS, 0.5, False, 0, uuid, -1, -1, 7, 10, 11, 12, -1, -1)
               for uuid in range(40) for metric in DCGM]

    def scrape(time_ns: int) -> Samples:
        return _samples([(m, time_ns, *rest) for m, _, *rest in devices])

    windows = Windows(60, 30, fold_rows=1)
    for t in (10, 20, 70):
        for half in np.array_split(np.arange(len(devices)), 4):
            windows.add(scrape(t * NS).take(half), empty_batch(), PodSamples.empty(), empty_batch())
    tables = {id(part.labels): part.labels for slot in windows._open.values() for part in slot.samples.parts}
    assert sum(map(len, tables.values())) == 40
    assert len(windows.codes()) == len(tables)
    order = np.arange(100)[::-1].copy()
    windows.remap(np.concatenate([order, [-1]]).astype(np.int32))
    after = {id(part.labels): part.labels for slot in windows._open.values() for part in slot.samples.parts}
    assert len(after) == len(tables)
    windows.watermark_ns = 10**6 * NS
    first, second = windows.due(flush=True)
    back = np.concatenate([order, [-1]])  # the same map undoes itself
    for interval, times in ((first, (10, 20)), (second, (70,))):
        samples = interval.samples
        samples.remap(back)
        assert reading(samples) == reading(Samples.concat([scrape(t * NS) for t in times]))


def test_a_row_with_only_presence_fields_unpacks_as_one_sample():
    one = np.zeros(3, np.int32)
    samples = Samples(np.array([Metric.POWER_USAGE, Metric.ENERGY, Metric.ENERGY], np.int16),
                      np.array([5, 5, 6], np.int64), np.array([300.0, 1e9, 2e9]), np.zeros(3, bool),
                      *(one for _ in Samples.CODES))
    out = Steps.of(samples).unpack()
    assert out.metric.tolist() == [PRESENT_METRIC] * 2 and out.time_ns.tolist() == [5, 6]
    assert np.isnan(out.value).all()


def test_whole_counts_are_kept_in_four_bytes_and_any_other_value_as_it_came():
    """dcgm-exporter's GPU_UTIL, FB_USED and FB_FREE are whole numbers: kept in float32, 12 bytes a
    row less; a part with a count float32 does not hold (a fraction, a number past its range or
    too small for it) keeps its counts in float64. Either way every value unpacks as it came,
    and parts of both kinds merge so."""
    one = np.zeros(4, np.int32)

    def part(time_ns: int, util: float) -> Steps:
        metrics = np.array([Metric.GR_ENGINE_ACTIVE, Metric.GPU_UTIL, Metric.FB_USED, Metric.FB_FREE], np.int16)
        values = np.array([0.123456789, util, 81_559.0, 0.0])
        return Steps.of(Samples(metrics, np.full(4, time_ns, np.int64), values, np.zeros(4, bool),
                                *(one for _ in Samples.CODES)))

    whole, odd = part(5, 97.0), [part(6, util) for util in (97.3, 1e300, 5e-324)]
    assert whole.counts.dtype == np.float32 and whole.activity.dtype == np.float64
    assert all(p.counts.dtype == np.float64 for p in odd)
    merged = Steps.merge([whole, *odd])
    assert merged.counts.dtype == np.float64
    assert Steps.merge([whole, part(7, 3.0)]).counts.dtype == np.float32
    for steps, util in ((whole, 97.0), *zip(odd, (97.3, 1e300, 5e-324))):
        assert steps.unpack().value.tolist() == [0.123456789, util, 81_559.0, 0.0]
    assert merged.value[:, 1].tolist() == [97.0, 97.3]  # resends of one time merged: the first value
    assert np.array_equal(merged.value, steps_module.merge_reference([whole, *odd]).value)


# The join's reading of the samples: consistent devices (a device's profile and model are its
# own), holders shown and not, time-sliced replicas, per-pod series, staleness markers, resends.
DEVICES = [(0, 1, -1, -1, 7), (0, 2, 3, 4, 8), (0, 2, 5, 4, 8), (1, 1, -1, -1, 7)]  # node, uuid, gi, profile, model
HOLDERS = [(-1, -1, -1, -1, -1), (10, 11, 12, -1, -1), (10, 13, 12, -1, 0), (10, 13, 12, 14, 1), (15, 16, 12, -1, -1)]
VALUES = {int(Metric.GR_ENGINE_ACTIVE): [0.0, 0.25, 0.5, 1.0], int(Metric.GPU_UTIL): [0.0, 25.0, 50.0, 100.0],
          int(Metric.FB_USED): [0.0, 1024.0, 40960.0], int(Metric.FB_FREE): [80.0, 40960.0],
          int(Metric.POWER_USAGE): [70.5], int(Metric.ENERGY): [1e6]}


@st.composite
def dcgm_arrivals(draw: st.DrawFn) -> list[Samples]:
    """Batches as a cluster's Collector sends them: each scrape's samples (some devices, some
    holders, some fields), split into batches, some batches resent, in any order."""
    rows = []
    for step in range(draw(st.integers(1, 4))):
        time_ns = draw(st.integers(0, 59)) * NS if draw(st.booleans()) else step * 15 * NS
        for device in draw(st.lists(st.sampled_from(DEVICES), min_size=1, max_size=4, unique=True)):
            stale = draw(st.integers(0, 9)) == 0
            for holder in draw(st.lists(st.sampled_from(HOLDERS), min_size=1, max_size=2, unique=True)):
                for metric in draw(st.lists(st.sampled_from(DCGM), min_size=1, max_size=6, unique=True)):
                    value = np.nan if stale else draw(st.sampled_from(VALUES[metric]))
                    rows.append((metric, time_ns, value, stale, *device, *holder))
    batches = [rows[lo:lo + 7] for lo in range(0, len(rows), 7)]
    batches += [batches[i] for i in draw(st.lists(st.integers(0, len(batches) - 1), max_size=3))]  # resent
    order = draw(st.permutations(range(len(batches))))
    return [_samples([batches[i] for i in order][k]) for k in range(len(batches))]


def _samples(rows: list[tuple]) -> Samples:
    cols = list(zip(*rows))
    dtypes = (np.int16, np.int64, np.float64, bool) + (np.int32,) * 10
    return Samples(*(np.array(col, dtype) for col, dtype in zip(cols, dtypes)))


def reading(samples: Samples, memory: Callable[[], Samples] | None = None) -> tuple[dict, dict]:
    """Per (entity, holder): held, measured and active seconds, replicas, own activity; and per
    entity its device memory (from `memory`'s samples where given, as the join reads it when
    `samples` leave the framebuffer's out). Keyed by labels, so that numbering and row order do
    not count."""
    samples = dedupe(samples)
    entity, entities = entities_of(samples)
    shared = (entities.uuid == 2)  # the MIG GPU's instances, time-shared
    held = tenures(Readings.of(samples), entity, shared, 0, 60 * NS)
    names = list(zip(entities.node.tolist(), entities.uuid.tolist(), entities.gi.tolist(), entities.profile.tolist(),
                     entities.model.tolist()))
    out = {(names[e], ns, pod): (h, a, i, r, p) for e, ns, pod, h, a, i, r, p in zip(
        held.entity.tolist(), held.holder_ns.tolist(), held.holder_pod.tolist(), held.held_s.tolist(),
        held.act_s.tolist(), held.act_integral.tolist(), held.replicas.tolist(), held.per_pod_activity.tolist())}
    units = SimpleNamespace(samples=samples, sample_entity=entity, entities=entities, memory=memory)
    units.memory_samples = lambda: Reported.memory_samples(units)  # type: ignore[arg-type]
    mib = _device_memory_mib(units, np.arange(len(names)))  # type: ignore[arg-type]
    return out, {names[e]: m for e, m in mib.items()}


@settings(max_examples=300, deadline=None)
@given(dcgm_arrivals(), st.integers(1, 3), st.booleans())
def test_tenures_worked_out_a_piece_of_the_entities_at_a_time_are_those_of_all_at_once(batches, piece, indexed):
    """Holders shown and not, time-sliced replicas, per-pod series, staleness markers (the dark
    holdings), resends: the same rows in the same order, the same figures to the bit."""
    samples = dedupe(Samples.concat(batches))
    if indexed:  # as the interval's computation hands them: labels read through the steps' table
        samples = Steps.of(samples).unpack(indexed=True)
    entity, entities = entities_of(samples)
    shared = entities.uuid == 2
    whole = tenures(Readings.of(samples), entity, shared, 0, 60 * NS)
    pieces = tenures(Readings.of(samples), entity, shared, 0, 60 * NS, piece=piece)
    for name in ("entity", "holder_ns", "holder_pod", "held_s", "act_s", "act_integral", "replicas",
                 "per_pod_activity"):
        got, want = getattr(pieces, name), getattr(whole, name)
        assert got.dtype == want.dtype and np.array_equal(got, want, equal_nan=got.dtype.kind == "f"), name


def test_tenures_joined_hold_one_copy_of_their_rows_and_a_column_at_the_peak():
    tracemalloc.start()
    try:
        parts = [Tenures(*(np.arange(50_000).astype(dtype) for dtype in (np.int64, np.int32, np.int32, float, float,
                                                                         float, np.int64, bool))) for _ in range(4)]
        held, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        joined = Tenures.joined(parts)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(joined.entity) == 200_000 and joined.held_s[50_000:100_000].tolist() == list(range(50_000))
    assert peak < 1.25 * held  # the parts' columns let go as each one is joined (both at once: twice)


@settings(max_examples=300, deadline=None)
@given(dcgm_arrivals(), st.lists(st.integers(1, 12), max_size=3))
def test_the_join_reads_from_steps_what_it_read_from_the_samples(batches, folds):
    as_sent = Samples.concat(batches)
    parts, folded = [Steps.of(batch) for batch in batches], []
    for at in sorted(folds):  # folded early, as an open interval does
        folded, parts = [Steps.merge(folded + parts[:at])], parts[at:]
    assert reading(Steps.merge(folded + parts).unpack()) == reading(as_sent)


@settings(max_examples=300, deadline=None)
@given(dcgm_arrivals())
def test_the_join_reads_the_same_without_the_framebuffer_samples_beside_an_activity_one(batches):
    """What the interval's computation reads (`unpack(memory=False)`, and the framebuffer's values
    from `memory()` for the device memory of shared GPUs) is what every sample gives."""
    steps = Steps.merge([Steps.of(batch) for batch in batches])
    every, slim = steps.unpack(), steps.unpack(memory=False)
    assert reading(slim, steps.memory) == reading(every)
    framebuffer = np.isin(every.metric, [Metric.FB_USED, Metric.FB_FREE])
    assert len(slim) <= len(every) and len(steps.memory()) == framebuffer.sum()
    assert same(steps.memory(), every.take(np.flatnonzero(framebuffer)))  # in the same order


@settings(max_examples=300, deadline=None)
@given(dcgm_arrivals())
def test_the_join_reads_the_same_from_samples_that_read_their_labels_through_the_steps_table(batches):
    """What the interval's computation reads: samples holding a row of the steps' label table
    each (`indexed`), not ten columns; the dark markers device memory adds extend the table."""
    steps = Steps.merge([Steps.of(batch) for batch in batches])
    dark = _samples([(Metric.GR_ENGINE_ACTIVE, 0, np.nan, True, 2, 9, -1, -1, 7, -1, -1, -1, -1, -1)])
    indexed = steps.unpack(memory=False, indexed=True).with_samples(dark)
    assert isinstance(indexed, IndexedSamples) and len(indexed.labels) == len(steps.labels) + 1
    assert same(indexed.plain(), Samples.concat([steps.unpack(memory=False), dark]))
    assert reading(indexed, partial(steps.memory, indexed=True)) == reading(Samples.concat([steps.unpack(), dark]))


@st.composite
def samples_of_near_combinations(draw: st.DrawFn) -> Samples:
    """Samples whose label combinations differ in a column or two: one device under two profiles
    or models, a series resent under another model, two holders of one device."""
    combos = draw(st.lists(st.lists(code, min_size=10, max_size=10), min_size=1, max_size=3))
    for _ in range(draw(st.integers(0, 4))):
        variant = list(combos[draw(st.integers(0, len(combos) - 1))])
        variant[draw(st.integers(0, 9))] = draw(code)
        combos.append(variant)
    n_sample = draw(st.integers(0, 30))
    rows = np.array([combos[draw(st.integers(0, len(combos) - 1))] for _ in range(n_sample)],
                    np.int32).reshape(n_sample, 10)
    stale = np.array(draw(st.lists(st.booleans(), min_size=n_sample, max_size=n_sample)), bool)
    return Samples(np.array(draw(st.lists(st.sampled_from(DCGM[:2]), min_size=n_sample, max_size=n_sample)), np.int16),
                   np.array(draw(st.lists(st.integers(0, 2), min_size=n_sample, max_size=n_sample)), np.int64),
                   np.arange(n_sample, dtype=np.float64), stale, *(rows[:, j].copy() for j in range(10)))


@settings(max_examples=500, deadline=None)
@given(samples_of_near_combinations(), st.randoms(use_true_random=False), st.lists(st.integers(0, 40), max_size=6))
def test_samples_read_through_a_table_drop_resends_and_find_entities_as_those_with_columns(samples, rng, copied):
    """Resends dropped and entities numbered, each with its first sample's labels, from the
    rows of a table (in any order, some twice, some that no sample reads): the same as from the
    columns."""
    rows = np.stack([getattr(samples, name) for name in Samples.CODES], axis=1).astype(np.int32).reshape(-1, 10)
    order = list(range(len(rows)))
    rng.shuffle(order)
    copied = [i % len(rows) for i in copied] if len(rows) else []
    table = np.concatenate([rows[order], rows[copied]]).astype(np.int32)
    label = np.empty(len(rows), np.int32)
    label[order] = np.arange(len(rows))
    for j, i in enumerate(copied):  # a sample that reads the copy of its row, or the copy unread
        if rng.random() < 0.5:
            label[i] = len(rows) + j
    indexed = IndexedSamples(samples.metric, samples.time_ns, samples.value, samples.stale, label, table)
    assert same(indexed.plain(), samples)
    assert same(dedupe(indexed).plain(), dedupe(samples))
    (ent, entities), (ent_i, entities_i) = entities_of(samples), entities_of(indexed)
    assert np.array_equal(ent, ent_i) and ent.dtype == ent_i.dtype
    for name in ("node", "uuid", "gi", "profile", "model"):
        assert np.array_equal(getattr(entities, name), getattr(entities_i, name))
    backwards = np.arange(len(samples))[::-1]
    assert same(indexed.take(backwards).plain(), samples.take(backwards))
    some = backwards[::2]
    for name in Samples.CODES:  # a label column at some rows, gathered for them alone
        assert np.array_equal(indexed.at(name, some), samples.at(name, some))
        assert np.array_equal(indexed.at(name, some), getattr(samples, name)[some])


def test_an_activity_sample_stands_for_its_rows_framebuffer_samples():
    devices = [(metric, 10 * NS, 0.5, False, 0, uuid, -1, -1, 7, 10, 11, 12, -1, -1)
               for uuid in range(3) for metric in DCGM]
    only_memory = [(Metric.FB_USED, 10 * NS, 9.0, False, 0, 9, -1, -1, 7, -1, -1, -1, -1, -1)]
    steps = Steps.of(_samples(devices + only_memory))
    slim = steps.unpack(memory=False)
    assert sorted(map(int, slim.metric)) == sorted([int(Metric.GR_ENGINE_ACTIVE), int(Metric.GPU_UTIL)] * 3
                                                   + [int(Metric.FB_USED)])  # a row of the framebuffer alone stays
    assert len(steps.unpack()) == 3 * 4 + 1


def test_a_device_named_with_two_models_at_once_keeps_the_memory_of_the_first():
    """Resent samples are dropped by series and time, whatever the modelName: a device reported
    under two model names at once keeps its first framebuffer samples, read from `memory()` too."""
    rows = [(metric, 10 * NS, value, False, 0, 5, -1, -1, model, 10, 11, 12, -1, -1)
            for model in (7, 8) for metric, value in ((Metric.GR_ENGINE_ACTIVE, 0.5), (Metric.FB_USED, 1000.0 * model),
                                                      (Metric.FB_FREE, 500.0))]
    steps = Steps.of(_samples(rows))
    every = reading(steps.unpack())
    assert every[1] == {(0, 5, -1, -1, 7): 7500.0}
    assert reading(steps.unpack(memory=False), steps.memory) == every


@settings(max_examples=100, deadline=None)
@given(dcgm_arrivals())
def test_an_interval_folded_as_it_fills_closes_as_one_folded_at_its_close(batches):
    def closed(fold_rows: int) -> Samples:
        windows = Windows(60, 30, fold_rows=fold_rows)
        for batch in batches:
            windows.add(batch, empty_batch(), PodSamples.empty(), empty_batch())
        windows.watermark_ns = 10**6 * NS
        return windows.due(flush=True)[0].samples

    assert same(closed(1), closed(1 << 40))
    assert reading(closed(1)) == reading(Samples.concat(batches))


def test_an_interval_resent_over_and_over_holds_what_it_was_sent_once():
    """A Collector replaying its queue sends the same batches again and again: an open interval
    folds them, so what it holds stays within twice the distinct rows (and one batch) instead of
    growing with every resend. Facts alike: each kube-state-metrics series' last row."""
    devices = [(metric, 10 * NS, 0.5, False, 0, uuid, -1, -1, 7, 10, 11, 12, -1, -1)
               for uuid in range(200) for metric in DCGM]
    batch = _samples(devices)
    distinct = len(Steps.of(batch))
    assert distinct == 200  # one row a device: its six fields folded
    rows = _pod_info_rows(50, 10 * NS)
    windows = Windows(60, 30, fold_rows=64)
    for _ in range(100):
        windows.add(batch, empty_batch(), PodSamples.empty(), rows)
        assert windows.ahead() <= 2 * (distinct + len(rows)) + len(batch) + len(rows)
    windows.watermark_ns = 10**6 * NS
    closed = windows.due(flush=True)[0]
    assert len(closed.facts) == len(rows)
    assert reading(closed.samples) == reading(batch)


def test_an_open_interval_holds_its_facts_within_a_quarter_more_than_their_series():
    """Each kube-state-metrics scrape resends every series; an interval folds its facts whenever
    they grow by a quarter, so the copies it holds before its close stay within 1.25 times the
    series (and one batch), where folding when doubled held twice. The close reads each series'
    last row."""
    pods, piece = 400, 10
    windows = Windows(60, 30, fold_rows=1)
    for scrape in range(12):
        rows = _pod_info_rows(pods, (10 + scrape) * NS)
        for start in range(0, pods, piece):
            windows.add(Samples.empty(), empty_batch(), PodSamples.empty(), rows.select(np.arange(start, start + piece)))
            held = sum(len(part) for part in windows._open[0].facts.parts)
            assert held <= 1.25 * pods + piece
    windows.watermark_ns = 10**6 * NS
    closed = windows.due(flush=True)[0].facts
    assert len(closed) == pods and set(closed.time_ns.tolist()) == {21 * NS}


def _pod_info_rows(pods: int, time_ns: int) -> PointBatch:
    """kube_pod_info of `pods` pods (namespace and pod labels, codes 0 and 1..pods) at `time_ns`."""
    none = np.full(pods, -1, np.int32)
    keys = np.tile(np.array([0, 1], np.int32), pods)
    values = np.stack([np.zeros(pods, np.int32), np.arange(1, pods + 1, dtype=np.int32)], axis=1).reshape(-1)
    return PointBatch(np.full(pods, Metric.POD_INFO, np.int16), np.full(pods, time_ns, np.int64), np.ones(pods),
                      np.zeros(pods, bool), none, none, np.arange(0, 2 * pods + 1, 2, dtype=np.int64), keys, values)
