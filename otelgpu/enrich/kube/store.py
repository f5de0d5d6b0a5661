"""The facts the Kubernetes API watches write and the join reads, with their recent history.

A change observed by a watch, or found by a relist, is a new version effective from when it was
observed (the injectable clock), so `view(as_of_ns)` gives the facts an interval ending at `as_of_ns`
must use, not the ones that arrived while it waited out its lateness. An object's first version is
effective from its creation (`metadata.creationTimestamp`; from the beginning of time when that is
unknown), so a pod that existed before otelgpu started, or before a relist found it, is not missing
from earlier intervals. Deletion is a change too. An event that changes nothing otelgpu keeps (a
status heartbeat) adds no version. Deleted pods stay for `grace_s`, marked deleted.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Iterable, Optional, TypeVar

from otelgpu.enrich import sharing
from otelgpu.enrich.kube import objects
from otelgpu.enrich.kube.history import Timeline
from otelgpu.enrich.kube.reflector import Obj
from otelgpu.enrich.labels import TagResolver
from otelgpu.enrich.model import (
    ClaimFacts,
    FactsView,
    NamespaceFacts,
    NodeFacts,
    OwnerFacts,
    OwnerKey,
    PodFacts,
    SliceFacts,
)
from otelgpu.telemetry import KubeTelemetry, SelfMetrics

NS = 1_000_000_000
RESOLVED_KINDS = {"ReplicaSet": "replicasets", "Job": "jobs"}
PodKey = tuple[str, str]
F = TypeVar("F")


def same_facts(before: Any, after: Any) -> bool:
    """Equal in everything kept but when they were seen."""
    return type(before) is type(after) and all(getattr(before, f.name) == getattr(after, f.name)
                                               for f in dataclasses.fields(before) if f.name != "seen_ns")


def since(known: bool, new_object: bool, created_ns: int, now_ns: int) -> int:
    """When a version takes effect: a change when it was observed; a new object from its creation,
    or from the beginning of time when that is unknown (observed time when it replaces another of
    its name, whose history it would otherwise erase)."""
    if not new_object:
        return now_ns
    return created_ns or (now_ns if known else 0)


class ApiFacts:
    """Written by the watch threads, read through view() by the pipeline; one lock."""

    def __init__(self, tags: TagResolver, grace_s: float, clock: Callable[[], float] = time.time,
                 metrics: Optional[SelfMetrics] = None, history_seconds: float = 900.0) -> None:
        self.tags, self.grace_s, self.clock, self.metrics = tags, grace_s, clock, metrics
        self._telemetry: dict[str, KubeTelemetry] = {}  # by resource, for the objects held
        self._lock = threading.Lock()
        retention = int(history_seconds * NS)
        self.pods: Timeline[PodKey, PodFacts] = Timeline(retention, same_facts)
        self.nodes: Timeline[str, NodeFacts] = Timeline(retention, same_facts)
        self.namespaces: Timeline[str, NamespaceFacts] = Timeline(retention, same_facts)
        self.owners: Timeline[OwnerKey, OwnerFacts] = Timeline(retention, same_facts)
        self.claims: Timeline[PodKey, ClaimFacts] = Timeline(retention, same_facts)  # DRA ResourceClaims
        self.slices: Timeline[str, SliceFacts] = Timeline(retention, same_facts)  # DRA ResourceSlices
        self.deleted_at: dict[PodKey, float] = {}
        self.previous: dict[PodKey, PodFacts] = {}  # the pod a same-name pod replaced
        self.previous_at: dict[PodKey, float] = {}
        self.on_pod: Optional[Callable[[str, PodFacts], None]] = None  # owner resolution hook

    def _pod(self, obj: Obj, now_ns: int) -> tuple[PodKey, PodFacts]:
        meta = objects.meta(obj)
        pod = objects.pod_facts(obj, self.tags.pod_label_keys | sharing.LABEL_KEYS, self.tags.annotation_keys
                          | sharing.ANNOTATION_KEYS, now_ns, sharing.LABEL_PREFIXES, sharing.ANNOTATION_PREFIXES)
        return (meta.get("namespace", ""), meta.get("name", "")), pod

    def _named(self, resource: str, obj: Obj, now_ns: int) -> tuple[Any, Any, int]:
        """(key, facts, creation ns) of a node, namespace, ResourceClaim or ResourceSlice."""
        meta = objects.meta(obj)
        if resource == "nodes":
            facts: Any = objects.node_facts(obj, now_ns)
        elif resource == "resourceclaims":
            facts = objects.claim_facts(obj, now_ns)
        elif resource == "resourceslices":
            facts = objects.slice_facts(obj, now_ns)
        else:
            facts = objects.namespace_facts(obj, self.tags.namespace_label_keys, now_ns)
        return _key(resource, meta), facts, objects.timestamp_ns(meta.get("creationTimestamp"))

    def _table(self, resource: str) -> Timeline[Any, Any]:
        return {"nodes": self.nodes, "resourceclaims": self.claims, "resourceslices": self.slices}.get(
            resource, self.namespaces)

    def replace(self, resource: str, items: Iterable[Obj]) -> None:
        self._replace(resource, items)
        self.publish()

    def _replace(self, resource: str, items: Iterable[Obj]) -> None:
        now = self.clock()
        now_ns = int(now * NS)
        if resource == "pods":
            fresh = dict(self._pod(o, now_ns) for o in items)
            with self._lock:
                for key, pod in list(self.pods.latest.items()):
                    if key not in fresh:  # deleted while the watch was down
                        self._mark_deleted(key, pod, now)
                for key, pod in fresh.items():
                    self._put_pod(key, pod, now)
            self._resolve(fresh)
            return
        named = [self._named(resource, o, now_ns) for o in items]
        table = self._table(resource)
        with self._lock:
            listed = {name for name, _, _ in named}
            for name in [n for n in table.latest if n not in listed]:
                table.put(name, None, now_ns, now_ns)
            for name, facts, created in named:
                self._put_named(table, name, facts, created, now_ns)

    def upsert(self, resource: str, obj: Obj) -> None:
        now = self.clock()
        now_ns = int(now * NS)
        if resource == "pods":
            key, pod = self._pod(obj, now_ns)
            with self._lock:
                self._put_pod(key, pod, now)
            self._resolve({key: pod})
        else:
            name, facts, created = self._named(resource, obj, now_ns)
            with self._lock:
                self._put_named(self._table(resource), name, facts, created, now_ns)
        self.publish()

    def delete(self, resource: str, obj: Obj) -> None:
        meta, now = objects.meta(obj), self.clock()
        with self._lock:
            if resource == "pods":
                key = (meta.get("namespace", ""), meta.get("name", ""))
                pod = self.pods.latest.get(key)
                if pod is not None and (not meta.get("uid") or meta.get("uid") == pod.uid):
                    self._mark_deleted(key, pod, now)
            else:  # absent from now on; kept as a version until the retention passes
                self._table(resource).put(_key(resource, meta), None, int(now * NS), int(now * NS))
        self.publish()

    def _put_pod(self, key: PodKey, pod: PodFacts, now: float) -> None:
        old = self.pods.latest.get(key)
        replaced = old is not None and old.uid != pod.uid
        if old is not None and replaced:  # recreated under the same name
            self.previous[key] = old if old.deleted else dataclasses.replace(old, deleted=True)
            self.previous_at[key] = self.deleted_at.get(key, now)
        now_ns = int(now * NS)
        self.pods.put(key, pod, since(key in self.pods, old is None or replaced, pod.created_ns, now_ns), now_ns)
        if not pod.deleted:
            self.deleted_at.pop(key, None)

    def _put_named(self, table: Timeline[Any, F], name: Any, facts: F, created_ns: int, now_ns: int) -> None:
        table.put(name, facts, since(name in table, name not in table.latest, created_ns, now_ns), now_ns)

    def _mark_deleted(self, key: PodKey, pod: PodFacts, now: float) -> None:
        if not pod.deleted:
            self.deleted_at[key] = now
            self.pods.put(key, dataclasses.replace(pod, deleted=True), int(now * NS), int(now * NS))

    def publish(self) -> None:
        """Object counts into the otelgpu_kube_objects gauge."""
        if self.metrics is not None:
            for resource, n in self.counts().items():
                if resource not in self._telemetry:
                    self._telemetry[resource] = KubeTelemetry(self.metrics, resource)
                self._telemetry[resource].objects.set(n)

    def _resolve(self, pods: dict[PodKey, PodFacts]) -> None:
        if self.on_pod is not None:
            for (namespace, _), pod in pods.items():
                self.on_pod(namespace, pod)

    def set_owner(self, key: OwnerKey, owner: OwnerFacts, created_ns: int = 0) -> None:
        now_ns = int(self.clock() * NS)
        with self._lock:
            self.owners.put(key, owner, since(key in self.owners, key not in self.owners.latest, created_ns, now_ns),
                            now_ns)

    def has_owner(self, key: OwnerKey) -> bool:
        with self._lock:
            return key in self.owners.latest

    def view(self, as_of_ns: Optional[int] = None) -> FactsView:
        """The facts as they were just before `as_of_ns` (versions effective earlier; None: as they
        are now), in dicts of their own; forgets what is past its grace or retention first."""
        now = self.clock()
        with self._lock:
            self._expire(now)
            pods = self.pods.at(as_of_ns)
            previous = {k: p for k, p in self.previous.items() if as_of_ns is None or
                        (k in pods and pods[k].uid != p.uid)}  # as of then, the pod it replaced may be the one there
            # A claim deleted with its pod still says, for the pod's grace, which GPU the pod held
            # until it ended (the join counts only pods that ran in the interval).
            before = (as_of_ns if as_of_ns is not None else int(now * NS)) - int(self.grace_s * NS)
            claims = {**self.claims.at(before), **self.claims.at(as_of_ns)}
            return FactsView(pods, self.nodes.at(as_of_ns), self.namespaces.at(as_of_ns), self.owners.at(as_of_ns),
                             previous, claims, self.slices.at(as_of_ns))

    def _expire(self, now: float) -> None:
        """Deleted pods past their grace, owners no kept pod version refers to, versions past the retention."""
        cutoff = now - self.grace_s
        for key in [k for k, t in self.deleted_at.items() if t < cutoff]:
            del self.deleted_at[key]
            pod = self.pods.latest.get(key)
            if pod is not None and pod.deleted:
                self.pods.forget(key)
        for key in [k for k, t in self.previous_at.items() if t < cutoff]:
            del self.previous_at[key]
            self.previous.pop(key, None)
        used = {(ns, p.owner_kind, p.owner_name) for (ns, _), p in self.pods.latest.items()}
        used.update((ns, p.owner_kind, p.owner_name) for (ns, _), p in self.pods.earlier())
        for key in [k for k in self.owners.latest if k[1] in RESOLVED_KINDS and k not in used]:
            self.owners.forget(key)
        now_ns = int(now * NS)
        for table in (self.pods, self.nodes, self.namespaces, self.owners, self.claims, self.slices):
            table.prune(now_ns)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"pods": len(self.pods.latest), "nodes": len(self.nodes.latest),
                    "namespaces": len(self.namespaces.latest), "owners": len(self.owners.latest),
                    "resourceclaims": len(self.claims.latest), "resourceslices": len(self.slices.latest)}

    def versions(self) -> dict[str, int]:
        """Versions kept per resource (deletion marks included): what the history costs."""
        with self._lock:
            return {"pods": self.pods.count(), "nodes": self.nodes.count(),
                    "namespaces": self.namespaces.count(), "owners": self.owners.count(),
                    "resourceclaims": self.claims.count(), "resourceslices": self.slices.count()}


def _key(resource: str, meta: Obj) -> Any:
    """A named object's key: (namespace, name) for ResourceClaims, the name for the rest."""
    return (meta.get("namespace", ""), meta.get("name", "")) if resource == "resourceclaims" else meta.get("name", "")
