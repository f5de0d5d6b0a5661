"""The pods scad splits a node's CPU and memory among: every pod that ran on a costed node in the
interval (the Running pods kube-state-metrics places there, and the GPU holders DCGM shows
there), with what it reserved (requests) and used (cAdvisor), time-weighted by the share of the
interval it ran; and the nodes without GPUs scad costs (those whose instance has a price)."""

from __future__ import annotations

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
    say which held GPUs there, for how long, and how."""
    node_of = {n.name: i for i, n in enumerate(nodes)}
    node_set = [attributes.node_sets.index(n.attrs) for n in nodes]
    gpu_share = _gpu_holders(rows, gpu_node)
    out: list[tuple] = []
    seen: set[tuple[int, int]] = set()
    for key, pod in scope.facts.pods.items():
        node = node_of.get(pod.node)
        if node is None:
            continue
        use = scope.pod_use(key)
        running = pod.phase == "Running" and not pod.deleted
        if use is not None and not np.isnan(use.running_share):
            share = use.running_share
        elif scope.gone(pod):
            share = 0.0
        else:
            share = float(running)
        holder = scope.holders.index(key)
        got = gpu_share.get((node, holder))
        if got is not None:
            share = max(share, got[0])
        if share <= 0 or (got is None and not _carries_cost(pod, use)):
            continue  # a pod that holds and uses nothing costs nothing: its tags take no place
        seen.add((node, holder))
        out.append(_pod_row(scope, attributes, node, node_set[node], holder, POD if got is None else got[1], share,
                            use))
    for (node, holder), (share, attribution) in gpu_share.items():
        if (node, holder) not in seen:  # unknown to kube-state-metrics: GPUs only
            out.append(_pod_row(scope, attributes, node, node_set[node], holder, attribution, share, None))
    if not out:
        return Pods.empty()
    node, pod_set, *values = (np.array(c) for c in zip(*out))
    return Pods(node.astype(np.int64), pod_set.astype(np.int64), *(v.astype(np.float64) for v in values))


def _gpu_holders(rows: Rows, gpu_node: np.ndarray) -> dict[tuple[int, int], tuple[float, int]]:
    """Per (node, holder): the longest share of the interval it held a unit there, and the
    attribution of its last row; in the order the rows name them."""
    out: dict[tuple[int, int], tuple[float, int]] = {}
    held = np.flatnonzero(rows.holder != NOBODY)
    if not len(held):
        return out
    node = gpu_node[rows.gpu[held]]
    key, first = group_ids(node, rows.holder[held])
    by_key = np.lexsort((np.arange(len(held)), key))  # each key's rows, in row order
    starts = np.flatnonzero(np.diff(key[by_key], prepend=-1))
    longest = np.maximum.reduceat(rows.share[held][by_key], starts)
    attribution = rows.attribution[held][by_key[np.append(starts[1:], len(held)) - 1]]  # its last row's
    holder = rows.holder[held]
    for k in np.argsort(first, kind="stable").tolist():
        out[(int(node[first[k]]), int(holder[first[k]]))] = (float(longest[k]), int(attribution[k]))
    return out


def _pod_row(scope: Scope, attributes: SeriesAttributes, node: int, node_set: int, holder: int, attribution: int,
             share: float, use: PodUse | None) -> tuple:
    pod = scope.pod(scope.holders.values[holder])
    pod_set = attributes.pod(holder, attribution, node_set, node)
    nan = float("nan")
    return (node, pod_set, min(share, 1.0), pod.requested("cpu") if pod else 0.0,
            pod.requested("memory") / 2**30 if pod else 0.0,
            use.cpu_cores if use else nan, use.memory_bytes / 2**30 if use else nan)


def _carries_cost(pod: PodFacts, use: PodUse | None) -> bool:
    """Whether scad can charge the pod for vCPU or memory: it requests some or uses some."""
    if pod.requested("cpu") > 0 or pod.requested("memory") > 0:
        return True
    return use is not None and ((use.cpu_cores or 0) > 0 or (use.memory_bytes or 0) > 0)
