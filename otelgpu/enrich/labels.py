"""Label names as kube-state-metrics writes them, and the five tags resolved from them."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Mapping

from otelgpu.core.settings import TAG_NAMES
from otelgpu.enrich.config import TagRule, TagValuesConfig
from otelgpu.telemetry import SelfMetrics, TagCap, TagTelemetry

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
    """Normalises tag values, cuts them to `max_length`, and bounds the distinct values of each tag.

    A tag holds at most `max_distinct` values, and one namespace at most `max_distinct_per_namespace`
    of them: a namespace that mints a value per pod (a cardinality bomb, a label with a build id)
    fills its own share and overflows to `overflow_value`, and cannot push the values of other
    namespaces out. A value a namespace has not used for `release_after` closed intervals (its pods
    are gone) gives its place back, so the sets follow the cluster instead of its whole history.
    Each capped value is counted once while it is remembered."""

    key = "tag_values"  # its checkpoint entry (core/state.py)

    def __init__(self, config: TagValuesConfig, metrics: SelfMetrics | None = None, release_after: int = 10) -> None:
        self.config = config
        self.telemetry = TagTelemetry(metrics) if metrics is not None else None
        self.release_after = release_after
        self.per_namespace = config.max_distinct_per_namespace or max(config.max_distinct // 4, 1)
        self.generation = 0  # closed intervals seen
        self._uses: dict[str, dict[str, dict[str, int]]] = {t: {} for t in TAG_NAMES}  # value -> namespace -> generation
        self._held: Counter[tuple[str, str]] = Counter()  # (tag, namespace) -> values it holds
        self._normal: dict[tuple[str, str], str] = {}
        self._capped: set[tuple[str, str, str]] = set()

    def __call__(self, tag: str, raw: str, namespace: str = "") -> str:
        value = self._normal.get((tag, raw))
        if value is None:
            value = self._normalise(tag, raw)
            if len(self._normal) >= 4 * self.config.max_distinct * len(TAG_NAMES):
                self._normal.clear()  # bounded; a value cut again is recounted at most once more
            self._normal[(tag, raw)] = value
        uses = self._uses[tag]
        users = uses.get(value)
        if users is not None and namespace in users:
            users[namespace] = self.generation
            return value
        tag_full = users is None and len(uses) >= self.config.max_distinct
        if tag_full or self._held[(tag, namespace)] >= self.per_namespace:
            if (tag, namespace, value) not in self._capped:
                if len(self._capped) >= 4 * self.config.max_distinct * len(TAG_NAMES):
                    self._capped.clear()
                self._capped.add((tag, namespace, value))
                self._count(tag, TagCap.DISTINCT)
            return self.config.overflow_value
        uses.setdefault(value, {})[namespace] = self.generation
        self._held[(tag, namespace)] += 1
        return value

    def _normalise(self, tag: str, raw: str) -> str:
        config = self.config
        value = _SPACES.sub(config.whitespace, raw.strip())
        value = value.lower() if config.case == "lower" else value.upper() if config.case == "upper" else value
        if len(value) > config.max_length:
            value = value[: config.max_length]
            self._count(tag, TagCap.LENGTH)
        return value

    def _count(self, tag: str, reason: TagCap) -> None:
        if self.telemetry is not None:
            self.telemetry.capped(tag, reason)

    def expire(self, end_ns: int = 0) -> None:
        """One interval closed: release what no namespace used in the last `release_after`."""
        self.generation += 1
        oldest = self.generation - self.release_after
        for tag, uses in self._uses.items():
            for value in list(uses):
                users = uses[value]
                for namespace in [n for n, g in users.items() if g < oldest]:
                    del users[namespace]
                    self._held[(tag, namespace)] -= 1
                    if not self._held[(tag, namespace)]:
                        del self._held[(tag, namespace)]
                if not users:
                    del uses[value]
        self._capped.clear()  # places may have come free: a value capped again is counted again

    def mark(self) -> Callable[[], None]:
        """What puts the admitted values back as they are now (resolving tags admits and touches)."""
        uses = {t: {v: dict(users) for v, users in values.items()} for t, values in self._uses.items()}
        held, capped, normal, generation = Counter(self._held), set(self._capped), dict(self._normal), self.generation

        def undo() -> None:
            self._uses, self._held, self._capped, self._normal, self.generation = uses, held, capped, normal, generation

        return undo

    def state(self) -> dict:
        """The values admitted per tag, with who used them when: a restart maps the same values
        to the overflow value and releases them on the same interval."""
        return {"generation": self.generation, "uses": self._uses}

    def restore(self, state: dict | None) -> None:
        state = state or {}
        if "uses" not in state:  # an older checkpoint: {tag: [values]}, used now
            state = {"generation": 0, "uses": {t: {str(v): {"": 0} for v in values} for t, values in state.items()}}
        self.generation = int(state.get("generation", 0))
        self._uses = {t: {} for t in TAG_NAMES}
        self._held.clear()
        for tag, uses in state["uses"].items():
            if tag not in self._uses:
                continue
            for value, users in list(uses.items())[: self.config.max_distinct]:
                self._uses[tag][str(value)] = {str(n): int(g) for n, g in users.items()}
                for namespace in users:
                    self._held[(tag, str(namespace))] += 1
        self._normal.clear()
        self._capped.clear()


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
                annotations: Mapping[str, str] | None = None, namespace: str = "") -> Tags:
        """The tags of a pod in `namespace` (whose share of each tag's values they count against)."""
        values: list[str] = []
        found: list[bool] = []
        for tag, (pod_keys, ns_keys, ann_keys, default) in zip(TAG_NAMES, self._rules):
            value = _first(pod_labels, pod_keys)
            if value is None:
                value = _first(namespace_labels, ns_keys)
            if value is None and annotations:
                value = _first(annotations, ann_keys)
            found.append(value is not None)
            values.append(self.values(tag, value, namespace) if value is not None else default)
        return Tags(tuple(values), tuple(found))  # type: ignore[arg-type]


def _first(mapping: Mapping[str, str], keys: tuple[str, ...]) -> str | None:
    """The value of the first of `keys` that `mapping` holds with more than whitespace."""
    for k in keys:
        value = mapping.get(k)
        if value and value.strip():
            return value
    return None
