"""What a point must satisfy to be used: timestamps near the receive clock, bounded labels, sane
values; and which label keys otelgpu reads at all (the others are never interned)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

from otelgpu.receiver.config import ReceiverConfig, SourcesConfig
from otelgpu.receiver.schema import VALUE_RANGE, Metric, quantity_problem
from otelgpu.receiver.sources import SourceTrust

NS = 1_000_000_000

# Labels read from the series otelgpu consumes (docs/pipeline.md and docs/cost-model.md section 5).
DCGM_KEYS = ("UUID", "GPU_I_ID", "GPU_I_PROFILE", "modelName", "Hostname", "hostname", "namespace", "pod",
             "container", "exported_namespace", "exported_pod", "exported_container", "pod_uid", "vgpu")
KSM_KEYS = ("namespace", "pod", "uid", "node", "phase", "resource", "container", "created_by_kind",
            "created_by_name", "replicaset", "job_name", "owner_kind", "owner_name", "owner_is_controller")
CADVISOR_KEYS = ("namespace", "pod", "container", "id")
VLLM_KEYS = ("model_name", "engine")  # and the tenant labels configured (`tenants.labels`)
# Names of things: a point may lack them, but one that carries them empty names nothing.
IDENTITY_KEYS = frozenset(DCGM_KEYS + KSM_KEYS + CADVISOR_KEYS + VLLM_KEYS)
FACT_KEYS = ("provider_id",)  # kube_node_info's: empty on a cluster with no cloud provider


@dataclass(frozen=True)
class Limits:
    max_age_ns: int = 0  # 0: no age limit
    max_future_ns: int = 120 * NS
    max_label_bytes: int = 4096
    max_attributes: int = 512
    wanted: Optional[frozenset[str]] = None  # label keys kept; None keeps every key
    trust: Optional[SourceTrust] = None  # which targets may send which kinds; None: any (`sources`)
    wanted_prefixes: tuple[str, ...] = ()  # label keys kept as well, by their beginning

    @classmethod
    def of(cls, config: ReceiverConfig, wanted: Optional[frozenset[str]] = None,
           sources: Optional[SourcesConfig] = None, prefixes: tuple[str, ...] = ()) -> "Limits":
        return cls(config.max_point_age_seconds * NS, config.max_future_seconds * NS, config.max_label_value_bytes,
                   config.max_attributes_per_point, wanted, SourceTrust(sources) if sources is not None else None,
                   prefixes)


def wanted_keys(fact_labels: Iterable[str]) -> frozenset[str]:
    """The fixed keys plus the kube-state-metrics `label_*` / `annotation_*` keys that tags, node
    pricing and workloads read (`fact_labels`)."""
    return IDENTITY_KEYS | frozenset(FACT_KEYS) | frozenset(fact_labels)


def value_problem(metric: int, value: float, resource: str = "") -> tuple[str, str]:
    """Why a point's value cannot be used, as (reason code, sentence); ("", "") when it can.
    `resource` is the point's `resource` label (requests and capacities)."""
    if math.isnan(value):
        return "no_value", "point without a value"
    if not math.isfinite(value):
        return "non_finite", "non-finite value"
    lo, hi = VALUE_RANGE.get(Metric(metric), (-math.inf, math.inf))
    if not lo <= value <= hi:
        return "out_of_range", f"value outside [{lo:g}, {hi:g}]"
    if metric in (Metric.POD_REQUESTS, Metric.NODE_CAPACITY):
        problem = quantity_problem(resource, value)
        if problem:
            return "bad_quantity", problem
    return "", ""
