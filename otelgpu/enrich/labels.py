"""Label names as kube-state-metrics writes them, and the five tags resolved from them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

from otelgpu.config import TAG_NAMES, TagRule

_INVALID = re.compile(r"[^a-zA-Z0-9_]")
_CAMEL = re.compile(r"([a-z0-9])([A-Z])")


@lru_cache(maxsize=4096)
def ksm_label_name(kubernetes_key: str) -> str:
    """`eks.amazonaws.com/capacityType` -> `label_eks_amazonaws_com_capacity_type`.

    kube-state-metrics sanitizes `[^a-zA-Z0-9_]` to `_`, then snake-cases camelCase, then prefixes
    `label_` (internal/store/utils.go, kubeMapToPrometheusLabels).
    """
    return "label_" + _CAMEL.sub(r"\1_\2", _INVALID.sub("_", kubernetes_key)).lower()


# Node labels otelgpu reads, in kube-state-metrics form.
INSTANCE_TYPE = ksm_label_name("node.kubernetes.io/instance-type")
INSTANCE_TYPE_BETA = ksm_label_name("beta.kubernetes.io/instance-type")
EKS_CAPACITY_TYPE = ksm_label_name("eks.amazonaws.com/capacityType")
KARPENTER_CAPACITY_TYPE = ksm_label_name("karpenter.sh/capacity-type")
GPU_PRODUCT = ksm_label_name("nvidia.com/gpu.product")
GPU_REPLICAS = ksm_label_name("nvidia.com/gpu.replicas")
GPU_COUNT = ksm_label_name("nvidia.com/gpu.count")
GPU_SHARING = ksm_label_name("nvidia.com/gpu.sharing-strategy")
MIG_STRATEGY = ksm_label_name("nvidia.com/mig.strategy")


@dataclass(frozen=True)
class Tags:
    values: tuple[str, str, str, str, str]  # in TAG_NAMES order
    from_labels: tuple[bool, bool, bool, bool, bool]  # False where the default was used

    @property
    def complete(self) -> bool:
        return all(self.from_labels)


class TagResolver:
    """For each tag: the pod's label keys in order, then the namespace's, then the default."""

    def __init__(self, rules: Mapping[str, TagRule]) -> None:
        self._rules = [
            (tuple(ksm_label_name(k) for k in rules[t].pod_labels),
             tuple(ksm_label_name(k) for k in rules[t].namespace_labels),
             rules[t].default)
            for t in TAG_NAMES
        ]

    def resolve(self, pod_labels: Mapping[str, str], namespace_labels: Mapping[str, str]) -> Tags:
        values: list[str] = []
        found: list[bool] = []
        for pod_keys, ns_keys, default in self._rules:
            value = next((pod_labels[k] for k in pod_keys if pod_labels.get(k)), None)
            if value is None:
                value = next((namespace_labels[k] for k in ns_keys if namespace_labels.get(k)), None)
            found.append(value is not None)
            values.append(value if value is not None else default)
        return Tags(tuple(values), tuple(found))  # type: ignore[arg-type]
