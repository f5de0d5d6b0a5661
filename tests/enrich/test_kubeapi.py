"""The FakeKubeApi test server, checked against the unpatched official `kubernetes` client: if these
pass, code under test that uses the client sees what it would see from a real apiserver."""

from __future__ import annotations

import json
import threading
import time
from typing import Callable, Iterator

import pytest
import urllib3
from kubernetes import client, watch
from kubernetes.client import ApiClient, Configuration
from kubernetes.client.exceptions import ApiException

from kubeapi import FakeKubeApi
from support import eventually, poll

TOKEN = "s3cret-token"


def pod(name: str, ns: str = "default", node: str = "gpu-1", **labels: str) -> dict:
    return {"kind": "Pod", "metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {"nodeName": node, "containers": [{"name": "main", "image": "cuda:12"}]},
            "status": {"phase": "Running"}}


def connect(server: FakeKubeApi, token: str | None = TOKEN) -> ApiClient:
    cfg = Configuration(host=server.url)
    if token:
        cfg.api_key = {"authorization": token}
        cfg.api_key_prefix = {"authorization": "Bearer"}
    return ApiClient(cfg)


@pytest.fixture
def server() -> Iterator[FakeKubeApi]:
    with FakeKubeApi(token=TOKEN, bookmark_interval=0.1) as api:
        yield api


@pytest.fixture
def api_client(server: FakeKubeApi) -> Iterator[ApiClient]:
    with connect(server) as c:
        yield c


@pytest.fixture
def v1(api_client: ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api_client)


def soon(action: Callable[[], None], when: Callable[[], bool] = lambda: True) -> threading.Thread:
    """Run `action` on a thread once `when()` holds (e.g. once a watch is open)."""
    def run() -> None:
        poll(when, 3, interval=0.01)
        action()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def raw_lines(resp: urllib3.HTTPResponse, count: int | None = None) -> list[dict]:
    """Watch events from a raw response: `count` of them, or all until the stream ends."""
    events: list[dict] = []
    buffer = b""
    for chunk in resp.stream():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        events += [json.loads(line) for line in lines if line]
        if count is not None and len(events) >= count:
            resp.close()
            break
    return events


def first(stream: Iterator[dict], count: int = 1) -> list[dict]:
    """The first `count` events of a Watch().stream, without waiting for its timeout."""
    return [event for _, event in zip(range(count), stream)]


def body(exc: ApiException) -> dict:
    return json.loads(exc.body)


def test_typed_pod_list(server: FakeKubeApi, v1: client.CoreV1Api) -> None:
    server.apply(pod("b", "ml", node="gpu-2", team="vision"))
    server.apply(pod("a", "ml"))
    stored = server.apply(pod("z", "default"))
    pods = v1.list_pod_for_all_namespaces()
    assert isinstance(pods, client.V1PodList) and pods.kind == "PodList" and pods.api_version == "v1"
    assert pods.metadata.resource_version == str(server.resource_version) == "3"
    assert [(p.metadata.namespace, p.metadata.name) for p in pods.items] == [("default", "z"), ("ml", "a"), ("ml", "b")]
    b = pods.items[2]
    assert (b.spec.node_name, b.metadata.labels, b.status.phase) == ("gpu-2", {"team": "vision"}, "Running")
    assert b.metadata.resource_version == "1" and b.spec.containers[0].image == "cuda:12"
    z = pods.items[0].metadata
    assert z.uid == stored["metadata"]["uid"] and z.creation_timestamp is not None
    assert [p.metadata.name for p in v1.list_namespaced_pod("ml").items] == ["a", "b"]
    assert server.requests[0] == ("GET", "/api/v1/pods", {})
    assert server.requests[1][1] == "/api/v1/namespaces/ml/pods"
    # raw list items carry no kind/apiVersion, as a real apiserver's typed lists
    raw = json.loads(v1.list_namespaced_pod("ml", _preload_content=False).data)
    assert raw["kind"] == "PodList" and "kind" not in raw["items"][0]


