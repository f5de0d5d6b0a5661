"""What a node's kube-state-metrics facts say about its GPUs, instance and price."""

from __future__ import annotations

from dataclasses import dataclass

from otelgpu.core.catalog import instance_of
from otelgpu.enrich import labels
from otelgpu.enrich.model import NodeFacts
from otelgpu.receiver.schema import MAX_GPUS_PER_NODE, MIG_PREFIX, gpu_count_label, replicas_label

_CAPACITY_TYPES = {"on_demand": "on-demand", "on-demand": "on-demand", "spot": "spot", "reserved": "reserved",
                   "capacity_block": "reserved", "capacity-block": "reserved"}


@dataclass(frozen=True)
class NodeInfo:
    instance_type: str
    capacity_type: str  # on-demand | spot | reserved | unknown
    gpu_product: str  # GFD's nvidia.com/gpu.product
    replicas: int  # time-slicing / MPS replicas per GPU (1: not shared)
    sharing: str  # none | time-slicing | mps
    mig_strategy: str  # none | single | mixed (single: MIG instances are requested as nvidia.com/gpu)
    vcpus: float
    memory_gib: float
    known: bool  # kube-state-metrics reported the node
    instance_id: str = ""  # the EC2 instance of its providerID ("": none, or another cloud's)


def node_info(facts: NodeFacts | None) -> NodeInfo:
    if facts is None:
        return NodeInfo("", "unknown", "", 1, "none", "mixed", 0.0, 0.0, False)
    lab = facts.labels
    raw_cap = (lab.get(labels.EKS_CAPACITY_TYPE) or lab.get(labels.KARPENTER_CAPACITY_TYPE) or "").lower()
    replicas = replicas_label(lab.get(labels.GPU_REPLICAS, "1")) or 1
    sharing = lab.get(labels.GPU_SHARING, "") or ("time-slicing" if replicas > 1 else "none")
    return NodeInfo(
        instance_type=lab.get(labels.INSTANCE_TYPE) or lab.get(labels.INSTANCE_TYPE_BETA) or "",
        capacity_type=_CAPACITY_TYPES.get(raw_cap, "unknown"),
        gpu_product=lab.get(labels.GPU_PRODUCT, ""),
        replicas=replicas,
        sharing=sharing,
        mig_strategy=lab.get(labels.MIG_STRATEGY, "") or "mixed",
        vcpus=facts.capacity.get("cpu", 0.0),
        memory_gib=facts.capacity.get("memory", 0.0) / 2**30,
        known=True,
        instance_id=instance_of(facts.provider_id) or "",
    )


def mig_resource(profile: str) -> str:
    """`1g.10gb+me` -> `nvidia_com_mig_1g_10gb_me`, the resource name as kube-state-metrics writes it."""
    return MIG_PREFIX + profile.replace(".", "_").replace("+", "_").replace("-", "_")


def profile_of_resource(resource: str) -> str:
    """`nvidia_com_mig_1g_10gb_me` -> `1g.10gb+me` (the inverse of mig_resource)."""
    core, _, suffix = resource[len(MIG_PREFIX):].partition("gb")
    return core.replace("_", ".", 1) + "gb" + suffix.replace("_", "+", 1)


def gpu_count(facts: NodeFacts, info: NodeInfo) -> int:
    """Physical GPUs of a node: GFD's nvidia.com/gpu.count, else the advertised nvidia.com/gpu
    capacity over the time-slicing replicas (MIG nodes without the label cannot be counted). Labels
    from the Kubernetes API are not validated at decode: an absurd count is no count."""
    count = gpu_count_label(facts.labels.get(labels.GPU_COUNT, ""))
    if count is not None:
        return count
    if any(r.startswith(MIG_PREFIX) for r in facts.capacity):
        return 0
    return int(min(facts.capacity.get("nvidia_com_gpu", 0) // info.replicas, MAX_GPUS_PER_NODE))
