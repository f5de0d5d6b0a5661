"""Showback from the cost series in Prometheus or AMP: what each group (any tags: team, project,
model, cost center, namespace, workload, ...) was charged over a period under one cost model, with
the idle capacity, so that the rows and the idle add up to the cluster's capacity cost.

Each series' cost over (start, end] is read exactly, not extrapolated as `increase()` does: its
last value by `end` less its last value by `start`. A series that restarted inside the period (it
ended, and the same pod held a unit again later: a counter reset) is read sample by sample, each
reset counted from zero, as Prometheus counts resets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

from otelgpu.report.promql import Labels, PromClient, QueryError, selector

NAMES = {"allocated": "gpu_cost_allocated_total", "effective": "gpu_cost_effective_total",
         "waste": "gpu_cost_waste_total", "unmeasured": "gpu_cost_unmeasured_total",
         "unused": "gpu_cost_unused_total", "idle": "gpu_cost_idle_total", "capacity": "gpu_cost_capacity_total",
         "unattributed": "gpu_cost_unattributed_total"}
HELD = "gpu_held_seconds_total"
GAP_CAUSES = ("series are missing from the workspace, or the period starts or ends inside a delivery outage "
              "(snapshots merged while the backend was down carry each series' cost of the outage at one time)")
LOOKBACK_S = 7 * 86_400  # how far before the period a series' last value is looked for (`--lookback`)


@dataclass
class Row:
    key: tuple[str, ...]  # the values of `Showback.by`, "" where a series has no such label
    allocated: float = 0.0
    unused: float = 0.0  # unheld capacity handed to the group (SCAD, idle policy share or platform)
    effective: float = 0.0
    waste: float = 0.0
    unmeasured: float = 0.0
    gpu_allocated: float = 0.0  # allocated of the GPU resource alone
    gpu_hours: float = 0.0  # GPU-hours held (unit fraction x hours)

    @property
    def charged(self) -> float:
        return self.allocated + self.unused

    @property
    def cost_per_gpu_hour(self) -> float:
        return self.gpu_allocated / self.gpu_hours if self.gpu_hours > 0 else math.nan


@dataclass
class Showback:
    start: float  # seconds since the epoch: the period is (start, end]
    end: float
    by: tuple[str, ...]
    cost_model: str
    matchers: Labels  # the selection (cost_model, cluster, ...)
    rows: list[Row] = field(default_factory=list)  # largest charge first; groups with nothing to show left out
    idle: float = 0.0  # capacity nobody held, kept as idle
    capacity: float = 0.0
    unattributed: float = 0.0  # allocated cost without all five tags (`request` allocation)
    basis: str = ""  # where the costs come from, when not otelgpu's prices (the bill tied out to)

    @property
    def charged(self) -> float:
        return sum(r.charged for r in self.rows)

    @property
    def idle_share(self) -> float:
        return self.idle / self.capacity if self.capacity > 0 else math.nan

    @property
    def total(self) -> Row:
        """The rows added up, the idle counted as unused (nobody's): its `charged` is what the rows
        and the idle add up to, the capacity but for `gap`."""
        rows = self.rows
        return Row(("(total)",), sum(r.allocated for r in rows), sum(r.unused for r in rows) + self.idle,
                   sum(r.effective for r in rows), sum(r.waste for r in rows), sum(r.unmeasured for r in rows),
                   sum(r.gpu_allocated for r in rows), sum(r.gpu_hours for r in rows))

    @property
    def gap(self) -> float:
        """Capacity not accounted for by the rows and the idle: 0 up to rounding, unless series are
        missing from the workspace (a dropped snapshot, a series refused by the backend) or the
        period is cut inside a delivery outage (`GAP_CAUSES`)."""
        return self.capacity - self.charged - self.idle


def increases(client: PromClient, name: str, matchers: Labels, start: float, end: float,
              lookback_s: int = LOOKBACK_S) -> list[tuple[Labels, float]]:
    """Each series' increase over (start, end]: the series with a sample in the period, with their
    labels (without `__name__`)."""
    if not end > start:
        raise ValueError(f"the period must end after it starts ({start} -> {end})")
    sel, period = selector(name, matchers), f"{_seconds(end - start)}s"
    now = {_key(labels): (labels, value) for labels, value in client.vector(f"last_over_time({sel}[{period}])", end)}
    if not now:
        return []
    before = {_key(labels): value for labels, value in client.vector(f"last_over_time({sel}[{lookback_s}s])", start)}
    # A reset inside the period, or between the last value before it and the first in it.
    around = f"{_seconds(end - start + lookback_s)}s"
    reset = {_key(labels) for labels, _ in client.vector(f"resets({sel}[{around}]) > 0", end)}
    out = []
    for key, (labels, last) in now.items():
        own = {k: v for k, v in labels.items() if k != "__name__"}
        if key in reset:
            out.append((own, _increase(client, selector(name, own), key, start, end, around)))
        else:
            out.append((own, last - before.get(key, 0.0)))
    return out


def increases_by_period(client: PromClient, name: str, matchers: Labels, bounds: list[float],
                        lookback_s: int = LOOKBACK_S) -> list[list[tuple[Labels, float]]]:
    """`increases` over each period (bounds[k], bounds[k+1]] of equal length, from three queries
    whatever the number of periods: the values at each period's end (a range query), the
    periods with a reset, and each series' last value before the first period. A series' value
    before a period is its last value in an earlier one. A series with a reset in or just before
    a period, or whose value went down, is read there sample by sample."""
    step = bounds[1] - bounds[0]
    if any(not abs((b - a) - step) < 1e-6 for a, b in zip(bounds, bounds[1:])) or not step > 0:
        raise ValueError("the periods must be of one length")
    sel, window = selector(name, matchers), f"{_seconds(step)}s"
    out: list[list[tuple[Labels, float]]] = [[] for _ in bounds[1:]]
    ends = client.range_matrix(f"last_over_time({sel}[{window}])", bounds[1], bounds[-1], step)
    if not ends:
        return out
    before = {_key(labels): value for labels, value in client.vector(f"last_over_time({sel}[{lookback_s}s])", bounds[0])}
    # A reset in a period or in the one before: a reset across the start of a period is in the
    # window when the series had a value in the period before (otherwise: see `_increase`).
    resets = {(_key(labels), _period(t, bounds)) for labels, points in
              client.range_matrix(f"resets({sel}[{_seconds(2 * step)}s]) > 0", bounds[1], bounds[-1], step)
              for t, _ in points}
    for labels, points in ends:
        key, own = _key(labels), {k: v for k, v in labels.items() if k != "__name__"}
        previous = before.get(key, 0.0)
        for t, value in points:
            period = _period(t, bounds)
            if (key, period) in resets or value < previous:
                increase = _increase(client, selector(name, own), key, bounds[period], t, window, previous)
            else:
                increase = value - previous
            out[period].append((own, increase))
            previous = value
    return out


def _period(time_s: float, bounds: list[float]) -> int:
    """The period ending at `t` (a step of the range query)."""
    period = int(round((time_s - bounds[0]) / (bounds[1] - bounds[0]))) - 1
    if not 0 <= period < len(bounds) - 1:
        raise QueryError(f"the server answered for {time_s}, outside the periods asked for")
    return period


def _increase(client: PromClient, sel: str, key: frozenset[tuple[str, str]], start: float, end: float,
              around: str, previous: float = 0.0) -> float:
    """A series' increase over (start, end] from its raw samples, each reset counted from zero,
    `previous` its value before the samples read. The selector also matches series with more
    labels: the one whose labels are `key` is read."""
    series = [samples for labels, samples in client.matrix(f"{sel}[{around}]", end) if _key(labels) == key]
    if len(series) != 1:
        raise QueryError(f"{sel}: expected one series with exactly these labels, found {len(series)}")
    total = 0.0
    for t, v in series[0]:
        if t > start:
            total += v - previous if v >= previous else v
        previous = v
    return total


MODEL_LABELS = ("cost_model", "idle_policy", "resource", "price_source")  # money series only


def showback(client: PromClient, start: float, end: float, by: Iterable[str], cost_model: str = "request",
             matchers: Optional[Labels] = None, lookback_s: int = LOOKBACK_S) -> Showback:
    """The period's showback grouped by the labels `by`, under `cost_model`, of the series that
    match `matchers` (a cluster, say). ValueError for a grouping by labels that only money series
    carry (the GPU-hours would fall in a group of their own)."""
    by = tuple(by)
    bad = sorted(set(by) & set(MODEL_LABELS))
    if bad:
        raise ValueError(f"cannot group by {', '.join(bad)}: GPU-hours carry none of {', '.join(MODEL_LABELS)} "
                         "(a report is in one cost model; resources show in the CPU and memory figures)")
    selection = {**(matchers or {}), "cost_model": cost_model}
    out = Showback(start, end, by, cost_model, selection)
    rows: dict[tuple[str, ...], Row] = {}

    def row(labels: Labels) -> Row:
        key = tuple(labels.get(name, "") for name in by)
        return rows.setdefault(key, Row(key))

    for metric in ("allocated", "unused", "effective", "waste", "unmeasured"):
        for labels, value in increases(client, NAMES[metric], selection, start, end, lookback_s):
            row_key = row(labels)
            setattr(row_key, metric, getattr(row_key, metric) + value)
            if metric == "allocated" and labels.get("resource", "gpu") == "gpu":
                row_key.gpu_allocated += value
    for labels, value in increases(client, HELD, matchers or {}, start, end, lookback_s):  # the same under every model
        row(labels).gpu_hours += value / 3600.0
    out.idle = sum(v for _, v in increases(client, NAMES["idle"], selection, start, end, lookback_s))
    out.capacity = sum(v for _, v in increases(client, NAMES["capacity"], selection, start, end, lookback_s))
    out.unattributed = sum(v for _, v in increases(client, NAMES["unattributed"], matchers or {}, start, end, lookback_s))
    held = [r for r in rows.values() if r.charged or r.gpu_hours or r.effective or r.waste or r.unmeasured]
    out.rows = sorted(held, key=lambda r: (-r.charged, r.key))  # groups that only ended in the period: none
    return out


def _key(labels: Labels) -> frozenset[tuple[str, str]]:
    return frozenset((k, v) for k, v in labels.items() if k != "__name__")


def _seconds(duration: float) -> int:
    return max(int(round(duration)), 1)