def test_pagination_with_limit_and_continue(server: FakeKubeApi, v1: client.CoreV1Api) -> None:
    for i in range(5):
        server.apply(pod(f"p{i}", "ns"))
    first = v1.list_pod_for_all_namespaces(limit=2)
    assert [p.metadata.name for p in first.items] == ["p0", "p1"] and first.metadata.remaining_item_count == 3
    second = v1.list_pod_for_all_namespaces(limit=2, _continue=first.metadata._continue)
    third = v1.list_pod_for_all_namespaces(limit=2, _continue=second.metadata._continue)
    assert [p.metadata.name for p in second.items + third.items] == ["p2", "p3", "p4"]
    assert third.metadata._continue is None and third.metadata.remaining_item_count is None
    assert server.requests[1][2] == {"limit": "2", "continue": first.metadata._continue}
    with pytest.raises(ApiException) as bad:
        v1.list_pod_for_all_namespaces(_continue="garbage")
    assert bad.value.status == 400


def test_field_and_label_selectors(server: FakeKubeApi, v1: client.CoreV1Api) -> None:
    server.apply(pod("a", "ml", node="gpu-1", app="train"))
    server.apply(pod("b", "ml", node="gpu-2", app="serve"))
    server.apply(pod("c", "web", node="gpu-1"))
    names = lambda **kw: [p.metadata.name for p in v1.list_pod_for_all_namespaces(**kw).items]  # noqa: E731
    assert names(field_selector="spec.nodeName=gpu-1") == ["a", "c"]
    assert names(field_selector="spec.nodeName=gpu-1,metadata.namespace!=web") == ["a"]
    assert names(field_selector="metadata.name==b") == ["b"]
    assert names(label_selector="app=train") == ["a"]
    assert names(label_selector="app!=train") == ["b", "c"]
    assert names(label_selector="app") == ["a", "b"]
    assert server.requests[0][2] == {"fieldSelector": "spec.nodeName=gpu-1"}


def test_watch_from_a_listed_resource_version(server: FakeKubeApi, v1: client.CoreV1Api) -> None:
    server.apply({"kind": "Namespace", "metadata": {"name": "old"}})
    rv = v1.list_namespace().metadata.resource_version
    server.apply({"kind": "Namespace", "metadata": {"name": "ml"}})  # before the watch: replayed from history

    def change() -> None:
        server.apply({"kind": "Namespace", "metadata": {"name": "ml", "labels": {"team": "a"}}})
        server.delete("Namespace", "ml")
    soon(change, when=lambda: server.watch_count() == 1)
    w = watch.Watch()
    seen = []
    for event in w.stream(v1.list_namespace, resource_version=rv, timeout_seconds=2):
        seen.append((event["type"], event["object"].metadata.name, event["object"].metadata.resource_version))
        if event["type"] == "DELETED":
            w.stop()
    assert seen == [("ADDED", "ml", "2"), ("MODIFIED", "ml", "3"), ("DELETED", "ml", "4")]
    assert isinstance(event["object"], client.V1Namespace) and event["object"].metadata.labels == {"team": "a"}
    assert server.requests[-1][2] == {"resourceVersion": "1", "timeoutSeconds": "2", "watch": "true"}


def test_watch_without_resource_version_starts_with_synthetic_added(server: FakeKubeApi, v1: client.CoreV1Api) -> None:
    server.apply(pod("a", "ml", node="gpu-1"))
    server.apply(pod("b", "ml", node="gpu-2"))
    resp = v1.list_pod_for_all_namespaces(watch=True, field_selector="spec.nodeName=gpu-2", _preload_content=False,
                                          _request_timeout=3)
    assert resp.headers["Content-Type"] == "application/json" and resp.headers["Transfer-Encoding"] == "chunked"
    soon(lambda: (server.apply(pod("c", "ml", node="gpu-1")), server.apply(pod("d", "ml", node="gpu-2"))))
    events = raw_lines(resp, 2)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "b"), ("ADDED", "d")]
    assert events[0]["object"]["kind"] == "Pod" and events[0]["object"]["apiVersion"] == "v1"


