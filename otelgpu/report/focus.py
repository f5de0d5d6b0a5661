"""A FOCUS 1.3 Cost and Usage dataset of the cost series: each node's GPU capacity cost per charge
period (an hour or a day) split into allocated charges, with FOCUS 1.3's split cost allocation
columns (AllocatedMethodId, AllocatedMethodDetails, AllocatedResourceId, AllocatedResourceName,
AllocatedTags).

The origin charge is what one node's capacity cost in one charge period under one cost model
(`gpu_cost_capacity_total`: its GPUs under `request`, `opencost` and `hybrid`; the whole instance
under `scad`). It is not written itself: the allocated charges take its place, as FOCUS asks, and
add up to it in every cost column and in PricingQuantity. They are, per node and period:
- one per holder (a pod, or a workload or namespace with coarser `series.detail`): its allocated
  cost plus the unheld capacity handed to it (SCAD, idle policy `share`);
- capacity nobody held: kept on the node (`idle`) or booked to the platform tags
  (`idle_platform`); GPU cost of a busy unit no pod holds (`no_holder`); these have no
  AllocatedResourceId, the unallocated portion of the origin;
- what the series in the workspace do not account for (`unaccounted`: a gap, see
  `showback.GAP_CAUSES`), so that the charges always add up to the origin.

AllocatedMethodDetails records, per row, the ratio of the origin the row takes, one element per
resource and part (held, or a share of unheld capacity), the GPU-hours held as UsageQuantity.
Every ratio of one origin's charges adds up to 1. docs/report.md documents the methods.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Iterable, Iterator, Optional, TextIO

from otelgpu.core.months import month
from otelgpu.core.settings import TAG_NAMES
from otelgpu.report.promql import Labels, PromClient
from otelgpu.report.showback import LOOKBACK_S, NAMES, increases_by_period

GRANULARITY_S = {"hour": 3600, "day": 86_400}
PROVISIONED = "gpu_provisioned_seconds_total"
HELD = "gpu_held_seconds_total"
HOLDER_LABELS = ("namespace", "pod", "workload_kind", "workload_name")
UNITS = {"gpu": "GPU-Hours", "cpu": "vCPU-Hours", "memory": "GiB-Hours"}
UNHELD = {"idle": "capacity nobody held, kept on the node",
          "idle_platform": "capacity nobody held, booked to the platform tags",
          "no_holder": "GPU cost of units in use that no pod holds",
          "unaccounted": "capacity cost the series in the workspace do not account for"}
COLUMNS = (
    "BilledCost", "BillingAccountId", "BillingAccountName", "BillingCurrency", "BillingPeriodEnd",
    "BillingPeriodStart", "ChargeCategory", "ChargeClass", "ChargeDescription", "ChargeFrequency",
    "ChargePeriodEnd", "ChargePeriodStart", "ContractedCost", "EffectiveCost", "HostProviderName",
    "InvoiceId", "InvoiceIssuerName", "ListCost", "PricingQuantity", "PricingUnit", "ProviderName", "PublisherName",
    "ServiceCategory", "ServiceName", "ServiceProviderName", "ServiceSubcategory",
    "ResourceId", "ResourceName", "ResourceType",
    "AllocatedMethodId", "AllocatedMethodDetails", "AllocatedResourceId", "AllocatedResourceName", "AllocatedTags",
    "x_ClusterName", "x_CostModel", "x_IdlePolicy", "x_AllocationKind", "x_GpuHoursHeld",
    "x_UsedCost", "x_WasteCost", "x_UnmeasuredCost", "x_InstanceType", "x_CapacityType", "x_GpuModel",
    "x_PriceSource", "x_InstanceId", "x_CostBasis",
)
DECIMALS = {"BilledCost", "ContractedCost", "EffectiveCost", "ListCost", "PricingQuantity", "x_GpuHoursHeld",
            "x_UsedCost", "x_WasteCost", "x_UnmeasuredCost"}
DATES = {"BillingPeriodEnd", "BillingPeriodStart", "ChargePeriodEnd", "ChargePeriodStart"}
TOLERANCE = 1e-9  # relative: figures that differ by less are equal (float sums in another order)


@dataclass
class Provider:
    """Who provides the capacity the nodes run on (FOCUS's provider columns)."""

    name: str = "Amazon Web Services"
    service: str = "Amazon Elastic Compute Cloud"
    billing_account_id: Optional[str] = None  # default: the cluster
    billing_account_name: Optional[str] = None


@dataclass
class Charge:
    """One allocated charge: a share of one node's capacity cost in one period."""

    kind: str  # "holder" or one of UNHELD
    labels: Labels  # of the holder: tags, namespace, pod or workload ("" where absent)
    parts: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))  # (resource, part) -> cost
    used: float = 0.0
    waste: float = 0.0
    unmeasured: float = 0.0
    gpu_seconds: float = 0.0  # held

    @property
    def cost(self) -> float:
        return sum(self.parts.values())


