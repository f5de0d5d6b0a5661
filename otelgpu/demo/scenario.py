"""The demo cluster: three GPU nodes as dcgm-exporter and kube-state-metrics would report them.

- p4d.24xlarge, 8x A100-40GB partitioned all-1g.5gb (56 slices); business units BU-A, BU-B and
  BU-C hold 3, 2 and 2 slices with activity 0.10, 0.20, 0.30, 0.40 in four quarters of an hour
  (the AWS GPU cost attribution recipe's scenario, priced at its $12.00 per GPU-hour);
- p5.48xlarge, 8x H100 80GB: two GPUs in mixed MIG profiles, three whole-GPU pods, three idle GPUs;
- g5.2xlarge on spot, one A10G time-sliced into 4 replicas, three tenants on it.
"""

from __future__ import annotations

import math
import uuid as uuidlib
from dataclasses import dataclass, field
from typing import Callable, Optional

Activity = Callable[[float], float]  # hour fraction (0..1) -> activity (0..1)
RECIPE: Activity = lambda h: (0.10, 0.20, 0.30, 0.40)[min(int(h * 4), 3)]  # noqa: E731


@dataclass
class Pod:
    namespace: str
    name: str
    container: str
    labels: dict[str, str]
    resource: str  # kube-state-metrics resource name of what it requests
    count: int
    activity: Activity
    uid: str = ""
    cpu: float = 4.0  # requested cores
    memory_gib: float = 32.0  # requested
    cpu_used: float = 3.0  # mean cores in use (cAdvisor)
    memory_used_gib: float = 24.0
    # A vLLM server: tenant -> (prompt, generation) tokens a second, the counters a proxy in the
    # pod labels by tenant; served_model is vLLM's model_name
    serves: dict[str, tuple[float, float]] = field(default_factory=dict)
    served_model: str = ""

    def __post_init__(self) -> None:
        self.uid = self.uid or str(uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f"{self.namespace}/{self.name}"))


@dataclass
class Device:
    index: int
    uuid: str
    model: str
    profile: str = ""  # MIG profile, "" for a whole GPU
    gi: str = ""  # GPU instance id
    holder: Optional[Pod] = None


@dataclass
class Node:
    name: str
    ip: str
    labels: dict[str, str]
    capacity: dict[str, float]
    devices: list[Device] = field(default_factory=list)
    shared: list[Pod] = field(default_factory=list)  # time-slicing tenants of device 0

    @property
    def provider_id(self) -> str:
        """The node's spec.providerID: an EC2 instance id made of its address."""
        return "aws:///us-west-2b/i-0" + "".join(f"{int(octet):02x}" for octet in self.ip.split(".")) + "00000000"


def _uuid(node: str, index: int) -> str:
    return "GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"{node}/{index}"))


def _wave(base: float, amp: float, phase: float) -> Activity:
    return lambda h: min(max(base + amp * math.sin(2 * math.pi * (h + phase)), 0.0), 1.0)


def _node(name: str, ip: str, itype: str, capacity_label: tuple[str, str], gpu: dict[str, str],
          cpu: float, mem_gib: float, gpus: dict[str, float]) -> Node:
    labels = {"node.kubernetes.io/instance-type": itype, "topology.kubernetes.io/zone": "us-west-2b",
              capacity_label[0]: capacity_label[1], **{f"nvidia.com/{k}": v for k, v in gpu.items()}}
    return Node(name, ip, labels, {"cpu": cpu, "memory": mem_gib * 2**30, "pods": 110, **gpus})


NAMESPACE_LABELS = {
    "bu-a": {"team": "bu-a", "cost-center": "cc-1100"},
    "bu-b": {"team": "bu-b", "cost-center": "cc-1200"},
    "bu-c": {"team": "bu-c", "cost-center": "cc-1300"},
    "search": {"team": "search", "cost-center": "cc-2001"},
    "ml-research": {"team": "ml-research", "cost-center": "cc-3001"},
    "tenant-blue": {"team": "tenant-blue", "cost-center": "cc-4001"},
    "tenant-green": {"team": "tenant-green"},
}


def build() -> tuple[list[Node], dict[str, dict[str, str]]]:
    """The nodes, and namespace labels by namespace."""
    return [_p4d(), _p5(), _g5()], {ns: dict(labels) for ns, labels in NAMESPACE_LABELS.items()}


def _pod(ns: str, name: str, res: str, count: int, act: Activity, **labels: str) -> Pod:
    """A production pod of the demo: its app is its name's first word."""
    return Pod(ns, name, name.split("-")[0], {"environment": "prod", **labels}, res, count, act)


