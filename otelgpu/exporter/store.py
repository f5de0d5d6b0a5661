"""Cumulative cost series: what every exporter reads.

Each interval's increments are added to monotonic sums that keep the start time of their first
interval, so a Prometheus `increase()` over any window reads the cost of that window. Gauges hold
the latest interval's value. Timestamps are interval ends on data time, strictly increasing.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Iterable, Mapping

Attrs = tuple[tuple[str, str], ...]  # sorted (key, value) pairs


def attrs_of(pairs: Mapping[str, str]) -> Attrs:
    """A series' attributes as its key: sorted, empty values dropped."""
    return tuple(sorted((k, v) for k, v in pairs.items() if v != ""))


def with_attrs(attrs: Attrs, extra: Mapping[str, str]) -> Attrs:
    """`attrs` with the keys of `extra` added or replaced."""
    return attrs_of({**dict(attrs), **extra})


@dataclass(frozen=True)
class MetricSpec:
    name: str  # OTLP name
    unit: str  # UCUM unit; `{USD}`-style annotations add no Prometheus suffix
    kind: str  # "sum" (cumulative, monotonic) or "gauge"
    description: str
    prometheus: str  # the name after the Collector's Prometheus translation


def cost_metrics(currency: str = "USD") -> dict[str, MetricSpec]:
    u = "{" + currency + "}"
    return {
        "allocated": MetricSpec("gpu.cost.allocated", u, "sum",
                                "Cost of the capacity a pod holds under the cost model, in " + currency, "gpu_cost_allocated_total"),
        "effective": MetricSpec("gpu.cost.effective", u, "sum",
                                "Allocated cost times measured activity", "gpu_cost_effective_total"),
        "waste": MetricSpec("gpu.cost.waste", u, "sum",
                            "Allocated cost of capacity held but not used", "gpu_cost_waste_total"),
        "unmeasured": MetricSpec("gpu.cost.unmeasured", u, "sum",
                                 "Allocated cost of units with no activity sample", "gpu_cost_unmeasured_total"),
        "unused": MetricSpec("gpu.cost.unused", u, "sum",
                             "Cost of capacity nobody held, handed to this holder (idle policy share, "
                             "SCAD's unused cost) or to the platform tags (idle policy platform)", "gpu_cost_unused_total"),
        "idle": MetricSpec("gpu.cost.idle", u, "sum",
                           "Cost of capacity nobody held, kept on the node", "gpu_cost_idle_total"),
        "unattributed": MetricSpec("gpu.cost.unattributed", u, "sum",
                                   "Allocated GPU cost (request allocation) not carrying all five tags, by reason: "
                                   "no_pod, pod_unknown, tag_missing", "gpu_cost_unattributed_total"),
        "held": MetricSpec("gpu.held", "s", "sum",
                           "GPU-seconds held: unit fraction times seconds held", "gpu_held_seconds_total"),
        "capacity": MetricSpec("gpu.cost.capacity", u, "sum",
                               "Cost of the capacity the model splits: allocated + unused + idle", "gpu_cost_capacity_total"),
        "activity": MetricSpec("gpu.activity", "1", "gauge",
                               "Time-weighted activity of the units a pod held in the last interval", "gpu_activity_ratio"),
        "tag_coverage": MetricSpec("gpu.cost.tag_coverage", "1", "gauge",
                                   "Share of allocated cost carrying the tag (tag=all: all five), per cluster and per namespace", "gpu_cost_tag_coverage_ratio"),
    }


@dataclass(frozen=True)
class Point:
    metric: str  # key into cost_metrics()
    attrs: Attrs
    start_ns: int
    time_ns: int
    value: float  # NaN when `ended`
    ended: bool = False  # the series' last point: OTLP flag NO_RECORDED_VALUE, a stale marker after remote write


@dataclass
class _Sum:
    start_ns: int
    time_ns: int
    value: float
    quiet: int = 0  # intervals in a row without an increment


