"""The cost models series by series, in dicts: the readable reference of `models` (which does the
same work on columns). Tests hold the two to the same results on the same joins.

Each model prices the same holdings (docs/cost-model.md section 2); see `models` for what each
model and idle policy does.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from otelgpu.attribution.engine import Attribution, attribute_request, scad, share
from otelgpu.attribution.models import (SUMS, CostModels, holder_activity, hybrid_allocation, model_attribution,
                                        shared_idle)
from otelgpu.attribution.pricing import Priced
from otelgpu.core.attrs import Attrs, attrs_of, with_attrs
from otelgpu.core.settings import TAG_NAMES

Series = dict[str, dict[Attrs, float]]


@dataclass
class _Idle:
    """Unheld cost per node and resource, and the rows that could take a share of it."""

    amount: np.ndarray  # [node]
    row_node: np.ndarray  # [row] node of each candidate row
    row_weight: np.ndarray  # [row] allocated cost of the row (0: not a holder of the resource)
    row_attrs: list[Attrs]


class CostModelsReference(CostModels):
    """`CostModels`' configuration, its sums and gauges computed series by series."""

    def attribute(self, priced: Priced, dt: float) -> tuple[Series, Series]:
        """Sums and gauges of one interval."""
        sums: Series = {m: defaultdict(float) for m in SUMS}
        base = attribute_request(priced.rows, dt)
        for i, attrs in enumerate(priced.held.row_attrs):
            sums["held"][attrs] += float(base.held_s[i])
        for n, gpus in enumerate(np.bincount(priced.held.gpu_node, minlength=len(priced.nodes)).tolist()):
            if gpus:
                sums["provisioned"][_extended(priced.nodes[n].attrs, ())] += gpus * dt
        for model in self.config.cost_models:
            self._model(model, priced, dt, base, sums)
        self._unattributed(priced, base, sums)
        gauges = self._gauges(priced, base)
        return {k: self._projected(v) for k, v in sums.items() if v}, gauges

    def _projected(self, series: Mapping[Attrs, float]) -> dict[Attrs, float]:
        """Series without the dropped attributes, the increments of series that merge added up."""
        if not self.dropped:
            return dict(series)
        out: dict[Attrs, float] = defaultdict(float)
        for attrs, value in series.items():
            out[self._project(attrs)] += value
        return dict(out)

    def _model(self, model: str, priced: Priced, dt: float, base: Attribution, sums: Series) -> None:
        cfg, n_node = self.config, len(priced.nodes)
        common = {"cost_model": model, "idle_policy": cfg.idle.policy}
        row_node = priced.held.gpu_node[priced.rows.row_gpu] if len(priced.rows.row_gpu) else np.zeros(0, np.int64)
        att, node_source, rates = model_attribution(model, priced, base, dt)
        extra = [self._extras(dict(common, resource="gpu", price_source=node_source[n])) for n in range(n_node)]
        row_attrs = [_extended(a, extra[n]) for a, n in zip(priced.held.row_attrs, row_node.tolist())]
        alloc = att.alloc
        if model == "hybrid":
            alloc = hybrid_allocation(att, row_node, n_node, cfg, lambda: self._holder_activity(priced, row_node, att))
        else:
            for i, attrs in enumerate(row_attrs):
                sums["effective"][attrs] += float(att.effective[i])
                sums["waste"][attrs] += float(att.waste[i])
                sums["unmeasured"][attrs] += float(att.unmeasured[i])
        for i, attrs in enumerate(row_attrs):
            sums["allocated"][attrs] += float(alloc[i])
        node_attrs = [_extended(node.attrs, extra[n]) for n, node in enumerate(priced.nodes)]
        capacity = np.bincount(priced.held.gpu_node, weights=att.capacity, minlength=n_node)
        gpu_idle = _Idle(np.bincount(priced.held.gpu_node, weights=att.idle, minlength=n_node), row_node, alloc,
                         row_attrs)
        idles = [("gpu", gpu_idle, capacity, node_attrs)]
        if model == "scad":
            # SCAD hands each resource's unused capacity to the pods on the node that hold it.
            unused, gpu_idle.amount = share(row_node, alloc, gpu_idle.amount)
            for i, attrs in enumerate(row_attrs):
                sums["unused"][attrs] += float(unused[i])
            idles += self._scad_cpu_memory(priced, dt, rates, node_source, common, sums)
        for resource, idle, cap, attrs_of_node in idles:
            for n in range(n_node):
                if cap[n] or priced.nodes[n].gpus:
                    sums["capacity"][attrs_of_node[n]] += float(cap[n])
            self._idle_policy(idle, priced, attrs_of_node, sums)

    @staticmethod
    def _holder_activity(priced: Priced, row_node: np.ndarray, att: Attribution) -> np.ndarray:
        """Each holder's activity (its effective over its measured allocation, all its units on the
        node together), spread over its rows by allocated cost, so the rows of one holder weigh
        a_p in total whatever the size of the holding."""
        codes: dict[tuple, int] = {}
        holder = np.array([codes.setdefault((int(row_node[i]), d["namespace"], d["pod"]) if d.get("pod")
                                            else (int(row_node[i]), attrs), len(codes))
                           for i, attrs in enumerate(priced.held.row_attrs) for d in (dict(attrs),)], dtype=np.int64)
        return holder_activity(holder, len(codes), att)

    def _scad_cpu_memory(self, priced: Priced, dt: float, rates, node_source, common, sums: Series) -> list:
        pods = priced.held.pod_rows()
        pod_node = np.array([p.node for p in pods], dtype=np.int64)
        qty = np.zeros((len(pods), 2))
        basis = []
        for i, p in enumerate(pods):
            cpu = p.cpu_request if np.isnan(p.cpu_used) else max(p.cpu_request, p.cpu_used)
            mem = p.memory_request_gib if np.isnan(p.memory_used_gib) else max(p.memory_request_gib, p.memory_used_gib)
            qty[i] = (p.share * cpu, p.share * mem)
            basis.append(("requests" if np.isnan(p.cpu_used) else "usage",
                          "requests" if np.isnan(p.memory_used_gib) else "usage"))
            if self.telemetry is not None:
                for resource, b, reserved in zip(("cpu", "memory"), basis[-1], (p.cpu_request, p.memory_request_gib)):
                    if b == "requests" and reserved > 0:
                        self.telemetry.request_fallbacks(resource)
        cap = np.array([[n.vcpus, n.memory_gib] for n in priced.nodes]).reshape(-1, 2)
        rate = np.array([[r[0][1], r[0][2]] for r in rates]).reshape(-1, 2)
        out = scad(pod_node, qty, cap, rate, dt)
        hours = dt / 3600.0
        result = []
        for x, resource in enumerate(("cpu", "memory")):
            extra = [self._extras(dict(common, resource=resource, price_source=node_source[n]))
                     for n in range(len(priced.nodes))]
            pod_extra = {(n, b): self._extras(dict(extra[n], activity_basis=b))
                         for n in range(len(priced.nodes)) for b in ("requests", "usage")}
            attrs = [_extended(p.attrs, pod_extra[p.node, basis[i][x]]) for i, p in enumerate(pods)]
            for i, a in enumerate(attrs):
                if qty[i, x] > 0:
                    sums["allocated"][a] += float(out.split[i, x])
                    sums["unused"][a] += float(out.unused[i, x])
            node_attrs = [_extended(node.attrs, extra[n]) for n, node in enumerate(priced.nodes)]
            idle = _Idle(out.idle[:, x].copy(), pod_node, out.split[:, x], attrs)
            result.append((resource, idle, cap[:, x] * rate[:, x] * hours, node_attrs))
        return result

    def _idle_policy(self, idle: _Idle, priced: Priced, node_attrs: list[Attrs], sums: Series) -> None:
        policy = self.config.idle
        amount = idle.amount
        if policy.policy == "share":
            to_rows, amount = shared_idle(policy.share_scope, idle.row_node, idle.row_weight, amount)
            for i, attrs in enumerate(idle.row_attrs):
                if to_rows[i]:
                    sums["unused"][attrs] += float(to_rows[i])
        for n, node in enumerate(priced.nodes):
            if amount[n] <= 0 and not node.gpus:
                continue
            if policy.policy == "platform":
                attrs = with_attrs(node_attrs[n], dict(self.platform, attribution="idle"))
                sums["unused"][attrs] += float(amount[n])
            else:
                sums["idle"][node_attrs[n]] += float(amount[n])

    def _gauges(self, priced: Priced, base: Attribution) -> Series:
        gauges: Series = {"activity": {}, "tag_coverage": {}}
        measured_alloc: dict[Attrs, float] = defaultdict(float)
        effective: dict[Attrs, float] = defaultdict(float)
        for i, attrs in enumerate(priced.held.row_attrs):  # activity of merged series: weighted by their cost
            measured_alloc[self._project(attrs)] += float(base.alloc[i] - base.unmeasured[i])
            effective[self._project(attrs)] += float(base.effective[i])
        for attrs, m in measured_alloc.items():
            if m > 0:
                gauges["activity"][attrs] = effective[attrs] / m
        found = np.array(priced.held.row_tags_found, dtype=bool).reshape(-1, len(TAG_NAMES))
        namespaces = np.array([dict(a).get("namespace", "") for a in priced.held.row_attrs], dtype=object)
        scopes: list[tuple[Attrs, np.ndarray]] = [((), np.ones(len(namespaces), dtype=bool))]
        if "namespace" not in self.dropped:
            scopes += [((("namespace", ns),), namespaces == ns) for ns in sorted(set(namespaces) - {""})]
        for scope, rows in scopes:
            total = float(base.alloc[rows].sum())
            if total <= 0:
                continue
            gauges["tag_coverage"][scope + (("tag", "all"),)] = float(base.alloc[rows & found.all(axis=1)].sum()) / total
            for k, name in enumerate(TAG_NAMES):
                gauges["tag_coverage"][with_attrs(scope, {"tag": name})] = \
                    float(base.alloc[rows & found[:, k]].sum()) / total
        return gauges

    @staticmethod
    def _unattributed(priced: Priced, base: Attribution, sums: Series) -> None:
        """Allocated GPU cost (request allocation) not tied to all five tags, by reason: no pod on
        a busy device, a pod no source knows, or a known pod missing a tag."""
        for i, attrs in enumerate(priced.held.row_attrs):
            if base.alloc[i] <= 0:
                continue
            fields = dict(attrs)
            reason = {"active_without_pod": "no_pod", "pod_unknown": "pod_unknown"}.get(fields.get("attribution", ""))
            if reason is None and not all(priced.held.row_tags_found[i]):
                reason = "tag_missing"
            if reason is not None:
                key = attrs_of({"namespace": fields.get("namespace", ""), "node": fields.get("node", ""),
                                "reason": reason})
                sums["unattributed"][key] += float(base.alloc[i])


def _extended(attrs: Attrs, extra: Attrs) -> Attrs:
    """`attrs` with the items of `extra` added or replaced."""
    return with_attrs(attrs, dict(extra))
