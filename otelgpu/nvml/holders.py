"""Who holds each entity: the kubelet's device assignments joined to NVML's entities, as
dcgm-exporter's pod mapper joins them.

Device ids as the device plugins name them:
- `GPU-<uuid>`: a whole GPU; `GPU-<uuid>::<n>`: replica n of a time-sliced (or MPS) GPU;
- `MIG-<uuid>`: a MIG device, found among the entities' MIG devices (its GPU instance);
  `MIG-GPU-<uuid>/<gi>/<ci>`: the same in the form of drivers before R470;
- `nvidia<minor>`, `nvidia<minor>/gi<id>`, with `/vgpu<n>` for a replica: GKE's device plugin.
An id that names nothing NVML shows (a GPU of another node, a stale id) places nobody.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Optional

from otelgpu.nvml.podresources import Allocation
from otelgpu.nvml.reader import Reading

Key = tuple[str, Optional[int]]  # (GPU uuid, GPU instance id or None)

_LEGACY_MIG = re.compile(r"MIG-(GPU-[0-9a-fA-F-]+)/(\d+)/(\d+)\Z")
_GKE = re.compile(r"nvidia(\d+)(?:/gi(\d+))?(?:/vgpu(\d+))?\Z")
# Extended resources of NVIDIA's device plugins: nvidia.com/gpu, nvidia.com/gpu.shared (renamed
# time-slicing), nvidia.com/mig-1g.10gb, ...
RESOURCE_PREFIX = "nvidia.com/"


@dataclass(frozen=True, order=True)
class Holder:
    """A container holding an entity; `vgpu` is the replica it holds of a shared GPU."""

    namespace: str
    pod: str
    container: str = ""
    vgpu: str = ""


def key_of(reading: Reading) -> Key:
    return reading.uuid, reading.gi


class DeviceIndex:
    """The entities' keys by every name a device plugin may give them."""

    def __init__(self, readings: Iterable[Reading]) -> None:
        self._mig: dict[str, Key] = {}
        self._minor: dict[int, str] = {}
        self._keys: set[Key] = set()
        for r in readings:
            self._keys.add(key_of(r))
            self._mig.update((u, key_of(r)) for u in r.mig_uuids)
            if r.minor is not None:
                self._minor[r.minor] = r.uuid

    def resolve(self, device_id: str) -> tuple[Optional[Key], str]:
        """(the entity `device_id` names, or None; the replica it names, "" if none)."""
        base, sep, replica = device_id.partition("::")
        vgpu = replica if sep else ""
        if base.startswith("GPU-"):
            return self._known((base, None)), vgpu
        if base.startswith("MIG-"):
            return self._mig_key(base), vgpu
        gke = _GKE.match(base)
        if gke and int(gke.group(1)) in self._minor:
            uuid = self._minor[int(gke.group(1))]
            gi = int(gke.group(2)) if gke.group(2) is not None else None
            return self._known((uuid, gi)), gke.group(3) or vgpu
        return None, vgpu

    def _mig_key(self, device_id: str) -> Optional[Key]:
        if device_id in self._mig:
            return self._mig[device_id]
        legacy = _LEGACY_MIG.match(device_id)
        if legacy:
            return self._known((legacy.group(1), int(legacy.group(2))))
        return self._known((device_id[len("MIG-"):], None))  # MIG-GPU-<uuid>: the GPU, as dcgm-exporter reads it

    def _known(self, key: Key) -> Optional[Key]:
        return key if key in self._keys else None


def holders_by_key(allocated: Iterable[Allocation], readings: Iterable[Reading]) -> dict[Key, list[Holder]]:
    """Each entity's holders, sorted, each (container, replica) once."""
    index = DeviceIndex(readings)
    out: dict[Key, set[Holder]] = defaultdict(set)
    for a in allocated:
        if not a.resource.startswith(RESOURCE_PREFIX):
            continue
        key, vgpu = index.resolve(a.device_id)
        if key is not None:
            out[key].add(Holder(a.namespace, a.pod, a.container, vgpu))
    return {k: sorted(v) for k, v in out.items()}
