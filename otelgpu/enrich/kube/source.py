"""Pod, namespace and node facts from the Kubernetes API: one list-then-watch thread per resource,
one thread resolving ReplicaSet and Job owners, and the store they write and the join reads.

`scope: node` watches the pods of one node (`spec.nodeName`) and that node only; namespaces are
always watched whole (few, and their labels carry tags). Deleted pods stay for
`deleted_pod_grace_seconds`, marked deleted, so the interval they ended in is still attributed.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from typing import Any, Callable, Iterable, Optional

from kubernetes import client

from otelgpu.config import KubernetesConfig
from otelgpu.enrich.facts import FactsView, NamespaceFacts, NodeFacts, OwnerFacts, OwnerKey, PodFacts
from otelgpu.enrich.kube import objects as O
from otelgpu.enrich.kube.client import api_client
from otelgpu.enrich.kube.reflector import Obj, Reflector, WatchSpec, api_message, reason_of
from otelgpu.enrich.labels import TagResolver
from otelgpu.telemetry import SelfMetrics

log = logging.getLogger(__name__)

NS = 1_000_000_000
OWNER_RETRY_S = 600.0  # an owner that could not be read is asked for again after this
RESOLVED_KINDS = {"ReplicaSet": "replicasets", "Job": "jobs"}


class ApiFacts:
    """Written by the watch threads, read through view() by the pipeline; one lock."""

    def __init__(self, tags: TagResolver, grace_s: float, clock: Callable[[], float] = time.time,
                 metrics: Optional[SelfMetrics] = None) -> None:
        self.tags, self.grace_s, self.clock, self.metrics = tags, grace_s, clock, metrics
        self._lock = threading.Lock()
        self.pods: dict[tuple[str, str], PodFacts] = {}
        self.deleted_at: dict[tuple[str, str], float] = {}
        self.previous: dict[tuple[str, str], PodFacts] = {}  # the pod a same-name pod replaced
        self.previous_at: dict[tuple[str, str], float] = {}
        self.nodes: dict[str, NodeFacts] = {}
        self.namespaces: dict[str, NamespaceFacts] = {}
        self.owners: dict[OwnerKey, OwnerFacts] = {}
        self.on_pod: Optional[Callable[[str, PodFacts], None]] = None  # owner resolution hook

    def _pod(self, obj: Obj) -> tuple[tuple[str, str], PodFacts]:
        m = O.meta(obj)
        pod = O.pod_facts(obj, self.tags.pod_label_keys, self.tags.annotation_keys, int(self.clock() * NS))
        return (m.get("namespace", ""), m.get("name", "")), pod

    def replace(self, resource: str, objects: Iterable[Obj]) -> None:
        self._replace(resource, objects)
        self.publish()

    def _replace(self, resource: str, objects: Iterable[Obj]) -> None:
        now = self.clock()
        if resource == "pods":
            fresh = dict(self._pod(o) for o in objects)
            with self._lock:
                for key, pod in self.pods.items():
                    if key not in fresh:  # deleted while the watch was down
                        fresh[key] = self._deleted(key, pod, now)
                for key in list(self.deleted_at):
                    if key in fresh and not fresh[key].deleted:
                        del self.deleted_at[key]
                self.pods = fresh
            self._resolve(fresh)
        elif resource == "nodes":
            nodes = {O.meta(o).get("name", ""): O.node_facts(o, int(now * NS)) for o in objects}
            with self._lock:
                self.nodes = nodes
        else:
            nss = {O.meta(o).get("name", ""): O.namespace_facts(o, self.tags.namespace_label_keys, int(now * NS))
                   for o in objects}
            with self._lock:
                self.namespaces = nss

    def upsert(self, resource: str, obj: Obj) -> None:
        self._upsert(resource, obj)
        self.publish()

    def _upsert(self, resource: str, obj: Obj) -> None:
        name = O.meta(obj).get("name", "")
        if resource == "pods":
            key, pod = self._pod(obj)
            with self._lock:
                old = self.pods.get(key)
                if old is not None and old.uid != pod.uid:  # recreated under the same name
                    self.previous[key] = PodFacts(**{**old.__dict__, "deleted": True})
                    self.previous_at[key] = self.deleted_at.get(key, self.clock())
                self.pods[key] = pod
                self.deleted_at.pop(key, None)
            self._resolve({key: pod})
        elif resource == "nodes":
            facts = O.node_facts(obj, int(self.clock() * NS))
            with self._lock:
                self.nodes[name] = facts
        else:
            ns = O.namespace_facts(obj, self.tags.namespace_label_keys, int(self.clock() * NS))
            with self._lock:
                self.namespaces[name] = ns

    def delete(self, resource: str, obj: Obj) -> None:
        m = O.meta(obj)
        with self._lock:
            if resource == "pods":
                key = (m.get("namespace", ""), m.get("name", ""))
                pod = self.pods.get(key)
                if pod is not None and (not m.get("uid") or m.get("uid") == pod.uid):
                    self.pods[key] = self._deleted(key, pod, self.clock())
            elif resource == "nodes":
                self.nodes.pop(m.get("name", ""), None)
            else:
                self.namespaces.pop(m.get("name", ""), None)
        self.publish()

    def publish(self) -> None:
        """Object counts into the otelgpu_kube_objects gauge."""
        if self.metrics is not None:
            for resource, n in self.counts().items():
                self.metrics.set("kube_objects", resource, n)

    def _deleted(self, key: tuple[str, str], pod: PodFacts, now: float) -> PodFacts:
        if not pod.deleted:
            self.deleted_at[key] = now
            pod = PodFacts(**{**pod.__dict__, "deleted": True})
        return pod

    def _resolve(self, pods: dict[tuple[str, str], PodFacts]) -> None:
        if self.on_pod is not None:
            for (namespace, _), pod in pods.items():
                self.on_pod(namespace, pod)

    def set_owner(self, key: OwnerKey, owner: OwnerFacts) -> None:
        with self._lock:
            self.owners[key] = owner

    def has_owner(self, key: OwnerKey) -> bool:
        with self._lock:
            return key in self.owners

    def view(self, as_of_ns: int | None = None) -> FactsView:
        """A consistent copy; forgets deleted pods past their grace and owners no pod refers to."""
        cutoff = self.clock() - self.grace_s
        with self._lock:
            for key in [k for k, t in self.deleted_at.items() if t < cutoff]:
                del self.deleted_at[key]
                if key in self.pods and self.pods[key].deleted:
                    del self.pods[key]
            for key in [k for k, t in self.previous_at.items() if t < cutoff]:
                del self.previous_at[key]
                self.previous.pop(key, None)
            used = {(ns, p.owner_kind, p.owner_name) for (ns, _), p in self.pods.items()}
            self.owners = {k: v for k, v in self.owners.items() if k in used or k[1] not in RESOLVED_KINDS}
            return FactsView(dict(self.pods), dict(self.nodes), dict(self.namespaces), dict(self.owners),
                             dict(self.previous))

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"pods": len(self.pods), "nodes": len(self.nodes), "namespaces": len(self.namespaces),
                    "owners": len(self.owners)}


class OwnerResolver:
    """Reads each ReplicaSet and Job a pod names once, to learn its Deployment or CronJob."""

    def __init__(self, api: client.ApiClient, facts: ApiFacts, metrics: SelfMetrics, stop: threading.Event,
                 clock: Callable[[], float] = time.time) -> None:
        self.facts, self.metrics, self.stop, self.clock = facts, metrics, stop, clock
        apps, batch = client.AppsV1Api(api), client.BatchV1Api(api)
        self._read = {"ReplicaSet": apps.read_namespaced_replica_set, "Job": batch.read_namespaced_job}
        self._queue: queue.Queue[OwnerKey] = queue.Queue(maxsize=100_000)
        self._asked: dict[OwnerKey, float] = {}  # key -> when it was last asked for (bounded below)
        self._refused: dict[str, float] = {}  # kind -> when get was refused (forbidden)
        self._lock = threading.Lock()

    def want(self, namespace: str, pod: PodFacts) -> None:
        key = (namespace, pod.owner_kind, pod.owner_name)
        if pod.owner_kind not in self._read or self.facts.has_owner(key):
            return
        now = self.clock()
        with self._lock:
            if now - self._asked.get(key, -OWNER_RETRY_S) < OWNER_RETRY_S:
                return
            if len(self._asked) > 50_000:
                self._asked = {k: t for k, t in self._asked.items() if now - t < OWNER_RETRY_S}
            self._asked[key] = now
        try:
            self._queue.put_nowait(key)
        except queue.Full:
            pass  # asked again when the pod next changes; the name pattern serves meanwhile

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                key = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            self._resolve(key)

    def _resolve(self, key: OwnerKey) -> None:
        namespace, kind, name = key
        if self.clock() - self._refused.get(kind, -OWNER_RETRY_S) < OWNER_RETRY_S:
            return
        resource = RESOLVED_KINDS[kind]
        try:
            resp = self._read[kind](name, namespace, _preload_content=False, _request_timeout=(10.0, 30.0))
            try:
                obj: Any = json.loads(resp.data)
            finally:
                resp.release_conn()
        except Exception as exc:  # the workload falls back to the owner itself (or its name pattern)
            reason = reason_of(exc)
            self.metrics.count("kube_errors", (resource, "get", reason))
            if reason == "forbidden":
                self._refused[kind] = self.clock()
                log.error("Kubernetes API refuses to get %s: %s. Grant get on %s to resolve workloads "
                          "(or set kubernetes.resolve_owners: false); using the owner's name meanwhile.",
                          resource, api_message(exc), resource)
            return
        self.facts.set_owner(key, O.owner_facts(obj, int(self.clock() * NS)))


class KubeSource:
    """Starts and stops the watches; `facts.view()` is what the join merges in."""

    def __init__(self, cfg: KubernetesConfig, tags: TagResolver, metrics: SelfMetrics,
                 api: Optional[client.ApiClient] = None, clock: Callable[[], float] = time.time) -> None:
        self.cfg, self.metrics = cfg, metrics
        self.api = api or api_client(cfg)
        self.facts = ApiFacts(tags, cfg.deleted_pod_grace_seconds, clock, metrics)
        self.stop = threading.Event()
        core = client.CoreV1Api(self.api)
        node = cfg.node_name if cfg.scope == "node" else None
        specs = [
            WatchSpec("pods", core.list_pod_for_all_namespaces, f"spec.nodeName={node}" if node else None),
            WatchSpec("namespaces", core.list_namespace),
            WatchSpec("nodes", core.list_node, f"metadata.name={node}" if node else None),
        ]
        self.reflectors = [Reflector(s, self.facts, cfg, metrics, self.stop) for s in specs]
        self.owners = OwnerResolver(self.api, self.facts, metrics, self.stop, clock) if cfg.resolve_owners else None
        if self.owners is not None:
            self.facts.on_pod = self.owners.want
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        runs: list[tuple[str, Callable[[], None]]] = [(r.spec.resource, r.run) for r in self.reflectors]
        if self.owners is not None:
            runs.append(("owners", self.owners.run))
        for name, run in runs:
            t = threading.Thread(target=run, name=f"otelgpu-kube-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def synced(self) -> bool:
        return all(r.synced for r in self.reflectors)

    def wait_synced(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.synced():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def view(self, as_of_ns: int | None = None) -> FactsView:
        view = self.facts.view()
        self.facts.publish()  # deleted pods past their grace are gone now
        return view

    def shutdown(self) -> None:
        self.stop.set()
        for r in self.reflectors:
            r.close()
        for t in self._threads:
            t.join(timeout=2.0)
        self.api.close()