def test_compacted_history_gives_410(server: FakeKubeApi, v1: client.CoreV1Api) -> None:
    server.apply({"kind": "Namespace", "metadata": {"name": "a"}})
    server.apply({"kind": "Namespace", "metadata": {"name": "b"}})
    server.compact()
    resp = v1.list_namespace(watch=True, resource_version="1", _preload_content=False)
    assert resp.status == 200
    [error] = raw_lines(resp)  # the ERROR event, then the stream ends
    assert error == {"type": "ERROR", "object": {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": "too old resource version: 1 (2)", "reason": "Expired", "code": 410}}
    with pytest.raises(ApiException) as gone:
        list(watch.Watch().stream(v1.list_namespace, resource_version="1", timeout_seconds=1))
    assert gone.value.status == 410 and "Expired" in gone.value.reason
    # from the compaction point on, history is whole again
    server.apply({"kind": "Namespace", "metadata": {"name": "c"}})
    events = first(watch.Watch().stream(v1.list_namespace, resource_version="2", timeout_seconds=2))
    assert [e["object"].metadata.name for e in events] == ["c"]


def test_bookmarks(server: FakeKubeApi, v1: client.CoreV1Api) -> None:
    server.apply(pod("a"))
    w = watch.Watch()
    for event in w.stream(v1.list_namespaced_pod, "default", resource_version="1", allow_watch_bookmarks=True,
                          timeout_seconds=2):
        if event["type"] == "BOOKMARK":
            w.stop()
    assert event["raw_object"] == {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}}
    assert w.resource_version == "1"
    # without allowWatchBookmarks nothing comes, and timeoutSeconds ends the stream cleanly
    started = time.monotonic()
    assert list(watch.Watch().stream(v1.list_namespaced_pod, "default", resource_version="1", timeout_seconds=1)) == []
    assert 0.9 < time.monotonic() - started < 2


def test_drop_watches_breaks_open_stream(server: FakeKubeApi, v1: client.CoreV1Api) -> None:
    resp = v1.list_namespace(watch=True, resource_version="0", _preload_content=False, _request_timeout=3)
    soon(server.drop_watches, when=lambda: server.watch_count() == 1)
    with pytest.raises(urllib3.exceptions.ProtocolError):
        b"".join(resp.stream())
    assert server.watch_count() == 0
    assert v1.list_namespace().items == []  # the server itself is fine


def test_client_hanging_up_ends_its_watch(server: FakeKubeApi, v1: client.CoreV1Api) -> None:
    resp = v1.list_namespace(watch=True, _preload_content=False)
    eventually(lambda: server.watch_count() == 1)
    resp.close()
    eventually(lambda: server.watch_count() == 0)


def test_silenced_watch_hangs(server: FakeKubeApi, v1: client.CoreV1Api) -> None:
    resp = v1.list_namespace(watch=True, allow_watch_bookmarks=True, _preload_content=False, _request_timeout=(1, 0.4))
    server.silence_watches()
    eventually(lambda: server.watch_count() == 1)  # the server holds the watch, silent
    server.apply({"kind": "Namespace", "metadata": {"name": "ml"}})
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        b"".join(resp.stream())
    resp.close()
    eventually(lambda: server.watch_count() == 0)  # and lets it go once the client hangs up
    server.silence_watches(False)
    events = first(watch.Watch().stream(v1.list_namespace, resource_version="0", timeout_seconds=2))
    assert [(e["type"], e["object"].metadata.name) for e in events] == [("ADDED", "ml")]


def test_go_down_and_come_up_on_same_port(server: FakeKubeApi, v1: client.CoreV1Api) -> None:
    server.apply(pod("a"))
    url = server.url
    resp = v1.list_pod_for_all_namespaces(watch=True, _preload_content=False, _request_timeout=3)
    soon(server.go_down, when=lambda: server.watch_count() == 1)
    with pytest.raises(urllib3.exceptions.ProtocolError):
        b"".join(resp.stream())
    with pytest.raises(urllib3.exceptions.MaxRetryError) as refused:
        v1.list_pod_for_all_namespaces()
    assert isinstance(refused.value.reason, urllib3.exceptions.NewConnectionError)
    server.apply(pod("b"))  # state changes while down are kept
    server.come_up()
    assert server.url == url
    pods = v1.list_pod_for_all_namespaces()
    assert [p.metadata.name for p in pods.items] == ["a", "b"] and pods.metadata.resource_version == "2"


def test_forbidden(server: FakeKubeApi, api_client: ApiClient, v1: client.CoreV1Api) -> None:
    user = 'User "system:serviceaccount:otelgpu:otelgpu"'
    server.forbid("list", "pods")
    with pytest.raises(ApiException) as denied:
        v1.list_pod_for_all_namespaces()
    assert denied.value.status == 403 and body(denied.value) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "Forbidden",
        "message": f'pods is forbidden: {user} cannot list resource "pods" in API group "" at the cluster scope',
        "details": {"kind": "pods"}, "code": 403}
    with pytest.raises(ApiException) as denied:
        v1.list_namespaced_pod("ml")
    assert body(denied.value)["message"].endswith('in the namespace "ml"')
    assert v1.list_pod_for_all_namespaces(watch=True, _preload_content=False).status == 200  # watch is its own verb
    server.forbid("watch", "pods")
    with pytest.raises(ApiException) as denied:
        list(watch.Watch().stream(v1.list_pod_for_all_namespaces, timeout_seconds=1))
    assert 'cannot watch resource "pods"' in body(denied.value)["message"]
    server.allow("list", "pods")
    assert v1.list_pod_for_all_namespaces().items == []
    server.forbid("get", "replicasets")
    with pytest.raises(ApiException) as denied:
        client.AppsV1Api(api_client).read_namespaced_replica_set("rs", "ml")
    assert body(denied.value)["message"] == (f'replicasets.apps "rs" is forbidden: {user} cannot get resource '
                                             '"replicasets" in API group "apps" in the namespace "ml"')


