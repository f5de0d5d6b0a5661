"""What enrich hands attribution each interval: the unpriced holdings.

Who held which unit of which GPU, for what share of the interval, how active it was, and with
which attribute set; each GPU's node with its spec (instance and capacity type, GPU model, the
vCPUs and memory scad splits); and, where a model needs them, the pods on those nodes with the
CPU and memory they reserved and used. No price is in here: attribution prices the nodes
(attribution/pricing.py) and the cost models read only this and those prices.

Rows and pods name their attribute set by index (`sets`); what the cost models read of a set
(the tags its holder's labels gave, the holder, its namespace, attribution and node) is kept
once per set, as columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from otelgpu.core.attrs import Attrs
from otelgpu.enrich.nodes import NodeInfo

KINDS = ("gpu", "mig", "replica", "fraction")  # unit_kind
GPU, MIG, REPLICA, FRACTION = 0, 1, 2, 3
BASES = ("device", "per_pod", "equal_split", "none", "by_fraction")  # activity_basis
DEVICE, PER_POD, EQUAL_SPLIT, UNMEASURED, BY_FRACTION = 0, 1, 2, 3, 4
ATTRIBUTIONS = ("pod", "ksm_request", "active_without_pod", "pod_unknown", "dra_claim")
POD, KSM_REQUEST, ACTIVE, POD_UNKNOWN, DRA_CLAIM = 0, 1, 2, 3, 4
NOBODY = 0  # the holder ("", "") of a unit held by no pod


@dataclass(frozen=True)
class NodeSpec:
    """A node of the interval as its facts describe it: what prices it, and its capacity series'
    attributes (capacity_type, gpu_model, instance_type, node)."""

    name: str
    info: NodeInfo
    gpu_model: str  # the driver's spelling; "" on a node without GPUs
    gpus: int  # physical GPUs of the interval
    attrs: Attrs


@dataclass
class Units:
    """One row per (unit, holder): the kernel's rows but for the price."""

    gpu: np.ndarray  # int64: index into the interval's GPUs (`Holdings.gpu_node`)
    fraction: np.ndarray  # share of the GPU the unit is (0..1)
    share: np.ndarray  # share of the interval held (0..1)
    measured: np.ndarray  # share of the held time with an activity figure (0..1)
    activity: np.ndarray  # activity over the measured time (0..1), NaN where none


@dataclass
class PodRow:
    """A pod on a costed node, with what scad splits besides GPUs: CPU and memory reserved
    (requests) and used (cAdvisor), time-weighted by the share of the interval it ran."""

    node: int  # index into Holdings.nodes
    attrs: Attrs  # tags, namespace, pod, node attributes, attribution
    tags_found: tuple[bool, ...]
    share: float
    cpu_request: float  # cores
    memory_request_gib: float
    cpu_used: float  # mean cores while running; NaN when not measured
    memory_used_gib: float  # NaN when not measured


@dataclass
class Pods:
    """The pods on costed nodes (`PodRow`s) as columns; `set` indexes `Holdings.sets`."""

    node: np.ndarray  # int64
    set: np.ndarray  # int64
    share: np.ndarray
    cpu_request: np.ndarray
    memory_request_gib: np.ndarray
    cpu_used: np.ndarray
    memory_used_gib: np.ndarray

    @staticmethod
    def empty() -> "Pods":
        ints, floats = np.zeros(0, np.int64), np.zeros(0)
        return Pods(ints, ints, floats, floats, floats, floats, floats)

    def __len__(self) -> int:
        return len(self.node)


@dataclass
class Holdings:
    """One interval's unpriced holdings. The distinct attribute sets of its rows and pods are
    listed once (`sets`), with what the cost models read of them as columns."""

    units: Units
    row_set: np.ndarray  # int64, per row: index into sets
    sets: list[Attrs]
    set_found: np.ndarray  # bool [set, tag]: the tags (TAG_NAMES order) the holder's labels gave
    set_holder: np.ndarray  # int64: index into holders (NOBODY: no pod)
    set_namespace: np.ndarray  # int64: index into namespaces ("" first)
    set_attribution: np.ndarray  # int8: index into ATTRIBUTIONS
    set_node: np.ndarray  # int64: index into nodes
    holders: list[tuple[str, str]]  # (namespace, pod)
    namespaces: list[str]
    gpu_node: np.ndarray  # int64, per GPU: index into nodes
    nodes: list[NodeSpec]  # those with GPUs first, in the order of their first GPU
    pods: Pods  # filled when a model needs CPU and memory (scad)
    gpus_without_device_data: int = 0  # GPUs of nodes known only from kube-state-metrics
    fraction_problems: dict[str, int] = field(default_factory=dict)  # pods whose grant holds nothing, by reason

    @property
    def row_attrs(self) -> list[Attrs]:
        return [self.sets[s] for s in self.row_set.tolist()]

    @property
    def row_tags_found(self) -> list[tuple[bool, ...]]:
        return [tuple(f) for f in self.set_found[self.row_set].tolist()]

    def pod_rows(self) -> list[PodRow]:
        pods = self.pods
        return [PodRow(n, self.sets[s], tuple(self.set_found[s].tolist()), *values) for n, s, *values in
                zip(pods.node.tolist(), pods.set.tolist(), pods.share.tolist(), pods.cpu_request.tolist(),
                    pods.memory_request_gib.tolist(), pods.cpu_used.tolist(), pods.memory_used_gib.tolist())]
