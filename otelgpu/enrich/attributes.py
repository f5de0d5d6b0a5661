"""The attribute sets of one interval's cost series: a holding's (its holder's tags, namespace,
pod and workload, its node's attributes, how it is held) and a node's capacity series'. Each
holder's attributes are worked out once per interval, and each distinct set is listed once with
what the cost models read of it (enrich/holdings.py)."""

from __future__ import annotations

from array import array
from typing import Callable, Optional

import numpy as np

from otelgpu.core.attrs import Attrs, attrs_of, with_attrs
from otelgpu.core.grouping import Numbering
from otelgpu.core.settings import TAG_NAMES
from otelgpu.enrich.holdings import ATTRIBUTIONS, BASES, FRACTION, KINDS
from otelgpu.enrich.labels import TagResolver, Tags
from otelgpu.enrich.model import PodFacts
from otelgpu.enrich.nodes import NodeInfo
from otelgpu.enrich.scope import PodKey, Scope
from otelgpu.enrich.workload import workload


def node_attrs(name: str, model: str, info: NodeInfo) -> Attrs:
    return attrs_of({"capacity_type": info.capacity_type, "gpu_model": model, "instance_id": info.instance_id,
                     "instance_type": info.instance_type, "node": name})


class SeriesAttributes:
    """The distinct attribute sets of one interval, numbered as they are met, with what the cost
    models read of each: which tags the holder's labels gave, the holder, its namespace, its
    attribution and its node."""

    def __init__(self, scope: Scope, tags: TagResolver, kept: Optional[Callable[[Attrs], Attrs]] = None) -> None:
        """`kept`: an equal set kept from intervals before (the cost store's), to hold instead of
        this interval's copy."""
        self.scope, self.tags = scope, tags
        self.sets: Numbering[Attrs] = Numbering(kept=kept)
        self._kept = kept if kept is not None else (lambda attrs: attrs)
        # What the models read of each set, as typed columns (at 100,000 GPUs some 200,000 sets a
        # join: Python lists of numbers, a tuple of three per holder and one of flags per set took
        # some 15 MiB more while the interval was computed)
        self.found = array("B")  # a bit per tag (TAG_NAMES order): its holder's labels gave it
        self.holder, self.namespace, self.node = array("q"), array("q"), array("q")
        self.attribution = array("b")
        self.namespaces: Numbering[str] = Numbering("")
        self.node_sets: Numbering[Attrs] = Numbering()  # the attributes of each node and GPU model
        self._holders: dict[int, tuple[Attrs, int, int]] = {}  # see `_holder`: attributes, found, attribution

    def holding(self, holder: int, attribution: int, node_set: int, node: int, kind: int, profile: int,
                basis: int) -> int:
        """The set of a holding: a holder's units of one kind and profile on one node."""
        attrs, found, attribution = self._holder(holder, attribution, node_set)
        named = self.scope.profiles.values[profile]
        attrs = with_attrs(attrs, {"unit_kind": KINDS[kind], "mig_profile": "" if kind == FRACTION else named,
                                   "fraction_basis": named if kind == FRACTION else "",
                                   "activity_basis": BASES[basis]})
        return self._add(attrs, found, holder, attribution, node)

    def pod(self, holder: int, attribution: int, node_set: int, node: int) -> int:
        """The set of a pod's row (scad's CPU and memory)."""
        attrs, found, attribution = self._holder(holder, attribution, node_set)
        return self._add(attrs, found, holder, attribution, node)

    def _add(self, attrs: Attrs, found: int, holder: int, attribution: int, node: int) -> int:
        index = self.sets.index(attrs)
        if index == len(self.found):  # new: what the models read of it
            self.found.append(found)
            self.holder.append(holder)
            self.namespace.append(self.namespaces.index(self.scope.holders.values[holder][0]))
            self.attribution.append(attribution)
            self.node.append(node)
        return index

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """found [set, tag], holder, namespace, attribution, node: per set."""
        found = np.array(self.found, np.uint8)
        return (((found[:, None] >> np.arange(len(TAG_NAMES), dtype=np.uint8)) & 1).astype(bool),
                np.array(self.holder, np.int64), np.array(self.namespace, np.int64),
                np.array(self.attribution, np.int8), np.array(self.node, np.int64))

    def _holder(self, holder: int, attribution: int, node_set: int) -> tuple[Attrs, int, int]:
        """The holder's attributes, which tags its labels gave (a bit each), and its attribution
        (`pod_unknown` for a pod no source knows); worked out once per interval for each holder,
        attribution and node (a pod holds several units, and it is a GPU holder and a pod row), so
        the sets of its rows share their pairs."""
        key = (holder * len(ATTRIBUTIONS) + attribution) << 32 | node_set  # one int: no tuple of three
        known = self._holders.get(key)
        if known is None:
            attrs, found, final = self._holder_attrs(self.scope.holders.values[holder], ATTRIBUTIONS[attribution],
                                                     self.node_sets.values[node_set])
            bits = sum(1 << tag for tag, given in enumerate(found) if given)
            # the store's equal set where it has one (a pod's scad series are named by it): at
            # 100,000 GPUs a copy per holder took some 20 MiB at the interval's peak
            known = self._holders[key] = (self._kept(attrs_of(attrs)), bits, ATTRIBUTIONS.index(final))
        return known

    def _holder_attrs(self, holder: PodKey, attribution: str,
                      node: Attrs) -> tuple[dict[str, str], tuple[bool, ...], str]:
        pod = self.scope.pod(holder)
        tags = self._tags(holder, pod)
        attrs = dict(zip(TAG_NAMES, tags.values))
        if attribution == "pod" and pod is None:
            attribution = "pod_unknown"
        kind, name = workload(holder[0], holder[1], pod, self.scope.facts.owners)
        attrs.update(dict(node), namespace=holder[0], pod=holder[1], attribution=attribution,
                     workload_kind=kind, workload_name=name)
        return attrs, tags.from_labels, attribution

    def _tags(self, holder: PodKey, pod: PodFacts | None) -> Tags:
        if holder == ("", ""):
            return self.tags.resolve({}, {})
        return self.tags.resolve(pod.labels if pod else {}, self.scope.facts.namespace_labels(holder[0]),
                                 pod.annotations if pod else None, holder[0])
