"""The facts the join reads about Kubernetes objects (pods, nodes, namespaces, owners, DRA claims
and devices), whichever source they come from: kube-state-metrics' series (enrich/facts.py) or the
Kubernetes API (enrich/kube). `FactsView` is one interval's; `merge` puts the two sources' views
together."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Mapping, Protocol

from otelgpu.core.attrs import Shared


@dataclass(slots=True)  # no dict per pod: 76,000 pods and their copies while an interval is computed ahead
class PodFacts:
    """A pod's maps (labels, requests, annotations) may be shared with other pods (`shared_map`):
    replace them, never change them in place."""

    uid: str = ""
    node: str = ""
    phase: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    requests: dict[tuple[str, str], float] = field(default_factory=dict)  # (container, resource) -> qty
    owner_kind: str = ""  # the controlling owner reference
    owner_name: str = ""
    seen_ns: int = 0
    annotations: dict[str, str] = field(default_factory=dict)
    deleted: bool = False  # gone from the API, kept for the grace period: holds nothing new
    created_ns: int = 0  # metadata.creationTimestamp (API facts only)
    info_node: str = ""  # kube-state-metrics: the node kube_pod_info names, and
    request_node: str = ""  # the one its resource requests name; `node` is the first, else the second
    ended_ns: int = 0  # kube-state-metrics: when its series ended with staleness markers (0: reported)

    def requested(self, resource: str) -> float:
        return sum(v for (_, r), v in self.requests.items() if r == resource)

    def request(self, container: str, resource: str, quantity: float) -> None:
        """Set a container's request of a resource. The dict is replaced, never changed in place,
        and only when the quantity differs: a copy of the pod (`KsmFacts.mark`) shares it. Pods of
        one workload name the same containers, resources and quantities: the key and a positive
        quantity are shared objects (`shared`)."""
        key = shared((container, resource))
        known = self.requests.get(key)
        if known is None or not same_number(known, quantity):
            self.requests = shared_map({**self.requests, key: shared(quantity) if quantity > 0 else quantity})


def same_number(known: float, new: float) -> bool:
    """The same number, the sign of a zero included (NaN is never the same)."""
    return known == new and (known != 0 or math.copysign(1.0, known) == math.copysign(1.0, new))


# Each (container, resource) key and positive quantity once, whatever the pods that repeat it (a
# positive float equal to another has its bits).
shared = Shared(65_536)
_maps = Shared(65_536)


def shared_map(items: dict) -> dict:
    """`items`, or a map of equal items in the same order met before: the pods of a workload share
    one dict of labels, of annotations and of requests (76,000 pods: some 33 MiB fewer). A pod's
    maps are therefore replaced, never changed in place. Only strings and positive numbers are
    taken as equal to what they equal (-0.0 equals 0.0, and a request keeps its zero's sign)."""
    if not all(type(v) is str or (type(v) is float and v > 0) for v in items.values()):
        return items
    return _maps.by(tuple(items.items()), items)


@dataclass(slots=True)  # no dict per node: 17,647 nodes at 100,000 GPUs, and a mark's copies of them
class NodeFacts:
    labels: dict[str, str] = field(default_factory=dict)
    capacity: dict[str, float] = field(default_factory=dict)
    seen_ns: int = 0
    provider_id: str = ""  # the cloud's id of the machine (`aws:///us-east-1a/i-0abc...`)


@dataclass(slots=True)
class NamespaceFacts:
    labels: dict[str, str] = field(default_factory=dict)
    seen_ns: int = 0


OwnerKey = tuple[str, str, str]  # (namespace, kind, name) of a ReplicaSet, Job or other owner
DeviceKey = tuple[str, str, str]  # (driver, pool, device) of a DRA device


@dataclass
class ClaimFacts:
    """A DRA ResourceClaim: the devices allocated to it and the pods (of its namespace) it is
    reserved for, which use it."""

    devices: tuple[DeviceKey, ...] = ()
    pods: tuple[str, ...] = ()
    seen_ns: int = 0


@dataclass(frozen=True)
class DraDevice:
    """A GPU or MIG device a DRA driver publishes: its NVML UUID, and for a MIG device the UUID
    of its GPU and its profile."""

    uuid: str
    parent_uuid: str = ""
    profile: str = ""


@dataclass
class SliceFacts:
    """A DRA ResourceSlice: the GPU devices of one node's pool."""

    node: str = ""
    devices: dict[DeviceKey, DraDevice] = field(default_factory=dict)
    seen_ns: int = 0


@dataclass
class OwnerFacts:
    kind: str  # the owner's own controlling owner ("" when it has none)
    name: str
    seen_ns: int = 0


@dataclass
class FactsView:
    """What the join reads for one interval."""

    pods: Mapping[tuple[str, str], PodFacts]
    nodes: Mapping[str, NodeFacts]
    namespaces: Mapping[str, NamespaceFacts]
    owners: Mapping[OwnerKey, OwnerFacts]
    previous: Mapping[tuple[str, str], PodFacts] = field(default_factory=dict)  # replaced under the same name
    claims: Mapping[tuple[str, str], ClaimFacts] = field(default_factory=dict)  # DRA, (namespace, name)
    slices: Mapping[str, SliceFacts] = field(default_factory=dict)  # DRA, by ResourceSlice name
    ksm_reported_ns: int = 0  # the newest pod row kube-state-metrics reported (0: none)

    def pod(self, key: tuple[str, str], start_ns: int = 0) -> PodFacts | None:
        """The pod of that name alive at `start_ns`: a pod deleted and recreated under the same
        name keeps its own facts for the intervals it began in."""
        pod = self.pods.get(key)
        if pod is not None and start_ns and pod.created_ns > start_ns:
            return self.previous.get(key, pod)
        return pod

    def namespace_labels(self, namespace: str) -> dict[str, str]:
        ns = self.namespaces.get(namespace)
        return ns.labels if ns else {}


def merge(ksm: FactsView, api: FactsView) -> FactsView:
    """The Kubernetes API wins for every object it has (its labels are complete, where
    kube-state-metrics carries only allowlisted keys); kube-state-metrics facts serve the objects
    the API source does not have (not listed yet, forbidden, API unreachable since start). A pod's
    end in kube-state-metrics (its staleness markers) holds for the API's pod of the same uid too:
    the API may learn of the deletion late, or forget the pod after its grace while
    kube-state-metrics' facts of it are still kept."""
    pods = {**ksm.pods, **api.pods}
    for key, pod in ksm.pods.items():
        if pod.ended_ns and (listed := api.pods.get(key)) is not None and listed.uid in ("", pod.uid):
            pods[key] = dataclasses.replace(listed, ended_ns=pod.ended_ns)
    return FactsView(pods, {**ksm.nodes, **api.nodes},
                     {**ksm.namespaces, **api.namespaces}, {**ksm.owners, **api.owners}, api.previous,
                     api.claims, api.slices, ksm.ksm_reported_ns)


class FactSource(Protocol):
    def view(self, as_of_ns: int | None = None) -> FactsView: ...
