"""Label names as kube-state-metrics writes them, and the five tags resolved from them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

from otelgpu.config import TAG_NAMES, TagRule, TagValuesConfig
from otelgpu.telemetry import SelfMetrics

_INVALID = re.compile(r"[^a-zA-Z0-9_]")
_CAMEL = re.compile(r"([a-z0-9])([A-Z])")
_SPACES = re.compile(r"\s+")


@lru_cache(maxsize=4096)
def ksm_label_name(kubernetes_key: str) -> str:
    """`eks.amazonaws.com/capacityType` -> `label_eks_amazonaws_com_capacity_type`.

    kube-state-metrics sanitizes `[^a-zA-Z0-9_]` to `_`, then snake-cases camelCase, then prefixes
    `label_` (internal/store/utils.go, kubeMapToPrometheusLabels).
    """
    return "label_" + _CAMEL.sub(r"\1_\2", _INVALID.sub("_", kubernetes_key)).lower()


def ksm_resource_name(kubernetes_name: str) -> str:
    """`nvidia.com/mig-1g.10gb` -> `nvidia_com_mig_1g_10gb`, the `resource` label of kube-state-metrics."""
    return _INVALID.sub("_", kubernetes_name)


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


# Node labels otelgpu reads: the API source keeps only these. Their Kubernetes keys are what
# kube-state-metrics' --metric-labels-allowlist must name for nodes (k8s/README.md).
NODE_LABEL_KEYS = ("node.kubernetes.io/instance-type", "beta.kubernetes.io/instance-type",
                   "eks.amazonaws.com/capacityType", "karpenter.sh/capacity-type", "nvidia.com/gpu.product",
                   "nvidia.com/gpu.replicas", "nvidia.com/gpu.count", "nvidia.com/gpu.sharing-strategy",
                   "nvidia.com/mig.strategy")
NODE_LABELS = frozenset(map(ksm_label_name, NODE_LABEL_KEYS))
POD_TEMPLATE_HASH = ksm_label_name("pod-template-hash")


@lru_cache(maxsize=4096)
def ksm_annotation_name(kubernetes_key: str) -> str:
    """`example.com/team` -> `annotation_example_com_team`, as kube_pod_annotations writes it."""
    return "annotation_" + ksm_label_name(kubernetes_key)[len("label_"):]


@dataclass(frozen=True)
class Tags:
    values: tuple[str, str, str, str, str]  # in TAG_NAMES order
    from_labels: tuple[bool, bool, bool, bool, bool]  # False where the default was used

    @property
    def complete(self) -> bool:
        return all(self.from_labels)


class TagValues:
    """Normalises tag values and caps their length and distinct count per tag; counts each value
    capped once (per distinct raw value while it is remembered)."""

    def __init__(self, config: TagValuesConfig, metrics: SelfMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self._distinct: dict[str, set[str]] = {t: set() for t in TAG_NAMES}
        self._memo: dict[tuple[str, str], str] = {}

    def __call__(self, tag: str, raw: str) -> str:
        key = (tag, raw)
        value = self._memo.get(key)
        if value is None:
            value = self._normalise(tag, raw)
            if len(self._memo) >= 4 * self.config.max_distinct * len(TAG_NAMES):
                self._memo.clear()  # bounded; a value seen again is recounted at most once more
            self._memo[key] = value
        return value

    def _normalise(self, tag: str, raw: str) -> str:
        c = self.config
        value = _SPACES.sub(c.whitespace, raw.strip())
        value = value.lower() if c.case == "lower" else value.upper() if c.case == "upper" else value
        if len(value) > c.max_length:
            value = value[: c.max_length]
            self._count(tag, "length")
        seen = self._distinct[tag]
        if value not in seen:
            if len(seen) >= c.max_distinct:
                self._count(tag, "distinct")
                return c.overflow_value
            seen.add(value)
        return value

    def _count(self, tag: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.count("tag_values_capped", (tag, reason))

    def state(self) -> dict[str, list[str]]:
        """The distinct values admitted per tag: a restart keeps mapping the same values to the
        overflow value."""
        return {tag: sorted(seen) for tag, seen in self._distinct.items()}

    def restore(self, state: dict[str, list[str]]) -> None:
        for tag, values in state.items():
            if tag in self._distinct:
                self._distinct[tag] = set(map(str, values[: self.config.max_distinct]))
        self._memo.clear()


class TagResolver:
    """For each tag: the pod's label keys in order, then the namespace's, then the pod's
    annotations, then the default. Found values are normalised and capped by `values`."""

    def __init__(self, rules: Mapping[str, TagRule], values: TagValues | None = None) -> None:
        self._rules = [
            (tuple(ksm_label_name(k) for k in rules[t].pod_labels),
             tuple(ksm_label_name(k) for k in rules[t].namespace_labels),
             tuple(ksm_annotation_name(k) for k in rules[t].annotations),
             rules[t].default)
            for t in TAG_NAMES
        ]
        self.values = values or TagValues(TagValuesConfig())
        self.pod_label_keys = frozenset(k for r in self._rules for k in r[0]) | {POD_TEMPLATE_HASH}
        self.namespace_label_keys = frozenset(k for r in self._rules for k in r[1])
        self.annotation_keys = frozenset(k for r in self._rules for k in r[2])

    def resolve(self, pod_labels: Mapping[str, str], namespace_labels: Mapping[str, str],
                annotations: Mapping[str, str] | None = None) -> Tags:
        values: list[str] = []
        found: list[bool] = []
        for tag, (pod_keys, ns_keys, ann_keys, default) in zip(TAG_NAMES, self._rules):
            value = next((pod_labels[k] for k in pod_keys if pod_labels.get(k, "").strip()), None)
            if value is None:
                value = next((namespace_labels[k] for k in ns_keys if namespace_labels.get(k, "").strip()), None)
            if value is None and annotations:
                value = next((annotations[k] for k in ann_keys if annotations.get(k, "").strip()), None)
            found.append(value is not None)
            values.append(self.values(tag, value) if value is not None else default)
        return Tags(tuple(values), tuple(found))  # type: ignore[arg-type]
