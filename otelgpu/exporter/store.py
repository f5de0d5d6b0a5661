"""Cumulative cost series: what every exporter reads.

Each interval's increments are added to monotonic sums that keep the start time of their first
interval, so a Prometheus `increase()` over any window reads the cost of that window. Gauges hold
the latest interval's value. Timestamps are interval ends on data time, strictly increasing.
"""

from __future__ import annotations

import math
import threading
from array import array
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping, Optional, Sequence

import numpy as np

from otelgpu.checkpoint import Pieces, string_ids, texts_of
from otelgpu.core.attrs import Attrs, Extended, named_sets, pair
from otelgpu.core.byvalue import ByValue
from otelgpu.core.grouping import RUN_SETS, gather_runs
from otelgpu.core.state import Undo, nothing_to_undo
from otelgpu.exporter.columns import Point, Points, SetCodes, SetTable, set_of

__all__ = ["CostStore", "MetricSpec", "Point", "Points", "cost_metrics"]


@dataclass(frozen=True)
class Plan:
    """Where `CostStore.record` will add each series' increment, looked up before it (`CostStore.plan`)."""

    records: int  # how many intervals the store had recorded then: the plan holds until the next one
    rows: dict[str, np.ndarray]  # per metric, each series' row in the order of its mapping; -1 for a new one
    parts: dict  # the numbers of the series' parts and the sets built from them (`_AttrSets.numbers`, `_Built`)


@dataclass(frozen=True)
class MetricSpec:
    name: str  # OTLP name
    unit: str  # UCUM unit; `{USD}`-style annotations add no Prometheus suffix
    kind: str  # "sum" (cumulative, monotonic) or "gauge"
    description: str
    prometheus: str  # the name after the Collector's Prometheus translation


def cost_metrics(currency: str = "USD") -> dict[str, MetricSpec]:
    unit = "{" + currency + "}"
    return {
        "allocated": MetricSpec("gpu.cost.allocated", unit, "sum",
                                "Cost of the capacity a pod holds under the cost model, in " + currency, "gpu_cost_allocated_total"),
        "effective": MetricSpec("gpu.cost.effective", unit, "sum",
                                "Allocated cost times measured activity", "gpu_cost_effective_total"),
        "waste": MetricSpec("gpu.cost.waste", unit, "sum",
                            "Allocated cost of capacity held but not used", "gpu_cost_waste_total"),
        "unmeasured": MetricSpec("gpu.cost.unmeasured", unit, "sum",
                                 "Allocated cost of units with no activity sample", "gpu_cost_unmeasured_total"),
        "unused": MetricSpec("gpu.cost.unused", unit, "sum",
                             "Cost of capacity nobody held, handed to this holder (idle policy share, "
                             "SCAD's unused cost) or to the platform tags (idle policy platform)", "gpu_cost_unused_total"),
        "idle": MetricSpec("gpu.cost.idle", unit, "sum",
                           "Cost of capacity nobody held, kept on the node", "gpu_cost_idle_total"),
        "unattributed": MetricSpec("gpu.cost.unattributed", unit, "sum",
                                   "Allocated GPU cost (request allocation) not carrying all five tags, by reason: "
                                   "no_pod, pod_unknown, tag_missing", "gpu_cost_unattributed_total"),
        "held": MetricSpec("gpu.held", "s", "sum",
                           "GPU-seconds held: unit fraction times seconds held", "gpu_held_seconds_total"),
        "provisioned": MetricSpec("gpu.provisioned", "s", "sum",
                                  "GPU-seconds of capacity on the node: its GPUs times seconds costed",
                                  "gpu_provisioned_seconds_total"),
        "capacity": MetricSpec("gpu.cost.capacity", unit, "sum",
                               "Cost of the capacity the model splits: allocated + unused + idle", "gpu_cost_capacity_total"),
        "tenant_cost": MetricSpec("gpu.cost.tenant", unit, "sum",
                                  "What a serving pod is charged (allocated + unused) split among the tenants it "
                                  "served, by their weighted tokens (tenant, served_model); they add up to the pod",
                                  "gpu_cost_tenant_total"),
        "tenant_tokens": MetricSpec("llm.tokens", "{token}", "sum",
                                    "Tokens a serving pod served, by tenant, served_model and token_kind "
                                    "(prompt, generation)", "llm_tokens_total"),
        "activity": MetricSpec("gpu.activity", "1", "gauge",
                               "Time-weighted activity of the units a pod held in the last interval", "gpu_activity_ratio"),
        "tag_coverage": MetricSpec("gpu.cost.tag_coverage", "1", "gauge",
                                   "Share of allocated cost carrying the tag (tag=all: all five), per cluster and per namespace", "gpu_cost_tag_coverage_ratio"),
        "tenant_cost_per_mtok": MetricSpec("gpu.cost.per_million_tokens", unit, "gauge",
                                           "Tenant cost per million tokens (prompt and generation) in the last "
                                           "interval, per cost model, served model and tenant, over the cluster",
                                           "gpu_cost_per_million_tokens"),
    }