def test_bearer_token_enforced(server: FakeKubeApi) -> None:
    for token in (None, "wrong"):
        with connect(server, token) as anonymous, pytest.raises(ApiException) as refused:
            client.CoreV1Api(anonymous).list_node()
        assert refused.value.status == 401 and body(refused.value)["reason"] == "Unauthorized"
    with connect(server) as good:
        assert client.CoreV1Api(good).list_node().items == []


def test_get_objects_of_each_api_group(server: FakeKubeApi, api_client: ApiClient, v1: client.CoreV1Api) -> None:
    server.apply({"kind": "Node", "metadata": {"name": "gpu-1", "labels": {"node.kubernetes.io/instance-type": "p4d"}}})
    server.apply({"kind": "ReplicaSet", "metadata": {"name": "web-5d9", "namespace": "ml", "ownerReferences": [
        {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web", "uid": "u1", "controller": True}]},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}}}})
    server.apply({"kind": "Job", "apiVersion": "batch/v1", "metadata": {"name": "train", "namespace": "ml"},
                  "spec": {"template": {"spec": {"containers": [{"name": "c", "image": "x"}]}}}})
    server.apply({"kind": "RayCluster", "apiVersion": "ray.io/v1", "metadata": {"name": "rc", "namespace": "ml"},
                  "spec": {"headGroupSpec": {}}})
    apps = client.AppsV1Api(api_client)
    rs = apps.read_namespaced_replica_set("web-5d9", "ml")
    assert rs.kind == "ReplicaSet" and rs.spec.replicas == 2 and rs.metadata.owner_references[0].name == "web"
    assert client.BatchV1Api(api_client).read_namespaced_job("train", "ml").metadata.resource_version == "3"
    assert v1.read_node("gpu-1").metadata.labels["node.kubernetes.io/instance-type"] == "p4d"
    custom = client.CustomObjectsApi(api_client)
    rc = custom.get_namespaced_custom_object("ray.io", "v1", "ml", "rayclusters", "rc")
    assert rc["kind"] == "RayCluster" and rc["metadata"]["resourceVersion"] == "4"
    assert custom.list_namespaced_custom_object("ray.io", "v1", "ml", "rayclusters")["items"][0]["kind"] == "RayCluster"
    with pytest.raises(ApiException) as missing:
        apps.read_namespaced_replica_set("nope", "ml")
    assert missing.value.status == 404 and body(missing.value) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "NotFound",
        "message": 'replicasets.apps "nope" not found',
        "details": {"name": "nope", "group": "apps", "kind": "replicasets"},
        "code": 404}
    with pytest.raises(ApiException) as missing:
        v1.read_namespaced_pod("x", "ml")
    assert body(missing.value)["message"] == 'pods "x" not found'
    assert body(missing.value)["details"] == {"name": "x", "kind": "pods"}
    with pytest.raises(ApiException) as unknown:  # a CRD that is not installed
        custom.list_cluster_custom_object("kubeflow.org", "v1", "pytorchjobs")
    assert unknown.value.status == 404


def test_stop_is_prompt_with_open_watches(v1: client.CoreV1Api, server: FakeKubeApi) -> None:
    streams = [v1.list_namespace(watch=True, _preload_content=False, _request_timeout=3) for _ in range(3)]
    eventually(lambda: server.watch_count() == 3)
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 0.5
    for resp in streams:
        with pytest.raises(urllib3.exceptions.ProtocolError):
            b"".join(resp.stream())
