"""The pods scad splits a node's CPU and memory among: every pod that ran on a costed node in the
interval (the Running pods kube-state-metrics places there, and the GPU holders DCGM shows
there), with what it reserved (requests) and used (cAdvisor), time-weighted by the share of the
interval it ran; and the nodes without GPUs scad costs (those whose instance has a price)."""

from __future__ import annotations

from array import array
from typing import Callable

import numpy as np

from otelgpu.core.grouping import group_ids
from otelgpu.enrich.attributes import SeriesAttributes, node_attrs
from otelgpu.enrich.holdings import NOBODY, POD, NodeSpec, Pods
from otelgpu.enrich.model import PodFacts
from otelgpu.enrich.nodes import NodeInfo, gpu_count, node_info
from otelgpu.enrich.reported import Rows
from otelgpu.enrich.scope import Scope
from otelgpu.enrich.usage import PodUse


def cpu_only_nodes(scope: Scope, costed: set[str], priced: Callable[[NodeInfo], bool]) -> list[NodeSpec]:
    """The nodes without GPUs that are not `costed` yet and whose instance has a price."""
    out = []
    for name, facts in scope.facts.nodes.items():
        info = node_info(facts)
        if name in costed or gpu_count(facts, info) > 0 or not priced(info):
            continue
        out.append(NodeSpec(name, info, "", 0, node_attrs(name, "", info)))
    return out


def pod_rows(scope: Scope, attributes: SeriesAttributes, nodes: list[NodeSpec], gpu_node: np.ndarray,
             rows: Rows) -> Pods:
    """Every pod that ran on one of `nodes` in the interval; `rows` (those of `gpu_node`'s GPUs)
    say which held GPUs there, for how long, and how. Its rows are columns as they are met (at
    100,000 GPUs some 100,000 pods: a tuple of Python numbers each, and the GPU holders' tuples,
    took some 20 MiB more while the interval was computed); the pods' GPU holdings are found
    for all of them at once, first."""
    node_of = {n.name: i for i, n in enumerate(nodes)}
    node_set = [attributes.node_sets.index(n.attrs) for n in nodes]
    gpus = _GpuHolders(rows, gpu_node, len(nodes))
    pods = scope.facts.pods
    on_node = np.fromiter((node_of.get(pod.node, -1) for pod in pods.values()), np.int64, len(pods))
    known = on_node >= 0
    holder = np.full(len(on_node), -1, np.int64)  # numbered in the pods' order, as the rows' holders before
    holder[known] = np.fromiter((scope.holders.index(key) for key, k in zip(pods, known.tolist()) if k), np.int64)
    got = gpus.find(on_node, holder).tolist()
    out = _PodColumns(scope, attributes)
    for (key, pod), node, h, g in zip(pods.items(), on_node.tolist(), holder.tolist(), got):
        if node < 0:
            continue
        use = scope.pod_use(key)
        running = pod.phase == "Running" and not pod.deleted
        if use is not None and not np.isnan(use.running_share):
            share = use.running_share
        elif scope.gone(pod):
            share = 0.0
        else:
            share = float(running)
        if g >= 0:
            share = max(share, float(gpus.longest[g]))
        if share <= 0 or (g < 0 and not _carries_cost(pod, use)):
            continue  # a pod that holds and uses nothing costs nothing: its tags take no place
        if g >= 0:
            gpus.seen[g] = True
        out.add(node, node_set[node], h, POD if g < 0 else int(gpus.attribution[g]), share, use)
    for g in np.flatnonzero(~gpus.seen).tolist():  # unknown to kube-state-metrics: GPUs only
        node = int(gpus.node[g])
        out.add(node, node_set[node], int(gpus.holder[g]), int(gpus.attribution[g]), float(gpus.longest[g]), None)
    return out.pods()


class _GpuHolders:
    """Per (node, holder) that held a unit there, in the order the rows name them: the longest
    share of the interval it held one, and the attribution of its last row; `seen`: those a pod
    row has taken. Columns, found by a sorted key: at 100,000 GPUs a dict and Python numbers
    per holder took some 15 MiB at the interval's peak."""

    def __init__(self, rows: Rows, gpu_node: np.ndarray, nodes: int) -> None:
        self._nodes = nodes
        held = np.flatnonzero(rows.holder != NOBODY)
        none = np.zeros(0, np.int64)
        self.longest, self.attribution, self.node, self.holder = np.zeros(0), none, none, none
        if len(held):
            node = gpu_node[rows.gpu[held]]
            key, first = group_ids(node, rows.holder[held])
            by_key = np.lexsort((np.arange(len(held)), key))  # each key's rows, in row order
            starts = np.flatnonzero(np.diff(key[by_key], prepend=-1))
            order = np.argsort(first, kind="stable")  # the keys in the order the rows name them
            last = by_key[np.append(starts[1:], len(held)) - 1]  # each key's last row
            self.longest = np.maximum.reduceat(rows.share[held][by_key], starts)[order]
            self.attribution = rows.attribution[held][last][order]
            self.node = node[first[order]].astype(np.int64)
            self.holder = rows.holder[held][first[order]].astype(np.int64)
        self._keys = self.holder * nodes + self.node
        self._sorted = np.argsort(self._keys, kind="stable")
        self.seen = np.zeros(len(self.node), bool)

    def find(self, node: np.ndarray, holder: np.ndarray) -> np.ndarray:
        """Per (node, holder): its index, -1 where it held no unit there (or a node is -1)."""
        keys = holder * self._nodes + node
        if not len(self._keys):
            return np.full(len(keys), -1, np.int64)
        at = np.minimum(np.searchsorted(self._keys, keys, sorter=self._sorted), len(self._keys) - 1)
        index = self._sorted[at]
        return np.where((self._keys[index] == keys) & (node >= 0), index, -1)


class _PodColumns:
    """Pod rows as typed columns, each pod's set named as its row is added."""

    def __init__(self, scope: Scope, attributes: SeriesAttributes) -> None:
        self.scope, self.attributes = scope, attributes
        self.node, self.set = array("q"), array("q")
        self.share, self.cpu_request, self.memory_request_gib = array("d"), array("d"), array("d")
        self.cpu_used, self.memory_used_gib = array("d"), array("d")

    def add(self, node: int, node_set: int, holder: int, attribution: int, share: float, use: PodUse | None) -> None:
        pod = self.scope.pod(self.scope.holders.values[holder])
        self.node.append(node)
        self.set.append(self.attributes.pod(holder, attribution, node_set, node))
        self.share.append(min(share, 1.0))
        self.cpu_request.append(pod.requested("cpu") if pod else 0.0)
        self.memory_request_gib.append(pod.requested("memory") / 2**30 if pod else 0.0)
        self.cpu_used.append(use.cpu_cores if use else np.nan)
        self.memory_used_gib.append(use.memory_bytes / 2**30 if use else np.nan)

    def pods(self) -> Pods:
        if not self.node:
            return Pods.empty()
        return Pods(np.array(self.node, np.int64), np.array(self.set, np.int64),
                    *(np.array(c, np.float64) for c in (self.share, self.cpu_request, self.memory_request_gib,
                                                         self.cpu_used, self.memory_used_gib)))


def _carries_cost(pod: PodFacts, use: PodUse | None) -> bool:
    """Whether scad can charge the pod for vCPU or memory: it requests some or uses some."""
    if pod.requested("cpu") > 0 or pod.requested("memory") > 0:
        return True
    return use is not None and ((use.cpu_cores or 0) > 0 or (use.memory_bytes or 0) > 0)
