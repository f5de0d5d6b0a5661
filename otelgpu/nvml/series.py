"""The series dcgm-exporter would give for a node's entities, named and labelled as it names them
(in Kubernetes, with pod mapping), so that the sidecar reads them as it reads dcgm-exporter's.

Labels, in dcgm-exporter's words: `gpu` (NVML index), `UUID`, `pci_bus_id`, `device`
(`nvidia<minor>`), `modelName`, for a MIG instance `GPU_I_PROFILE` and `GPU_I_ID`, `Hostname` (the
node, as dcgm-exporter takes it from NODE_NAME), `DCGM_FI_DRIVER_VERSION`, and for a held entity
`container`, `namespace`, `pod`, with `vgpu` for a replica of a time-sliced GPU. An entity held by
several containers or replicas gets one copy of each series per holder, as dcgm-exporter does with
KUBERNETES_VIRTUAL_GPUS. Empty values are left out (the Collector drops empty labels, and the
sidecar refuses an empty name).

Only what NVML measures is reported: no DCGM profiling fields (DCGM_FI_PROF_GR_ENGINE_ACTIVE);
activity is DCGM_FI_DEV_GPU_UTIL, which NVML gives for whole GPUs only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from otelgpu.nvml.holders import Holder, Key, key_of
from otelgpu.nvml.reader import Reading, Snapshot

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class MetricSpec:
    name: str
    unit: str
    description: str  # dcgm-exporter's help text
    counter: bool = False


GPU_UTIL = MetricSpec("DCGM_FI_DEV_GPU_UTIL", "%", "GPU utilization (in %).")
FB_USED = MetricSpec("DCGM_FI_DEV_FB_USED", "MiB", "Framebuffer memory used (in MiB).")
FB_FREE = MetricSpec("DCGM_FI_DEV_FB_FREE", "MiB", "Framebuffer memory free (in MiB).")
POWER = MetricSpec("DCGM_FI_DEV_POWER_USAGE", "W", "Power draw (in W).")
ENERGY = MetricSpec("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "mJ",
                    "Total energy consumption since boot (in mJ).", counter=True)
METRICS = (GPU_UTIL, FB_USED, FB_FREE, POWER, ENERGY)


@dataclass(frozen=True)
class Point:
    metric: MetricSpec
    labels: Labels
    value: float


def entity_labels(reading: Reading, node: str, driver: str) -> dict[str, str]:
    labels = {"gpu": str(reading.index), "UUID": reading.uuid, "pci_bus_id": reading.pci_bus_id,
              "device": f"nvidia{reading.minor}" if reading.minor is not None else "", "modelName": reading.model}
    if reading.gi is not None:
        labels.update(GPU_I_PROFILE=reading.profile, GPU_I_ID=str(reading.gi))
    labels.update(Hostname=node, DCGM_FI_DRIVER_VERSION=driver)
    return labels


def holder_labels(holder: Holder) -> dict[str, str]:
    return {"container": holder.container, "namespace": holder.namespace, "pod": holder.pod, "vgpu": holder.vgpu}


def _values(reading: Reading) -> list[tuple[MetricSpec, Optional[float]]]:
    return [(GPU_UTIL, reading.util), (FB_USED, reading.fb_used), (FB_FREE, reading.fb_free), (POWER, reading.power),
            (ENERGY, reading.energy)]


def points(snapshot: Snapshot, node: str, holders: Mapping[Key, Sequence[Holder]]) -> list[Point]:
    """Every series of the snapshot: per entity, one label set per holder (one without a pod if
    nobody holds it), each with the values NVML gave."""
    out: list[Point] = []
    for r in snapshot.readings:
        base = entity_labels(r, node, snapshot.driver)
        label_sets = [{**base, **holder_labels(h)} for h in holders.get(key_of(r), ())] or [base]
        for spec, value in _values(r):
            if value is None:
                continue
            out += [Point(spec, tuple((k, v) for k, v in labels.items() if v), value) for labels in label_sets]
    return out
