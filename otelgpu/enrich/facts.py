"""Pod, namespace and node facts from kube-state-metrics series, latest value wins, and the view
the join reads: those facts merged with the Kubernetes API's (enrich/kube).

Facts are per Kubernetes object (a few per pod), not per GPU sample, so they live in small
dicts keyed by name. A fact not refreshed within `ttl_ns` is forgotten; a deleted pod (its
series went stale) is kept for the same grace so its last interval is still attributed.
Labels and annotations are keyed as kube-state-metrics writes them (`label_team`,
`annotation_example_com_team`), whichever source they came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

import numpy as np

from otelgpu.receiver.decode import PointBatch
from otelgpu.receiver.interner import Interner
from otelgpu.receiver.schema import Metric, is_ksm


@dataclass
class PodFacts:
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

    def requested(self, resource: str) -> float:
        return sum(v for (_, r), v in self.requests.items() if r == resource)


@dataclass
class NodeFacts:
    labels: dict[str, str] = field(default_factory=dict)
    capacity: dict[str, float] = field(default_factory=dict)
    seen_ns: int = 0


@dataclass
class NamespaceFacts:
    labels: dict[str, str] = field(default_factory=dict)
    seen_ns: int = 0


OwnerKey = tuple[str, str, str]  # (namespace, kind, name) of a ReplicaSet, Job or other owner


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
    the API source does not have (not listed yet, forbidden, API unreachable since start)."""
    return FactsView({**ksm.pods, **api.pods}, {**ksm.nodes, **api.nodes},
                     {**ksm.namespaces, **api.namespaces}, {**ksm.owners, **api.owners}, api.previous)


_METRICS = {int(m): m for m in Metric}