@dataclass
class Origin:
    """One node's capacity in one period under the cost model, and its allocated charges."""

    start: float
    end: float
    cluster: str
    node: str
    labels: Labels  # instance_type, instance_id, capacity_type, gpu_model, idle_policy, price_source
    capacity: float = 0.0
    gpu_seconds: float = 0.0  # provisioned
    charges: dict[tuple, Charge] = field(default_factory=dict)
    # What the bill says the node's instance cost in the period (reconcile.py): its effective and
    # its billed cost, split in the charges' proportions; None: not reconciled, otelgpu's prices.
    effective_cost: Optional[float] = None
    billed_cost: Optional[float] = None

    @property
    def factor(self) -> float:
        """The bill's effective cost over otelgpu's cost of the node (1 where not reconciled)."""
        return 1.0 if self.effective_cost is None else self.effective_cost / self.cost

    def charge(self, kind: str, labels: Labels) -> Charge:
        key = (kind, tuple(sorted(labels.items())))
        return self.charges.setdefault(key, Charge(kind, labels))

    @property
    def cost(self) -> float:
        """What the charges split: the capacity, or more when the capacity series is short."""
        return max(self.capacity, sum(c.cost for c in self.charges.values()))


@dataclass
class Dataset:
    cost_model: str
    origins: list[Origin]
    warnings: list[str]


def periods(start: float, end: float, step_s: int) -> list[float]:
    """The bounds of the charge periods of `step_s` seconds from `start` to `end`, which must fall
    on their edges (UTC)."""
    if not end > start:
        raise ValueError("the period must end after it starts")
    if start % step_s or end % step_s:
        what = {v: k for k, v in GRANULARITY_S.items()}.get(step_s, f"{step_s}-second period")
        raise ValueError(f"--start and --end must fall on a UTC {what}'s edge (the charge periods' edges)")
    return [float(t) for t in range(int(start), int(end) + 1, step_s)]


def collect(client: PromClient, start: float, end: float, step_s: int = GRANULARITY_S["day"],
            cost_model: str = "request", matchers: Optional[Labels] = None, lookback_s: int = LOOKBACK_S) -> Dataset:
    """The origins of each charge period (`step_s` seconds) from `start` to `end` under
    `cost_model`, each with its charges, from the series that match `matchers` (a cluster, say)."""
    reading = _Reading(client, periods(start, end, step_s), dict(matchers or {}), cost_model, lookback_s)
    origins = reading.origins()
    warnings: list[str] = []
    if reading.dropped:
        warnings.append(f"{reading.dropped} series-periods whose increase is not a number were left out")
    merged = _balanced(origins)
    if merged:
        warnings.append(f"{merged} node-periods cut inside a delivery outage were merged with the next ones, up "
                        "to where their charges add up to their capacity (ChargePeriodStart and End say so)")
    kept = _settled(origins, warnings)
    kept.sort(key=lambda o: (o.start, o.cluster, o.node))
    return Dataset(cost_model, kept, warnings)


