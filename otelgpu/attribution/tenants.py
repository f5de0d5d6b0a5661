"""A shared inference pod's cost, split among the tenants it served by the tokens it served them.

One vLLM deployment serves one model to many tenants: the pod holds the GPU, the tenants should
pay. Per interval, each (model, tenant) of a pod weighs `prompt_weight * prompt tokens +
generation_weight * generation tokens` (vLLM's counters, differenced at the close); what the pod
is charged under each cost model (allocated + unused) is split in those proportions. The pod's
total is unchanged: its tenants add up to it in every interval its counters were scraped in (an
interval whose counters show nothing served, an idle server or their first scrape, books its cost
to the `without_tokens` tenant); an interval they were not scraped in has no tenant series.
docs/cost-model.md section 10 states these rules and has a worked example.

This module is plain Python over the interval's charged series: the pods that serve tokens are
few (one per model replica), so no kernel is needed.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping

from otelgpu.attribution.config import TenantsConfig
from otelgpu.core.attrs import Attrs, attrs_of, with_attrs
from otelgpu.enrich.usage import Tokens

# Attributes of a pod's allocated series that describe how a unit was held: the tenant series are
# the pod's, whatever units it held.
UNIT_ATTRIBUTES = frozenset(("activity_basis", "attribution", "fraction_basis", "mig_profile", "unit_kind"))
TOKEN_KINDS = ("prompt", "generation")
OTHER = "other"  # the served model and tenant of the pairs beyond a pod's cap


def split_by_tenant(charged: Mapping[Attrs, float], tokens: Tokens, cfg: TenantsConfig) -> dict[Attrs, float]:
    """`tenant_cost` of one interval: what each serving pod is charged (`charged`: its allocated
    and unused series), per cost model and resource, split among the (served model, tenant) pairs
    it served by their weighted tokens."""
    pods: dict[tuple[str, str], dict[Attrs, float]] = defaultdict(lambda: defaultdict(float))
    for attrs, value in charged.items():
        fields = dict(attrs)
        key = (fields.get("namespace", ""), fields.get("pod", ""))
        if key in tokens:
            pods[key][tuple(kv for kv in attrs if kv[0] not in UNIT_ATTRIBUTES)] += value
    cost: dict[Attrs, float] = defaultdict(float)
    for key, bases in pods.items():
        served = _capped(tokens[key], cfg)
        weights = {mt: cfg.prompt_weight * p + cfg.generation_weight * g for mt, (p, g) in served.items()}
        total = sum(weights.values())
        for base, value in bases.items():
            if total <= 0:  # served nothing: the cost stays the pod's, under its own tenant value
                cost[with_attrs(base, {"tenant": cfg.without_tokens})] += value
                continue
            for (model, tenant), w in weights.items():
                cost[with_attrs(base, {"served_model": model, "tenant": tenant})] += value * (w / total)  # a share first: tiny weights stay exact
    return dict(cost)


def token_sums(tokens: Tokens, cfg: TenantsConfig) -> dict[Attrs, float]:
    """`tenant_tokens` of one interval: the tokens each pod served, by served model, tenant (as
    `split_by_tenant` names them) and kind."""
    out: dict[Attrs, float] = defaultdict(float)
    for (namespace, pod), served in tokens.items():
        for (model, tenant), counts in _capped(served, cfg).items():
            for kind, n in zip(TOKEN_KINDS, counts):
                out[attrs_of({"namespace": namespace, "pod": pod, "served_model": model, "tenant": tenant,
                                "token_kind": kind})] += n
    return dict(out)


def cost_per_million_tokens(cost: Mapping[Attrs, float], counted: Mapping[Attrs, float],
                            cfg: TenantsConfig) -> dict[Attrs, float]:
    """`tenant_cost_per_mtok` of one interval, over the cluster: per cost model, served model and
    tenant, its cost over its tokens (prompt and generation), times a million. The series may have
    lost `served_model` or `tenant` (`series.drop_attributes`): the figure is then over what is left."""
    spent: dict[tuple[str, str, str], float] = defaultdict(float)
    for attrs, value in cost.items():
        fields = dict(attrs)
        if fields.get("tenant") != cfg.without_tokens:  # a pod's cost while it served nothing has no tokens
            spent[(fields.get("cost_model", ""), fields.get("served_model", ""), fields.get("tenant", ""))] += value
    served: dict[tuple[str, str], float] = defaultdict(float)
    for attrs, tokens in counted.items():
        fields = dict(attrs)
        served[(fields.get("served_model", ""), fields.get("tenant", ""))] += tokens
    out = {}
    for (cost_model, model, tenant), value in spent.items():
        tokens = served.get((model, tenant), 0.0)
        if tokens > 0:
            out[attrs_of({"cost_model": cost_model, "served_model": model, "tenant": tenant})] = value / tokens * 1e6
    return out


def _capped(served: dict[tuple[str, str], list[float]], cfg: TenantsConfig) -> dict[tuple[str, str], list[float]]:
    """The pod's `max_tenants_per_pod` heaviest (served model, tenant) pairs, the rest added up as
    (`other`, `other`): a gateway that mints tenant or model values cannot mint series."""
    if len(served) <= cfg.max_tenants_per_pod:
        return served

    def weight(pair: tuple[str, str]) -> float:
        prompt, generated = served[pair]
        return cfg.prompt_weight * prompt + cfg.generation_weight * generated

    kept = set(sorted(served, key=lambda pair: (-weight(pair), pair))[:cfg.max_tenants_per_pod - 1])
    out: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for pair, (p, g) in served.items():
        mine = out[pair if pair in kept else (OTHER, OTHER)]
        mine[0] += p
        mine[1] += g
    return dict(out)

