"""GPU fractions that schedulers hand out beyond the device plugin's view: HAMi's per-container
core and memory limits, and NVIDIA KAI Scheduler (Run:ai) `gpu-fraction` / `gpu-memory` pods.

dcgm-exporter cannot name these pods: HAMi gives containers virtual device ids that map to no
device, and KAI runs each shared GPU under a *reservation pod* (namespace
`kai-resource-reservation`, formerly `runai-reservation`) that holds the device for the fraction
pods of its GPU group. Both schedulers write what they granted on the pods, and that is read here:

- HAMi: annotation `hami.io/vgpu-devices-allocated`, `UUID,NVIDIA,<memory MiB>,<cores %>:` per
  device, containers separated by `;` (pkg/device/devices.go, EncodeContainerDevices). Cores 0 is
  HAMi's "not limited": then the memory share is the fraction.
- KAI: annotation `gpu-fraction` (0 < f <= 1) or `gpu-memory` (MiB) on the pod, or (KAI 0.17 and
  later, which prefer it) `nvidia.com/container.<container>.gpu-memory.request` (a quantity), and
  label `runai-gpu-group`, which the reservation pod of the same node carries too, with annotation
  `run.ai/reserve_for_gpu_index` naming the GPU's UUID. A fraction of several GPUs
  (`gpu-fraction-num-devices`) names its other groups in labels `runai-gpu-group/<group>`
  (pkg/common/constants and resources/gpu_sharing.go).

What each pod was granted becomes a `Claim` on one (node, GPU UUID); the join turns claims into
fractions of that GPU (docs/cost-model.md section 11).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

from otelgpu.enrich.labels import ksm_annotation_name, ksm_label_name
from otelgpu.enrich.model import FactsView, PodFacts
from otelgpu.receiver.schema import GPU_RESOURCES, MIG_PREFIX

HAMI_ALLOCATED = ksm_annotation_name("hami.io/vgpu-devices-allocated")
KAI_FRACTION = ksm_annotation_name("gpu-fraction")
KAI_MEMORY = ksm_annotation_name("gpu-memory")
KAI_DEVICES = ksm_annotation_name("gpu-fraction-num-devices")
KAI_RESERVED_GPU = ksm_annotation_name("run.ai/reserve_for_gpu_index")
KAI_GROUP = ksm_label_name("runai-gpu-group")
KAI_GROUP_PREFIX = ksm_label_name("runai-gpu-group/")  # label_runai_gpu_group_<group>
NV_FRACTIONS_PREFIX = ksm_annotation_name("nvidia.com/container.")
NV_MEMORY_REQUEST_SUFFIX = "_gpu_memory_request"  # `.gpu-memory.request`, as kube-state-metrics writes it
RESERVATION_NAMESPACES = frozenset(("kai-resource-reservation", "runai-reservation"))
# The pod keys a join keeps for sharing, whatever the tag rules read (kube-state-metrics needs
# them in --metric-annotations-allowlist and --metric-labels-allowlist; k8s/README lists them),
# and the keys kept by their beginning (per container or per GPU group: the Kubernetes API source
# sees them; kube-state-metrics only with a `*` allowlist).
ANNOTATION_KEYS = frozenset((HAMI_ALLOCATED, KAI_FRACTION, KAI_MEMORY, KAI_DEVICES, KAI_RESERVED_GPU))
LABEL_KEYS = frozenset((KAI_GROUP,))
LABEL_PREFIXES, ANNOTATION_PREFIXES = (KAI_GROUP_PREFIX,), (NV_FRACTIONS_PREFIX,)
KEY_PREFIXES = LABEL_PREFIXES + ANNOTATION_PREFIXES

HAMI, KAI = "hami", "kai"  # Claim.scheduler
_UUID = re.compile(r"^GPU-[0-9A-Za-z-]{1,64}$")
_MODEL_MEMORY = re.compile(r"(\d{1,4})\s*GB", re.IGNORECASE)  # "NVIDIA H100 80GB HBM3", "A100-SXM4-40GB"

PodKey = tuple[str, str]


@dataclass(frozen=True)
class Claim:
    """What one pod was granted of one GPU."""

    pod: PodKey
    node: str
    uuid: str
    scheduler: str  # HAMI or KAI
    compute: Optional[float]  # share of the GPU's compute, 0 < c <= 1; None where not limited
    memory_mib: Optional[float]  # device memory granted; None where not stated

    def fraction(self, total_mib: Optional[float], rule: str) -> tuple[float, str]:
        """(share of the GPU, basis): under `compute` the compute share, else the memory share;
        under `max` the larger of the two that are known. (0, "") when neither can be known."""
        mem = self.memory_mib / total_mib if self.memory_mib is not None and total_mib else None
        mem = min(mem, 1.0) if mem is not None else None
        if self.compute is not None and (mem is None or rule != "max" or self.compute >= mem):
            return self.compute, f"{self.scheduler}_{'fraction' if self.scheduler == KAI else 'cores'}"
        if mem is not None:
            return mem, f"{self.scheduler}_memory"
        return 0.0, ""


@dataclass
class Sharing:
    """The claims of one join's facts, by (node, GPU UUID); the pods that hold through claims
    (they hold no whole unit: their GPU requests are counted in vGPUs or reserve for others);
    and the annotations that could not be used, by reason (pods)."""

    claims: dict[tuple[str, str], list[Claim]] = field(default_factory=dict)
    pods: set[PodKey] = field(default_factory=set)  # claimants and reservation pods
    reservations: set[PodKey] = field(default_factory=set)
    problems: Counter = field(default_factory=Counter)

    def __bool__(self) -> bool:
        return bool(self.pods)

    def nodes(self, scheduler: str) -> set[str]:
        """The nodes with grants of `scheduler` (HAMI or KAI)."""
        return {c.node for claims in self.claims.values() for c in claims if c.scheduler == scheduler}


def hami_devices(text: str) -> list[tuple[str, float, float]]:
    """(UUID, memory MiB, cores %) of each device in a `hami.io/vgpu-devices-allocated` value.
    Newer HAMi releases put the device index first (`0,GPU-...,NVIDIA,...`). ValueError when a
    device entry is malformed."""
    out = []
    for container in text.split(";"):
        for device in container.split(":"):
            if not device.strip():
                continue
            fields = [f.strip() for f in device.split(",")]
            if len(fields) == 5 and fields[0].isdigit():
                fields = fields[1:]
            if len(fields) != 4 or not _UUID.match(fields[0]):
                raise ValueError(f"device entry {device[:80]!r} is not UUID,type,memory,cores")
            memory, cores = float(fields[2]), float(fields[3])
            if not (0 <= memory < 1e7 and 0 <= cores <= 100):
                raise ValueError(f"device entry {device[:80]!r} has memory or cores out of range")
            out.append((fields[0], memory, cores))
    return out


def model_memory_mib(model: str) -> Optional[float]:
    """A GPU's memory from its model name where it says it ("NVIDIA H100 80GB HBM3": 81920)."""
    match = _MODEL_MEMORY.search(model)
    return float(match.group(1)) * 1024 if match and int(match.group(1)) > 0 else None