class _Reading:
    """The increases of each cost series per charge period, gathered into one origin per period,
    cluster and node."""

    def __init__(self, client: PromClient, bounds: list[float], matchers: Labels, cost_model: str,
                 lookback_s: int) -> None:
        self.client, self.bounds, self.lookback_s = client, bounds, lookback_s
        self.matchers, self.money = matchers, {**matchers, "cost_model": cost_model}
        self.found: dict[tuple[int, str, str], Origin] = {}
        self.dropped = 0  # increases that are not numbers (NaN, infinite): left out, and said so

    def origins(self) -> dict[tuple[int, str, str], Origin]:
        for k, labels, value in self._read(NAMES["capacity"], self.money):
            self._origin(k, labels).capacity += value
        for k, labels, value in self._read(NAMES["idle"], self.money):
            self._origin(k, labels).charge("idle", {}).parts[(labels.get("resource", "gpu"), "idle")] += value
        for metric, part in (("allocated", "held"), ("unused", "unused")):
            for k, labels, value in self._read(NAMES[metric], self.money):
                charge = self._origin(k, labels).charge(_kind(labels), _holder(labels))
                charge.parts[(labels.get("resource", "gpu"), part)] += value
        for metric, attr in (("effective", "used"), ("waste", "waste"), ("unmeasured", "unmeasured")):
            for k, labels, value in self._read(NAMES[metric], self.money):
                charge = self._origin(k, labels).charge(_kind(labels), _holder(labels))
                setattr(charge, attr, getattr(charge, attr) + value)
        for k, labels, value in self._read(HELD, self.matchers):  # the same under every model
            origin = self.found.get((k, labels.get("cluster", ""), labels.get("node", "")))
            if origin is not None:
                origin.charge(_kind(labels), _holder(labels)).gpu_seconds += value
        for k, labels, value in self._read(PROVISIONED, self.matchers):
            origin = self.found.get((k, labels.get("cluster", ""), labels.get("node", "")))
            if origin is not None:
                origin.gpu_seconds += value
        return self.found

    def _read(self, name: str, selection: Labels) -> Iterator[tuple[int, Labels, float]]:
        """(period, labels, increase) of each series of `name`, period by period."""
        by_period = increases_by_period(self.client, name, selection, self.bounds, self.lookback_s)
        for k, series in enumerate(by_period):
            kept = [(labels, v) for labels, v in series if math.isfinite(v)]
            self.dropped += len(series) - len(kept)
            yield from ((k, labels, v) for labels, v in kept)

    def _origin(self, period: int, labels: Labels) -> Origin:
        where = (period, labels.get("cluster", ""), labels.get("node", ""))
        if where not in self.found:
            self.found[where] = Origin(self.bounds[period], self.bounds[period + 1], where[1], where[2], {})
        origin = self.found[where]
        for name in ("instance_type", "instance_id", "capacity_type", "gpu_model", "idle_policy", "price_source"):
            if labels.get(name) and not origin.labels.get(name):
                origin.labels[name] = labels[name]
        return origin


def _settled(origins: dict[tuple[int, str, str], Origin], warnings: list[str]) -> list[Origin]:
    """The origins with a cost, each with what its series leave of its capacity written as
    `unaccounted`; what was left out or does not add up, said in `warnings`."""
    kept, unpriced, short, gaps = [], 0, 0, 0
    for o in origins.values():
        if o.cost <= 0:
            unpriced += 1  # nothing to split (unpriced, or a node that came and went)
            continue
        gap = _gap(o)
        if gap > TOLERANCE * o.capacity:
            o.charge("unaccounted", {}).parts[(_main(o), "unaccounted")] += gap
            gaps += 1
        elif -gap > TOLERANCE * o.capacity:
            short += 1
        o.charges = {key: c for key, c in o.charges.items() if c.cost or c.gpu_seconds or c.used or c.waste or c.unmeasured}
        kept.append(o)
    if unpriced:
        warnings.append(f"{unpriced} node-periods with no capacity cost left out (unpriced, or nothing to split)")
    if gaps:
        warnings.append(f"{gaps} node-periods whose series do not add up to the capacity: the rest is written as "
                        "x_AllocationKind=unaccounted (series missing, or a period edge inside a delivery outage)")
    if short:
        warnings.append(f"{short} node-periods whose charges exceed the capacity series (capacity series missing): "
                        "the origin is taken as the charges' sum")
    return kept


