"""Cumulative cost series: what every exporter reads.

Each interval's increments are added to monotonic sums that keep the start time of their first
interval, so a Prometheus `increase()` over any window reads the cost of that window. Gauges hold
the latest interval's value. Timestamps are interval ends on data time, strictly increasing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable, Mapping

Attrs = tuple[tuple[str, str], ...]  # sorted (key, value) pairs


def attrs_of(pairs: Mapping[str, str]) -> Attrs:
    """A series' attributes as its key: sorted, empty values dropped."""
    return tuple(sorted((k, v) for k, v in pairs.items() if v != ""))


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


class CostStore:
    def __init__(self, currency: str = "USD") -> None:
        self.specs = cost_metrics(currency)
        self._lock = threading.Lock()
        self._sums: dict[tuple[str, Attrs], list] = {}  # -> [start_ns, time_ns, value]
        self._gauges: dict[tuple[str, Attrs], tuple[int, float]] = {}
        self.last_time_ns = 0

    def record(self, start_ns: int, end_ns: int,
               sums: Mapping[str, Mapping[Attrs, float]], gauges: Mapping[str, Mapping[Attrs, float]]) -> None:
        """Add one interval's increments (and replace gauges). Every existing sum advances to end_ns."""
        with self._lock:
            for metric, series in sums.items():
                for attrs, inc in series.items():
                    state = self._sums.get((metric, attrs))
                    if state is None:
                        self._sums[(metric, attrs)] = [start_ns, end_ns, inc]
                    else:
                        state[2] += inc
            for state in self._sums.values():
                state[1] = max(state[1], end_ns)
            self._gauges = {(m, a): (end_ns, v) for m, series in gauges.items() for a, v in series.items()}
            self.last_time_ns = max(self.last_time_ns, end_ns)

    def points(self) -> list[Point]:
        with self._lock:
            out = [Point(m, a, s[0], s[1], s[2]) for (m, a), s in self._sums.items()]
            out += [Point(m, a, t, t, v) for (m, a), (t, v) in self._gauges.items()]
        return out

    def totals(self, metric: str, by: Iterable[str] = (),
               where: Mapping[str, str] | None = None) -> dict[tuple[str, ...], float]:
        """Sum of a cumulative metric grouped by attribute keys, over the series whose attributes
        match `where` (for tables and tests)."""
        keys = tuple(by)
        out: dict[tuple[str, ...], float] = {}
        for p in self.points():
            if p.metric == metric:
                d = dict(p.attrs)
                if where and any(d.get(k, "") != v for k, v in where.items()):
                    continue
                k = tuple(d.get(x, "") for x in keys)
                out[k] = out.get(k, 0.0) + p.value
        return out