def _number(text: str) -> Optional[float]:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def sharing_of(facts: FactsView, holds: Callable[[PodKey, PodFacts], bool]) -> Sharing:
    """The grants of the pods that held anything in the interval (`holds`: Running in it, on a
    node). A pod whose grant cannot be used is counted and stays an ordinary pod: its GPU requests
    place it as they would without the grant, so a malformed annotation never makes a pod free."""
    out = Sharing()
    groups: dict[tuple[str, str], str] = {}  # (node, KAI GPU group) -> UUID, from reservation pods
    kai: list[tuple[PodKey, PodFacts]] = []
    for key, pod in facts.pods.items():
        if not holds(key, pod):
            continue
        if key[0] in RESERVATION_NAMESPACES and pod.annotations.get(KAI_RESERVED_GPU):
            _add_reservation(out, groups, key, pod)
        elif pod.annotations.get(HAMI_ALLOCATED):
            _add_hami(out, key, pod)
        elif pod.annotations.get(KAI_FRACTION) or pod.annotations.get(KAI_MEMORY) or _nv_requests(pod):
            kai.append((key, pod))
    for key, pod in kai:  # once every reservation pod's GPU is known
        _add_kai(out, groups, key, pod)
    return out


def _add_reservation(out: Sharing, groups: dict[tuple[str, str], str], key: PodKey, pod: PodFacts) -> None:
    """A KAI reservation pod: it holds its GPU for the fraction pods of its group, and is never
    charged itself."""
    uuid, group = pod.annotations[KAI_RESERVED_GPU].strip(), pod.labels.get(KAI_GROUP, "")
    out.pods.add(key)
    out.reservations.add(key)
    if _UUID.match(uuid) and group:
        groups[(pod.node, group)] = uuid
    else:
        out.problems["reservation without GPU UUID or group"] += 1


