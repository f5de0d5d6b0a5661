"""The interval join: DCGM entities and their holders, plus pod, namespace and node facts, into
the interval's unpriced holdings (enrich/holdings.py), the contract attribution begins from.

Its jobs, each in a module of its own, in the order they run:
- what DCGM reported, per entity, and each unit's share of its GPU (enrich/reported.py);
- who holds each unit DCGM reported: the pods it shows, requests placed on units it shows
  nobody on, the last holder of a dark unit (enrich/placement.py);
- the whole GPUs DRA claims allocate and those HAMi or KAI share out in fractions
  (enrich/claims.py);
- the GPUs of nodes DCGM did not report (enrich/blind.py);
- each holding's attribute set (enrich/attributes.py);
- the pods scad splits CPU and memory among (enrich/pods.py).
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from otelgpu.core.attrs import Attrs
from otelgpu.core.grouping import Numbering, group_ids
from otelgpu.enrich.attributes import SeriesAttributes, node_attrs
from otelgpu.enrich.blind import Gpus, without_device_data
from otelgpu.enrich.claims import Claims
from otelgpu.enrich.devices import DeviceMemory
from otelgpu.enrich.holdings import Holdings, NodeSpec, Pods, Units
from otelgpu.enrich.labels import TagResolver
from otelgpu.enrich.model import FactSource, FactsView
from otelgpu.enrich.nodes import NodeInfo
from otelgpu.enrich.placement import holder_rows, unheld_rows
from otelgpu.enrich.pods import cpu_only_nodes, pod_rows
from otelgpu.enrich.reported import Hardware, Reported, Rows, reported
from otelgpu.enrich.samples import AnySamples
from otelgpu.enrich.scope import Scope
from otelgpu.enrich.usage import PodUse
from otelgpu.receiver.interner import Interner


class Joiner:
    """`devices`: the GPUs each node had, remembered between intervals (the dark ones' holders);
    `pod_resources`: list the pods on costed nodes (scad); `cpu_only`: which nodes without GPUs
    scad costs as well (None: none); `kept`: a series' attribute set as kept from intervals
    before (the cost store's object of equal value), held instead of the one the join builds."""

    def __init__(self, strings: Interner, facts: FactSource, tags: TagResolver, hardware: Hardware,
                 devices: DeviceMemory, *, pod_resources: bool = False,
                 cpu_only: Callable[[NodeInfo], bool] | None = None,
                 kept: Callable[[Attrs], Attrs] | None = None) -> None:
        self.strings, self.source, self.tags, self.hardware, self.devices = strings, facts, tags, hardware, devices
        self.pod_resources, self.cpu_only, self.kept = pod_resources, cpu_only, kept

    def join(self, samples: AnySamples, start_ns: int, end_ns: int,
             use: Mapping[tuple[int, int], PodUse] | None = None, only_node: str | None = None,
             without_pods: bool = False, facts: FactsView | None = None,
             memory: Callable[[], AnySamples] | None = None) -> Holdings:
        """`only_node`: the join of that node alone (its samples must be the only ones given);
        `without_pods`: as if no pod were known (its capacity alone); `facts`: the facts as of
        `end_ns` when the caller has them already; `memory`: the interval's framebuffer samples,
        when `samples` leave them out (`Steps.unpack`)."""
        facts = facts if facts is not None else self.source.view(end_ns)
        if only_node is not None:
            facts = _one_node(facts, only_node, without_pods)
        scope = Scope(self.strings, facts, start_ns, end_ns, use or {})
        claims = Claims(scope, self.hardware)
        handed = [samples]  # the join lets the samples go while `reported` reads them: it lets go of
        del samples  # what it has read (with `memory`, all of them); what DCGM reported is `units` now
        units = reported(handed.pop(), scope, self.hardware, memory)
        whole = units.whole_gpus(scope) if claims else {}
        if claims.sharing.claims:
            claims.admit_grants(units, whole)
        rows = Rows.concat([holder_rows(scope, units),
                            unheld_rows(scope, units, self.devices, claims.taken(), claims.sharing.pods)])
        if claims:
            rows = claims.with_claims(rows, units, whole)
        gpus, blind_rows, blind = without_device_data(scope, claims, self.hardware, self._reported_gpus(scope, units))
        del units, whole  # read no more: what DCGM reported per entity (at 100,000 GPUs some 45 MiB) is let go
        rows = Rows.concat([rows, blind_rows])
        problems = claims.problems()  # after the nodes without device data: their grants placed too
        attributes = SeriesAttributes(scope, self.tags, self.kept)
        row_set, gpu_node, nodes = _row_sets(rows, gpus, attributes)
        pods = Pods.empty()
        if self.pod_resources:
            if self.cpu_only is not None:
                nodes += cpu_only_nodes(scope, {n.name for n in nodes}, self.cpu_only)
            pods = pod_rows(scope, attributes, nodes, gpu_node, rows)
        found, holder, namespace, attribution, node = attributes.columns()  # every set named, the pods' too
        return Holdings(Units(rows.gpu, rows.f, rows.share, rows.measured, rows.activity), row_set,
                        attributes.sets.values, found, holder, namespace, attribution, node, scope.holders.values,
                        attributes.namespaces.values, gpu_node, nodes, pods, blind, problems)

    def _reported_gpus(self, scope: Scope, units: Reported) -> Gpus:
        """The GPUs DCGM reported: each one's node and model, in the order of their first entity;
        the models' spellings learnt."""
        models: Numbering[str] = Numbering()
        model = scope.indices(models, units.entities.model[units.gpu_first])
        for name in models.values:
            self.hardware.learn_spelling(name)
        return Gpus(units.node[units.gpu_first], model, list(zip(units.node_names, units.node_infos)), models)


def _row_sets(rows: Rows, gpus: Gpus, attributes: SeriesAttributes) -> tuple[np.ndarray, np.ndarray, list[NodeSpec]]:
    """Each row's attribute set, one per holding (a pod's units on a node, of one kind and
    profile) worked out once; each GPU's node, the nodes numbered in the order their first GPU
    comes."""
    spec_of, first_gpu = np.unique(gpus.node, return_index=True)
    order = np.argsort(first_gpu, kind="stable")
    renumber = np.zeros(len(gpus.nodes), np.int64)
    renumber[spec_of[order]] = np.arange(len(order))
    gpu_node = renumber[gpus.node]
    gpus_on_node = np.bincount(gpu_node, minlength=len(order))
    models = gpus.models.values
    nodes = []
    for n, (s, g) in enumerate(zip(spec_of[order].tolist(), first_gpu[order].tolist())):
        name, info = gpus.nodes[s]
        model = models[gpus.model[g]]
        nodes.append(NodeSpec(name, info, model, int(gpus_on_node[n]), node_attrs(name, model, info)))
    # A node's GPUs of one model share one set of node attributes.
    pair_of_gpu, pair_first = group_ids(gpu_node, gpus.model)
    pair_set = np.array([attributes.node_sets.index(node_attrs(nodes[n].name, models[m], nodes[n].info))
                         for n, m in zip(gpu_node[pair_first].tolist(), gpus.model[pair_first].tolist())], np.int64)
    row_set = np.zeros(len(rows), np.int64)
    if len(rows):
        pair = pair_of_gpu[rows.gpu]
        key, first = group_ids(rows.holder, rows.attribution, pair, rows.kind, rows.profile, rows.basis)
        # In the order of their first rows: holders' tag values are admitted under the caps
        # (tag_values) in the order their units come, whatever the order of their names.
        order = np.argsort(first)
        row = first[order]  # each holding's first row, as plain lists: no numpy scalar per value
        sets = np.zeros(len(first), np.int64)
        sets[order] = [attributes.holding(*holding) for holding in zip(
            rows.holder[row].tolist(), rows.attribution[row].tolist(), pair_set[pair[row]].tolist(),
            gpu_node[rows.gpu[row]].tolist(), rows.kind[row].tolist(), rows.profile[row].tolist(),
            rows.basis[row].tolist())]
        row_set = sets[key]
    return row_set, gpu_node, nodes


def _one_node(facts: FactsView, node: str, without_pods: bool) -> FactsView:
    return FactsView({k: p for k, p in facts.pods.items() if p.node == node and not without_pods},
                     {n: f for n, f in facts.nodes.items() if n == node}, facts.namespaces, facts.owners,
                     {k: p for k, p in facts.previous.items() if p.node == node},
                     {} if without_pods else facts.claims, {k: s for k, s in facts.slices.items() if s.node == node},
                     facts.ksm_reported_ns)
