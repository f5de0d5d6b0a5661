"""One interval's join -> the cost series of every configured cost model, side by side.

Each model prices the same holdings (docs/cost-model.md section 2):
- request: per unit, P * f * held time, P by the configured split convention;
- opencost: the same holdings priced by OpenCost's base-price split of the instance;
- hybrid: the request allocation of each node's GPUs re-blended by measured use;
- scad: the whole instance split over GPU, vCPU and memory with SCAD's weights; unused capacity
  of each resource goes to its holders on the node.
The idle policy then deals with what is still unheld: keep it as idle, share it among the GPU
holders (per node or across the cluster) pro rata to allocated, or book it to the platform tags.

Every money series carries `cost_model`, `idle_policy`, `resource` and `price_source`. Per node
and model: allocated + unused + idle = capacity (with `share_scope: cluster`, per cluster).

The work is done on columns: every increment names an attribute set of the join (or a node's)
and the attributes its model adds by index, and each metric's series are added up with one
`bincount`; each series is named by those two parts (`Extended`), and its set is built only
where something reads it. `models_reference` is the same computation series by series, in dicts:
tests hold the two to the same results.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Optional, Sequence

import numpy as np

from otelgpu.attribution.config import AttributionConfig
from otelgpu.attribution.engine import Attribution, UnitRows, attribute_request, hybrid, scad, share
from otelgpu.attribution.pricing import Priced
from otelgpu.core.attrs import Attrs, Extended, attrs_of, with_attrs
from otelgpu.core.grouping import Numbering, group_ids, id_type
from otelgpu.core.settings import TAG_NAMES
from otelgpu.enrich.holdings import ACTIVE, NOBODY, POD_UNKNOWN
from otelgpu.telemetry import IntervalScope, IntervalTelemetry, SelfMetrics

log = logging.getLogger(__name__)
Series = dict[str, Mapping[Attrs, float]]
Split = Callable[[Mapping[Attrs, float]], dict[Attrs, float]]  # charged series -> tenant_cost (tenants.py)
SUMS = ("allocated", "effective", "waste", "unmeasured", "unused", "idle", "capacity", "held", "provisioned",
        "unattributed")
RESOURCES = ("gpu", "cpu", "memory")
CHARGED = ("allocated", "unused")  # what a holder is charged
REASONS = ("no_pod", "pod_unknown", "tag_missing")  # why allocated cost is unattributed


class Packed(Mapping[Attrs, float]):
    """A series mapping (attribute set -> value) kept as its sets and an array of values. The sets
    are a list, or named by their parts (`Extended`, `named()`): then a set is built only when it
    is read."""

    def __init__(self, series: Mapping[Attrs, float]) -> None:
        self._sets: Sequence[Attrs] = list(series)
        self._values = np.fromiter(series.values(), np.float64, len(self._sets))
        self._index: Optional[dict[Attrs, int]] = None

    @staticmethod
    def columns(keys: Sequence[Attrs], values: np.ndarray) -> "Packed":
        """The mapping of `keys[i]` to `values[i]` (keys distinct; a list, or `Extended`)."""
        packed = Packed({})
        packed._sets, packed._values = keys, np.asarray(values, np.float64)
        return packed

    def named(self) -> Optional[Extended]:
        """The sets by their parts, when they are named so."""
        return self._sets if isinstance(self._sets, Extended) else None

    def items(self) -> Iterator[tuple[Attrs, float]]:  # type: ignore[override]
        return zip(self._sets, self._values.tolist())

    def values(self) -> list[float]:  # type: ignore[override]
        return self._values.tolist()

    def array(self) -> np.ndarray:
        """The values, in the order of the keys (read-only: the mapping's own)."""
        view = self._values.view()
        view.flags.writeable = False
        return view

    def __iter__(self) -> Iterator[Attrs]:
        return iter(self._sets)

    def __len__(self) -> int:
        return len(self._sets)

    def __getitem__(self, attrs: Attrs) -> float:
        if self._index is None:
            self._index = {a: i for i, a in enumerate(self._sets)}
        return float(self._values[self._index[attrs]])


@dataclass
class _Idle:
    """Unheld cost per node and resource, and the rows that could take a share of it."""

    amount: np.ndarray  # [node]
    row_node: np.ndarray  # [row] node of each candidate row
    row_weight: np.ndarray  # [row] allocated cost of the row (0: not a holder of the resource)
    row_set: np.ndarray  # [row] its attribute set and extra (`_Sums`)
    row_extra: np.ndarray


class _Sums:
    """One interval's increments, gathered in parts. A part names, per row, an attribute set (an
    index into the join's sets, then the node, platform and reason sets added here), an extra
    (an index into `extras`, the attributes a model adds; 0 adds none) and a value. A metric's
    series are the distinct (set, extra) pairs its parts name, an increment of 0 included, in
    the order they are first named, each named by its parts (`Extended`); a series' value is the
    sum of its increments in the order they were added (as `models_reference` adds them one by
    one)."""

    def __init__(self, sets: list[Attrs], extras: "_Extras") -> None:
        self._joined = sets
        self._added: Numbering[Attrs] = Numbering()
        self.extras: Numbering[Attrs] = Numbering(())
        self._kept = extras
        self._parts: dict[str, list[tuple[np.ndarray, np.ndarray | int, np.ndarray]]] = {m: [] for m in SUMS}

    def set(self, attrs: Attrs) -> int:
        """The index of a set that is not one of the join's."""
        return len(self._joined) + self._added.index(attrs)

    def extra(self, items: Mapping[str, str]) -> int:
        return self.extras.index(self._kept(items))

    def add(self, metric: str, sets: np.ndarray, extras: np.ndarray | int, values: np.ndarray,
            where: Optional[np.ndarray] = None) -> None:
        if where is not None:
            sets, values = sets[where], values[where]
            extras = extras if np.isscalar(extras) else extras[where]
        if len(sets):  # one extra for every row stays a number: a part holds no column of it
            self._parts[metric].append((sets, extras, values))

    def series(self, merge: Callable[[Sequence[Attrs], np.ndarray], Mapping[Attrs, float]],
               metrics: Optional[tuple[str, ...]] = None, keep: bool = False) -> Series:
        """Every metric's series (or only `metrics`'), each merged by `merge`. Unless `keep`, a
        metric's parts are let go once its series are made (at 100,000 GPUs the parts of every
        metric, held to the last, were the peak of the interval's attribution)."""
        width = len(self.extras)
        bases = self._joined + self._added.values  # the sets every metric's series name by index
        out: Series = {}
        for metric in list(self._parts):
            parts = self._parts[metric] if keep else self._parts.pop(metric)
            if not parts or (metrics is not None and metric not in metrics):
                continue
            keys = np.concatenate([sets.astype(np.int64, copy=False) * width + extras for sets, extras, _ in parts])
            values = np.concatenate([part[2] for part in parts])
            del parts
            named, totals = _first_named(keys, values)
            del keys, values
            out[metric] = merge(Extended(bases, self.extras.values, named // width, named % width), totals)
        return out


class CostModels:
    def __init__(self, config: AttributionConfig, tag_defaults: Mapping[str, str],
                 metrics: Optional[SelfMetrics] = None, dropped: frozenset[str] = frozenset()) -> None:
        self.config = config
        self.telemetry = IntervalTelemetry(metrics) if metrics is not None else None
        self.dropped = dropped  # attributes the series do not keep (`series.detail`, `series.drop_attributes`)
        self.platform = {name: config.idle.platform_tags.get(name, tag_defaults[name]) for name in TAG_NAMES}
        self._extras = _Extras()

    def needs_pods(self) -> bool:
        return "scad" in self.config.cost_models

    def attribute(self, priced: Priced, dt: float, split: Optional[Split] = None) -> tuple[Series, Series]:
        """Sums and gauges of one interval. `split`, given what the holders are charged (the
        allocated and unused series, with every attribute: a pod's included, whatever
        `series.detail` drops), gives the `tenant_cost` series (attribution/tenants.py); they are
        then reduced as the others."""
        base = attribute_request(priced.rows, dt)
        sums = self._sums(priced, dt, base, split)  # its parts let go before the gauges are made
        return sums, self._gauges(priced, base)

    def _sums(self, priced: Priced, dt: float, base: Attribution, split: Optional[Split]) -> Series:
        held = priced.held
        out = _Sums(held.sets, self._extras)
        out.add("held", held.row_set, 0, base.held_s)
        gpus = np.bincount(held.gpu_node, minlength=len(priced.nodes)).astype(np.float64)
        node_set = np.array([out.set(node.attrs) for node in priced.nodes], np.int64)  # each node's capacity series
        out.add("provisioned", node_set, 0, gpus * dt, where=gpus > 0)
        for model in self.config.cost_models:
            self._model(model, priced, dt, base, node_set, out)
        self._unattributed(priced, base, out)
        sums = out.series(self._merged, keep=split is not None and bool(self.dropped))  # kept for `full`
        if split is not None and "allocated" in sums:
            full = out.series(Packed.columns, CHARGED) if self.dropped else sums
            charged: dict[Attrs, float] = defaultdict(float)  # what the pods are charged: allocated + unused
            for metric in CHARGED:
                for attrs, value in full.get(metric, {}).items():
                    charged[attrs] += value
            try:
                tenants = split(charged)
            except Exception:  # noqa: BLE001 - the tenants' split must never cost the interval its costs
                log.exception("tenant split failed; the interval's other series are kept")
                if self.telemetry is not None:
                    self.telemetry.failed(IntervalScope.TENANTS)
                tenants = {}
            if tenants:
                sums["tenant_cost"] = self.reduce(tenants)
        return sums

    def reduce(self, series: Mapping[Attrs, float]) -> Mapping[Attrs, float]:
        """Series without the attributes `series.detail` and `series.drop_attributes` drop, those
        that merge added up: what every sum the models make goes through."""
        return self._merged(list(series), np.fromiter(series.values(), np.float64, len(series)))

    def _project(self, attrs: Attrs) -> Attrs:
        return tuple(kv for kv in attrs if kv[0] not in self.dropped) if self.dropped else attrs

    def _merged(self, attrs: Sequence[Attrs], values: np.ndarray) -> Mapping[Attrs, float]:
        """Series without the dropped attributes, the values of series that merge added up."""
        if not self.dropped:
            return Packed.columns(attrs, values)
        if isinstance(attrs, Extended) and not self._overlap(attrs):
            return self._merged_by_parts(attrs, values)
        index: dict[Attrs, int] = {}
        into = np.array([index.setdefault(self._project(a), len(index)) for a in attrs], np.int64)
        return Packed.columns(list(index), np.bincount(into, weights=values, minlength=len(index)))

    def _overlap(self, sets: Extended) -> bool:
        """Whether a series' base keeps a key that its extra adds (so that parts could merge into
        one set that their projections do not tell apart)."""
        added = {k: 1 << bit for bit, k in enumerate({k for e in sets.extras for k, _ in e if k not in self.dropped})}
        if not added:
            return False
        extra_keys = np.array([sum(added.get(k, 0) for k, _ in e) for e in sets.extras], np.int64).reshape(-1)
        base_keys = np.array([sum(added.get(k, 0) for k, _ in b) for b in sets.bases], np.int64).reshape(-1)
        return bool(np.any(base_keys[sets.base] & extra_keys[sets.extra]))

    def _merged_by_parts(self, sets: Extended, values: np.ndarray) -> Packed:
        """`_merged` of sets whose projections are told apart by their projected parts: each base
        and extra projected once, the series of equal parts added up, first named first."""
        bases: Numbering[Attrs] = Numbering()
        extras: Numbering[Attrs] = Numbering()
        base_of = np.array([bases.index(self._project(b)) for b in sets.bases], np.int64).reshape(-1)
        extra_of = np.array([extras.index(self._project(e)) for e in sets.extras], np.int64).reshape(-1)
        width = max(len(extras), 1)
        named, totals = _first_named(base_of[sets.base] * width + extra_of[sets.extra], values)
        return Packed.columns(Extended(bases.values, extras.values, named // width, named % width), totals)

    def _model(self, model: str, priced: Priced, dt: float, base: Attribution, node_set: np.ndarray,
               out: _Sums) -> None:
        cfg, n_node, held = self.config, len(priced.nodes), priced.held
        common = {"cost_model": model, "idle_policy": cfg.idle.policy}
        row_node = held.gpu_node[priced.rows.row_gpu] if len(priced.rows.row_gpu) else np.zeros(0, np.int64)
        att, node_source, rates = model_attribution(model, priced, base, dt)
        extra = np.array([out.extra(dict(common, resource="gpu", price_source=node_source[n])) for n in range(n_node)],
                         np.int64)
        row_extra = extra[row_node]
        alloc = att.alloc
        if model == "hybrid":
            alloc = hybrid_allocation(att, row_node, n_node, cfg, lambda: self._holder_activity(priced, row_node, att))
        else:
            out.add("effective", held.row_set, row_extra, att.effective)
            out.add("waste", held.row_set, row_extra, att.waste)
            out.add("unmeasured", held.row_set, row_extra, att.unmeasured)
        out.add("allocated", held.row_set, row_extra, alloc)
        capacity = np.bincount(held.gpu_node, weights=att.capacity, minlength=n_node)
        gpu_idle = _Idle(np.bincount(held.gpu_node, weights=att.idle, minlength=n_node), row_node, alloc,
                         held.row_set, row_extra)
        idles = [(gpu_idle, capacity, extra)]
        if model == "scad":
            # SCAD hands each resource's unused capacity to the pods on the node that hold it.
            unused, gpu_idle.amount = share(row_node, alloc, gpu_idle.amount)
            out.add("unused", held.row_set, row_extra, unused)
            idles += self._scad_cpu_memory(priced, dt, rates, node_source, common, out)
        has_gpus = np.array([node.gpus > 0 for node in priced.nodes], bool)
        for idle, cap, node_extra in idles:
            out.add("capacity", node_set, node_extra, cap, where=(cap != 0) | has_gpus)
            self._idle_policy(idle, priced, node_set, node_extra, has_gpus, out)

    @staticmethod
    def _holder_activity(priced: Priced, row_node: np.ndarray, att: Attribution) -> np.ndarray:
        """Each holder's activity (its effective over its measured allocation, all its units on the
        node together), spread over its rows by allocated cost, so the rows of one holder weigh
        a_p in total whatever the size of the holding. A row of no pod is a holder of its own set."""
        held = priced.held
        holder = held.set_holder[held.row_set]
        who = np.where(holder != NOBODY, holder, len(held.holders) + held.row_set)
        group, first = group_ids(row_node, who)
        return holder_activity(group, len(first), att)

    def _scad_cpu_memory(self, priced: Priced, dt: float, rates, node_source, common, out: _Sums) -> list:  # noqa: ANN001
        pods = priced.held.pods
        cpu = np.where(np.isnan(pods.cpu_used), pods.cpu_request, np.maximum(pods.cpu_request, pods.cpu_used))
        memory = np.where(np.isnan(pods.memory_used_gib), pods.memory_request_gib,
                          np.maximum(pods.memory_request_gib, pods.memory_used_gib))
        qty = np.stack([pods.share * cpu, pods.share * memory], axis=1).reshape(-1, 2)
        by_requests = np.stack([np.isnan(pods.cpu_used), np.isnan(pods.memory_used_gib)], axis=1).reshape(-1, 2)
        if self.telemetry is not None:
            for x, (resource, reserved) in enumerate((("cpu", pods.cpu_request), ("memory", pods.memory_request_gib))):
                fallbacks = int(np.count_nonzero(by_requests[:, x] & (reserved > 0)))
                if fallbacks:
                    self.telemetry.request_fallbacks(resource, fallbacks)
        cap = np.array([[n.vcpus, n.memory_gib] for n in priced.nodes]).reshape(-1, 2)
        rate = np.array([[r[0][1], r[0][2]] for r in rates]).reshape(-1, 2)
        split = scad(pods.node, qty, cap, rate, dt)
        hours = dt / 3600.0
        result = []
        for x, resource in enumerate(("cpu", "memory")):
            extra = [dict(common, resource=resource, price_source=node_source[n]) for n in range(len(priced.nodes))]
            node_extra = np.array([out.extra(e) for e in extra], np.int64)
            by_basis = np.array([[out.extra(dict(e, activity_basis=b)) for b in ("requests", "usage")] for e in extra],
                                np.int64).reshape(-1, 2)
            pod_extra = by_basis[pods.node, np.where(by_requests[:, x], 0, 1)]
            holds = qty[:, x] > 0
            out.add("allocated", pods.set, pod_extra, split.split[:, x], where=holds)
            out.add("unused", pods.set, pod_extra, split.unused[:, x], where=holds)
            idle = _Idle(split.idle[:, x].copy(), pods.node, split.split[:, x], pods.set, pod_extra)
            result.append((idle, cap[:, x] * rate[:, x] * hours, node_extra))
        return result

    def _idle_policy(self, idle: _Idle, priced: Priced, node_set: np.ndarray, node_extra: np.ndarray,
                     has_gpus: np.ndarray, out: _Sums) -> None:
        policy = self.config.idle
        amount = idle.amount
        if policy.policy == "share":
            to_rows, amount = shared_idle(policy.share_scope, idle.row_node, idle.row_weight, amount)
            out.add("unused", idle.row_set, idle.row_extra, to_rows, where=to_rows != 0)
        booked = ~((amount <= 0) & ~has_gpus)
        if policy.policy == "platform":
            platform = dict(self.platform, attribution="idle")
            sets = np.array([out.set(with_attrs(node.attrs, platform)) for node in priced.nodes], np.int64)
            out.add("unused", sets, node_extra, amount, where=booked)
        else:
            out.add("idle", node_set, node_extra, amount, where=booked)

    def _gauges(self, priced: Priced, base: Attribution) -> Series:
        gauges: Series = {"activity": {}, "tag_coverage": {}}
        held = priced.held
        # Activity of each series (merged series: weighted by their cost).
        distinct, first, inverse = np.unique(held.row_set, return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")
        index: dict[Attrs, int] = {}
        into = np.array([index.setdefault(self._project(held.sets[s]), len(index)) for s in distinct[order].tolist()],
                        np.int64)
        row_series = np.zeros(len(distinct), np.int64)
        row_series[order] = into
        row_series = row_series[inverse.reshape(-1)]
        measured = np.bincount(row_series, weights=base.alloc - base.unmeasured, minlength=len(index))
        effective = np.bincount(row_series, weights=base.effective, minlength=len(index))
        kept = measured > 0  # as columns: at 100,000 GPUs half a million series, held until the close
        gauges["activity"] = Packed.columns([a for a, k in zip(index, kept.tolist()) if k],
                                            effective[kept] / measured[kept])
        # Tag coverage per cluster and per namespace.
        found = held.set_found[held.row_set]
        everything = found.all(axis=1)
        namespace = held.set_namespace[held.row_set]
        by_namespace = np.argsort(namespace, kind="stable")  # each namespace's rows, in row order
        bounds = np.searchsorted(namespace[by_namespace], np.arange(len(held.namespaces) + 1))
        scopes: list[tuple[Attrs, np.ndarray]] = [((), np.arange(len(namespace)))]
        if "namespace" not in self.dropped:
            names = sorted((name, k) for k, name in enumerate(held.namespaces) if name)
            scopes += [((("namespace", name),), by_namespace[bounds[k]:bounds[k + 1]]) for name, k in names]
        coverage = gauges["tag_coverage"]
        for scope, rows in scopes:
            alloc = base.alloc[rows]
            total = float(alloc.sum())
            if total <= 0:
                continue
            coverage[scope + (("tag", "all"),)] = float(alloc[everything[rows]].sum()) / total
            for k, name in enumerate(TAG_NAMES):
                coverage[with_attrs(scope, {"tag": name})] = float(alloc[found[rows, k]].sum()) / total
        return gauges

    @staticmethod
    def _unattributed(priced: Priced, base: Attribution, out: _Sums) -> None:
        """Allocated GPU cost (request allocation) not tied to all five tags, by reason: no pod on
        a busy device, a pod no source knows, or a known pod missing a tag."""
        held = priced.held
        reason = np.where(held.set_attribution == ACTIVE, 0, np.where(held.set_attribution == POD_UNKNOWN, 1,
                                                                    np.where(held.set_found.all(axis=1), -1, 2)))
        row_reason = reason[held.row_set]
        rows = np.flatnonzero((base.alloc > 0) & (row_reason >= 0))
        if not len(rows):
            return
        sets = held.row_set[rows]
        key, first = group_ids(held.set_namespace[sets], held.set_node[sets], row_reason[rows])
        keyed = np.array([out.set(attrs_of({"namespace": held.namespaces[held.set_namespace[s]],
                                             "node": priced.nodes[held.set_node[s]].name, "reason": REASONS[reason[s]]}))
                          for s in sets[first].tolist()], np.int64)
        out.add("unattributed", keyed[key], 0, base.alloc[rows])


def model_attribution(model: str, priced: Priced, base: Attribution,
                      dt: float) -> tuple[Attribution, list[str], Optional[list]]:
    """The model's attribution of the join's rows (`base`, the request model's, where the model
    prices GPUs the same way), each node's price source, and SCAD's rates per node (scad only)."""
    rates = None
    if model == "scad":
        rates = [node.price.scad_rates() for node in priced.nodes]
        node_price = np.array([r[0][0] for r in rates])
        node_source = [r[1] for r in rates]
    else:
        convention = "opencost" if model == "opencost" else priced.split
        per_gpu = [node.price.per_gpu(convention) for node in priced.nodes]
        node_price = np.array([p.per_gpu_hour for p in per_gpu])
        node_source = [p.source for p in per_gpu]
    gpu_node = priced.held.gpu_node
    if model in ("request", "hybrid") or not len(gpu_node):
        return base, node_source, rates
    rows = priced.rows
    return attribute_request(UnitRows(node_price[gpu_node], rows.row_gpu, rows.row_f, rows.row_share,
                                      rows.row_measured, rows.row_activity), dt), node_source, rates


def hybrid_allocation(att: Attribution, row_node: np.ndarray, n_node: int, config: AttributionConfig,
                      holder_activity: Callable[[], np.ndarray]) -> np.ndarray:
    """Each row's allocated cost under hybrid: the request allocation re-blended per node by use
    (activity times allocated, or `holder_activity()` with `hybrid_weight: activity`)."""
    measured = att.alloc - att.unmeasured > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        activity = np.where(measured, att.effective / (att.alloc - att.unmeasured), 0.0)
    use = holder_activity() if config.hybrid_weight == "activity" else activity * att.alloc
    return hybrid(row_node, n_node, att.alloc, use, measured, config.hybrid_alpha)


def holder_activity(holder: np.ndarray, holders: int, att: Attribution) -> np.ndarray:
    """Per row: its holder's activity (of `n` holders, numbered per row in `holder`), spread over
    the holder's rows by allocated cost (hybrid_weight `activity`)."""
    effective = np.bincount(holder, weights=att.effective, minlength=holders)
    measured = np.bincount(holder, weights=att.alloc - att.unmeasured, minlength=holders)
    alloc = np.bincount(holder, weights=att.alloc, minlength=holders)
    with np.errstate(invalid="ignore", divide="ignore"):
        activity = np.where(measured > 0, effective / measured, 0.0)
        part = np.where(alloc[holder] > 0, att.alloc / alloc[holder], 0.0)
    return activity[holder] * part


def shared_idle(scope: str, row_node: np.ndarray, row_weight: np.ndarray,
                amount: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Idle policy `share`: each node's unheld cost (across the cluster with scope `cluster`)
    handed to the rows pro rata to their weight; returns (per row, left per node)."""
    if scope == "cluster":
        group = np.zeros(len(row_node), dtype=np.int64)
        to_rows, left = share(group, row_weight, np.array([amount.sum()]))
        return to_rows, (np.zeros_like(amount) if left[0] == 0 else amount)
    return share(row_node, row_weight, amount)


def _first_named(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct keys in the order they are first named, and the sum of each one's values in
    the order they come."""
    ids = id_type(len(keys))  # ids and places in 4 bytes where they fit
    inverse, first = group_ids(keys, dtype=ids)
    order = np.argsort(first, kind="stable")
    rank = np.empty(len(order), ids)
    rank[order] = np.arange(len(order), dtype=ids)
    rank = rank[inverse]
    del inverse
    return keys[first[order]], np.bincount(rank, weights=values, minlength=len(order))


class _Extras:
    """Each distinct extra (the attributes a model adds, as items) kept once: an interval's series
    name a handful of extras, whatever their number."""

    def __init__(self) -> None:
        self._kept: dict[Attrs, Attrs] = {}

    def __call__(self, extra: Mapping[str, str]) -> Attrs:
        items = tuple(extra.items())
        if len(self._kept) > 4096:  # node and price-source combinations come and go
            self._kept = {}
        return self._kept.setdefault(items, items)
