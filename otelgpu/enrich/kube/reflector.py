"""List, then watch, one Kubernetes resource, forever, until stopped.

The list's resourceVersion starts the watch; each event (and each BOOKMARK) advances it, so a
watch the server ends, or a broken connection, resumes where it stopped. 410 Gone (history
compacted) means relist. Any other failure waits an exponential backoff with jitter, then resumes.
A stream silent for longer than the server's own watch timeout is treated as broken (read timeout).
Errors are counted by resource, verb and reason; a refusal names the verb and the resource.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol

import urllib3
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from otelgpu.core.backoff import Backoff
from otelgpu.enrich.config import KubernetesConfig
from otelgpu.telemetry import KubeReason, KubeTelemetry, KubeVerb, ListReason, SelfMetrics, WatchEvent

log = logging.getLogger(__name__)

Obj = dict[str, Any]
CONNECT_TIMEOUT_S = 10.0
_REASONS = {401: KubeReason.UNAUTHORIZED, 403: KubeReason.FORBIDDEN, 404: KubeReason.NOT_FOUND, 410: KubeReason.GONE,
            429: KubeReason.THROTTLED}


class Gone(Exception):
    """The resourceVersion asked for is older than the server's history: relist."""


class Store(Protocol):
    def replace(self, resource: str, objects: Iterable[Obj]) -> None: ...
    def upsert(self, resource: str, obj: Obj) -> None: ...
    def delete(self, resource: str, obj: Obj) -> None: ...


def reason_of(exc: BaseException) -> KubeReason:
    """The `reason` label of an API failure."""
    if isinstance(exc, Gone):
        return KubeReason.GONE
    if isinstance(exc, ApiException):
        if exc.status in _REASONS:
            return _REASONS[exc.status]
        if not exc.status:
            return KubeReason.CONNECTION
        return KubeReason.SERVER_ERROR if exc.status >= 500 else KubeReason.INVALID
    if isinstance(exc, urllib3.exceptions.ReadTimeoutError):
        return KubeReason.TIMEOUT
    if isinstance(exc, (ValueError, KeyError, TypeError)):
        return KubeReason.INVALID
    return KubeReason.CONNECTION


def api_message(exc: BaseException) -> str:
    """The API's own message (a Status object's `message`) where there is one."""
    if isinstance(exc, ApiException) and exc.body:
        try:
            return str(json.loads(exc.body).get("message") or exc.reason)
        except (ValueError, AttributeError):
            return str(exc.body)[:300]
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class WatchSpec:
    resource: str  # plural: pods, namespaces, nodes
    list_fn: Callable[..., Any]  # e.g. CoreV1Api.list_pod_for_all_namespaces
    field_selector: Optional[str] = None