MAX_MERGED = 48  # periods one merge may span: an outage longer than that stays apart, its gaps unaccounted


def _balanced(origins: dict[tuple[int, str, str], Origin]) -> int:
    """Merge each node's consecutive periods whose charges do not add up to their capacity, up to
    the first period where, together, they do; returns how many periods were merged away.

    While the backend is down, otelgpu merges queued snapshots (newest value per series), so each
    series carries its cost of the outage at one time of its own: the capacity of a period cut
    inside the outage may have arrived in a later period than its charges, or the reverse. Those
    periods cannot be split; together they are exact. A merge never crosses a calendar month
    (each month's bill stays its own) and spans at most MAX_MERGED periods; a node whose periods
    do not add up within that (series missing for good) keeps them apart."""
    by_node: dict[tuple[str, str], list[tuple[int, Origin]]] = defaultdict(list)
    for (k, cluster, node), o in sorted(origins.items()):
        by_node[(cluster, node)].append((k, o))
    merged = 0
    for (cluster, node), periods in by_node.items():
        start = 0
        while start < len(periods):
            first = periods[start][1]
            gap, capacity, end = _gap(first), first.capacity, start
            first_month = month(first.start)
            while abs(gap) > TOLERANCE * max(capacity, 1e-300):
                end += 1
                # Periods without any series in between are spanned: an outage leaves such holes.
                if end == len(periods) or periods[end][0] - periods[start][0] >= MAX_MERGED \
                        or month(periods[end][1].start) != first_month:
                    end = start  # not within reach: this period stays apart
                    break
                gap += _gap(periods[end][1])
                capacity += periods[end][1].capacity
            if end > start:
                for k, o in periods[start + 1:end + 1]:
                    _absorb(first, o)
                    del origins[(k, cluster, node)]
                merged += end - start
            start = end + 1
    return merged


def _gap(origin: Origin) -> float:
    return origin.capacity - sum(c.cost for c in origin.charges.values())


def _absorb(into: Origin, origin: Origin) -> None:
    """`o`'s capacity and charges added to `into`, whose period now ends where `o`'s does."""
    into.end = origin.end
    into.capacity += origin.capacity
    into.gpu_seconds += origin.gpu_seconds
    for name, value in origin.labels.items():
        into.labels.setdefault(name, value)
    if origin.effective_cost is not None or into.effective_cost is not None:
        raise ValueError("origins are merged before they are reconciled")
    for (kind, labels), c in origin.charges.items():
        target = into.charge(kind, dict(labels))
        for part, value in c.parts.items():
            target.parts[part] += value
        target.used += c.used
        target.waste += c.waste
        target.unmeasured += c.unmeasured
        target.gpu_seconds += c.gpu_seconds


def _kind(labels: Labels) -> str:
    attribution = labels.get("attribution", "")
    if attribution == "idle":
        return "idle_platform"
    if attribution == "active_without_pod":
        return "no_holder"
    return "holder"


def _holder(labels: Labels) -> Labels:
    return {k: labels[k] for k in (*TAG_NAMES, *HOLDER_LABELS) if labels.get(k)}


def _main(origin: Origin) -> str:
    """The resource most of an origin's charges are of (where a gap is put)."""
    by: dict[str, float] = defaultdict(float)
    for c in origin.charges.values():
        for (resource, _), v in c.parts.items():
            by[resource] += v
    return max(by, key=lambda r: (by[r], r == "gpu")) if by else "gpu"


