"""DCGM samples as an open interval keeps them: one row per label combination and timestamp.

What the interval join reads of DCGM samples (enrich/timeline.py, enrich/claims.py) is, per
entity and timestamp, who was shown holding it and four values: the graphics engine's activity,
GPU_UTIL, and the framebuffer used and free. dcgm-exporter sends six series per device (and more
with its other fields), each with the device's and its holder's labels: so the samples of one
label combination at one timestamp fold into one row, the four values as columns and a bit per
value present. Any other consumed field (power, energy) only says the entity was there: a bit,
without its value.

Rows merge on (label combination, timestamp, staleness) as they arrive, the first value of each
column winning, as the join's deduplication keeps the first of samples resent with the same series
and timestamp: a resent batch adds nothing. What an interval holds then grows with its units,
holders and scrape times, not with the series each sends or the times a batch is sent. Unpacked at
the close they are the samples the join reads: the same steps, holders and values, with the
fields read only for presence left out where a value column already says so.

The label combinations are a table a part may share (`LabelTable`): the open intervals' parts
refer to the table the last fold left wherever it holds every combination they bring, so a
combination is kept once for all of them, not once in each part and each interval (at 100,000
GPUs some 400,000 combinations of 40 bytes). A table is always sorted by its codes and holds each
combination once (`merge` makes them so, and a compaction of the interner keeps the order of the
codes it keeps), so rows grouped by their combination's place in a shared table come in the
order they would in a table of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np

from otelgpu.core.grouping import group_ids
from otelgpu.core.jit import kernel
from otelgpu.enrich.samples import AnySamples, IndexedSamples, Samples
from otelgpu.receiver.interner import Coded
from otelgpu.receiver.schema import Metric

# The metrics whose values the join reads, a column each; the last bit marks any other.
VALUED = (Metric.GR_ENGINE_ACTIVE, Metric.GPU_UTIL, Metric.FB_USED, Metric.FB_FREE)
PRESENT_ONLY = len(VALUED)  # the bit of a field read only for presence
PRESENT_METRIC = Metric.POWER_USAGE  # the metric such a row unpacks as
_CELL = np.full(int(max(Metric)) + 1, PRESENT_ONLY, np.int64)
_CELL[list(map(int, VALUED))] = np.arange(len(VALUED))
_METRIC_OF_CELL = np.array([*map(int, VALUED), int(PRESENT_METRIC)], np.int16)
_ACTIVITY_CELLS = (VALUED.index(Metric.GR_ENGINE_ACTIVE), VALUED.index(Metric.GPU_UTIL))
_MEMORY_CELLS = (VALUED.index(Metric.FB_USED), VALUED.index(Metric.FB_FREE))


@dataclass
class Steps(Coded):
    """Rows of (label combination, timestamp, staleness), each with its values (NaN where absent)
    and a bit per column present (and `PRESENT_ONLY`'s). `labels` holds each combination once,
    as the ten label columns of `Samples`; 34 bytes a row (46 where the counts are not whole
    numbers), where the samples it stands for took 23 bytes each. Rows are made from their values
    by `made`, and `value` gives them back as they came, bit for bit."""

    CODES: ClassVar[tuple[str, ...]] = ("labels",)
    time_ns: np.ndarray  # int64 [n]
    stale: np.ndarray  # bool [n]
    label: np.ndarray  # int32 [n]: row of `labels`
    present: np.ndarray  # uint8 [n]: bit c set where column c (or PRESENT_ONLY) has a value
    activity: np.ndarray  # float64 [n]: the first column (GR_ENGINE_ACTIVE)
    # [n, len(VALUED) - 1]: the others (GPU_UTIL, FB_USED, FB_FREE), which dcgm-exporter sends as
    # whole numbers: float32 where that keeps every one of them as it came, else float64
    counts: np.ndarray
    labels: np.ndarray  # int32 [k, len(Samples.CODES)]

    @staticmethod
    def made(time_ns: np.ndarray, stale: np.ndarray, label: np.ndarray, present: np.ndarray, value: np.ndarray,
             labels: np.ndarray) -> "Steps":
        """Rows whose values are `value` (float64 [n, len(VALUED)], a column each)."""
        return Steps(time_ns, stale, label, present, np.ascontiguousarray(value[:, 0]), _narrowed(value[:, 1:]), labels)

    @property
    def value(self) -> np.ndarray:
        """float64 [n, len(VALUED)]: the values as they were made, built at each read."""
        out = np.empty((len(self), len(VALUED)))
        out[:, 0], out[:, 1:] = self.activity, self.counts
        return out

    def values_at(self, rows: np.ndarray, cells: np.ndarray) -> np.ndarray:
        """float64: the value of each row's cell (< PRESENT_ONLY), without building `value`."""
        out = np.empty(len(rows))
        first = cells == 0
        out[first] = self.activity[rows[first]]
        out[~first] = self.counts[rows[~first], cells[~first] - 1]
        return out

    def __len__(self) -> int:
        return len(self.time_ns)

    def codes(self) -> list[np.ndarray]:
        return [self.labels.reshape(-1)]

    def remap(self, table: np.ndarray, done: Optional[dict[int, tuple[np.ndarray, np.ndarray]]] = None) -> None:
        """`done`: the tables rewritten so far, by id (the old one kept with the new, so its id is
        not reused meanwhile): parts that shared a table share its rewrite."""
        if done is None:
            self.labels = table[self.labels].astype(np.int32)
            return
        old = self.labels
        self.labels = done.setdefault(id(old), (old, table[old].astype(np.int32)))[1]

    def sharing(self, known: "LabelTable") -> "Steps":
        """These rows referring to `known`'s table, when it holds every label combination they
        have; themselves otherwise."""
        found = known.find(self.labels)
        if found is None:
            return self
        return Steps(self.time_ns, self.stale, found[self.label], self.present, self.activity, self.counts,
                     known.labels)

    @staticmethod
    def of(samples: Samples) -> "Steps":
        """The samples folded: each sample first a row of its own with one bit, then merged."""
        n_sample = len(samples)
        cell = _CELL[samples.metric.astype(np.int64)]
        value = np.full((n_sample, len(VALUED)), np.nan)
        valued = np.flatnonzero(cell < PRESENT_ONLY)
        value[valued, cell[valued]] = samples.value[valued]
        labels = np.stack([getattr(samples, name) for name in Samples.CODES], axis=1).astype(np.int32, copy=False)
        label_of, first = group_ids(*labels.T) if n_sample else (np.zeros(0, np.int64),) * 2
        one = Steps.made(samples.time_ns, samples.stale, label_of.astype(np.int32),
                         (np.uint8(1) << cell.astype(np.uint8)).astype(np.uint8), value,
                         np.ascontiguousarray(labels[first]))
        return Steps.merge([one])

    @staticmethod
    def merge(parts: list["Steps"]) -> "Steps":
        """The parts' rows one after the other, rows of the same label combination, timestamp
        and staleness merged: each column's first value (in that order) wins (`merge_reference`,
        the same in numpy's operations). Each part's cells are laid into the merged rows by a
        kernel: no cell is unpacked, where numpy's way held some 250 bytes a row at once (at
        100,000 GPUs a fold of a million rows went up by 360 MiB)."""
        if not parts:
            return Steps.of(Samples.empty())
        label, labels = _labels_of(parts)
        time_ns = np.concatenate([p.time_ns for p in parts])
        stale = np.concatenate([p.stale for p in parts])
        row, first = group_ids(label, time_ns, stale, dtype=np.int32)
        present = np.zeros(len(first), np.uint8)
        activity = np.full(len(first), np.nan)
        # float32 when every part's are: a value laid from them is as it came
        counts = np.full((len(first), len(VALUED) - 1), np.nan, np.result_type(*(p.counts for p in parts)))
        at = 0
        for p in parts:
            _first_cells(row[at:at + len(p)], np.ascontiguousarray(p.present, np.uint8),
                         np.ascontiguousarray(p.activity), np.ascontiguousarray(p.counts),
                         present, activity, counts)
            at += len(p)
        return Steps(time_ns[first], stale[first], label[first].astype(np.int32), present, activity, counts, labels)

    def unpack(self, memory: bool = True, indexed: bool = False) -> AnySamples:
        """The samples the join reads: a sample per value present, and one of `PRESENT_METRIC`
        (value NaN) for a row with none.

        `memory` False leaves out a row's framebuffer samples (FB_USED, FB_FREE) where it has an
        activity sample (GR_ENGINE_ACTIVE or GPU_UTIL), which comes first in the row: they would
        only say again who held what and when (the row's labels, time and staleness), and the
        join reads their values only for the device memory of GPUs that grants share
        (`memory()`). Every group of rows keeps its first sample and its last row: the same join
        from about a third of the samples of dcgm-exporter's default fields. `indexed`: the
        samples read their labels through this table (`IndexedSamples`), where each has its own."""
        bits = _bits(self.present)
        bits[:, PRESENT_ONLY] &= ~bits[:, :PRESENT_ONLY].any(axis=1)
        if not memory:
            active = bits[:, list(_ACTIVITY_CELLS)].any(axis=1)
            for cell in _MEMORY_CELLS:
                bits[:, cell] &= ~active
        return self._samples(bits, indexed)

    def memory(self, indexed: bool = False) -> AnySamples:
        """The framebuffer samples alone, in the order `unpack()` gives them."""
        bits = _bits(self.present)
        kept = np.zeros(PRESENT_ONLY + 1, bool)
        kept[list(_MEMORY_CELLS)] = True
        bits &= kept
        return self._samples(bits, indexed)

    @staticmethod
    def empty() -> "Steps":
        return Steps.of(Samples.empty())

    def _samples(self, bits: np.ndarray, indexed: bool = False) -> AnySamples:
        """A sample per bit set, row after row, each row's in the order of its columns."""
        at, cell = np.nonzero(bits)
        valued = cell < PRESENT_ONLY
        value = np.full(len(at), np.nan)
        value[valued] = self.values_at(at[valued], cell[valued])
        samples = IndexedSamples(_METRIC_OF_CELL[cell], self.time_ns[at], value, self.stale[at], self.label[at],
                                 self.labels)
        return samples if indexed else samples.plain()


def merge_reference(parts: list[Steps]) -> Steps:
    """`Steps.merge` in numpy's operations: every cell of every row unpacked, and each merged
    row's cells taken from the first row that has them."""
    if not parts:
        return Steps.of(Samples.empty())
    label, labels = _labels_of(parts)
    time_ns = np.concatenate([p.time_ns for p in parts])
    stale = np.concatenate([p.stale for p in parts])
    row, first = group_ids(label, time_ns, stale)
    bits = _bits(np.concatenate([p.present for p in parts]))
    at, cell = np.nonzero(bits)  # row-major: each row's cells, rows in order
    key, first_cell = np.unique(row[at] * (PRESENT_ONLY + 1) + cell, return_index=True)
    merged_row, merged_cell = key // (PRESENT_ONLY + 1), key % (PRESENT_ONLY + 1)
    present = np.bincount(merged_row, weights=np.left_shift(1, merged_cell), minlength=len(first))
    value = np.full((len(first), len(VALUED)), np.nan)
    valued = merged_cell < PRESENT_ONLY
    value[merged_row[valued], merged_cell[valued]] = \
        np.concatenate([p.value for p in parts])[at[first_cell[valued]], merged_cell[valued]]
    return Steps.made(time_ns[first], stale[first], label[first].astype(np.int32), present.astype(np.uint8), value,
                      labels)


@kernel
def _first_cells(row: np.ndarray, present: np.ndarray, activity: np.ndarray, counts: np.ndarray,
                 merged_present: np.ndarray, merged_activity: np.ndarray, merged_counts: np.ndarray) -> None:
    """Lay rows, in order, into the merged rows `row` names: each merged row takes the bits of its
    rows, and each value cell (the activity, then the counts) from the first of them that has it."""
    for i in range(len(row)):
        m = row[i]
        new = present[i] & ~merged_present[m]
        if new:
            if new & 1:
                merged_activity[m] = activity[i]
            for c in range(merged_counts.shape[1]):
                if (new >> (c + 1)) & 1:
                    merged_counts[m, c] = counts[i, c]
            merged_present[m] |= new


def warm_up() -> str:
    """Compile (or load from numba's cache) the merge's kernel for the columns a fold hands it;
    returns how it was (otelgpu.core.jit.how_loaded)."""
    from otelgpu.core.jit import how_loaded

    one = np.zeros(1, np.int32), np.zeros(1, np.uint8), np.zeros(1)
    for part, merged in ((np.float32, np.float32), (np.float32, np.float64), (np.float64, np.float64)):
        _first_cells(*one, np.zeros((1, len(VALUED) - 1), part), np.zeros(1, np.uint8), np.zeros(1),
                     np.zeros((1, len(VALUED) - 1), merged))
    return how_loaded(_first_cells)


def _narrowed(counts: np.ndarray) -> np.ndarray:
    """`counts` in float32 when that keeps each as it is (NaN where absent), else as they are."""
    with np.errstate(over="ignore"):  # a value past float32's range becomes inf there: not kept so
        narrow = counts.astype(np.float32)
    return narrow if np.array_equal(narrow.astype(np.float64), counts, equal_nan=True) else np.ascontiguousarray(counts)


def _labels_of(parts: list[Steps]) -> tuple[np.ndarray, np.ndarray]:
    """The parts' rows' label combinations, end to end, and the table they refer to: the one table
    all of them share, or one of every combination of theirs (each table read once however many
    parts share it), sorted."""
    tables = {id(p.labels): p.labels for p in parts}
    if len(tables) == 1 and _ordered(parts[0].labels):
        return np.concatenate([p.label for p in parts]), parts[0].labels
    bases = dict(zip(tables, np.cumsum([0] + [len(t) for t in tables.values()][:-1]).tolist()))
    labels = np.concatenate(list(tables.values())).reshape(-1, len(Samples.CODES))
    label_of, first_label = group_ids(*labels.T) if len(labels) else (np.zeros(0, np.int64),) * 2
    label = np.concatenate([label_of[p.label.astype(np.int64) + bases[id(p.labels)]] for p in parts])
    return label, np.ascontiguousarray(labels[first_label]).astype(np.int32, copy=False)


def _ordered(labels: np.ndarray) -> bool:
    """Whether the rows are in strictly increasing order of their codes, column after column (as
    `merge` leaves a table; a compaction of the interner keeps that order, a table rewritten by
    any other map of codes need not)."""
    if len(labels) < 2:
        return True
    before, after = labels[:-1], labels[1:]
    differ = before != after
    column = np.argmax(differ, axis=1)  # each pair's first column that differs
    rows = np.arange(len(column))
    return bool(differ[rows, column].all() and (after[rows, column] > before[rows, column]).all())


class LabelTable:
    """A table of label combinations (`Steps.labels`), found by content: each combination's
    fingerprint, sorted, and where each stands. Built on the first `find`."""

    def __init__(self, labels: np.ndarray) -> None:
        self.labels = labels
        self._sorted: Optional[tuple[np.ndarray, np.ndarray]] = None

    def find(self, labels: np.ndarray) -> Optional[np.ndarray]:
        """Where each row of `labels` stands in the table; None when one is not in it."""
        if self._sorted is None:
            prints = _fingerprints(self.labels)
            order = np.argsort(prints)
            self._sorted = (prints[order], order)
        prints, order = self._sorted
        if not len(prints):
            return None if len(labels) else np.zeros(0, np.int64)
        at = order[np.minimum(np.searchsorted(prints, _fingerprints(labels)), len(prints) - 1)]
        # a fingerprint met twice finds the first row that has it: one that is not this row's is
        # not taken for it
        return at if np.array_equal(self.labels[at], labels) else None


def _fingerprints(labels: np.ndarray) -> np.ndarray:
    """uint64 [k]: a hash of each row's codes."""
    out = np.zeros(len(labels), np.uint64)
    for column in labels.T:
        out ^= column.astype(np.int64).astype(np.uint64)
        out *= np.uint64(0x9E3779B97F4A7C15)
        out ^= out >> np.uint64(29)
    return out


def _bits(present: np.ndarray) -> np.ndarray:
    """bool [n, PRESENT_ONLY + 1]: whether each bit of each row is set."""
    return ((present[:, None] >> np.arange(PRESENT_ONLY + 1, dtype=np.uint8)) & 1).astype(bool)


def unpack_reference(samples: Samples) -> Samples:
    """What `Steps.of(samples).unpack()` gives, the readable way: the first sample of each series
    and timestamp (as the join's deduplication keeps it), fields read only for presence kept
    where their label combination, timestamp and staleness have no valued sample, then ordered by
    (label combination, timestamp, staleness) and column."""
    seen: dict[tuple, dict[int, float]] = {}
    for i in range(len(samples)):
        labels = tuple(int(getattr(samples, name)[i]) for name in Samples.CODES)
        key = (labels, int(samples.time_ns[i]), bool(samples.stale[i]))
        cell = int(_CELL[int(samples.metric[i])])
        seen.setdefault(key, {}).setdefault(cell, float(samples.value[i]) if cell < PRESENT_ONLY else np.nan)
    out = []
    for key in sorted(seen):
        cells = seen[key]
        kept = [c for c in sorted(cells) if c < PRESENT_ONLY] or [PRESENT_ONLY]
        out += [(key, int(_METRIC_OF_CELL[c]), cells[c]) for c in kept]
    n_row = len(out)
    labels = np.array([key[0] for key, _, _ in out], np.int32).reshape(n_row, len(Samples.CODES))
    return Samples(np.array([m for _, m, _ in out], np.int16), np.array([k[1] for k, _, _ in out], np.int64),
                   np.array([v for _, _, v in out], np.float64), np.array([k[2] for k, _, _ in out], bool),
                   **{name: labels[:, j].copy() for j, name in enumerate(Samples.CODES)})
