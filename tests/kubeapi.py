"""A real local Kubernetes API server for tests: get, list and watch over HTTP/1.1 the way
kube-apiserver serves them, so the unpatched official `kubernetes` client talks to it.

It is not a mock: requests go through urllib3 and a socket, and the failures a controller meets in
production can be provoked on demand (410 Expired after compaction, bookmarks, 401/403/404 Status
bodies, dropped or silent watch streams, an apiserver that goes away and comes back)."""

from __future__ import annotations

import base64
import bisect
import copy
import json
import math
import select
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socketserver import TCPServer
from typing import Any, Iterator, Optional
from urllib.parse import parse_qsl, unquote, urlsplit

USER = "system:serviceaccount:otelgpu:otelgpu"  # who the 403 messages say was refused
TRUE = {"1", "t", "T", "true", "TRUE", "True"}  # what Go's strconv.ParseBool accepts
Selector = list[tuple[str, str, str]]  # (key, op, value); op is one of = != exists !


@dataclass(frozen=True)
class Resource:
    kind: str
    group: str
    version: str
    plural: str
    namespaced: bool = True
    builtin: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """How the apiserver names a resource in messages: `pods`, `replicasets.apps`."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


BUILTIN = [Resource("Pod", "", "v1", "pods"), Resource("Namespace", "", "v1", "namespaces", False),
           Resource("Node", "", "v1", "nodes", False), Resource("Job", "batch", "v1", "jobs"),
           Resource("CronJob", "batch", "v1", "cronjobs"),
           *(Resource(k, "apps", "v1", k.lower() + "s")
             for k in ("ReplicaSet", "Deployment", "StatefulSet", "DaemonSet"))]


def status(code: int, reason: str, message: str, details: Optional[dict] = None) -> dict:
    """A metav1.Status failure body, which every apiserver error carries."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, **({"details": details} if details else {}), "code": code}


def _details(res: Resource, name: Optional[str]) -> dict:
    return {**({"name": name} if name else {}), **({"group": res.group} if res.group else {}), "kind": res.plural}


def parse_selector(text: str) -> Selector:
    """Comma-separated `k=v`, `k==v`, `k!=v`, `k`, `!k` terms (no set-based `in`/`notin`)."""
    terms: Selector = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        op = next((op for op in ("!=", "==", "=") if op in term), None)
        if op:
            key, value = term.split(op, 1)
            terms.append((key.strip(), "!=" if op == "!=" else "=", value.strip()))
        else:
            terms.append((term.lstrip("!"), "!" if term.startswith("!") else "exists", ""))
    return terms


def _field(obj: dict, path: str) -> str:
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None  # type: ignore[assignment]
    return "" if obj is None else str(obj)


def _key(obj: dict) -> tuple[str, str]:
    return obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


@dataclass
class _Query:
    """Which objects a list or watch request selects."""
    res: Resource
    namespace: Optional[str]
    fields: Selector
    labels: Selector

    def matches(self, obj: dict) -> bool:
        meta = obj["metadata"]
        if obj["kind"] != self.res.kind or self.namespace not in (None, meta.get("namespace")):
            return False
        if any((_field(obj, k) == v) != (op == "=") for k, op, v in self.fields):
            return False
        labels = meta.get("labels") or {}
        return all(k in labels if op == "exists" else k not in labels if op == "!" else
                   (labels.get(k) == v) == (op == "=") for k, op, v in self.labels)


def _hung_up(sock: socket.socket) -> bool:
    """Whether the peer closed the connection (readable with nothing to read), as Go's server notices."""
    try:
        return bool(select.select([sock], [], [], 0)[0]) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


@dataclass(eq=False)
class _Stream:
    """One open watch connection."""
    sock: socket.socket
    muted: bool = False  # silenced: never sends another byte (a hung stream)
    dropped: bool = False