def method_id(cost_model: str, idle_policy: str, billed: bool = False) -> str:
    return f"otelgpu-{cost_model}-idle-{idle_policy}" + ("-bill" if billed else "")


BASIS = {True: "bill", False: "prices"}  # x_CostBasis: the bill's cost of the node, or otelgpu's prices


def rows(data: Dataset, provider: Provider, currency: str = "USD") -> Iterable[dict[str, object]]:
    """The FOCUS rows: one per allocated charge, in origin order."""
    for o in data.origins:
        cost, hours = o.cost, o.gpu_seconds / 3600.0
        policy = o.labels.get("idle_policy", "")
        account = provider.billing_account_id or o.cluster or "otelgpu"
        period = month(o.start)
        node = {"instance_type": o.labels.get("instance_type", ""), "capacity_type": o.labels.get("capacity_type", "")}
        billed = o.effective_cost is not None
        factor = o.factor
        for c in sorted(o.charges.values(), key=lambda c: (c.kind != "holder", -c.cost, _resource_id(o, c) or "")):
            ratio = c.cost / cost
            resource_id = _resource_id(o, c)
            effective = ratio * o.effective_cost if billed else c.cost
            yield {
                "BilledCost": ratio * o.billed_cost if billed else c.cost, "ContractedCost": effective,
                "EffectiveCost": effective, "ListCost": c.cost,
                "BillingAccountId": account, "BillingAccountName": provider.billing_account_name or account,
                "BillingCurrency": currency, "BillingPeriodStart": period[0], "BillingPeriodEnd": period[1],
                "ChargeCategory": "Usage", "ChargeClass": None, "ChargeFrequency": "Usage-Based",
                "ChargeDescription": _description(o, c, data.cost_model, node),
                "ChargePeriodStart": o.start, "ChargePeriodEnd": o.end,
                "HostProviderName": provider.name, "InvoiceId": None, "InvoiceIssuerName": provider.name, "ProviderName": provider.name,
                "PublisherName": provider.name, "ServiceProviderName": provider.name,
                "ServiceCategory": "Compute", "ServiceSubcategory": "Virtual Machines", "ServiceName": provider.service,
                "PricingQuantity": hours * ratio, "PricingUnit": "GPU-Hours",
                "ResourceId": o.node or None, "ResourceName": o.node or None,
                "ResourceType": "Kubernetes node" if o.node else None,
                "AllocatedMethodId": method_id(data.cost_model, policy, billed),
                "AllocatedMethodDetails": json.dumps(_details(c, cost, factor if billed else None),
                                                     separators=(",", ":")),
                "AllocatedResourceId": resource_id,
                "AllocatedResourceName": _resource_name(c) if resource_id else None,
                "AllocatedTags": _tags(c),
                "x_ClusterName": o.cluster or None, "x_CostModel": data.cost_model, "x_IdlePolicy": policy or None,
                "x_AllocationKind": c.kind, "x_GpuHoursHeld": c.gpu_seconds / 3600.0,
                "x_UsedCost": c.used * factor, "x_WasteCost": c.waste * factor,
                "x_UnmeasuredCost": c.unmeasured * factor,
                "x_InstanceType": node["instance_type"] or None, "x_CapacityType": node["capacity_type"] or None,
                "x_GpuModel": o.labels.get("gpu_model") or None, "x_PriceSource": o.labels.get("price_source") or None,
                "x_InstanceId": o.labels.get("instance_id") or None, "x_CostBasis": BASIS[billed],
            }


def _resource_id(origin: Origin, charge: Charge) -> Optional[str]:
    """The holder: cluster/namespace/pod, cluster/namespace/kind/name (a workload) or
    cluster/namespace; none for the unallocated portion."""
    if charge.kind != "holder":
        return None
    labels = charge.labels
    if labels.get("pod"):
        path = [labels.get("namespace", ""), labels["pod"]]
    elif labels.get("workload_name"):
        path = [labels.get("namespace", ""), labels.get("workload_kind", ""), labels["workload_name"]]
    elif labels.get("namespace"):
        path = [labels["namespace"]]
    else:
        path = ["(unknown holder)"]
    return "/".join([origin.cluster, *path] if origin.cluster else path)


