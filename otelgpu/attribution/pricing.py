"""Where attribution begins: the interval's unpriced holdings (enrich/holdings.py) priced.

Each node gets its price (attribution/prices.py: explicit, instance split, default), and each
GPU the per-GPU price of its node by the configured split convention: the kernel's rows are the
holdings' units with those prices. The cost models read the holdings and these prices only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from otelgpu.attribution.engine import UnitRows
from otelgpu.attribution.prices import NodePrice, Pricer
from otelgpu.core.attrs import Attrs
from otelgpu.enrich.holdings import Holdings, NodeSpec


@dataclass
class NodeCost:
    """One node in the interval: what it costs and the attributes of its capacity series."""

    name: str
    price: NodePrice
    attrs: Attrs  # capacity_type, gpu_model, instance_type, node
    gpus: int  # physical GPUs costed this interval
    vcpus: float  # the capacity scad splits (the instance type's figures where known)
    memory_gib: float


@dataclass
class Priced:
    """The holdings with their prices: the kernel's rows (`gpu_price_hour` by the configured split
    convention) and each node's cost, in the order of `held.nodes`."""

    held: Holdings
    rows: UnitRows
    nodes: list[NodeCost]
    split: str  # the instance-price split convention in force (prices can be reloaded)
    unpriced_gpus: int  # GPUs of nodes no source prices


def node_cost(pricer: Pricer, node: NodeSpec) -> NodeCost:
    info = node.info
    price = pricer.node_price(info.instance_type, (node.gpu_model, info.gpu_product), info.capacity_type,
                              node.gpus, info.vcpus, info.memory_gib, info.instance_id)
    return NodeCost(node.name, price, node.attrs, node.gpus, price.vcpus or info.vcpus,
                    price.memory_gib or info.memory_gib)


def priced(held: Holdings, pricer: Pricer) -> Priced:
    nodes = [node_cost(pricer, node) for node in held.nodes]
    split = pricer.config.instance_price_split
    per_gpu = [node.price.per_gpu(split) for node in nodes]
    prices = np.array([p.per_gpu_hour for p in per_gpu], np.float64)[held.gpu_node]
    unpriced = sum(node.gpus for node, price in zip(nodes, per_gpu) if price.source == "none")
    units = held.units
    rows = UnitRows(prices, units.gpu, units.fraction, units.share, units.measured, units.activity)
    return Priced(held, rows, nodes, split, unpriced)
