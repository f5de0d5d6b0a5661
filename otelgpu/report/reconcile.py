"""A past period tied out to the cloud bill: each node's cost in each charge period replaced by what
the bill says its EC2 instance cost then, split as otelgpu split the node's capacity.

A node is matched to the bill by the instance id its cost series carry (`instance_id`, from its
providerID). For each node and charge period (an origin of the FOCUS dataset, focus.py), the
bill's lines of that instance inside the period are summed: their effective cost (amortised, net
of discounts: Savings Plans, Reserved Instances, spot, private pricing lines that name the
instance) and what was billed. Every figure of the origin (allocated, unused, idle, effective,
waste, unmeasured, CPU and memory under scad) is then multiplied by

    factor = billed effective cost of the instance in the period / otelgpu's cost of the node then

so the node's figures add up to its bill, in otelgpu's proportions. An instance replaced inside
an hour is two instances, each with its own partial hour on both sides. Two nodes that name the
same instance in one period (a node re-registered under a new name) share its lines in proportion
to their cost.

Nothing is dropped unseen:
- a node-period without bill lines keeps otelgpu's price and is listed (`unbilled`), and so does
  one whose instance's lines cost nothing (a Capacity Block's instance: the block's upfront fee is
  no instance's line), rather than being scaled to nothing;
- bill lines of an instance no node-period takes (an instance outside the cluster, or a node whose
  series are missing for that period) are listed per instance (`strays`);
- lines of no instance (credits, taxes, fees, unused commitments) are totalled by category, as the
  bill reader counts them (`Bill.unmatched`);
- an instance's lines other than its hourly compute (data transfer, say) are shown beside its node,
  not allocated.
"""

from __future__ import annotations

import bisect
import csv
import math
from dataclasses import dataclass, field
from typing import Optional, TextIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from otelgpu.report.bill import Bill
from otelgpu.report.focus import Charge, Dataset, Origin
from otelgpu.report.promql import Labels
from otelgpu.report.showback import Row, Showback


@dataclass
class NodeTie:
    """One node over the whole period: otelgpu's cost of it, its bill, and what the report shows."""

    cluster: str
    node: str
    instance_id: str  # "" where its series carry none
    instance_type: str
    capacity_type: str
    listed: float = 0.0  # otelgpu's cost of its matched and unmatched periods (list or configured prices)
    billed: float = 0.0  # the bill's effective compute cost of its instance in the periods it was matched
    reconciled: float = 0.0  # what the report shows for it: billed where matched, otelgpu's price where not
    billed_cost: float = 0.0  # the bill's BilledCost (what was invoiced for those lines)
    other: float = 0.0  # the instance's other lines in those periods (not allocated)
    periods: int = 0
    unbilled_periods: int = 0
    unbilled: float = 0.0  # otelgpu's cost of the periods without bill lines, kept as it is

    @property
    def rate(self) -> float:
        """The bill over otelgpu's cost, of the matched periods (1: the bill agrees with the prices)."""
        matched = self.listed - self.unbilled
        return self.billed / matched if matched > 0 else float("nan")


FREE = ("its usage lines cost nothing: a Capacity Block's instances are paid by the block's upfront fee, a line "
        "of no instance; the node keeps otelgpu's prices")
NO_PERIOD_OF_NODE = ("no node-period took them: its node has no cost series then, or a period merged over an "
                     "outage has bill lines in only some of its hours")


@dataclass
class Stray:
    """An instance's bill lines in the period that no node-period took."""

    instance_id: str
    periods: int
    cost: float  # effective, compute
    billed_cost: float
    other: float
    reason: str  # "no node", NO_PERIOD_OF_NODE or FREE


@dataclass
class Reconciliation:
    bill_format: str
    bill_lines: int
    nodes: list[NodeTie] = field(default_factory=list)
    strays: list[Stray] = field(default_factory=list)
    unmatched: dict[str, tuple[int, float]] = field(default_factory=dict)  # the bill's lines of no instance
    outside: int = 0  # instance-periods of the bill before or after the report's period

    @property
    def billed(self) -> float:
        """The bill's compute lines that matched a node."""
        return sum(n.billed for n in self.nodes)

    @property
    def reconciled(self) -> float:
        return sum(n.reconciled for n in self.nodes)

    @property
    def unbilled(self) -> float:
        return sum(n.unbilled for n in self.nodes)


class BillPeriodError(ValueError):
    """The bill's charge periods do not fit in the report's (a daily bill under hourly periods)."""