def _resource_name(charge: Charge) -> str:
    labels = charge.labels
    return labels.get("pod") or labels.get("workload_name") or labels.get("namespace") or "(unknown holder)"


def _tags(charge: Charge) -> Optional[str]:
    tags = {k: v for k, v in charge.labels.items() if k in TAG_NAMES or k in HOLDER_LABELS}
    return json.dumps(tags, sort_keys=True, separators=(",", ":")) if tags else None


def _details(charge: Charge, cost: float, factor: Optional[float] = None) -> dict[str, object]:
    """The charge's parts and their ratios of the origin; `factor`: the origin is tied out to the
    bill, and each element says so (x_CostBasis `bill`, x_BillFactor: the bill over otelgpu's cost)."""
    elements = []
    for (resource, part), value in sorted(charge.parts.items()):
        if value == 0:
            continue
        element: dict[str, object] = {"AllocatedRatio": value / cost, "UsageUnit": UNITS[resource]}
        if resource == "gpu" and part == "held":
            element["UsageQuantity"] = charge.gpu_seconds / 3600.0
        element["x_Resource"], element["x_Part"] = resource, part
        elements.append(element)
    if not elements:  # a holder with GPU-hours and no cost (a zero price)
        elements.append({"AllocatedRatio": 0.0, "UsageUnit": "GPU-Hours", "UsageQuantity": charge.gpu_seconds / 3600.0,
                         "x_Resource": "gpu", "x_Part": "held"})
    if factor is not None:
        for element in elements:
            element["x_CostBasis"], element["x_BillFactor"] = "bill", factor
    return {"Elements": elements}


def _description(origin: Origin, charge: Charge, cost_model: str, node: dict[str, str]) -> str:
    what = f"{node['instance_type'] or 'node'} {origin.node}".strip()
    scope = "instance" if cost_model == "scad" else "GPU capacity"
    if charge.kind == "holder":
        return f"{scope} of {what} held by {_resource_name(charge)} ({cost_model} allocation)"
    return f"{scope} of {what}: {UNHELD[charge.kind]} ({cost_model} allocation)"


def _text(column: str, value: object) -> str:
    if value is None:
        return ""
    if column in DATES:
        return datetime.fromtimestamp(float(value), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")  # type: ignore[arg-type]
    if column in DECIMALS:
        number = float(value)  # type: ignore[arg-type]
        return repr(number) if math.isfinite(number) else ""  # always with a point or an exponent: a decimal
    return str(value)


def write_csv(data: Dataset, out: TextIO, provider: Provider, currency: str = "USD") -> int:
    """The dataset as CSV (a header, then a row per allocated charge); returns the rows written."""
    import csv

    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    written = 0
    for row in rows(data, provider, currency):
        writer.writerow([_text(c, row[c]) for c in COLUMNS])
        written += 1
    return written


def write_parquet(data: Dataset, path: str, provider: Provider, currency: str = "USD") -> int:
    """The dataset as Parquet: decimals as float64, times as UTC timestamps, the rest strings.
    Needs pyarrow (`pip install otelgpu[focus]`)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ValueError("Parquet output needs pyarrow: pip install 'otelgpu[focus]'") from exc
    table = list(rows(data, provider, currency))
    fields, arrays = [], []
    for c in COLUMNS:
        values = [r[c] for r in table]
        if c in DECIMALS:
            kind = pa.float64()
        elif c in DATES:
            kind = pa.timestamp("s", tz="UTC")
            values = [datetime.fromtimestamp(float(v), timezone.utc) for v in values]  # type: ignore[arg-type]
        else:
            kind = pa.string()
        fields.append(pa.field(c, kind))
        arrays.append(pa.array(values, type=kind))
    pq.write_table(pa.Table.from_arrays(arrays, schema=pa.schema(fields)), path)
    return len(table)
