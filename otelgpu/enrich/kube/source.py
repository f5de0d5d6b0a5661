"""Pod, namespace and node facts from the Kubernetes API: one list-then-watch thread per resource,
one thread resolving ReplicaSet and Job owners, writing the store the join reads (store.py).

`scope: node` watches the pods of one node (`spec.nodeName`) and that node only; namespaces are
always watched whole (few, and their labels carry tags). Deleted pods stay for
`deleted_pod_grace_seconds`, marked deleted, so the interval they ended in is still attributed.
The store keeps `kubernetes.history_seconds` of changes, so `view(as_of_ns)` gives the facts as they were
when an interval ended.
"""

from __future__ import annotations

import functools
import json
import logging
import queue
import threading
import time
from typing import Any, Callable, Optional

from kubernetes import client

from otelgpu.core.lifecycle import grace
from otelgpu.enrich.config import KubernetesConfig
from otelgpu.enrich.kube import objects
from otelgpu.enrich.kube.client import api_client
from otelgpu.enrich.kube.reflector import Reflector, WatchSpec, api_message, reason_of
from otelgpu.enrich.kube.store import NS, RESOLVED_KINDS, ApiFacts
from otelgpu.enrich.labels import TagResolver
from otelgpu.enrich.model import FactsView, OwnerKey, PodFacts
from otelgpu.telemetry import KubeReason, KubeTelemetry, KubeVerb, SelfMetrics

log = logging.getLogger(__name__)

OWNER_RETRY_S = 600.0  # an owner that could not be read is asked for again after this
DRA_GROUP, DRA_VERSION = "resource.k8s.io", "v1"
DRA_RESOURCES = ("resourceclaims", "resourceslices")


class OwnerResolver:
    """Reads each ReplicaSet and Job a pod names once, to learn its Deployment or CronJob."""

    def __init__(self, api: client.ApiClient, facts: ApiFacts, metrics: SelfMetrics, stop: threading.Event,
                 clock: Callable[[], float] = time.time) -> None:
        self.facts, self.stop, self.clock = facts, stop, clock
        self.telemetry = {kind: KubeTelemetry(metrics, resource) for kind, resource in RESOLVED_KINDS.items()}
        apps, batch = client.AppsV1Api(api), client.BatchV1Api(api)
        self._read = {"ReplicaSet": apps.read_namespaced_replica_set, "Job": batch.read_namespaced_job}
        self._queue: queue.Queue[Optional[OwnerKey]] = queue.Queue(maxsize=100_000)  # None: closing
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
            key = self._queue.get()
            if key is None:  # close(): stop is set
                break
            self._resolve(key)

    def close(self) -> None:
        """Wake `run` to see `stop` (set first); the queue may be full, then a take makes room."""
        while True:
            try:
                self._queue.put_nowait(None)
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    pass

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
            self.telemetry[kind].failed(KubeVerb.GET, reason)
            if reason is KubeReason.FORBIDDEN:
                self._refused[kind] = self.clock()
                log.error("Kubernetes API refuses to get %s: %s. Grant get on %s to resolve workloads "
                          "(or set kubernetes.resolve_owners: false); using the owner's name meanwhile.",
                          resource, api_message(exc), resource)
            return
        created = objects.timestamp_ns(objects.meta(obj).get("creationTimestamp"))
        self.facts.set_owner(key, objects.owner_facts(obj, int(self.clock() * NS)), created)


class KubeSource:
    """Starts and stops the watches; `facts.view()` is what the join merges in."""

    def __init__(self, cfg: KubernetesConfig, tags: TagResolver, metrics: SelfMetrics,
                 api: Optional[client.ApiClient] = None, clock: Callable[[], float] = time.time) -> None:
        self.cfg, self.metrics = cfg, metrics
        self.api = api or api_client(cfg)
        self.facts = ApiFacts(tags, cfg.deleted_pod_grace_seconds, clock, metrics, cfg.history_seconds)
        self.stop = threading.Event()
        core = client.CoreV1Api(self.api)
        node = cfg.node_name if cfg.scope == "node" else None
        specs = [
            WatchSpec("pods", core.list_pod_for_all_namespaces, f"spec.nodeName={node}" if node else None),
            WatchSpec("namespaces", core.list_namespace),
            WatchSpec("nodes", core.list_node, f"metadata.name={node}" if node else None),
        ]
        if cfg.dra:  # through the generic client: the typed DRA API is only in recent client releases
            dra = functools.partial(client.CustomObjectsApi(self.api).list_cluster_custom_object, DRA_GROUP, DRA_VERSION)
            specs += [WatchSpec("resourceclaims", functools.partial(dra, "resourceclaims")),
                      WatchSpec("resourceslices", functools.partial(dra, "resourceslices"),
                                f"spec.nodeName={node}" if node else None)]
        self.reflectors = [Reflector(s, self.facts, cfg, metrics, self.stop) for s in specs]
        self.owners = OwnerResolver(self.api, self.facts, metrics, self.stop, clock) if cfg.resolve_owners else None
        if self.owners is not None:
            self.facts.on_pod = self.owners.want
        self._threads: list[threading.Thread] = []
        self._started = False

    def start(self) -> None:
        if self._started or self.stop.is_set():
            return
        self._started = True
        runs: list[tuple[str, Callable[[], None]]] = [(r.spec.resource, r.run) for r in self.reflectors]
        if self.owners is not None:
            runs.append(("owners", self.owners.run))
        for name, run in runs:
            thread = threading.Thread(target=run, name=f"otelgpu-kube-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def synced(self) -> bool:
        """Pods, namespaces and nodes listed. DRA objects are not waited for: a cluster before 1.34
        serves none, and their watches retry in the background."""
        return all(r.synced for r in self.reflectors if r.spec.resource not in DRA_RESOURCES)

    def wait_synced(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.synced():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def view(self, as_of_ns: Optional[int] = None) -> FactsView:
        """The facts as they were just before `as_of_ns` (an interval's end), or now when None."""
        view = self.facts.view(as_of_ns)
        self.facts.publish()  # deleted pods past their grace are gone now
        return view

    def shutdown(self, deadline: Optional[float] = None) -> None:
        """Stop the watches; their threads are waited for until `deadline` (default: 2 s each)."""
        if self.stop.is_set() or not self._started:
            return
        self.stop.set()
        for r in self.reflectors:
            r.close()
        if self.owners is not None:
            self.owners.close()
        for t in self._threads:
            t.join(timeout=grace(deadline, 2.0))
        self.api.close()