class CostStore:
    """The cumulative series and the latest gauges.

    A sum that receives no increment (not even 0) for `end_after_intervals` intervals in a row has
    lost its holder (a pod gone, a node drained): it is ended with one NO_RECORDED_VALUE point and
    forgotten, so memory and active series in the backend follow the live cluster. A gauge missing
    from an interval is ended the same way at once. Should the series come back, it starts afresh
    with a new start time, which Prometheus reads as a new counter.

    The sums are columns (metric, attribute set, start, value, intervals quiet) indexed by a row
    per series; each distinct attribute set is kept once, with its series' rows by metric in one
    array (no dict per series), so a snapshot is built from the columns with no object per point
    (`Points`).

    `keep_ended` keeps ended sums' final values for `totals()` (run reports such as the demo's);
    exporters never see them again.
    """

    key = "store"  # its checkpoint entry (core/state.py)
    BORN_LIMIT = 2**31 - 1  # creation numbers are renumbered before they pass this (int32)

    def __init__(self, currency: str = "USD", end_after_intervals: int = 2, keep_ended: bool = False) -> None:
        self.specs = cost_metrics(currency)
        self.metric_keys = tuple(self.specs)
        self._code = {m: i for i, m in enumerate(self.metric_keys)}
        if not 1 <= end_after_intervals <= 10_000:  # a row's intervals quiet are kept in 16 bits
            raise ValueError(f"end_after_intervals must be 1 to 10,000, not {end_after_intervals}")
        self.end_after_intervals = end_after_intervals
        self.keep_ended = keep_ended
        self._lock = threading.Lock()
        self._records = 0  # intervals recorded, and restores: a plan is valid while this stays
        self._reset()

    def _reset(self) -> None:
        self._sets = _AttrSets()
        # Each attribute set's live sums, chained: its newest row, and each row the next of its set
        # (a few per set where a row per set and metric would take 60 MiB at 100,000 GPUs)
        self._head = np.full(1024, -1, np.int32)  # [attribute set]
        cap = 1024
        self._next = np.full(cap, -1, np.int32)  # [row]
        # Rows never used are those from `_top` on; rows released since are reused first, the
        # latest first (`_freed`, the first `_n_freed`): no column of the free rows as long as the rows
        self._top = 0
        self._freed = np.zeros(64, np.int32)
        self._n_freed = 0
        self._metric = np.zeros(cap, np.uint16)
        self._aset = np.zeros(cap, np.uint32)
        self._start = np.zeros(cap, np.int64)
        self._value = np.zeros(cap, np.float64)
        self._quiet = np.zeros(cap, np.uint16)  # never above end_after_intervals: a row is dropped there
        # Creation order (snapshots list sums oldest first), renumbered in that order before it
        # passes BORN_LIMIT: 4 bytes a row
        self._born = np.zeros(cap, np.int32)
        self._live = np.zeros(cap, bool)
        self._births = 0
        self._gauges: dict[str, _Gauges] = {}  # the latest interval's, per metric
        self._gauge_time = 0
        self._ended_totals: dict[tuple[str, Attrs], float] = {}
        self.last_time_ns = 0
        self.series_ended = 0

    def plan(self, sums: Mapping[str, Mapping[Attrs, float]]) -> Plan:
        """The rows `record(..., sums, ...)` would add to, looked up now (an interval computed
        ahead of its close does this then, so that its close need not)."""
        with self._lock:
            parts: dict = {}
            # rows as int32: held from the computation ahead to the close (2 million at 100,000 GPUs)
            rows = {metric: self._look_up(metric, series, parts).astype(np.int32) for metric, series in sums.items()}
            parts.pop("by name", None)  # the look-ups' alone (`_by_name`, some 9 MiB): the close looks none up
            return Plan(self._records, rows, parts)

    def _look_up(self, metric: str, series: Mapping[Attrs, float], parts: dict) -> np.ndarray:
        """Each series' row, -1 for a new one. A series named by its parts (the cost models'
        `Extended`) is found by them, all at once (`_AttrSets.find_named`); the others, and
        those whose set was not named so yet, by value."""
        named = named_sets(series)
        keys = _Built(named, parts) if named is not None else list(series)
        sets = self._sets.find_named(named, parts) if named is not None else np.full(len(keys), -1, np.int64)
        missed = np.flatnonzero(sets < 0)
        if len(missed):
            sets[missed] = self._sets.find_all([keys[i] for i in missed.tolist()])
        return self._rows_of(sets, self._code[metric])

    def _rows_of(self, sets: np.ndarray, code: int) -> np.ndarray:
        """The live row of metric `code` of each attribute set (-1: none, or no set: -1)."""
        found = np.full(len(sets), -1, np.int64)
        at = np.flatnonzero(sets >= 0)
        row = self._head[sets[at]].astype(np.int64)
        while len(at):  # one step along every chain at once
            more = row >= 0
            at, row = at[more], row[more]
            hit = self._metric[row] == code
            found[at[hit]] = row[hit]
            at, row = at[~hit], self._next[row[~hit]].astype(np.int64)
        return found

    def record(self, start_ns: int, end_ns: int, sums: Mapping[str, Mapping[Attrs, float]],
               gauges: Mapping[str, Mapping[Attrs, float]], plan: Optional[Plan] = None) -> Points:
        """Add one interval's increments, replace the gauges, end the series that went quiet.
        Returns the interval's snapshot for the exporters: every live series at `end_ns` plus one
        ended point per series that ended now. `plan`: `plan(sums)`, used if nothing was recorded
        since it was made."""
        if end_ns <= self.last_time_ns:
            raise ValueError(f"interval ending {end_ns} is not after the last one ({self.last_time_ns}): "
                             "timestamps of a series must strictly increase")
        with self._lock:
            if plan is not None and plan.records != self._records:
                plan = None
            self._records += 1
            rows, incs = [np.zeros(0, np.int64)], [np.zeros(0, np.float64)]  # arrays: no Python number per series
            parts = plan.parts if plan is not None else {}
            looked_up = plan.rows if plan is not None else {m: self._look_up(m, s, parts) for m, s in sums.items()}
            for metric, series in sums.items():
                found = np.array(looked_up[metric], np.int64)
                new = np.flatnonzero(found < 0).tolist()
                named = named_sets(series)
                if new:
                    keys = _Built(named, parts) if named is not None else list(series)
                    asets = self._sets.add_all([keys[i] for i in new]).tolist()
                    for i, aset in zip(new, asets):  # in the mapping's order, as they were found
                        found[i] = self._add(metric, aset, start_ns, 0.0, 0)
                if named is not None:
                    self._sets.name(self._aset[found].astype(np.int64), named, parts)
                rows.append(found)
                incs.append(_values(series))
            table = self._table()  # the snapshot's own: a set's index is reused once it is released
            seen = np.concatenate(rows)
            live = self._live
            self._quiet[live] += 1
            self._quiet[seen] = 0
            self._value[seen] += np.concatenate(incs)  # one row per series: no index twice
            gone = np.flatnonzero(live & (self._quiet >= self.end_after_intervals))
            gone = gone[np.argsort(self._born[gone], kind="stable")]
            ended = self._columns(gone, end_ns, table, ended=True)
            self._drop(gone)
            kept = self._live_rows()
            old_gauges = self._gauges
            self._gauges = {m: _Gauges(self._sets.kept_all(list(series)),
                                       np.fromiter(series.values(), np.float64, len(series)))
                            for m, series in gauges.items() if len(series)}
            self._gauge_time = end_ns
            gone_gauges = {m: old.missing_from(self._gauges.get(m)) for m, old in old_gauges.items()}
            self.last_time_ns = end_ns
            self.series_ended += len(gone) + sum(map(len, gone_gauges.values()))
            return self._snapshot(kept, end_ns, table, [self._gauge_points(self._gauges, end_ns),
                                                        self._gauge_points(gone_gauges, end_ns, ended=True), ended])

    def _table(self) -> SetTable:
        """The attribute sets as they are now, for a snapshot (`_AttrSets.snapshot`)."""
        return self._sets.snapshot(self._serial_of)

    def kept(self, attrs: Attrs) -> Attrs:
        """The set series are named by equal to `attrs`, if there is one, else `attrs`: an
        interval's join, which builds every set anew, then holds the store's object rather than a
        copy until the interval closes (the join runs beside the exporters: under the lock)."""
        with self._lock:
            return self._sets.kept(attrs)

    def _serial_of(self, attrs: Attrs) -> int:
        """The serial of the live set equal to `attrs`, -1 if none (a gauge's set that a sum has too)."""
        with self._lock:
            index = self._sets.find(attrs)
            return self._sets.serial(index) if index >= 0 else -1

    def _add(self, metric: str, aset: int, start_ns: int, value: float, quiet: int) -> int:
        """A row of `metric` for the attribute set `aset` (`_AttrSets.add_all`: a user of it already)."""
        if self._n_freed:
            self._n_freed -= 1
            row = int(self._freed[self._n_freed])
        else:
            if self._top == len(self._live):
                self._grow()
            row, self._top = self._top, self._top + 1
        if self._births >= self.BORN_LIMIT:
            self._renumber_births()
        self._metric[row] = self._code[metric]
        self._aset[row] = aset
        if aset >= len(self._head):
            self._head = np.concatenate([self._head, np.full(len(self._head) // 2, -1, np.int32)])
        self._next[row], self._head[aset] = self._head[aset], row
        self._start[row], self._value[row], self._quiet[row] = start_ns, value, quiet
        self._born[row] = self._births
        self._births += 1
        self._live[row] = True
        return row

    def _grow(self) -> None:
        """Half as many rows again: at most a third of the columns is room."""
        n_row = len(self._live)
        size = n_row + n_row // 2
        for name in ("_metric", "_aset", "_start", "_value", "_quiet", "_born", "_live", "_next"):
            old = getattr(self, name)
            new = np.zeros(size, old.dtype)
            new[:n_row] = old
            setattr(self, name, new)

    def _renumber_births(self) -> None:
        """The live rows' creation numbers made 0, 1, ... in the same order."""
        rows = self._live_rows()
        self._born[rows] = np.arange(len(rows), dtype=np.int32)
        self._births = len(rows)

    def _drop(self, rows: np.ndarray) -> None:
        asets = self._aset[rows].tolist()
        self._unchain(rows.tolist(), asets)
        if self.keep_ended:
            for metric, aset, value in zip(self._metric[rows].tolist(), asets, self._value[rows].tolist()):
                key = (self.metric_keys[metric], self._sets.value(aset))
                self._ended_totals[key] = self._ended_totals.get(key, 0.0) + value
        self._sets.release(asets)
        self._live[rows] = False
        need = self._n_freed + len(rows)
        if need > len(self._freed):
            freed = np.zeros(need + need // 2, np.int32)
            freed[:self._n_freed] = self._freed[:self._n_freed]
            self._freed = freed
        self._freed[self._n_freed:need] = rows[::-1]
        self._n_freed = need

    def _unchain(self, rows: list[int], asets: list[int]) -> None:
        """Take each row out of its set's chain (a set has a row per metric it has, a few)."""
        head, chained = self._head, self._next
        for row, aset in zip(rows, asets):
            at = int(head[aset])
            if at == row:
                head[aset] = chained[row]
                continue
            while (following := int(chained[at])) != row:
                if following < 0:  # never so: a clear error rather than a walk off the chain's end
                    raise RuntimeError(f"cost store: row {row} is not in its attribute set's chain")
                at = following
            chained[at] = chained[row]

    def _columns(self, rows: np.ndarray, end_ns: int, table: SetTable, ended: bool = False) -> Points:
        """Sums of these rows at `end_ns`, over `table` (a copy of the attribute sets)."""
        n_row = len(rows)
        return Points(self.metric_keys, table, self._metric[rows], self._aset[rows], self._start[rows],
                      np.full(n_row, end_ns, np.int64), np.full(n_row, np.nan) if ended else self._value[rows],
                      np.full(n_row, ended, bool))

    def _snapshot(self, rows: np.ndarray, end_ns: int, table: SetTable, after: list[Points]) -> Points:
        """`_snapshot_reference`: the sums of `rows` then the points `after` (of this store's
        metrics; each over `table` or a table of its own, whose sets follow `table`'s as plain
        ones), with the rows' columns taken straight into the snapshot's, where built apart and
        then copied they would be there twice."""
        after = [part for part in after if len(part)]
        if any(part.metrics != self.metric_keys for part in after):
            raise ValueError("a snapshot's parts must name the store's metrics")
        n_row, n_point = len(rows), len(rows) + sum(map(len, after))
        # An interval's points are all at its end: one number read as a column, where a column of
        # it took 8 bytes a point (16 MiB at 100,000 GPUs, from the record to the snapshot's send)
        at_end = all(bool(np.all(part.time_ns == end_ns)) for part in after)
        time_ns = np.broadcast_to(np.int64(end_ns), (n_point,)) if at_end else np.full(n_point, end_ns, np.int64)
        columns = {"metric": np.empty(n_point, np.uint16), "aset": np.empty(n_point, np.uint32),
                   "start_ns": np.empty(n_point, np.int64), "time_ns": time_ns, "value": np.empty(n_point),
                   "ended": np.zeros(n_point, bool)}
        copied = ("metric", "start_ns", "value", "ended") + (() if at_end else ("time_ns",))
        for name, column in (("metric", self._metric), ("aset", self._aset), ("start_ns", self._start),
                             ("value", self._value)):
            np.take(column, rows, out=columns[name][:n_row])
        at, placed, plain = n_row, {id(table): 0}, []
        for part in after:
            if id(part.attrs) not in placed:
                placed[id(part.attrs)] = len(table) + len(plain)
                plain.extend(part.attrs)
            points = slice(at, at + len(part))
            columns["aset"][points] = part.aset + placed[id(part.attrs)]
            for name in copied:
                columns[name][points] = getattr(part, name)
            at += len(part)
        return Points(self.metric_keys, table.with_plain(plain) if plain else table, **columns)

    def _snapshot_reference(self, rows: np.ndarray, end_ns: int, table: SetTable, after: list[Points]) -> Points:
        """What `_snapshot` gives, built as parts and stacked."""
        return Points.stack([self._columns(rows, end_ns, table), *after])

    def _gauge_points(self, gauges: Mapping[str, "_Gauges"], time_ns: int, ended: bool = False) -> Points:
        parts = [(self._code[m], g) for m, g in gauges.items() if len(g)]
        if not parts:
            return Points.empty()
        n_point = sum(len(g) for _, g in parts)
        return Points(self.metric_keys, [a for _, g in parts for a in g.keys],
                      np.concatenate([np.full(len(g.keys), code, np.uint16) for code, g in parts]),
                      np.arange(n_point, dtype=np.uint32), np.full(n_point, time_ns, np.int64),
                      np.full(n_point, time_ns, np.int64),
                      np.full(n_point, np.nan) if ended else np.concatenate([g.values for _, g in parts]),
                      np.full(n_point, ended, bool))

    def points(self) -> Points:
        """Every live series at its latest point (what a scrape shows)."""
        with self._lock:
            return Points.stack([self._columns(self._live_rows(), self.last_time_ns, self._table()),
                                 self._gauge_points(self._gauges, self._gauge_time)])

    def _live_rows(self) -> np.ndarray:
        """The live sums' rows, oldest series first."""
        rows = np.flatnonzero(self._live)
        return rows[np.argsort(self._born[rows], kind="stable")]

    def _sums(self) -> list[tuple[str, Attrs, float]]:
        rows = self._live_rows()
        return [(self.metric_keys[m], self._sets.value(a), v) for m, a, v in
                zip(self._metric[rows].tolist(), self._aset[rows].tolist(), self._value[rows].tolist())]

    def totals(self, metric: str, by: Iterable[str] = (),
               where: Mapping[str, str] | None = None) -> dict[tuple[str, ...], float]:
        """Sum of a cumulative metric grouped by attribute keys, over the series whose attributes
        match `where` (for reports and tests); with `keep_ended`, ended series count too."""
        keys = tuple(by)
        out: dict[tuple[str, ...], float] = {}
        with self._lock:
            values = [(a, v) for m, a, v in self._sums() if m == metric]
            values += [(a, v) for (m, a), v in self._ended_totals.items() if m == metric]
        for attrs, value in values:
            fields = dict(attrs)
            if where and any(fields.get(k, "") != v for k, v in where.items()):
                continue
            key = tuple(fields.get(x, "") for x in keys)
            out[key] = out.get(key, 0.0) + value
        return out

    def active_series(self) -> int:
        with self._lock:
            return int(self._live.sum()) + sum(map(len, self._gauges.values()))

    # Checkpoint state: the sums and the last interval end, all a restart needs to continue them.

    def mark(self) -> Undo:
        """Nothing to put back: an interval computed ahead is recorded only at its close."""
        return nothing_to_undo

    def expire(self, end_ns: int) -> None:
        """Nothing: `record` ends the sums that stopped."""

    def state(self) -> dict:
        """The live sums as columns (oldest first) over a table of their attribute sets, all as
        arrays: the table is the sets' pair ids cut at `pair_ends` into one set each, each pair
        the ids of its key and value (`pair_strings`) in the UTF-8 strings cut at `string_ends`.
        The columns and the pair ids are `Pieces`, read from the store as the checkpoint is
        written (right after, in the thread that records): no copy of them is held whole."""
        with self._lock:
            rows = self._live_rows()
            sets, aset = np.unique(self._aset[rows], return_inverse=True)
            columns = {name: Pieces.gathered(column, rows) for name, column in
                       (("metric", self._metric), ("start_ns", self._start), ("value", self._value),
                        ("quiet", self._quiet))}
            return {"last_time_ns": self.last_time_ns, "metrics": list(self.metric_keys),
                    "table": self._sets.table(sets.tolist()),
                    "columns": {**columns, "attrs": aset.reshape(-1).astype(np.uint32)}}

    def restore(self, state: Mapping | None) -> None:
        """Continue from `state()` of an earlier run (same currency); also reads the layouts of
        earlier versions: the attribute sets as lists of pairs (`attrs`), the columns as lists with
        metric names, or a row per series (`sums`: metric, attribute set, start, time, value, quiet).
        Raises ValueError or KeyError/TypeError on a malformed state; the store is unchanged then.
        None: no series."""
        if state is None:
            state = {"last_time_ns": 0, "attrs": [], "sums": []}
        table = (_AttrSets.read_table(**state["table"]) if "table" in state
                 else [tuple((str(k), str(v)) for k, v in a) for a in state["attrs"]])
        if "columns" in state:
            columns = state["columns"]
            n_series = len(columns["metric"])
            if any(len(columns[k]) != n_series for k in ("attrs", "start_ns", "value", "quiet")):
                raise ValueError("store columns of different lengths")
            names = [str(m) for m in state["metrics"]] if "metrics" in state else None
            metric = [names[int(m)] for m in columns["metric"]] if names is not None else list(columns["metric"])
            rows = list(zip(metric, np.asarray(columns["attrs"]).tolist(), np.asarray(columns["start_ns"]).tolist(),
                            np.asarray(columns["value"]).tolist(), np.asarray(columns["quiet"]).tolist()))
        else:
            rows = [(m, a, start, value, quiet) for m, a, start, _, value, quiet in state["sums"]]
        restored = []
        for m, a, start, value, quiet in rows:
            if m not in self.specs or self.specs[m].kind != "sum":
                raise ValueError(f"unknown cumulative metric {m!r}")
            if not 0 <= int(a) < len(table):
                raise ValueError(f"series {m} refers to attribute set {a}, not in the table")
            attrs = table[int(a)]
            if attrs != tuple(sorted(attrs)) or not math.isfinite(float(value)) or int(quiet) < 0:
                raise ValueError(f"series {m} {dict(attrs)} is malformed")
            # quiet as long or longer than this run ends series after: ended at the next interval either way
            restored.append((m, attrs, int(start), float(value), min(int(quiet), self.end_after_intervals)))
        last = int(state["last_time_ns"])
        if any(start > last for _, _, start, _, _ in restored):
            raise ValueError("a series starts after the last interval")
        with self._lock:
            self._reset()
            self._records += 1
            asets = self._sets.add_all([attrs for _, attrs, _, _, _ in restored]).tolist()
            for (m, _, start, value, quiet), aset in zip(restored, asets):
                self._add(m, aset, start, value, quiet)
            self.last_time_ns = last


class _Built:
    """The sets of `named` that are read, each built once for all the metrics that name it by the
    same parts (kept in `parts`, with the parts' numbers, for one interval's look-ups and record)."""

    def __init__(self, named: Extended, parts: dict) -> None:
        self._named = named
        key = ("built", id(named.bases), id(named.extras))
        known = parts.get(key)
        if known is None or known[0] is not named.bases or known[1] is not named.extras:
            known = parts[key] = (named.bases, named.extras, {})
        self._sets: dict[tuple[int, int], Attrs] = known[2]

    def __getitem__(self, at: int) -> Attrs:
        named = self._named
        key = (int(named.base[at]), int(named.extra[at]))
        attrs = self._sets.get(key)
        if attrs is None:
            attrs = self._sets[key] = named[at]
        return attrs


def _values(series: Mapping[Attrs, float]) -> np.ndarray:
    """The values of `series` in its order, as an array (the cost models' `Packed` has one)."""
    values = getattr(series, "array", None)
    return values() if values is not None else np.fromiter(series.values(), np.float64, len(series))


@dataclass
class _Gauges:
    """One metric's gauges of the latest interval."""

    keys: list[Attrs]
    values: np.ndarray

    def __len__(self) -> int:
        return len(self.keys)

    def missing_from(self, new: Optional["_Gauges"]) -> "_Gauges":
        """The gauges of these that `new` has not: matched by object first (the cost models hand
        back the same objects interval after interval), then the rest by value."""
        if new is None:
            return _Gauges(self.keys, np.full(len(self.keys), np.nan))
        old_ids = np.fromiter(map(id, self.keys), np.int64, len(self.keys))
        new_ids = np.fromiter(map(id, new.keys), np.int64, len(new.keys))  # both alive: ids are distinct objects
        unmatched = np.flatnonzero(~np.isin(old_ids, new_ids)).tolist()
        if unmatched:
            others = {new.keys[i] for i in np.flatnonzero(~np.isin(new_ids, old_ids)).tolist()}
            unmatched = [i for i in unmatched if self.keys[i] not in others]
        return _Gauges([self.keys[i] for i in unmatched], np.full(len(unmatched), np.nan))


_EXTRA_BITS = 24  # a set's key: the number of its base, then that of its extra in these low bits


FIRST_IDS = 1 << 14  # the sets' pair ids: room for this many at first, and at the least
SETS_AT_ONCE = 1 << 12  # sets whose pairs are looked up at once (some 40,000 pairs)


class _Runs:
    """Each set's pair ids (uint32) as a run of one array: set i is ids[start[i]:start[i] +
    count[i]]. A run is written once: a set's ids go after the last run, a released set's run is
    left where it is, and when there is no room left the live runs are packed into a new array
    (with half as much room again). So the tables handed out (`view`) and the arrays a checkpoint
    reads are never written again; the arrays are replaced together, in one assignment."""

    def __init__(self) -> None:
        self._arrays = (np.zeros(FIRST_IDS, np.uint32), np.zeros(1024, np.uint32), np.zeros(1024, np.int32))
        self._sets = 0  # indices given (live or released)
        self._end = 0  # ids written
        self._live = 0  # ids of live runs

    def __len__(self) -> int:
        return self._sets

    def __getitem__(self, index: int) -> bytes:
        ids, start, count = self._arrays
        begin = int(start[index])
        return ids[begin:begin + int(count[index])].tobytes()

    def put(self, index: int, codes: np.ndarray) -> None:
        """Set `index` (a new one, `len(self)`, or one released) has the pair ids `codes`."""
        ids, start, count = self._arrays
        if index == len(start):
            grown = len(start) + len(start) // 2
            start, count = (np.concatenate([a, np.zeros(grown - len(a), a.dtype)]) for a in (start, count))
        if self._end + len(codes) > len(ids):
            ids, start = self._packed(ids, start, count, len(codes))
        ids[self._end:self._end + len(codes)] = codes
        start[index], count[index] = self._end, len(codes)
        self._arrays = (ids, start, count)
        self._sets = max(self._sets, index + 1)
        self._end += len(codes)
        self._live += len(codes)

    def release(self, indices: list[int]) -> np.ndarray:
        """The pair ids of these sets, end to end; the sets have none from now on."""
        ids, start, count = self._arrays
        chosen = np.asarray(indices, np.int64)
        codes = gather_runs(ids, start[chosen], count[chosen])
        count[chosen] = 0  # a view's counts are its own copy
        self._live -= len(codes)
        return codes

    def view(self) -> SetCodes:
        """Every set as it is now, in arrays of its own but for the ids, which are never written again."""
        ids, start, count = self._arrays
        return SetCodes(ids, start[:self._sets].copy(), count[:self._sets].copy())

    def pieces(self, sets: np.ndarray) -> Pieces:
        """The pair ids of `sets` end to end, for a checkpoint: gathered some sets at a time."""
        ids, start, count = self._arrays
        start, count = start[sets], count[sets].astype(np.int64)  # copies: the sets as they are now

        def chunks() -> Iterator[np.ndarray]:
            for lo in range(0, len(sets), RUN_SETS):
                yield gather_runs(ids, start[lo:lo + RUN_SETS], count[lo:lo + RUN_SETS])
        return Pieces(np.uint32, int(count.sum()), chunks)

    def counts(self, sets: np.ndarray) -> np.ndarray:
        return self._arrays[2][sets].astype(np.int64)

    def _packed(self, ids: np.ndarray, start: np.ndarray, count: np.ndarray,
                more: int) -> tuple[np.ndarray, np.ndarray]:
        """The live runs packed at the start of a new array with room for `more` ids and half as
        many as they are again, and where each now starts (the counts are unchanged)."""
        live = np.flatnonzero(count[:self._sets]).astype(np.int64)
        packed = np.zeros(max(FIRST_IDS, (self._live + more) * 3 // 2), np.uint32)  # room's pages untouched till used
        joined = gather_runs(ids, start[live], count[live])
        packed[:len(joined)] = joined
        new_start = np.zeros(len(start), np.uint32)
        new_start[live[1:]] = np.cumsum(count[live[:-1]], dtype=np.int64)
        self._end = len(joined)
        return packed, new_start


class _AttrSets:
    """Each distinct attribute set once, with the number of live series using it; a released set's
    index is reused by the next new set. A set is kept as the ids of its pairs (4 bytes a pair, a
    run of one array: `_Runs`), in a reference-counted pair table: no tuple per set (`value`
    builds one), and a checkpoint writes the sets as arrays without visiting their pairs (the
    pairs' strings numbered once for every checkpoint until a pair comes or goes). Each set also
    has a serial that no other set of the process has had, so that what a snapshot's sets became
    elsewhere (the queue's attribute log) is found by it.

    A set that series name by their parts (`Extended`: a base set and the attributes added to it)
    is also found by them: each set keeps the numbers of the last parts that named it, a base and
    an extra each counted by the sets they name, so that the next interval's series, named by
    equal parts, find their sets without building them (`find_named`)."""

    def __init__(self) -> None:
        self._codes = _Runs()  # each set's pair ids, uint32
        self._index = ByValue(self._codes)  # by the pair ids, which are a set's while it lives
        self._users = np.zeros(1024, np.int32)  # [set] the live series using it
        self._free = array("i")  # released sets' indices, the next new set's the last
        self._pairs = _Pairs()
        self._serial = np.zeros(1024, np.int64)  # [set] its serial
        self._serial_lent = False  # whether a table reads `_serial` itself: copied before a serial is written
        self._serials = 0  # serials given
        self._bases, self._extras = _Parts(), _Parts()
        self._named = np.full(1024, -1, np.int64)  # [set] the key of the parts that last named it; -1: none
        self._table: Optional[SetTable] = None  # `snapshot()`'s, shared until a set comes or goes

    def add_all(self, sets: Sequence[Attrs]) -> np.ndarray:
        """The index of the set equal to each of `sets`, in their order, counting one user more
        each time (a new set is given one): the known ones found all at once, the new ones' pairs
        too."""
        out = self.find_all(sets)
        new = np.flatnonzero(out < 0).tolist()
        distinct, indices = list(dict.fromkeys(sets[at] for at in new)), {}  # each new set once, as first met
        for at in range(0, len(distinct), SETS_AT_ONCE):  # their pairs found and given ids a piece at a time
            piece = distinct[at:at + SETS_AT_ONCE]
            ends = np.cumsum(np.fromiter(map(len, piece), np.int64, len(piece))).tolist()
            codes = self._pairs.add_all([kv for attrs in piece for kv in attrs]).astype(np.uint32)
            indices.update({attrs: self._new(codes[a:b]) for attrs, a, b in zip(piece, [0, *ends[:-1]], ends)})
        for at in new:
            out[at] = indices[sets[at]]
        np.add.at(self._users, out, 1)  # grown, perhaps, for the new sets: read after them
        return out

    def _new(self, codes: np.ndarray) -> int:
        """The index of a new set of these pair ids (uint32, each counted already), without users."""
        if self._free:
            index = self._free.pop()
        else:
            index = len(self._codes)
            if index == len(self._named):
                self._named = np.concatenate([self._named, np.full(index, -1, np.int64)])
                self._serial = np.concatenate([self._serial, np.zeros(index, np.int64)])
                self._users = np.concatenate([self._users, np.zeros(index, np.int32)])
        self._users[index] = 0
        self._codes.put(index, codes)
        if self._serial_lent:  # a table reads the serials as they were: it keeps them so
            self._serial, self._serial_lent = self._serial.copy(), False
        self._serial[index] = self._serials
        self._serials += 1
        self._index.put(index, hash(codes.tobytes()))
        self._table = None
        return index

    def release(self, sets: list[int]) -> None:
        """One user fewer for each of `sets` (a set twice: two fewer); a set left without users
        is forgotten, and its pairs released all at once."""
        gone = []
        for i in sets:
            self._users[i] -= 1
            if not self._users[i]:
                self._index.remove(i)
                gone.append(i)
        if not gone:
            return
        self._pairs.release(self._codes.release(gone))
        self._table = None
        self._unname(np.array(gone, np.int64))
        self._free.extend(gone)

    def value(self, index: int) -> Attrs:
        """The set at `index`, built from its pairs."""
        return set_of(self._codes[index], self._pairs.live())

    def serial(self, index: int) -> int:
        return int(self._serial[index])

    def snapshot(self, serial_of: Callable[[Attrs], int]) -> SetTable:
        """Every set as it is now, for a snapshot: a list of them, pairs and serials of its own
        (a released set's index and pair ids are reused; the snapshot keeps what they were). One
        table is shared by the snapshots of the intervals that follow until a set comes or goes:
        queued through an outage, each would otherwise hold its own (some 30 MiB at 100,000 GPUs)."""
        if self._table is None:
            serials = self._serial[:len(self._codes)]  # read where they are kept until a serial is written
            serials.flags.writeable = False
            self._serial_lent = True
            self._table = SetTable(self._codes.view(), self._pairs.listed(), serials, serial_of=serial_of)
        return self._table

    def kept(self, attrs: Attrs) -> Attrs:
        """The base the sets are named by equal to `attrs`, if there is one, else `attrs`: gauges
        keyed by the join's sets (activity) then hold the store's object rather than another copy."""
        number = self._bases.find(attrs)
        return attrs if number < 0 else self._bases.value(number)

    def kept_all(self, sets: Sequence[Attrs]) -> list[Attrs]:
        """`kept` of each of `sets`, found all at once."""
        numbers, value = self._bases.find_all(sets).tolist(), self._bases.value
        return [attrs if number < 0 else value(number) for attrs, number in zip(sets, numbers)]

    def find(self, attrs: Attrs) -> int:
        """The index of the set equal to `attrs`, -1 when no live series uses one."""
        known = self._pairs.codes(attrs)  # None: a pair no set has
        return self._index.find(known) if known is not None else -1

    def find_all(self, sets: Sequence[Attrs]) -> np.ndarray:
        """`find` of each of `sets` (int64), their pairs, then the sets, found all at once."""
        codes = self._pairs.codes_all(sets)
        have = [at for at, code in enumerate(codes) if code is not None]
        out = np.full(len(sets), -1, np.int64)
        out[have] = self._index.find_all([codes[at] for at in have])
        return out

    def indexed(self) -> list[Attrs]:
        """The sets found by value."""
        return [self.value(i) for i in self._index.indices()]

    def numbers(self, named: Extended, parts: dict) -> tuple[np.ndarray, np.ndarray]:
        """The numbers of `named`'s bases and extras (-1: no set is named by it), worked out once
        for each list of parts and kept in `parts` (a dict that lives as long as one interval's
        look-ups and record)."""
        out = []
        for values, table in ((named.bases, self._bases), (named.extras, self._extras)):
            known = parts.get(id(values))
            if known is None or known[0] is not values:
                known = parts[id(values)] = (values, table.find_all(values))
            out.append(known[1])
        return out[0], out[1]

    def find_named(self, named: Extended, parts: dict) -> np.ndarray:
        """The index of the set each of `named` names by its parts, -1 when no set is named by
        them (a set named so before by other parts, or not at all, is found by value instead)."""
        wanted = self._keys(named, parts)
        keys, sets = self._by_name(parts)
        at = np.minimum(np.searchsorted(keys, wanted), max(len(keys) - 1, 0))
        hit = (wanted >= 0) & (keys[at] == wanted) if len(keys) else np.zeros(len(wanted), bool)
        return np.where(hit, sets[at] if len(keys) else -1, -1)

    def name(self, sets: np.ndarray, named: Extended, parts: dict) -> None:
        """Each of `sets` (the sets of `named`, one each) is named by its parts from now on."""
        wanted = self._keys(named, parts)
        stale = np.flatnonzero((wanted < 0) | (self._named[sets] != wanted)).tolist()
        if not stale:
            return
        base_no, extra_no = self.numbers(named, parts)
        for i in stale:
            index, base, extra = int(sets[i]), int(named.base[i]), int(named.extra[i])
            if self._named[index] >= 0:  # named by other parts before (a new set is named by none)
                self._unname(np.array([index], np.int64))
            base_no[base] = self._bases.take(named.bases[base])
            extra_no[extra] = self._extras.take(named.extras[extra])
            self._named[index] = (int(base_no[base]) << _EXTRA_BITS) | int(extra_no[extra])
        parts.pop("by name", None)

    def _keys(self, named: Extended, parts: dict) -> np.ndarray:
        """The key of each of `named`'s parts (base << _EXTRA_BITS | extra), -1 where a part has no number."""
        base_no, extra_no = self.numbers(named, parts)
        base, extra = base_no[named.base], extra_no[named.extra]
        return np.where((base >= 0) & (extra >= 0), (base << _EXTRA_BITS) | extra, -1)

    def _unname(self, sets: np.ndarray) -> None:
        """These sets are named by no parts any more: each part they were named by counts them no more."""
        keys = self._named[sets]
        keys = keys[keys >= 0]
        if len(keys):
            self._bases.release(keys >> _EXTRA_BITS)
            self._extras.release(keys & ((1 << _EXTRA_BITS) - 1))
            self._named[sets] = -1

    def _by_name(self, parts: dict) -> tuple[np.ndarray, np.ndarray]:
        """The sets named by parts: their keys sorted, and the sets in that order. Kept in `parts`
        for one interval's look-ups (every metric's), not beyond: some 9 MiB at 100,000 GPUs."""
        known = parts.get("by name")
        if known is None:
            keys = self._named[:len(self._codes)]
            sets = np.flatnonzero(keys >= 0)
            order = np.argsort(keys[sets])
            known = parts["by name"] = (keys[sets][order], sets[order])
        return known

    def table(self, sets: list[int]) -> dict[str, np.ndarray]:
        """These sets as arrays: their pair ids end to end (4 bytes a pair, as kept), where each
        set ends, each pair's key and value string ids, the strings' UTF-8 bytes and where each
        string ends (released pairs are left in, as empty strings)."""
        sets = np.asarray(sets, np.int64)
        pair_strings, strings, string_ends = self._pairs.encoded()
        return {"set_pairs": self._codes.pieces(sets), "pair_ends": np.cumsum(self._codes.counts(sets)),
                "pair_strings": pair_strings, "strings": strings, "string_ends": string_ends}

    @staticmethod
    def read_table(strings: np.ndarray, string_ends: np.ndarray, **arrays: np.ndarray) -> list[Attrs]:
        """The attribute sets written by `table`, or by the versions before it (`pairs`: each
        set's string ids, key, value, key, ..., cut at `set_ends`); ValueError when the arrays do
        not fit together."""
        text = texts_of(strings, string_ends)
        if "set_pairs" in arrays:
            kinds = np.asarray(arrays["pair_strings"], np.int64).reshape(-1, 2)
            codes, ends = (np.asarray(arrays[k], np.int64) for k in ("set_pairs", "pair_ends"))
        else:  # each pair's strings written out where it is used: a pair for every two strings
            strings_of_sets, set_ends = (np.asarray(arrays[k], np.int64) for k in ("pairs", "set_ends"))
            if np.any(np.diff(set_ends, prepend=0) % 2) or len(strings_of_sets) % 2:
                raise ValueError("attribute set table: a set of an odd number of strings")
            kinds = strings_of_sets.reshape(-1, 2)
            codes, ends = np.arange(len(kinds), dtype=np.int64), set_ends // 2
        if np.any((kinds < 0) | (kinds >= len(text))):
            raise ValueError("attribute set table: a pair refers to no string")
        return _cut(codes, ends, [pair((text[k], text[v])) for k, v in kinds.tolist()])


def _cut(codes: np.ndarray, ends: np.ndarray, known: list[tuple[str, str]]) -> list[Attrs]:
    """The sets `known[codes[a:b]]` for each end b (a: the end before); ValueError when the ends
    do not cut `codes` or a code is not in `known`."""
    if (np.any(np.diff(ends, prepend=0) < 0) or (len(ends) and ends[-1] != len(codes)) or (not len(ends) and len(codes))
            or np.any((codes < 0) | (codes >= len(known)))):
        raise ValueError("attribute set table arrays do not fit together")
    pairs = [known[c] for c in codes.tolist()]
    return [tuple(pairs[a:b]) for a, b in zip([0, *ends[:-1].tolist()], ends.tolist())]


class _Counted:
    """Keys by id, each kept while something refers to it; a released id is reused by the next
    new key. The keys are a list by id, found by value through a table of their hashes
    (`ByValue`): a dict took some 60 bytes a key besides it, with an int object for its id (at
    100,000 GPUs, for the pairs and the parts, some 30 MiB); this takes 12-20. Many keys are
    found at once (`find_all`, `take_all`): found one by one, each would be a probe in Python."""

    def __init__(self, empty: object) -> None:
        self._keys: list = []  # [id] its key; a released id's is `empty`
        self._index = ByValue(self._keys)
        self._empty = empty
        self._refs = array("i")  # [id] what refers to its key
        self._free = array("i")  # released ids, the next new key's the last

    def find(self, key) -> int:  # noqa: ANN001 - a pair or a set of them
        """`key`'s id, -1 when it has none."""
        return self._index.find(key)

    def find_all(self, keys: Sequence) -> np.ndarray:
        """Each key's id (int64), -1 where it has none."""
        return self._index.find_all(keys)

    def keys(self) -> list:
        """The keys that have an id."""
        return [self._keys[i] for i in self._index.indices()]

    def take_all(self, keys: Sequence) -> tuple[np.ndarray, bool]:
        """Each key's id, with one reference more per time it is among `keys` (a key without an
        id is given one), and whether any was given one."""
        ids = self._index.find_all(keys)
        given: dict = {}  # the keys given an id now, in the order first met
        for at in np.flatnonzero(ids < 0).tolist():
            index = given.get(keys[at])
            ids[at] = given[keys[at]] = self._give(keys[at]) if index is None else index
        if given:
            self._index.put_all(list(given.values()), list(map(hash, given)))
        refs = self._refs
        for index in ids.tolist():
            refs[index] += 1
        return ids, bool(given)

    def _take(self, key) -> int:  # noqa: ANN001 - a pair or a set of them
        """`key`'s id, with one reference more (a key without an id is given one)."""
        hashed = hash(key)
        index = self._index.find(key, hashed)
        if index < 0:
            index = self._give(key)
            self._index.put(index, hashed)
        self._refs[index] += 1
        return index

    def _give(self, key) -> int:  # noqa: ANN001 - a pair or a set of them
        """A free id for `key`, without references, not indexed yet."""
        if self._free:
            index = self._free.pop()
            self._refs[index] = 0
            self._keys[index] = key
        else:
            index = len(self._refs)
            self._refs.append(0)
            self._keys.append(key)
        return index

    def _let_go(self, codes: np.ndarray) -> list[int]:
        """One reference fewer per occurrence of an id in `codes`; the ids left without are
        forgotten (their keys `empty`) and returned (ascending)."""
        ids, counts = np.unique(codes, return_counts=True)
        gone = []
        for i, n in zip(ids.tolist(), counts.tolist()):
            self._refs[i] -= n
            if not self._refs[i]:
                self._index.remove(i)
                self._keys[i] = self._empty
                gone.append(i)
        self._free.extend(gone)
        return gone


class _Parts(_Counted):
    """The parts sets are named by (bases, extras), each counted by the sets it names."""

    def __init__(self) -> None:
        super().__init__(())

    def take(self, value: Attrs) -> int:
        """The part's number, counting one set more named by it."""
        return self._take(value)

    def value(self, index: int) -> Attrs:
        return self._keys[index]

    def release(self, numbers: np.ndarray) -> None:
        """One set fewer named by the part of each number (a number twice: two fewer); a part
        that names none is forgotten."""
        self._let_go(numbers)


class _Pairs(_Counted):
    """(key, value) pairs by id, each kept while a set refers to it. Their strings are numbered
    only for a checkpoint (`encoded`), not kept in a table of their own."""

    def __init__(self) -> None:
        super().__init__(("", ""))
        self._listed: Optional[list[tuple[str, str]]] = None  # a copy of the pairs until one comes or goes
        self._encoded: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None  # `encoded()` until it changes

    def codes(self, attrs: Attrs) -> Optional[bytes]:
        """The ids of a set's pairs (uint32), None when one of them has none."""
        ids = [self._index.find(kv) for kv in attrs]
        return None if -1 in ids else array("I", ids).tobytes()

    def codes_all(self, sets: Sequence[Attrs]) -> list[Optional[bytes]]:
        """`codes` of each of `sets`, their pairs found all at once, SETS_AT_ONCE sets at a time."""
        if len(sets) > SETS_AT_ONCE:
            pieces = (sets[at:at + SETS_AT_ONCE] for at in range(0, len(sets), SETS_AT_ONCE))
            return [code for piece in pieces for code in self.codes_all(piece)]
        ids = self.find_all([kv for attrs in sets for kv in attrs])
        ends = np.cumsum(np.fromiter(map(len, sets), np.int64, len(sets))).tolist()
        missing = [0, *np.cumsum(ids < 0).tolist()]  # the pairs without an id before each
        raw = ids.astype(np.uint32).tobytes()
        return [None if missing[b] != missing[a] else raw[4 * a:4 * b] for a, b in zip([0, *ends[:-1]], ends)]

    def live(self) -> list[tuple[str, str]]:
        """Every pair by its id as it is now (the table's own list: read it, do not keep it)."""
        return self._keys

    def listed(self) -> list[tuple[str, str]]:
        """Every pair by its id (released ones as empty strings), as a list of its own that no
        later change touches: one copy shared until a pair comes or goes."""
        if self._listed is None:
            self._listed = list(self._keys)
        return self._listed

    def add_all(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """The id of each of `pairs`, each counting one reference more (`take_all`)."""
        ids, given = self.take_all(pairs)
        if given:
            self._listed = self._encoded = None
        return ids

    def release(self, codes: np.ndarray) -> None:
        """One reference fewer per occurrence of an id in `codes`; a pair left without is forgotten."""
        if self._let_go(codes):
            self._listed = self._encoded = None

    def encoded(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every pair id's key and value as ids of strings, shape (ids, 2) uint32; the strings
        (each once, in the order the pairs name them first) as UTF-8 bytes and where each ends.
        Built again only once a pair has come or gone (the arrays are shared: do not change them)."""
        if self._encoded is None:
            codes, strings, ends = string_ids((text for kv in self._keys for text in kv), 2 * len(self._keys))
            self._encoded = (codes.reshape(-1, 2), strings, ends)
        return self._encoded