def reconcile(data: Dataset, bill: Bill, bounds: list[float]) -> Reconciliation:
    """Scale `data`'s origins to `bill` in place (each origin's `effective_cost` and `billed_cost`
    set where the bill has lines for it) and say how the two tie out. `bounds`: the report's
    charge periods, which each bill line in the report's period must fall inside."""
    lines = _in_period(bill.instances, bounds)
    result = Reconciliation(bill.format, bill.lines, unmatched=dict(bill.unmatched),
                            outside=bill.instances.num_rows - lines.num_rows)
    ids = sorted({o.labels.get("instance_id", "") for o in data.origins} - {""})
    grid = _Grid(lines, ids, bounds)
    shares = _shares(data.origins, grid)
    ties: dict[tuple[str, str, str], NodeTie] = {}
    for origin, share in zip(data.origins, shares):
        _tie(ties, origin, share)
    result.nodes = sorted(ties.values(), key=lambda t: (t.cluster, t.node, t.instance_id))
    result.strays = grid.strays(lines, ids)
    return result


def _in_period(instances: pa.Table, bounds: list[float]) -> pa.Table:
    """The bill's instance-periods inside the report's period, each refused if it crosses one of
    the report's period edges."""
    start, end = instances["start"].to_numpy(), instances["end"].to_numpy()
    inside = (start >= bounds[0]) & (end <= bounds[-1])
    crossing = (start < bounds[-1]) & (end > bounds[0]) & ~inside
    step = bounds[1] - bounds[0]
    period = np.floor((start - bounds[0]) / step)
    crossing |= inside & (end > bounds[0] + (period + 1) * step)
    if crossing.any():
        first = int(np.flatnonzero(crossing)[0])
        raise BillPeriodError(
            f"the bill charges {instances['instance'][first].as_py()} for {int(end[first] - start[first])} s from "
            f"{int(start[first])}, across an edge of the report's {int(step)}-second charge periods: choose a "
            "--granularity the bill's periods fit in (a daily bill needs --granularity day) and a --start and --end "
            "on their edges")
    return instances.filter(pa.array(inside))