def _add_hami(out: Sharing, key: PodKey, pod: PodFacts) -> None:
    hami = pod.annotations[HAMI_ALLOCATED]
    if "[" in hami:  # MIG mode: `GPU-<uuid>[<template>-<index>]`, a MIG instance HAMi made
        out.problems["HAMi MIG-mode grant (priced by its GPU request)"] += 1
        return
    try:
        devices = hami_devices(hami)
    except ValueError:
        out.problems["malformed hami.io/vgpu-devices-allocated"] += 1
        return
    out.pods.add(key)
    for uuid, memory, cores in devices:
        out.claims.setdefault((pod.node, uuid), []).append(
            Claim(key, pod.node, uuid, HAMI, cores / 100 if cores > 0 else None, memory or None))


def _add_kai(out: Sharing, groups: dict[tuple[str, str], str], key: PodKey, pod: PodFacts) -> None:
    if any(r in GPU_RESOURCES or r.startswith(MIG_PREFIX) for _, r in pod.requests):
        # KAI's fraction pods request no GPU: one that does holds what it requests
        out.problems["KAI grant on a pod that requests GPUs"] += 1
        return
    try:
        compute, memory, devices = _kai_request(pod)
    except ValueError:
        out.problems["malformed gpu-fraction, gpu-memory or gpu-fraction-num-devices"] += 1
        return
    named = [g for g in (pod.labels.get(KAI_GROUP, ""), *_kai_groups(pod)) if g]
    uuids = list(dict.fromkeys(found for g in named if (found := groups.get((pod.node, g))) is not None))
    if not uuids:
        out.problems["fraction pod without a reservation pod on its node"] += 1
    elif len(uuids) < devices:
        out.problems["KAI fraction of several GPUs without a reservation pod for each"] += 1
    else:
        out.pods.add(key)
        for uuid in uuids[:devices]:
            out.claims.setdefault((pod.node, uuid), []).append(Claim(key, pod.node, uuid, KAI, compute, memory))


def _nv_requests(pod: PodFacts) -> list[str]:
    """The values of a pod's `nvidia.com/container.<name>.gpu-memory.request` annotations."""
    return [v for k, v in pod.annotations.items() if k.startswith(NV_FRACTIONS_PREFIX)
            and k.endswith(NV_MEMORY_REQUEST_SUFFIX)]


def _kai_groups(pod: PodFacts) -> list[str]:
    """The GPU groups of a fraction of several GPUs: the values of its `runai-gpu-group/<group>` labels."""
    return sorted(v for k, v in pod.labels.items() if k.startswith(KAI_GROUP_PREFIX))


def _kai_request(pod: PodFacts) -> tuple[Optional[float], Optional[float], int]:
    """(share of each GPU, memory MiB of each GPU, number of GPUs) a KAI pod asks for: the
    NvFractions memory request where there is one (KAI prefers it), else `gpu-fraction` or
    `gpu-memory`. ValueError when malformed, or when it asks for nothing."""
    annotations = pod.annotations
    devices = _number(annotations.get(KAI_DEVICES) or "1")
    if devices is None or devices != int(devices) or not 1 <= devices <= 64:
        raise ValueError("gpu-fraction-num-devices")
    nv = _nv_requests(pod)
    if nv:
        if len(nv) != 1:  # KAI refuses requests on several containers
            raise ValueError("NvFractions requests on several containers")
        memory, compute = _mib(nv[0]), None
    else:
        compute = _number(annotations[KAI_FRACTION]) if annotations.get(KAI_FRACTION) else None
        memory = _number(annotations[KAI_MEMORY]) if annotations.get(KAI_MEMORY) else None
    if (compute is not None and not 0 < compute <= 1) or (memory is not None and not 0 < memory < 1e7) \
            or (compute is None and memory is None):
        raise ValueError("fraction or memory out of range")
    return compute, memory, int(devices)


def _mib(quantity: str) -> Optional[float]:
    """A Kubernetes quantity of bytes (`20Gi`, `512Mi`) in MiB; None when it is not one."""
    from kubernetes.utils.quantity import parse_quantity  # here: a sidecar without KAI never loads the client

    try:
        value = float(parse_quantity(quantity.strip())) / 2**20
    except (ValueError, ArithmeticError, TypeError):
        return None
    return value if math.isfinite(value) else None


def release(sharing: Sharing, pods: set[PodKey], reason: str) -> None:
    """Take back every grant of `pods`: they are ordinary pods again, whose GPU requests place them
    as they would without the grants; each is counted once under `reason`."""
    pods = (pods & sharing.pods) - sharing.reservations
    if not pods:
        return
    for key in list(sharing.claims):
        kept = [c for c in sharing.claims[key] if c.pod not in pods]
        if kept:
            sharing.claims[key] = kept
        else:
            del sharing.claims[key]
    sharing.pods -= pods
    sharing.problems[reason] += len(pods)