def _p4d() -> Node:
    # p4d: all-1g.5gb, GPU instance ids 7..13 on each A100 (the layout mig-parted creates).
    p4d = _node("ip-10-20-1-10.us-west-2.compute.internal", "10.20.1.10", "p4d.24xlarge",
                ("eks.amazonaws.com/capacityType", "ON_DEMAND"),
                {"gpu.product": "NVIDIA-A100-SXM4-40GB", "gpu.count": "8", "mig.strategy": "mixed"},
                96, 1152, {"nvidia_com_mig_1g_5gb": 56})
    bu = [_pod("bu-a", "bu-a-train-5f7c9", "nvidia_com_mig_1g_5gb", 3, RECIPE, project="forecasting", model="tft"),
          _pod("bu-b", "bu-b-api-7d9f8-x2k4q", "nvidia_com_mig_1g_5gb", 1, RECIPE, project="pricing", model="xgb-gpu"),
          _pod("bu-b", "bu-b-api-7d9f8-m8w3z", "nvidia_com_mig_1g_5gb", 1, RECIPE, project="pricing", model="xgb-gpu"),
          _pod("bu-c", "bu-c-notebook-0", "nvidia_com_mig_1g_5gb", 2, RECIPE, project="research")]
    holders = [bu[0]] * 3 + [bu[1], bu[2]] + [bu[3]] * 2
    for g in range(8):
        for s, gi in enumerate(range(7, 14)):
            index = g * 7 + s
            p4d.devices.append(Device(g, _uuid(p4d.name, g), "NVIDIA A100-SXM4-40GB", "1g.5gb", str(gi),
                                      holders[index] if index < len(holders) else None))
    return p4d


def _p5() -> Node:
    p5 = _node("ip-10-20-3-41.us-west-2.compute.internal", "10.20.3.41", "p5.48xlarge",
               ("eks.amazonaws.com/capacityType", "ON_DEMAND"),
               {"gpu.product": "NVIDIA-H100-80GB-HBM3", "gpu.count": "8", "mig.strategy": "mixed"},
               192, 2048, {"nvidia_com_gpu": 6, "nvidia_com_mig_3g_40gb": 2, "nvidia_com_mig_2g_20gb": 1,
                           "nvidia_com_mig_1g_10gb": 2, "nvidia_com_mig_4g_40gb": 1})
    h100 = "NVIDIA H100 80GB HBM3"
    llama8 = _pod("search", "vllm-llama3-8b-6b9d7-k2x7q", "nvidia_com_mig_3g_40gb", 1, _wave(0.55, 0.3, 0.0),
                 project="web-search", model="llama3-8b")
    embed = _pod("search", "embedder-5c8d9-q7r2t", "nvidia_com_mig_4g_40gb", 1, _wave(0.35, 0.2, 0.3),
                project="web-search", model="e5-large")
    nb = _pod("ml-research", "notebook-ana-0", "nvidia_com_mig_2g_20gb", 1, _wave(0.08, 0.07, 0.5))
    ollama = Pod("testing", "ollama-76f687f4cd-xcvvp", "ollama", {"app": "ollama"}, "nvidia_com_mig_1g_10gb", 1,
                 _wave(0.4, 0.1, 0.1))
    train = _pod("ml-research", "finetune-llama-7xk2p", "nvidia_com_gpu", 2, _wave(0.9, 0.05, 0.0),
                project="llm-finetune", model="llama3-70b")
    train.cpu, train.memory_gib, train.cpu_used, train.memory_used_gib = 48.0, 512.0, 60.0, 700.0  # bursts over
    serve = _pod("search", "vllm-llama3-70b-0", "nvidia_com_gpu", 1, _wave(0.6, 0.35, 0.2),
                project="web-search", model="llama3-70b")
    serve.serves = {"docs-search": (1800.0, 300.0), "chat-assist": (600.0, 450.0), "internal-eval": (150.0, 50.0)}
    serve.served_model = "meta-llama/Llama-3.1-70B-Instruct"
    layout = [(0, "3g.40gb", "2", llama8), (0, "2g.20gb", "3", nb), (0, "1g.10gb", "9", ollama), (0, "1g.10gb", "10", None),
              (1, "4g.40gb", "1", embed), (1, "3g.40gb", "2", None)]
    p5.devices = [Device(g, _uuid(p5.name, g), h100, prof, gi, holder) for g, prof, gi, holder in layout]
    p5.devices += [Device(g, _uuid(p5.name, g), h100, holder=h) for g, h in
                   [(2, train), (3, train), (4, serve), (5, None), (6, None), (7, None)]]
    return p5


def _g5() -> Node:
    g5 = _node("ip-10-20-7-12.us-west-2.compute.internal", "10.20.7.12", "g5.2xlarge",
               ("karpenter.sh/capacity-type", "spot"),
               {"gpu.product": "NVIDIA-A10G-SHARED", "gpu.count": "1", "gpu.replicas": "4",
                "gpu.sharing-strategy": "time-slicing"},
               8, 32, {"nvidia_com_gpu": 4})
    g5.devices = [Device(0, _uuid(g5.name, 0), "NVIDIA A10G")]
    g5.shared = [_pod("tenant-blue", "chat-api-6f7d9c8b7-4xq2m", "nvidia_com_gpu", 1, _wave(0.45, 0.15, 0.0),
                     project="chat", model="mistral-7b"),
                 _pod("tenant-green", "embedder-85b4d6f9c-wz8pl", "nvidia_com_gpu", 1, _wave(0.2, 0.1, 0.4),
                     model="bge-small"),
                 _pod("tenant-blue", "batch-scorer-27h8k", "nvidia_com_gpu", 1, _wave(0.1, 0.08, 0.7),
                     project="chat", model="mistral-7b")]
    for p in g5.shared:  # a g5.2xlarge has 8 vCPUs and 32 GiB
        p.cpu, p.memory_gib, p.cpu_used, p.memory_used_gib = 2.0, 8.0, 1.0, 6.0
    return g5