class _Grid:
    """The bill's compute, billed and other cost per (instance of a node, report period), and
    which cells a node-period took."""

    def __init__(self, lines: pa.Table, ids: list[str], bounds: list[float]) -> None:
        self.bounds, self.step = bounds, bounds[1] - bounds[0]
        shape = (len(ids), len(bounds) - 1)
        self.index = {name: k for k, name in enumerate(ids)}
        self.cells = {c: np.zeros(shape) for c in ("compute", "billed", "other")}
        self.taken = np.zeros(shape, bool)
        self.free = np.zeros(shape, bool)  # lines of a node-period that cost nothing (FREE)
        self.lines = np.zeros(shape, bool)
        found = pc.index_in(lines["instance"], value_set=pa.array(ids, pa.string()))
        code = pc.fill_null(found, -1).to_numpy().astype(np.int64)
        known = code >= 0
        period = ((lines["start"].to_numpy() - bounds[0]) // self.step).astype(np.int64)
        for column in self.cells:
            np.add.at(self.cells[column], (code[known], period[known]), lines[column].to_numpy()[known])
        self.lines[code[known], period[known]] = True

    def periods(self, origin: Origin) -> slice:
        first = int(round((origin.start - self.bounds[0]) / self.step))
        return slice(first, int(round((origin.end - self.bounds[0]) / self.step)))

    def strays(self, lines: pa.Table, ids: list[str]) -> list[Stray]:
        out = []
        for cells, reason in ((self.lines & ~self.taken & ~self.free, NO_PERIOD_OF_NODE), (self.free, FREE)):
            for name, row in self.index.items():
                if cells[row].any():
                    picked = cells[row]
                    out.append(Stray(name, int(picked.sum()), float(self.cells["compute"][row][picked].sum()),
                                     float(self.cells["billed"][row][picked].sum()),
                                     float(self.cells["other"][row][picked].sum()), reason))
        others = lines.filter(pc.invert(pc.is_in(lines["instance"], value_set=pa.array(ids, pa.string()))))
        if others.num_rows:
            summed = others.group_by("instance").aggregate(
                [("start", "count"), ("compute", "sum"), ("billed", "sum"), ("other", "sum")])
            for row in summed.to_pylist():
                out.append(Stray(row["instance"], row["start_count"], row["compute_sum"], row["billed_sum"],
                                 row["other_sum"], "no node"))
        return sorted(out, key=lambda s: (-s.cost, s.instance_id))


def _shares(origins: list[Origin], grid: _Grid) -> list[dict[str, float]]:
    """Each origin's part of its instance's bill in its periods: the whole, or, where several
    origins name one instance in one period, a part in proportion to their cost per period. An
    origin merged over several periods (a delivery outage, focus.py) is matched only if the bill
    has lines of its instance in every one of them: part of the bill would not be its cost."""
    weight = np.zeros_like(grid.cells["compute"])
    spans = []
    for origin in origins:
        row = grid.index.get(origin.labels.get("instance_id", ""))
        span = grid.periods(origin)
        spans.append((row, span))
        if row is not None:
            weight[row, span] += origin.cost / max(span.stop - span.start, 1)
    shares = []
    for origin, (row, span) in zip(origins, spans):
        if row is None or not grid.lines[row, span].all():  # a merged period takes its lines only all together
            shares.append({})
            continue
        per_period = origin.cost / max(span.stop - span.start, 1)
        part = np.divide(per_period, weight[row, span], out=np.zeros(span.stop - span.start),
                         where=weight[row, span] > 0)
        share = {column: float((cells[row, span] * part).sum()) for column, cells in grid.cells.items()}
        if share["compute"] == 0 and origin.cost > 0:  # billed as nothing: not the node's cost (FREE)
            grid.free[row, span] |= grid.lines[row, span]
            shares.append({})
            continue
        grid.taken[row, span] |= grid.lines[row, span]
        shares.append(share)
    return shares


def _tie(ties: dict[tuple[str, str, str], NodeTie], origin: Origin, share: dict[str, float]) -> None:
    instance = origin.labels.get("instance_id", "")
    key = (origin.cluster, origin.node, instance)
    tie = ties.get(key)
    if tie is None:
        tie = ties[key] = NodeTie(origin.cluster, origin.node, instance, origin.labels.get("instance_type", ""),
                                  origin.labels.get("capacity_type", ""))
    cost = origin.cost
    tie.listed += cost
    tie.periods += 1
    if not share:
        tie.unbilled_periods += 1
        tie.unbilled += cost
        tie.reconciled += cost
        return
    origin.effective_cost, origin.billed_cost = share["compute"], share["billed"]
    tie.billed += share["compute"]
    tie.billed_cost += share["billed"]
    tie.other += share["other"]
    tie.reconciled += share["compute"]


def showback_of(data: Dataset, by: tuple[str, ...], matchers: Labels, start: float, end: float,
                unattributed: Optional[dict[tuple[float, str, str], float]] = None) -> Showback:
    """The showback of `data`'s charges grouped by the labels `by` (the holder's, or the node's:
    `node`, `instance_type`, `cluster`, ...), each at its origin's cost: the bill's where it was
    reconciled. `unattributed`: the request allocation's untagged cost per (period start, cluster,
    node), each scaled by its node-period's factor."""
    out = Showback(start, end, by, data.cost_model, {**matchers, "cost_model": data.cost_model})
    rows: dict[tuple[str, ...], Row] = {}
    for origin in data.origins:
        factor = origin.factor
        out.capacity += origin.cost * factor
        where = {**origin.labels, "cluster": origin.cluster, "node": origin.node}
        for charge in origin.charges.values():
            if charge.kind == "idle":
                out.idle += charge.cost * factor
            elif charge.kind != "unaccounted":  # what the series leave of the capacity: the gap
                labels = {**where, **charge.labels}
                key = tuple(labels.get(name, "") for name in by)
                _add(rows.setdefault(key, Row(key)), charge, factor)
    factor_at = _FactorAt(data.origins)
    for (at, cluster, node), value in (unattributed or {}).items():
        out.unattributed += value * factor_at(at, cluster, node)
    held = [r for r in rows.values() if r.charged or r.gpu_hours or r.effective or r.waste or r.unmeasured]
    out.rows = sorted(held, key=lambda r: (-r.charged, r.key))
    return out


def _add(row: Row, charge: Charge, factor: float) -> None:
    for (resource, part), value in charge.parts.items():
        if part == "held":
            row.allocated += value * factor
            row.gpu_allocated += value * factor if resource == "gpu" else 0.0
        else:
            row.unused += value * factor
    row.effective += charge.used * factor
    row.waste += charge.waste * factor
    row.unmeasured += charge.unmeasured * factor
    row.gpu_hours += charge.gpu_seconds / 3600.0


class _FactorAt:
    """The factor of the origin of a node that covers a time (1: none does)."""

    def __init__(self, origins: list[Origin]) -> None:
        self.spans: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        for origin in origins:
            self.spans.setdefault((origin.cluster, origin.node), []).append((origin.start, origin.end, origin.factor))
        for spans in self.spans.values():
            spans.sort()

    def __call__(self, at: float, cluster: str, node: str) -> float:
        spans = self.spans.get((cluster, node), [])
        found = bisect.bisect_right(spans, (at, math.inf, math.inf)) - 1
        if found >= 0 and spans[found][0] <= at < spans[found][1]:
            return spans[found][2]
        return 1.0


HEADER = ("kind", "cluster", "node", "instance_id", "instance_type", "capacity_type", "periods", "unbilled_periods",
          "list_cost", "bill_cost", "bill_over_list", "reported_cost", "reported_minus_bill", "billed_cost",
          "other_cost", "note")


def write_csv(result: Reconciliation, out: TextIO) -> None:
    """One row per node (`node`), per instance of the bill no node took (`stray`), per category of
    the bill's lines of no instance (`no_instance`), and the nodes' total (`total`)."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(HEADER)
    for tie in result.nodes:
        note = f"{tie.unbilled_periods} periods without bill lines keep otelgpu's prices" if tie.unbilled_periods else ""
        writer.writerow(["node", tie.cluster, tie.node, tie.instance_id, tie.instance_type, tie.capacity_type,
                         tie.periods, tie.unbilled_periods, _money(tie.listed), _money(tie.billed), _ratio(tie.rate),
                         _money(tie.reconciled), _money(tie.reconciled - tie.billed), _money(tie.billed_cost),
                         _money(tie.other), note or ("no instance id on its series" if not tie.instance_id else "")])
    for stray in result.strays:
        writer.writerow(["stray", "", "", stray.instance_id, "", "", stray.periods, "", "", _money(stray.cost), "", "",
                         "", _money(stray.billed_cost), _money(stray.other), stray.reason])
    for category, (lines, cost) in sorted(result.unmatched.items()):
        writer.writerow(["no_instance", "", "", "", "", "", lines, "", "", _money(cost), "", "", "", "", "",
                         f"{category}: lines of no instance, not allocated"])
    listed = sum(t.listed for t in result.nodes)
    writer.writerow(["total", "", "", "", "", "", sum(t.periods for t in result.nodes), sum(t.unbilled_periods for t in
                     result.nodes), _money(listed), _money(result.billed), _ratio(result.billed / (listed - result.unbilled)
                     if listed > result.unbilled else math.nan), _money(result.reconciled),
                     _money(result.reconciled - result.billed), _money(sum(t.billed_cost for t in result.nodes)),
                     _money(sum(t.other for t in result.nodes)), "reported minus bill: the unbilled periods' cost"])


def summary(result: Reconciliation, currency: str = "USD") -> list[str]:
    """What the tie-out says, a line each: the matched total, then every gap."""
    listed = sum(t.listed for t in result.nodes) - result.unbilled
    matched = sum(t.periods - t.unbilled_periods for t in result.nodes)
    lines = [f"bill ({result.bill_format}, {result.bill_lines:,} lines): {matched} node-periods matched: the bill "
             f"{result.billed:,.6f} {currency} against otelgpu's prices {listed:,.6f} "
             f"({_ratio(result.billed / listed if listed > 0 else math.nan)} of them); reported "
             f"{result.reconciled - result.unbilled:,.6f}"]
    unbilled = sum(t.unbilled_periods for t in result.nodes)
    if unbilled:
        lines.append(f"warning: {unbilled} node-periods have no bill lines and keep otelgpu's prices "
                     f"({result.unbilled:,.6f} {currency}): nodes without an instance id, outside this bill, or whose usage "
                     "the bill charged nothing (a Capacity Block's instances: its fee is the block's)")
    if result.strays:
        lines.append(f"warning: {len(result.strays)} instances' compute in the bill is no node's "
                     f"({sum(s.cost for s in result.strays):,.6f} {currency}): instances outside the cluster, or "
                     "nodes whose series are missing then; listed as `stray`")
    for category, (count, cost) in sorted(result.unmatched.items()):
        lines.append(f"bill lines of no instance, not allocated: {category}: {count:,} lines, {cost:,.6f} {currency}")
    return lines


def _money(value: float) -> str:
    return repr(float(value))


def _ratio(value: float) -> str:
    return f"{value:.6f}" if math.isfinite(value) else ""