class FakeKubeApi:
    """In-memory objects, one global resourceVersion counter and an event history, served over HTTP."""

    def __init__(self, token: str | tuple[str, ...] | None = None, bookmark_interval: float | None = None) -> None:
        """`token`: the bearer token the API accepts (several during a rotation); None accepts any."""
        self.token, self.bookmark_interval = token, bookmark_interval
        self.url = ""
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self._cond = threading.Condition()  # guards everything below; watch threads wait on it
        self._objects: dict[tuple[str, str, str], dict] = {}  # (kind, namespace, name) -> object
        self._events: list[tuple[int, dict]] = []  # (rv, event), rv ascending
        self._rv = 0
        self._floor = 0  # watches from an rv below this get 410 Expired
        self._resources = {r.kind: r for r in BUILTIN}
        self._forbidden: set[tuple[str, str]] = set()
        self._streams: set[_Stream] = set()
        self._conns: set[socket.socket] = set()
        self._silent = False
        self._server: Optional[_Server] = None
        self._port = 0

    def start(self) -> "FakeKubeApi":
        """Listen on 127.0.0.1: a free port the first time, the same port again after go_down."""
        server = self._server = _Server(("127.0.0.1", self._port), _Handler)
        server.api = self
        self._port = server.server_address[1]
        self.url = f"http://127.0.0.1:{self._port}"
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True, name=f"kubeapi:{self._port}").start()
        return self

    def go_down(self) -> None:
        """Stop listening and cut every connection, watches and idle keep-alives alike; state is kept."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        self._cut(everything=True)

    come_up = start
    stop = go_down

    def __enter__(self) -> "FakeKubeApi":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def resource_version(self) -> int:
        with self._cond:
            return self._rv

    def define(self, kind: str, api_version: str, namespaced: bool = True) -> None:
        """Serve a kind that is not built in (plural: lowercased kind + "s"), cluster-scoped unless
        `namespaced`; `apply` defines one it does not know as namespaced."""
        group, _, version = api_version.partition("/")
        with self._cond:
            self._resources[kind] = Resource(kind, group, version, kind.lower() + "s", namespaced, builtin=False)

    def apply(self, obj: dict) -> dict:
        """Create or replace by (kind, namespace, name); a replace keeps uid and creationTimestamp."""
        obj = copy.deepcopy(obj)
        with self._cond:
            kind, (group, _, version) = obj["kind"], obj.get("apiVersion", "").partition("/")
            if kind not in self._resources:  # a custom kind, served with plural = lowercased kind + "s"
                if not version:
                    raise ValueError(f"unknown kind {kind!r}: give it an apiVersion group/version")
                self._resources[kind] = Resource(kind, group, version, kind.lower() + "s", builtin=False)
            res = self._resources[kind]
            obj.setdefault("apiVersion", res.api_version)
            meta = obj.setdefault("metadata", {})
            if res.namespaced:
                meta.setdefault("namespace", "default")
            else:
                meta.pop("namespace", None)
            key = (res.kind, meta.get("namespace", ""), meta["name"])
            old = self._objects.get(key, {}).get("metadata", {})
            meta.setdefault("uid", old.get("uid") or str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", old.get("creationTimestamp")
                            or datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
            self._objects[key] = self._record("MODIFIED" if old else "ADDED", obj)
            return copy.deepcopy(obj)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict:
        """A copy of a stored object (KeyError if absent; namespace as in `delete`)."""
        with self._cond:
            ns = (namespace or "default") if self._resources[kind].namespaced else ""
            return copy.deepcopy(self._objects[(kind, ns, name)])

    def delete(self, kind: str, name: str, namespace: str | None = None) -> None:
        """Remove an object (KeyError if absent; namespace defaults to "default" for namespaced kinds)."""
        with self._cond:
            ns = (namespace or "default") if self._resources[kind].namespaced else ""
            self._record("DELETED", copy.deepcopy(self._objects.pop((kind, ns, name))))

    def _record(self, type_: str, obj: dict) -> dict:
        """Bump the counter into obj and append the event; stored objects are never mutated after."""
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        self._events.append((self._rv, {"type": type_, "object": obj}))
        self._cond.notify_all()
        return obj

    def compact(self) -> None:
        with self._cond:
            self._events.clear()
            self._floor = self._rv

    def forbid(self, verb: str, resource: str) -> None:
        assert verb in ("get", "list", "watch"), verb
        with self._cond:
            self._forbidden.add((verb, resource))

    def allow(self, verb: str, resource: str) -> None:
        with self._cond:
            self._forbidden.discard((verb, resource))

    def drop_watches(self) -> None:
        """Shut down every watch socket mid-stream: the client sees the body end without its last chunk."""
        self._cut(everything=False)

    def _cut(self, everything: bool) -> None:
        with self._cond:
            for stream in self._streams:
                stream.dropped = True
            socks = list(self._conns) if everything else [s.sock for s in self._streams]
            self._streams.clear()  # gone as soon as this returns, not when their threads notice
            self._cond.notify_all()
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def silence_watches(self, on: bool = True) -> None:
        """Open watches, and those opened while silent, hang: connected, but never another byte,
        not even the end of the stream at timeoutSeconds (a half-open connection)."""
        with self._cond:
            self._silent = on
            for stream in self._streams:
                stream.muted = stream.muted or on

    def watch_count(self) -> int:
        with self._cond:
            return len(self._streams)

    # -- serving, called from handler threads ----------------------------------------------------
    def _route(self, path: str) -> Optional[tuple[Resource, Optional[str], Optional[str]]]:
        """(resource, namespace, name) of a collection or object path; None when there is no such path."""
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if parts[:2] == ["api", "v1"]:
            group, version, rest = "", "v1", parts[2:]
        elif parts[0] == "apis" and len(parts) >= 3:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return None
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        if not 1 <= len(rest) <= 2:
            return None
        with self._cond:
            res = next((r for r in self._resources.values()
                        if (r.group, r.version, r.plural) == (group, version, rest[0])), None)
        name = rest[1] if len(rest) == 2 else None
        if res is None or (namespace is not None or bool(name)) and res.namespaced != (namespace is not None):
            return None  # no such resource, or a namespaced path for a cluster-scoped one or vice versa
        return res, namespace, name

    def _denied(self, verb: str, res: Resource, namespace: Optional[str], name: Optional[str]) -> Optional[dict]:
        with self._cond:
            if (verb, res.plural) not in self._forbidden:
                return None
        subject = f'{res.qualified} "{name}"' if name else res.qualified
        scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
        return status(403, "Forbidden", f'{subject} is forbidden: User "{USER}" cannot {verb} resource '
                      f'"{res.plural}" in API group "{res.group}" {scope}', _details(res, name))

    def _get(self, res: Resource, namespace: Optional[str], name: str) -> tuple[int, dict]:
        with self._cond:
            obj = self._objects.get((res.kind, namespace or "", name))
        if obj is None:
            return 404, status(404, "NotFound", f'{res.qualified} "{name}" not found', _details(res, name))
        return 200, obj

    def _list(self, q: _Query, query: dict[str, str]) -> tuple[int, dict]:
        """Items sorted by namespace/name; a `limit` page's continue token names the key to resume after."""
        with self._cond:
            items = sorted((o for o in self._objects.values() if q.matches(o)), key=_key)
            rv = self._rv
        if query.get("continue"):
            try:
                after = tuple(json.loads(base64.urlsafe_b64decode(query["continue"]))["start"])
            except (ValueError, KeyError, TypeError):
                return 400, status(400, "BadRequest", "continue key is not valid: illegal base64 data")
            items = [o for o in items if _key(o) > after]
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        limit = int(query.get("limit") or 0)
        if 0 < limit < len(items):
            token = {"v": "meta.k8s.io/v1", "rv": rv, "start": _key(items[limit - 1])}
            meta["continue"] = base64.urlsafe_b64encode(json.dumps(token).encode()).decode()
            meta["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        if q.res.builtin:  # items of typed lists carry no kind/apiVersion; unstructured (CRD) ones do
            items = [{k: v for k, v in o.items() if k not in ("kind", "apiVersion")} for o in items]
        return 200, {"kind": q.res.kind + "List", "apiVersion": q.res.api_version, "metadata": meta, "items": items}

    def _follow(self, q: _Query, rv: str, stream: _Stream, timeout: Optional[float],
                bookmarks: bool, initial_events: bool = False) -> Iterator[list[dict]]:
        """Batches of watch events for one connection, until timeoutSeconds passes or it is dropped.
        `initial_events` (sendInitialEvents=true, a streaming list as client-go's reflector asks for
        by default since 1.35): the current state as ADDED events, then a BOOKMARK annotated
        k8s.io/initial-events-end, as kube-apiserver sends it."""
        now = time.monotonic()
        deadline = now + timeout if timeout is not None else math.inf
        interval = self.bookmark_interval if bookmarks and self.bookmark_interval else math.inf
        next_bookmark = now + interval
        with self._cond:
            expired = rv not in ("", "0") and int(rv) < self._floor
            if rv in ("", "0"):  # no history asked for: the current state as synthetic ADDED events
                batch = [{"type": "ADDED", "object": o}
                         for o in sorted(self._objects.values(), key=_key) if q.matches(o)]
            elif expired:
                message = f"too old resource version: {rv} ({self._floor})"
                batch = [{"type": "ERROR", "object": status(410, "Expired", message)}]
            else:
                batch = []
            cursor = int(rv) if rv not in ("", "0") and not expired else self._rv
            if initial_events and rv in ("", "0"):
                batch.append({"type": "BOOKMARK", "object": {
                    "kind": q.res.kind, "apiVersion": q.res.api_version, "metadata": {
                        "resourceVersion": str(cursor), "annotations": {"k8s.io/initial-events-end": "true"}}}})
            muted = stream.muted
        if not muted:
            yield batch
            if expired:
                return
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    if stream.dropped or (now >= deadline and not stream.muted):
                        return  # a hung stream does not even end at timeoutSeconds
                    if not stream.muted:
                        start = bisect.bisect_right(self._events, cursor, key=lambda e: e[0])
                        batch = [ev for _, ev in self._events[start:] if q.matches(ev["object"])]
                        cursor = self._rv
                        if now >= next_bookmark:
                            next_bookmark = now + interval
                            batch.append({"type": "BOOKMARK", "object": {
                                "kind": q.res.kind, "apiVersion": q.res.api_version,
                                "metadata": {"resourceVersion": str(cursor)}}})
                        if batch:
                            break
                    wake = math.inf if stream.muted else min(deadline, next_bookmark)
                    self._cond.wait(min(wake - now, 0.05))  # poll, to notice a client that hung up
                    stream.dropped = stream.dropped or _hung_up(stream.sock)
            yield batch


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    api: FakeKubeApi

    def server_bind(self) -> None:
        """Skip HTTPServer's reverse DNS lookup of the host, which can stall in sandboxes."""
        TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        with self.server.api._cond:  # tracked so go_down can cut idle keep-alive connections too
            self.server.api._conns.add(self.connection)

    def finish(self) -> None:
        with self.server.api._cond:
            self.server.api._conns.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        api = self.server.api
        url = urlsplit(self.path)
        query = dict(parse_qsl(url.query, keep_blank_values=True))
        with api._cond:
            api.requests.append(("GET", url.path, query))
        accepted = (api.token,) if isinstance(api.token, str) else api.token or ()
        if accepted and self.headers.get("Authorization") not in {f"Bearer {t}" for t in accepted}:
            return self._send(401, status(401, "Unauthorized", "Unauthorized"))
        route = api._route(url.path)
        if route is None:
            return self._send(404, status(404, "NotFound", "the server could not find the requested resource"))
        res, namespace, name = route
        watch = query.get("watch") in TRUE
        denied = api._denied("watch" if watch else "get" if name else "list", res, namespace, name)
        if denied:
            return self._send(403, denied)
        fields = parse_selector(query.get("fieldSelector", "")) + ([("metadata.name", "=", name)] if name else [])
        q = _Query(res, namespace, fields, parse_selector(query.get("labelSelector", "")))
        if watch:
            return self._watch(q, query)
        self._send(*(api._get(res, namespace, name) if name else api._list(q, query)))

    def _watch(self, q: _Query, query: dict[str, str]) -> None:
        """A chunked stream of one JSON event per line; ends with the zero chunk unless dropped."""
        api = self.server.api
        rv = query.get("resourceVersion", "")
        if rv and not rv.isdigit():
            return self._send(400, status(400, "BadRequest", f'invalid resource version: "{rv}"'))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        with api._cond:
            stream = _Stream(self.connection, muted=api._silent)
            api._streams.add(stream)
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        events = api._follow(q, rv, stream, timeout, query.get("allowWatchBookmarks") in TRUE,
                             query.get("sendInitialEvents") in TRUE)
        try:
            for batch in events:
                for event in batch:
                    line = json.dumps(event).encode() + b"\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            if not stream.dropped:
                self.wfile.write(b"0\r\n\r\n")
        except OSError:
            stream.dropped = True
        finally:
            events.close()
            with api._cond:
                api._streams.discard(stream)
            self.close_connection = self.close_connection or stream.dropped