class CostStore:
    """The cumulative series and the latest gauges.

    A sum that receives no increment (not even 0) for `end_after_intervals` intervals in a row has
    lost its holder (a pod gone, a node drained): it is ended with one NO_RECORDED_VALUE point and
    forgotten, so memory and active series in the backend follow the live cluster. A gauge missing
    from an interval is ended the same way at once. Should the series come back, it starts afresh
    with a new start time, which Prometheus reads as a new counter.

    `keep_ended` keeps ended sums' final values for `totals()` (run reports such as the demo's);
    exporters never see them again.
    """

    def __init__(self, currency: str = "USD", end_after_intervals: int = 2, keep_ended: bool = False) -> None:
        self.specs = cost_metrics(currency)
        self.end_after_intervals = end_after_intervals
        self.keep_ended = keep_ended
        self._lock = threading.Lock()
        self._sums: dict[tuple[str, Attrs], _Sum] = {}
        self._gauges: dict[tuple[str, Attrs], tuple[int, float]] = {}
        self._ended_totals: dict[tuple[str, Attrs], float] = {}
        self.last_time_ns = 0
        self.series_ended = 0

    def record(self, start_ns: int, end_ns: int, sums: Mapping[str, Mapping[Attrs, float]],
               gauges: Mapping[str, Mapping[Attrs, float]]) -> list[Point]:
        """Add one interval's increments, replace the gauges, end the series that went quiet.
        Returns the interval's snapshot for the exporters: every live series at `end_ns` plus one
        ended point per series that ended now."""
        if end_ns <= self.last_time_ns:
            raise ValueError(f"interval ending {end_ns} is not after the last one ({self.last_time_ns}): "
                             "timestamps of a series must strictly increase")
        with self._lock:
            seen = set()
            for metric, series in sums.items():
                for attrs, inc in series.items():
                    key = (metric, attrs)
                    seen.add(key)
                    state = self._sums.get(key)
                    if state is None:
                        self._sums[key] = _Sum(start_ns, end_ns, inc)
                    else:
                        state.value += inc
                        state.quiet = 0
            ended = []
            for key, state in list(self._sums.items()):
                if key not in seen:
                    state.quiet += 1
                    if state.quiet >= self.end_after_intervals:
                        del self._sums[key]
                        ended.append(Point(key[0], key[1], state.start_ns, end_ns, math.nan, ended=True))
                        if self.keep_ended:
                            self._ended_totals[key] = self._ended_totals.get(key, 0.0) + state.value
                        continue
                state.time_ns = end_ns
            new_gauges = {(m, a): (end_ns, v) for m, series in gauges.items() for a, v in series.items()}
            ended += [Point(m, a, end_ns, end_ns, math.nan, ended=True)
                      for (m, a) in self._gauges.keys() - new_gauges.keys()]
            self._gauges = new_gauges
            self.last_time_ns = end_ns
            self.series_ended += len(ended)
            return self._points() + ended

    def points(self) -> list[Point]:
        """Every live series at its latest point (what a scrape shows)."""
        with self._lock:
            return self._points()

    def _points(self) -> list[Point]:
        out = [Point(m, a, s.start_ns, s.time_ns, s.value) for (m, a), s in self._sums.items()]
        out += [Point(m, a, t, t, v) for (m, a), (t, v) in self._gauges.items()]
        return out

    def totals(self, metric: str, by: Iterable[str] = (),
               where: Mapping[str, str] | None = None) -> dict[tuple[str, ...], float]:
        """Sum of a cumulative metric grouped by attribute keys, over the series whose attributes
        match `where` (for reports and tests); with `keep_ended`, ended series count too."""
        keys = tuple(by)
        out: dict[tuple[str, ...], float] = {}
        with self._lock:
            values = [(a, s.value) for (m, a), s in self._sums.items() if m == metric]
            values += [(a, v) for (m, a), v in self._ended_totals.items() if m == metric]
        for attrs, value in values:
            d = dict(attrs)
            if where and any(d.get(k, "") != v for k, v in where.items()):
                continue
            k = tuple(d.get(x, "") for x in keys)
            out[k] = out.get(k, 0.0) + value
        return out

    def active_series(self) -> int:
        with self._lock:
            return len(self._sums) + len(self._gauges)

    # Checkpoint state: the sums and the last interval end, all a restart needs to continue them.

    def state(self) -> dict:
        with self._lock:
            index: dict[Attrs, int] = {}  # each attribute set once: the metrics of a pod share it
            sums = [[m, index.setdefault(a, len(index)), s.start_ns, s.time_ns, s.value, s.quiet]
                    for (m, a), s in self._sums.items()]
            return {"last_time_ns": self.last_time_ns, "attrs": [[list(kv) for kv in a] for a in index], "sums": sums}

    def restore(self, state: Mapping) -> None:
        """Continue from `state()` of an earlier run (same currency). Raises ValueError or
        KeyError/TypeError on a malformed state; the store is unchanged then."""
        sums = {}
        table = [tuple((str(k), str(v)) for k, v in a) for a in state["attrs"]]
        for m, a, start, time, value, quiet in state["sums"]:
            if m not in self.specs or self.specs[m].kind != "sum":
                raise ValueError(f"unknown cumulative metric {m!r}")
            attrs = table[a]
            if attrs != tuple(sorted(attrs)) or not (int(start) <= int(time)) or not math.isfinite(float(value)):
                raise ValueError(f"series {m} {dict(attrs)} is malformed")
            sums[(m, attrs)] = _Sum(int(start), int(time), float(value), int(quiet))
        last = int(state["last_time_ns"])
        with self._lock:
            self._sums = sums
            self._gauges = {}
            self.last_time_ns = last
