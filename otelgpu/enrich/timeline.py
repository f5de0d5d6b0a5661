"""Who held each DCGM entity (whole GPU or MIG instance) for how long, and how active it was.

Each entity's samples in an interval form a step function: the state seen at a timestamp holds
until the entity's next timestamp, the first state also covers the start of the interval, and
the last runs to its end. A holder is present in a step if a non-stale sample of the entity
names it; a staleness marker ends a holder. Summing step durations gives each holder's held
seconds and the time-weighted activity, all with array operations.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from otelgpu.core.grouping import group_ids, id_type
from otelgpu.core.jit import kernel
from otelgpu.enrich.samples import LABEL_COLUMN, AnySamples, Columns, IndexedSamples
from otelgpu.receiver.schema import Metric

NONE = -1
DARK = -2  # holder of the time an entity had no live series: its exporter's scrape failed or went silent
ENTITIES_AT_ONCE = 32_768  # the tenures of so many entities worked out at a time


@dataclass
class Readings(Columns):
    """What the timeline reads of each sample: no more. The join hands it these columns of the
    samples and lets the rest go (the GPU's labels, which the entity ids stand for now): at
    100,000 GPUs six columns of a million samples were held through the interval's peak."""

    metric: np.ndarray
    time_ns: np.ndarray
    value: np.ndarray
    stale: np.ndarray
    namespace: np.ndarray
    pod: np.ndarray
    pod_uid: np.ndarray
    vgpu: np.ndarray

    @staticmethod
    def of(samples: AnySamples) -> "Readings | IndexedSamples":
        """Samples that read their labels through a table are read as they are: their label
        columns are gathered where the timeline reads them, one at a time."""
        if isinstance(samples, IndexedSamples):
            return samples
        return Readings(samples.metric, samples.time_ns, samples.value, samples.stale, samples.namespace, samples.pod,
                        samples.pod_uid, samples.vgpu)


# A series is its metric and these labels (a device's profile and model name do not make it another)
SERIES_LABELS = ("node", "uuid", "gi", "namespace", "pod", "container", "pod_uid", "vgpu")


def dedupe(samples: AnySamples) -> AnySamples:
    """Drop samples resent with the same series and timestamp (a retried batch)."""
    if isinstance(samples, IndexedSamples):  # the series' labels grouped once per row of the table
        labels = samples.labels
        series, _ = group_ids(*(labels[:, LABEL_COLUMN[name]] for name in SERIES_LABELS), dtype=np.int32)
        _, first = group_ids(samples.metric, samples.time_ns, series[samples.label], samples.stale,
                             dtype=id_type(len(samples)))
    else:
        _, first = group_ids(samples.metric, samples.time_ns, *(getattr(samples, name) for name in SERIES_LABELS),
                             samples.stale, dtype=id_type(len(samples)))
    return samples if len(first) == len(samples) else samples.take(np.sort(first))  # nothing resent: no copy


@dataclass
class Tenures:
    """One row per (entity, holder): how long the holder held the entity in the interval, and how
    active it was. Holder NONE means the entity showed no pod; DARK, that it showed nothing."""

    entity: np.ndarray  # entity id
    holder_ns: np.ndarray  # namespace code or NONE
    holder_pod: np.ndarray  # pod code or NONE
    held_s: np.ndarray  # seconds of the interval the holder held the entity
    act_s: np.ndarray  # seconds of that with an activity figure
    act_integral: np.ndarray  # integral of unit activity over act_s
    replicas: np.ndarray  # distinct vgpu indices seen for the holder (time-slicing), 0 if none
    per_pod_activity: np.ndarray  # bool: activity came from the holder's own series

    @staticmethod
    def joined(parts: list["Tenures"]) -> "Tenures":
        """The parts' rows one after the other, a column at a time: each part's column is let go
        once joined (the parts are the caller's to give up), so no second copy of all of them is
        held at once."""
        columns = {}
        for column in fields(Tenures):
            columns[column.name] = np.concatenate([getattr(part, column.name) for part in parts])
            for part in parts:
                setattr(part, column.name, None)
        return Tenures(**columns)

    @property
    def mean_activity(self) -> np.ndarray:
        """Time-weighted activity over the measured part of each holding; NaN where unmeasured."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.act_s > 0, self.act_integral / self.act_s, np.nan)

    @property
    def measured_share(self) -> np.ndarray:
        """Share of each holding's time that has an activity figure."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.held_s > 0, self.act_s / self.held_s, 0.0)


@dataclass
class Entities:
    """One row per entity: the DCGM device or MIG instance, with its first sample's labels."""

    node: np.ndarray
    uuid: np.ndarray
    gi: np.ndarray
    profile: np.ndarray
    model: np.ndarray


ENTITY_LABELS = ("node", "uuid", "gi", "profile", "model")  # Entities' columns: an entity is the first three


def entities_of(samples: AnySamples) -> tuple[np.ndarray, Entities]:
    """Each sample's entity (numbered in the order of (node, uuid, gi), in 4 bytes where they fit),
    and each entity with the labels of its first sample."""
    if isinstance(samples, IndexedSamples):
        return _indexed_entities(samples)
    ent, first = group_ids(samples.node, samples.uuid, samples.gi, dtype=id_type(len(samples)))
    return ent, Entities(samples.node[first], samples.uuid[first], samples.gi[first], samples.profile[first],
                         samples.model[first])


def _indexed_entities(samples: IndexedSamples) -> tuple[np.ndarray, Entities]:
    """`entities_of` grouping the rows of the table the samples use rather than the samples."""
    if not len(samples):
        return entities_of(samples.plain())
    used, first_of_row = np.unique(samples.label, return_index=True)  # each used row's first sample
    labels = samples.labels[used]
    ent_of_used, _ = group_ids(*(labels[:, LABEL_COLUMN[name]] for name in ENTITY_LABELS[:3]))
    first = np.full(int(ent_of_used.max()) + 1, len(samples), np.int64)
    np.minimum.at(first, ent_of_used, first_of_row)
    ent_of_row = np.full(len(samples.labels), -1, id_type(len(samples)))
    ent_of_row[used] = ent_of_used
    row = samples.label[first]
    return ent_of_row[samples.label], Entities(*(samples.labels[row, LABEL_COLUMN[name]] for name in ENTITY_LABELS))


def _steps(ent: np.ndarray, time_ns: np.ndarray, start: int, end: int,
           ids: type) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each distinct (entity, time) step's duration in seconds, each row's step (as `ids`), each
    step's entity."""
    row_step, first = group_ids(ent, time_ns, dtype=ids)
    st_ent, st_t = ent[first].astype(np.int64), time_ns[first].astype(np.int64)
    nxt = np.empty_like(st_t)
    nxt[:-1] = st_t[1:]
    last = np.ones(len(st_t), dtype=bool)
    last[:-1] = st_ent[1:] != st_ent[:-1]
    nxt[last] = end
    first = np.ones(len(st_t), dtype=bool)
    first[1:] = st_ent[1:] != st_ent[:-1]
    begin = np.where(first, start, st_t)
    return (nxt - begin) / 1e9, row_step, st_ent


def tenures(samples: Readings, ent: np.ndarray, shared: np.ndarray, start: int, end: int,
            piece: int = ENTITIES_AT_ONCE) -> Tenures:
    """`shared[e]` marks time-sliced entities: several holders at once, activity per pod.

    For shared entities `act_integral` integrates the holder's share of device time (its own
    per-process GPU_UTIL series, else the device activity split equally among the holders
    present); the caller turns that into activity of the replicas held.

    Entities are worked out `piece` at a time (ids in ranges): an entity's tenures read its own
    samples only, and the ids number holdings in the order of their entity, so the pieces' rows
    one after the other are the rows of all at once (the dark holdings after all others, as
    `_with_dark` puts them). At 100,000 GPUs the columns per sample built for all entities at
    once were the interval's computation's peak.
    """
    n_entity = int(ent.max()) + 1 if len(ent) else 0
    if n_entity <= piece:
        return _with_dark(*_tenures(samples, ent, shared, start, end))
    held, dark = [], []
    for lo in range(0, n_entity, piece):
        mine = np.flatnonzero((ent >= lo) & (ent < lo + piece))
        part, *steps = _tenures(samples.take(mine), ent[mine], shared, start, end)
        held.append(part)
        dark.append(_dark(part, *steps))
    return Tenures.joined(held + dark)


def _tenures(samples: Readings, ent: np.ndarray, shared: np.ndarray, start: int,
             end: int) -> tuple[Tenures, np.ndarray, np.ndarray, np.ndarray]:
    """The tenures of the entities of `ent` but the dark ones, and what `_with_dark` adds those
    from: each step's duration, whether it has a live row, and its entity. A column is let go
    once read."""
    ids = id_type(len(samples))  # every row, entity, step, holding and pair number is below it
    dur, row_step, step_ent = _steps(ent, samples.time_ns, start, end, ids)
    rows, by_pod, step_live = _holder_rows(samples, row_step, len(dur), ids)
    r_ent, r_step = ent[rows].astype(ids), row_step[rows]
    del row_step
    r_ns = np.where(by_pod, samples.namespace[rows], NONE)
    r_pod = np.where(by_pod, samples.pod[rows], NONE)
    del by_pod
    hold, hold_first = group_ids(r_ent, r_ns, r_pod, dtype=ids)
    holder_ns, holder_pod = r_ns[hold_first], r_pod[hold_first]
    del r_ns
    pair, pair_first = group_ids(hold, r_step, dtype=ids)
    n_hold = len(hold_first)
    pair_is_pod = r_pod[pair_first] >= 0
    del r_pod
    replicas = _replicas(hold, samples.vgpu[rows], n_hold)
    pair_hold, pair_step = hold[pair_first], r_step[pair_first]
    del hold
    pair_shared = shared[r_ent[pair_first]] & pair_is_pod
    entity = r_ent[hold_first].astype(np.int64)
    del pair_first
    act, own = _pair_activities(samples.metric, samples.pod_uid, samples.value, rows, r_ent, r_step, pair, pair_step,
                                pair_is_pod, pair_shared, len(dur), int(Metric.GR_ENGINE_ACTIVE), int(Metric.GPU_UTIL))
    del rows, r_ent, r_step, pair, pair_is_pod, pair_shared
    measured = ~np.isnan(act)
    pair_dur = dur[pair_step]
    out = Tenures(
        entity=entity, holder_ns=holder_ns, holder_pod=holder_pod,
        held_s=np.bincount(pair_hold, weights=pair_dur, minlength=n_hold),
        act_s=np.bincount(pair_hold, weights=np.where(measured, pair_dur, 0.0), minlength=n_hold),
        act_integral=np.bincount(pair_hold, weights=np.where(measured, act * pair_dur, 0.0), minlength=n_hold),
        replicas=replicas,
        per_pod_activity=np.bincount(pair_hold, weights=own, minlength=n_hold) > 0,
    )
    return out, dur, step_live, step_ent


def _holder_rows(samples: Readings, row_step: np.ndarray, n_steps: int,
                 ids: type) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The live rows that name a holder (as `ids`), whether each names a pod, and the steps with
    a live row. In a step where a pod is present, the entity's pod-less series name no holder of
    their own."""
    live = ~samples.stale
    step_live = np.zeros(n_steps, dtype=bool)
    step_live[row_step[live]] = True
    has_pod = (samples.pod >= 0) & live
    step_has_pod = np.zeros(n_steps, dtype=bool)
    step_has_pod[row_step[has_pod]] = True
    rows = np.flatnonzero(live & (has_pod | ~step_has_pod[row_step])).astype(ids)
    return rows, has_pod[rows], step_live


def _replicas(hold: np.ndarray, vgpu: np.ndarray, n_hold: int) -> np.ndarray:
    """Replicas held on shared devices: distinct vgpu indices per holding."""
    vg = vgpu >= 0
    _, vfirst = group_ids(hold[vg], vgpu[vg])
    return np.bincount(hold[vg][vfirst], minlength=n_hold) if len(vfirst) else np.zeros(n_hold, np.int64)


def _activity(metric: np.ndarray, pod_uid: np.ndarray, value: np.ndarray, rows: np.ndarray, r_ent: np.ndarray,
              r_step: np.ndarray, pair: np.ndarray, n_pair: int, n_steps: int, gr: int,
              util: int) -> tuple[np.ndarray, np.ndarray]:
    """Each step's device activity, and each (holding, step) pair's own per-process activity
    (NaN where none). Device activity is DCGM_FI_PROF_GR_ENGINE_ACTIVE where the entity has it,
    else GPU_UTIL/100. Values are read only for the rows that give one."""
    kind = metric[rows]
    is_gr, is_util = kind == gr, kind == util
    del kind
    ent_has_gr = np.zeros(int(r_ent.max()) + 1 if len(r_ent) else 0, dtype=bool)
    ent_has_gr[r_ent[is_gr]] = True
    own = pod_uid[rows] >= 0  # per-process series of one pod on a shared device
    dev = np.flatnonzero((is_gr | (is_util & ~ent_has_gr[r_ent])) & ~own)
    mine = np.flatnonzero(is_util & own)
    del is_gr, own
    read = value[rows[dev]]
    step_act = _mean_by(r_step[dev], np.where(is_util[dev], read / 100.0, read), n_steps)
    del read
    return step_act, _mean_by(pair[mine], value[rows[mine]] / 100.0, n_pair, reduce_sum=True)


def _pair_activity(step_act: np.ndarray, pod_act: np.ndarray, pair_step: np.ndarray, pair_is_pod: np.ndarray,
                   pair_shared: np.ndarray) -> np.ndarray:
    """Per (holding, step) pair: its activity. On a shared entity a holder's activity is its own
    series', else the device's split equally among the holders present."""
    holders_in_step = np.bincount(pair_step, weights=pair_is_pod, minlength=len(step_act))
    act = step_act[pair_step]
    split = act / np.maximum(holders_in_step[pair_step], 1)
    del holders_in_step
    return np.where(pair_shared, np.where(np.isnan(pod_act), split, pod_act), act)


def _pair_activities_reference(metric: np.ndarray, pod_uid: np.ndarray, value: np.ndarray, rows: np.ndarray,
                               r_ent: np.ndarray, r_step: np.ndarray, pair: np.ndarray, pair_step: np.ndarray,
                               pair_is_pod: np.ndarray, pair_shared: np.ndarray, n_steps: int, gr: int,
                               util: int) -> tuple[np.ndarray, np.ndarray]:
    """`_pair_activities` the plain way, with numpy's arrays per row."""
    step_act, pod_act = _activity(metric, pod_uid, value, rows, r_ent, r_step, pair, len(pair_step), n_steps, gr, util)
    return _pair_activity(step_act, pod_act, pair_step, pair_is_pod, pair_shared), ~np.isnan(pod_act)


@kernel(interpreted=_pair_activities_reference)
def _pair_activities(metric, pod_uid, value, rows, r_ent, r_step, pair,  # noqa: ANN001, ANN201
                     pair_step, pair_is_pod, pair_shared, n_steps, gr, util):
    """Each (holding, step) pair's activity, and whether the holding's own per-process series gave
    it one: `_pair_activity(*_activity(...))` in one pass over the holders' rows, with no array
    per row (at 100,000 GPUs the row-sized arrays of the plain way were the peak of the
    interval's computation). Sums are taken in the rows' order, as numpy's `bincount` takes them:
    the figures are the same to the bit (tests/enrich/test_timeline_kernels.py). Interpreted
    kernels run the plain way, which Python runs faster than this loop."""
    n_ent = 0
    for i in range(len(rows)):
        n_ent = max(n_ent, r_ent[i] + 1)
    has_gr = np.zeros(n_ent, np.bool_)
    for i in range(len(rows)):
        if metric[rows[i]] == gr:
            has_gr[r_ent[i]] = True
    n_pair = len(pair_step)
    step_act, count = np.zeros(n_steps), np.zeros(n_steps, np.int32)  # sums and counts, then the means
    act, own_n = np.zeros(n_pair), np.zeros(n_pair, np.int32)  # first the sums of pairs' own series
    for i in range(len(rows)):
        row = rows[i]
        kind, mine = metric[row], pod_uid[row] >= 0
        if kind == util and mine:
            act[pair[i]] += value[row] / 100.0
            own_n[pair[i]] += 1
        elif (kind == gr or (kind == util and not has_gr[r_ent[i]])) and not mine:
            step_act[r_step[i]] += value[row] / 100.0 if kind == util else value[row]
            count[r_step[i]] += 1
    for k in range(n_steps):
        step_act[k] = step_act[k] / count[k] if count[k] else np.nan
        count[k] = 0  # from here on: the holders present in each step
    for j in range(n_pair):
        if pair_is_pod[j]:
            count[pair_step[j]] += 1
    own = np.empty(n_pair, np.bool_)
    for j in range(n_pair):
        k = pair_step[j]
        own[j] = own_n[j] > 0 and not np.isnan(act[j])  # a NaN sum is no figure, as the plain way reads it
        if not pair_shared[j]:
            act[j] = step_act[k]
        elif not own[j]:
            act[j] = step_act[k] / max(count[k], 1.0)
    return act, own


def warm_up() -> str:
    """Compile (or load from numba's cache) the pass over the holders' rows for the columns the
    join hands it (4-byte row numbers); returns how it was (otelgpu.core.jit.how_loaded)."""
    from otelgpu.core.jit import how_loaded

    one, no = np.zeros(1, np.int32), np.zeros(1, bool)
    _pair_activities(np.zeros(1, np.int16), one, np.zeros(1), one, one, one, one, one, no, no, 1,
                     int(Metric.GR_ENGINE_ACTIVE), int(Metric.GPU_UTIL))
    return how_loaded(_pair_activities)


def _with_dark(held: Tenures, dur: np.ndarray, step_live: np.ndarray, step_ent: np.ndarray) -> Tenures:
    """Steps in which an entity has no live series at all (only staleness markers: a failed
    scrape) become one DARK holding per entity: time someone may well have held it, unmeasured."""
    dark = _dark(held, dur, step_live, step_ent)
    return Tenures.joined([held, dark]) if len(dark.entity) else held


def _dark(held: Tenures, dur: np.ndarray, step_live: np.ndarray, step_ent: np.ndarray) -> Tenures:
    """The DARK holdings of `_with_dark`, in the columns' types of `held`'s."""
    dark = np.flatnonzero(~step_live & (dur > 0))
    ents, inverse = np.unique(step_ent[dark], return_inverse=True)
    n_entity = len(ents)
    zeros, marks = np.zeros(n_entity), np.full(n_entity, DARK, dtype=held.holder_ns.dtype)
    return Tenures(ents.astype(held.entity.dtype), marks, marks.astype(held.holder_pod.dtype),
                   np.bincount(inverse.reshape(-1), weights=dur[dark], minlength=n_entity), zeros, zeros.copy(),
                   np.zeros(n_entity, held.replicas.dtype), np.zeros(n_entity, bool))


def _mean_by(group: np.ndarray, value: np.ndarray, groups: int, reduce_sum: bool = False) -> np.ndarray:
    """Mean (or sum) of `value` per group id; NaN for groups without values."""
    out = np.bincount(group, weights=value, minlength=groups).astype(np.float64, copy=False)  # ints if no group
    count = np.bincount(group, minlength=groups)
    if not reduce_sum:
        out /= np.maximum(count, 1)
    out[count == 0] = np.nan
    return out