class Reflector:
    def __init__(self, spec: WatchSpec, store: Store, cfg: KubernetesConfig, metrics: SelfMetrics,
                 stop: threading.Event, rng: Callable[[], float] = random.random) -> None:
        self.spec, self.store, self.cfg, self.stop = spec, store, cfg, stop
        self.telemetry = KubeTelemetry(metrics, spec.resource)
        self.backoff = Backoff(cfg.backoff_initial_seconds, cfg.backoff_max_seconds, 0.2, rng)  # +/-20 %
        self.rng = rng
        self._resp: Any = None
        self.version: Optional[str] = None  # where the next watch starts; None: list first
        self._failing: Optional[str] = None  # the reason logged for the current run of failures
        self.synced = False  # listed, and not relisting
        self._listed = ("", 0)  # (resourceVersion, objects) of the list in progress

    def _kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"_preload_content": False}
        if self.spec.field_selector:
            kw["field_selector"] = self.spec.field_selector
        return kw

    def run(self) -> None:
        relist_reason = ListReason.INITIAL
        while not self.stop.is_set():
            verb = KubeVerb.LIST
            try:
                if self.version is None:
                    self.version = self._list(relist_reason)
                verb = KubeVerb.WATCH
                self._watch()
                self._recovered()
            except Exception as exc:  # every failure of a long-lived watch is retried; none may end it
                if self.stop.is_set():
                    break
                reason = reason_of(exc)
                if reason is KubeReason.GONE:  # history compacted past our version (or a list's continue expired)
                    self.telemetry.failed(verb, reason)
                    self.version, relist_reason = None, ListReason.GONE
                    continue
                self._failed(verb, reason, exc)
                self.stop.wait(self.backoff.next())

    def _list(self, reason: ListReason) -> str:
        self._set_synced(False)
        self._listed = ("", 0)
        self.store.replace(self.spec.resource, self._pages())
        version, count = self._listed
        self.telemetry.listed(reason)
        self._set_synced(True)
        log.info("listed %d %s at resourceVersion %s", count, self.spec.resource, version)
        return version

    def _pages(self) -> Iterator[Obj]:
        """Every object, fetched a page at a time as the store consumes them, so no more than one
        page of raw JSON is held however large the cluster."""
        token: Optional[str] = None
        while True:
            kw = self._kwargs()
            kw.update(limit=self.cfg.page_size, _request_timeout=(CONNECT_TIMEOUT_S, 60.0))
            if token:
                kw["_continue"] = token
            resp = self.spec.list_fn(**kw)
            try:
                body = json.loads(resp.data)
            finally:
                resp.release_conn()
            items = body.get("items") or []
            meta = body.get("metadata") or {}
            self._listed = (meta.get("resourceVersion") or self._listed[0], self._listed[1] + len(items))
            yield from items
            token = meta.get("continue")
            if not token:
                return

    def _set_synced(self, synced: bool) -> None:
        self.synced = synced
        self.telemetry.synced(synced)

    def _watch(self) -> None:
        """Stream events from `self.version` until the server ends the watch; every event (and
        bookmark) advances `self.version`, so a broken stream resumes where it stopped."""
        timeout = max(int(self.cfg.watch_timeout_seconds * (0.9 + 0.2 * self.rng())), 1)  # spread the rewatches
        kw = self._kwargs()
        kw.update(watch=True, resource_version=self.version, allow_watch_bookmarks=True, timeout_seconds=timeout,
                  _request_timeout=(CONNECT_TIMEOUT_S, timeout + min(30.0, timeout)))  # silent past this: broken
        resp = self._resp = self.spec.list_fn(**kw)
        try:
            if self.stop.is_set():  # closed while the watch was being opened: close() saw no response
                return
            for line in iter_resp_lines(resp):
                if self.stop.is_set():
                    break
                if not line.strip():
                    continue
                self.version = self._apply(json.loads(line), self.version)
                self._recovered()
        finally:
            self._resp = None
            resp.release_conn()

    def _apply(self, event: Obj, version: Optional[str]) -> Optional[str]:
        kind, obj = event.get("type", ""), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone(obj.get("message", ""))
            raise ApiException(status=obj.get("code") or 500, reason=obj.get("reason"), body=json.dumps(obj))
        if kind not in WatchEvent.__members__:
            raise ValueError(f"unknown watch event type {kind!r}")
        self.telemetry.event(WatchEvent(kind))
        if kind in (WatchEvent.ADDED, WatchEvent.MODIFIED):
            self.store.upsert(self.spec.resource, obj)
        elif kind == WatchEvent.DELETED:
            self.store.delete(self.spec.resource, obj)
        return (obj.get("metadata") or {}).get("resourceVersion") or version

    def _failed(self, verb: KubeVerb, reason: KubeReason, exc: BaseException) -> None:
        resource = self.spec.resource
        self.telemetry.failed(verb, reason)
        if self._failing == reason:
            log.debug("%s %s still failing (%s)", verb, resource, reason)
            return
        self._failing = reason
        if reason is KubeReason.NOT_FOUND and resource.startswith("resource"):
            log.warning("Kubernetes API does not serve %s (DRA's resource.k8s.io/v1 needs Kubernetes 1.34 or later; "
                        "kubernetes.dra: false stops asking); retrying with backoff", resource)
        elif reason in (KubeReason.FORBIDDEN, KubeReason.UNAUTHORIZED):
            log.error("Kubernetes API refuses to %s %s: %s. otelgpu needs get, list and watch on %s; it goes on "
                      "attributing with the facts it has and retries.", verb, resource, api_message(exc), resource)
        else:
            log.warning("Kubernetes API: %s %s failed (%s): %s; retrying with backoff", verb, resource, reason,
                        api_message(exc))

    def _recovered(self) -> None:
        self.backoff.reset()
        if self._failing is not None:
            log.info("Kubernetes API: %s watch recovered", self.spec.resource)
            self._failing = None

    def close(self) -> None:
        """Interrupt a watch in progress (from another thread)."""
        resp = self._resp
        if resp is not None:
            try:
                resp.shutdown()
            except Exception:  # already closed
                pass
