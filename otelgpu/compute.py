"""One interval's costs, isolated per node when something goes wrong.

The join and the cost models run over the whole interval at once. Should that raise (input no
validation foresaw, a bug), the interval is not lost: it is computed again node by node, so every
node that computes still gets its exact costs, and a node that fails even alone has its capacity
booked to idle series marked `error="processing"` (the explicit bucket), or, when not even its
capacity can be priced, its GPU time counted as lost. Every such fall-back is logged and counted.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable, Mapping, Optional

import numpy as np

from otelgpu.attribution.config import TenantsConfig
from otelgpu.attribution.models import CostModels, Packed, Series, Split
from otelgpu.attribution.prices import Pricer
from otelgpu.attribution.pricing import priced
from otelgpu.attribution.tenants import cost_per_million_tokens, split_by_tenant, token_sums
from otelgpu.core.attrs import Attrs, with_attrs
from otelgpu.enrich.join import Joiner
from otelgpu.enrich.model import FactsView
from otelgpu.enrich.samples import AnySamples
from otelgpu.enrich.usage import PodUse, Tokens
from otelgpu.enrich.window import Interval
from otelgpu.exporter.store import Plan
from otelgpu.receiver.interner import Interner
from otelgpu.telemetry import IntervalScope, IntervalTelemetry, SelfMetrics

log = logging.getLogger(__name__)
CLUSTER_GAUGES = ("tag_coverage",)  # ratios over the whole cluster: not made of per-node parts


@dataclass
class Costs:
    sums: Series
    gauges: Series
    unpriced_gpus: int = 0
    gpus_without_device_data: int = 0
    plan: Optional[Plan] = None  # where the store adds the sums, looked up ahead of the close
    fraction_problems: dict[str, int] = field(default_factory=dict)  # Holdings.fraction_problems

    def packed(self) -> "Costs":
        """The same costs with each series as two columns (`Packed`): what waits for the close
        of an interval computed ahead takes some 16 bytes a series instead of some 120."""
        return Costs({m: _packed(s) for m, s in self.sums.items()}, {m: _packed(s) for m, s in self.gauges.items()},
                     self.unpriced_gpus, self.gpus_without_device_data, fraction_problems=self.fraction_problems)


class IntervalCosts:
    def __init__(self, joiner: Joiner, pricer: Pricer, models: CostModels, strings: Interner, metrics: SelfMetrics,
                 tenants: Optional[TenantsConfig] = None) -> None:
        self.joiner, self.pricer, self.models, self.strings, self.metrics = joiner, pricer, models, strings, metrics
        self.telemetry = IntervalTelemetry(metrics)
        self.tenants = tenants  # splitting serving pods' cost among their tenants, when enabled

    def compute(self, interval: Interval, use: Optional[Mapping[tuple[int, int], PodUse]],
                tokens: Optional[Tokens] = None) -> Costs:
        """`tokens`: what each serving pod served in the interval, by model and tenant."""
        facts = self.joiner.source.view(interval.end_ns)
        # The join takes the samples (`pop`) and lets them go once it has read them: the rest of
        # the computation does not hold them (at 100,000 GPUs some 60 MiB, with each one's entity).
        handed = [self._samples(interval, facts)]
        tenants = self.tenants
        split: Optional[Split] = (lambda charged: split_by_tenant(charged, tokens, tenants)) if tokens and tenants else None
        try:
            costs = self._one(interval, handed.pop, use, facts, None, split)
        except Exception:  # noqa: BLE001 - any failure: isolate it instead of losing the interval
            log.exception("interval ending %d failed; computing it node by node", interval.end_ns)
            self.telemetry.failed(IntervalScope.WHOLE)
            handed.clear()
            costs = self._per_node(interval, self._samples(interval, facts), use, facts, split)
        if tokens and tenants:
            try:
                counted = self.models.reduce(token_sums(tokens, tenants))
                per_mtok = cost_per_million_tokens(costs.sums.get("tenant_cost", {}), counted, tenants)
            except Exception:  # noqa: BLE001 - the tokens' series must never cost the interval its costs
                log.exception("token series of the interval ending %d failed; its costs are kept", interval.end_ns)
                self.telemetry.failed(IntervalScope.TENANTS)
            else:
                costs.sums["tenant_tokens"] = counted
                if per_mtok:
                    costs.gauges["tenant_cost_per_mtok"] = per_mtok
        return costs

    def _samples(self, interval: Interval, facts: FactsView) -> AnySamples:
        """The interval's DCGM samples as the join reads them, the dark GPUs' staleness markers
        added (device memory remembers what they show: the same samples remember the same). The
        framebuffer's values are read only where grants share a GPU, and then from the steps."""
        return self.joiner.devices.fill(interval.steps.unpack(memory=False, indexed=True), interval.start_ns,
                                        interval.end_ns, set(facts.nodes))

    def _one(self, interval: Interval, samples: Callable[[], AnySamples], use, facts: FactsView,  # noqa: ANN001
             only_node: Optional[str], split: Optional[Split] = None) -> Costs:
        """`samples`: called once, straight into the join (no frame here holds them)."""
        held = self.joiner.join(samples(), interval.start_ns, interval.end_ns, use, only_node=only_node, facts=facts,
                                memory=partial(interval.steps.memory, indexed=True))
        costed = priced(held, self.pricer)
        sums, gauges = self.models.attribute(costed, interval.seconds, split)
        return Costs(sums, gauges, costed.unpriced_gpus, held.gpus_without_device_data,
                     fraction_problems=held.fraction_problems)

    def _per_node(self, interval: Interval, samples: AnySamples, use, facts: FactsView,  # noqa: ANN001
                  split: Optional[Split] = None) -> Costs:
        names = {self.strings.string(int(c)) for c in np.unique(samples.node) if c >= 0} | set(facts.nodes)
        total = Costs({}, {})
        for name in sorted(names):
            mine = samples.take(np.flatnonzero(samples.node == self.strings.find(name)))
            try:
                part = self._one(interval, lambda: mine, use, facts, name, split)
            except Exception:  # noqa: BLE001
                log.exception("node %s failed alone in the interval ending %d", name, interval.end_ns)
                self.telemetry.failed(IntervalScope.NODE)
                part = self._capacity_only(interval, mine, name, facts)
                if part is None:
                    continue
            _add(total, part)
        return total

    def _capacity_only(self, interval: Interval, samples: AnySamples, name: str,
                       facts: FactsView) -> Optional[Costs]:
        """The node's GPUs as nobody's (its samples without holders or activity), marked."""
        none = np.full(len(samples), -1, dtype=np.int32)
        bare = replace(samples.plain(), value=np.full(len(samples), np.nan), namespace=none, pod=none, container=none,
                       pod_uid=none, vgpu=none)
        try:
            held = self.joiner.join(bare, interval.start_ns, interval.end_ns, None, only_node=name, without_pods=True,
                                    facts=facts)
            costed = priced(held, self.pricer)
            sums, _ = self.models.attribute(costed, interval.seconds)
        except Exception:  # noqa: BLE001
            log.exception("node %s: not even its capacity could be costed in the interval ending %d",
                          name, interval.end_ns)
            gpus = len({(int(u), int(g)) for u, g in zip(samples.uuid, samples.gi)})
            self.metrics.gpu_seconds_lost.inc(gpus * interval.seconds)
            return None
        error = {"error": "processing"}
        marked = {m: {with_attrs(a, error): v for a, v in series.items()} for m, series in sums.items()}
        return Costs(marked, {}, costed.unpriced_gpus, held.gpus_without_device_data)


def _add(total: Costs, part: Costs) -> None:
    for metric, series in part.sums.items():
        into = total.sums.setdefault(metric, defaultdict(float))
        for attrs, value in series.items():
            into[attrs] += value
    for metric, series in part.gauges.items():
        if metric not in CLUSTER_GAUGES:
            total.gauges.setdefault(metric, {}).update(series)
    total.unpriced_gpus += part.unpriced_gpus
    total.gpus_without_device_data += part.gpus_without_device_data
    for reason, n in part.fraction_problems.items():
        total.fraction_problems[reason] = total.fraction_problems.get(reason, 0) + n


def _packed(series: Mapping[Attrs, float]) -> Packed:
    return series if isinstance(series, Packed) else Packed(series)