class KsmFacts:
    def __init__(self, strings: Interner, ttl_ns: int) -> None:
        self._s = strings
        self.ttl_ns = ttl_ns
        self.pods: dict[tuple[str, str], PodFacts] = {}
        self.namespaces: dict[str, NamespaceFacts] = {}
        self.nodes: dict[str, NodeFacts] = {}
        self.owners: dict[OwnerKey, OwnerFacts] = {}

    def update(self, batch: PointBatch) -> int:
        """Apply the kube-state-metrics rows of `batch`; returns how many rows were used."""
        rows = np.flatnonzero(is_ksm(batch.metric))
        s = self._s.strings()
        off = batch.attr_off.tolist()  # plain lists: one row's labels without a numpy scalar per label
        keys, values = batch.attr_key.tolist(), batch.attr_val.tolist()
        metric, value, stale, t = (c[rows].tolist() for c in (batch.metric, batch.value, batch.stale, batch.time_ns))
        for i, row in enumerate(rows.tolist()):
            lo, hi = off[row], off[row + 1]
            self._apply(_METRICS[metric[i]], {s[k]: s[v] for k, v in zip(keys[lo:hi], values[lo:hi])},
                        value[i], stale[i], t[i])
        return len(rows)

    def _apply(self, metric: Metric, attrs: dict[str, str], value: float, stale: bool, t: int) -> None:
        if metric in (Metric.NODE_LABELS, Metric.NODE_CAPACITY):
            node = self.nodes.setdefault(attrs["node"], NodeFacts())
            if stale or t < node.seen_ns:
                return
            node.seen_ns = t
            if metric == Metric.NODE_LABELS:
                node.labels = {k: v for k, v in attrs.items() if k.startswith("label_")}
            else:
                node.capacity[attrs["resource"]] = value
            return
        if metric in (Metric.REPLICASET_OWNER, Metric.JOB_OWNER):
            name = attrs["replicaset"] if metric == Metric.REPLICASET_OWNER else attrs["job_name"]
            owner = attrs["owner_kind"] if attrs["owner_kind"] != "<none>" else ""  # "<none>": known to have none
            kind = "ReplicaSet" if metric == Metric.REPLICASET_OWNER else "Job"
            known = self.owners.get((attrs["namespace"], kind, name))
            if not stale and (known is None or t >= known.seen_ns) \
                    and (not owner or attrs.get("owner_is_controller", "true") == "true"):
                self.owners[(attrs["namespace"], kind, name)] = OwnerFacts(owner, attrs["owner_name"] if owner else "", t)
            return
        if metric == Metric.NAMESPACE_LABELS:
            ns = self.namespaces.setdefault(attrs["namespace"], NamespaceFacts())
            if not stale and t >= ns.seen_ns:
                ns.seen_ns = t
                ns.labels = {k: v for k, v in attrs.items() if k.startswith("label_")}
            return
        key = (attrs["namespace"], attrs["pod"])
        pod = self.pods.get(key)
        if pod is None:
            if stale:
                return
            pod = self.pods[key] = PodFacts()
        if stale or t < pod.seen_ns:
            return  # going away (keep its facts for the grace period), or older than what is known
        pod.seen_ns = t
        pod.uid = attrs.get("uid", pod.uid)
        if metric == Metric.POD_LABELS:
            pod.labels = {k: v for k, v in attrs.items() if k.startswith("label_")}
        elif metric == Metric.POD_ANNOTATIONS:
            pod.annotations = {k: v for k, v in attrs.items() if k.startswith("annotation_")}
        elif metric == Metric.POD_INFO:
            pod.node = attrs.get("node", "")
            pod.owner_kind = attrs.get("created_by_kind", "")
            pod.owner_name = attrs.get("created_by_name", "")
        elif metric == Metric.POD_PHASE:
            if value == 1.0:
                pod.phase = attrs["phase"]
        elif metric == Metric.POD_REQUESTS:
            pod.requests[(attrs.get("container", ""), attrs["resource"])] = value
            pod.node = pod.node or attrs.get("node", "")

    def expire(self, now_ns: int) -> None:
        """Forget facts older than the grace period."""
        cutoff = now_ns - self.ttl_ns
        for table in (self.pods, self.namespaces, self.nodes, self.owners):
            for key in [k for k, v in table.items() if v.seen_ns < cutoff]:
                del table[key]

    def view(self, as_of_ns: int | None = None) -> FactsView:
        """The facts applied so far; the pipeline applies each interval's rows at its close, so
        they are the facts as of the interval's end already."""
        return FactsView(self.pods, self.nodes, self.namespaces, self.owners)

    # Checkpoint state: a restart continues with these facts instead of waiting for every object
    # to be scraped again (the log is replayed only from the oldest open interval).

    def state(self) -> dict[str, Any]:
        return {"pods": [[ns, name, _plain(p)] for (ns, name), p in self.pods.items()],
                "nodes": [[name, _plain(n)] for name, n in self.nodes.items()],
                "namespaces": [[name, _plain(n)] for name, n in self.namespaces.items()],
                "owners": [[list(k), _plain(o)] for k, o in self.owners.items()]}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Raises KeyError, TypeError or ValueError on a malformed state (nothing is changed then)."""
        pods = {(str(ns), str(name)): _pod(d) for ns, name, d in state["pods"]}
        nodes = {str(name): NodeFacts(dict(d["labels"]), {str(k): float(v) for k, v in d["capacity"].items()},
                                      int(d["seen_ns"])) for name, d in state["nodes"]}
        namespaces = {str(name): NamespaceFacts(dict(d["labels"]), int(d["seen_ns"])) for name, d in state["namespaces"]}
        owners = {(str(k[0]), str(k[1]), str(k[2])): OwnerFacts(str(d["kind"]), str(d["name"]), int(d["seen_ns"]))
                  for k, d in state["owners"]}
        self.pods, self.nodes, self.namespaces, self.owners = pods, nodes, namespaces, owners


def _plain(obj: Any) -> dict[str, Any]:
    d = dict(obj.__dict__)
    if "requests" in d:
        d["requests"] = [[c, r, q] for (c, r), q in d["requests"].items()]
    return d


def _pod(d: Mapping[str, Any]) -> PodFacts:
    fields = dict(d)
    fields["requests"] = {(str(c), str(r)): float(q) for c, r, q in d["requests"]}
    pod = PodFacts(**fields)
    if not isinstance(pod.labels, dict) or not isinstance(pod.annotations, dict):
        raise TypeError("pod labels and annotations must be mappings")
    return pod


class FactSource(Protocol):
    def view(self, as_of_ns: int | None = None) -> FactsView: ...


class MergedFacts:
    """kube-state-metrics facts and the Kubernetes API's, merged per object at each view (see merge)."""

    def __init__(self, ksm: KsmFacts, api: FactSource) -> None:
        self.ksm, self.api = ksm, api

    def view(self, as_of_ns: int | None = None) -> FactsView:
        return merge(self.ksm.view(as_of_ns), self.api.view(as_of_ns))
