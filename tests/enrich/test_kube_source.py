"""The Kubernetes API source with the real `kubernetes` client against a local API endpoint that
serves list and watch as the API server does (tests/kubeapi.py): list then watch, 410, bookmarks,
dropped and silent connections, the API going away, refusals, node scope, owners, grace."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import pytest
from kubeapi import FakeKubeApi

from otelgpu.enrich.config import KubernetesConfig, TagRule, TagValuesConfig, default_tags
from otelgpu.enrich.kube.source import KubeSource
from otelgpu.enrich.labels import TagResolver, TagValues
from otelgpu.enrich.workload import workload
from otelgpu.telemetry import SelfMetrics, by_label
from support import eventually as support_eventually

NODE_A, NODE_B = "ip-10-0-1-1.ec2.internal", "ip-10-0-1-2.ec2.internal"


def pod(name: str, node: str = NODE_A, namespace: str = "ml", labels: dict | None = None,
        owner: tuple[str, str] | None = None, gpus: int = 1, phase: str = "Running", **meta: Any) -> dict:
    m: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels or {}, **meta}
    if owner:
        m["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": owner[0], "name": owner[1], "uid": "u",
                                 "controller": True}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": m,
            "spec": {"nodeName": node, "containers": [{"name": "main", "resources": {"requests": {
                "nvidia.com/gpu": str(gpus), "cpu": "500m", "memory": "8Gi"}}}]},
            "status": {"phase": phase}}


def node(name: str, instance_type: str = "p4d.24xlarge") -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"node.kubernetes.io/instance-type": instance_type,
                                                  "kubernetes.io/hostname": name, "unrelated/label": "x"}},
            "status": {"capacity": {"cpu": "96", "memory": "1152Gi", "nvidia.com/gpu": "8"}}}


def namespace(name: str, labels: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}}


def config(api: FakeKubeApi, **overrides: Any) -> KubernetesConfig:
    base = dict(enabled=True, auth="token", api_url=api.url, token="secret", watch_timeout_seconds=30,
                backoff_initial_seconds=0.05, backoff_max_seconds=0.2, page_size=2)
    return KubernetesConfig(**{**base, **overrides})


def tags(**rules: TagRule) -> TagResolver:
    return TagResolver({**default_tags(), **rules}, TagValues(TagValuesConfig()))


def eventually(check: Callable[[], Any], timeout: float = 5.0) -> Any:
    """support.eventually, a KeyError or failed assertion inside `check` meaning "not yet"."""
    return support_eventually(check, timeout, ignoring=(KeyError, AssertionError))


@pytest.fixture
def api():
    with FakeKubeApi(token="secret") as server:
        server.apply(namespace("ml", {"team": "ml-research", "cost-center": "cc-7"}))
        server.apply(node(NODE_A))
        server.apply(node(NODE_B))
        yield server


@pytest.fixture
def started():
    sources: list[KubeSource] = []

    def start(api: FakeKubeApi, tag_resolver: TagResolver | None = None, clock: Callable[[], float] = time.time,
              **overrides: Any) -> KubeSource:
        source = KubeSource(config(api, **overrides), tag_resolver or tags(), SelfMetrics(), clock=clock)
        source.start()
        sources.append(source)
        assert source.wait_synced(5.0), "the first lists did not complete"
        return source

    yield start
    for s in sources:
        s.shutdown()


def test_lists_then_watches_and_keeps_only_the_fields_it_uses(api, started):
    for i in range(5):  # more than one page (page_size 2)
        api.apply(pod(f"train-{i}", labels={"team": "vision", "app": "x" * 300},
                      annotations={"kubectl.kubernetes.io/last-applied-configuration": "{" + "y" * 5000 + "}"}))
    source = started(api)
    assert by_label(source.metrics.kube_objects)["pods"] == 5  # published on every change, not per interval
    view = source.view()
    assert len(view.pods) == 5
    p = view.pods[("ml", "train-0")]
    assert p.labels == {"label_team": "vision"}  # only the label keys the tag rules read
    assert p.annotations == {}
    assert p.requests == {("main", "nvidia_com_gpu"): 1.0, ("main", "cpu"): 0.5, ("main", "memory"): 8 * 2**30}
    assert (p.node, p.phase) == (NODE_A, "Running")
    assert view.nodes[NODE_A].labels == {"label_node_kubernetes_io_instance_type": "p4d.24xlarge"}
    assert view.nodes[NODE_A].capacity["nvidia_com_gpu"] == 8.0
    assert view.namespace_labels("ml") == {"label_team": "ml-research", "label_cost_center": "cc-7"}
    lists = [q for m, path, q in api.requests if path == "/api/v1/pods" and q.get("watch") != "true"]
    assert [q.get("limit") for q in lists] == ["2", "2", "2"] and "continue" in lists[1]

    api.apply(pod("train-0", labels={"team": "speech"}))  # relabelled: arrives by watch
    eventually(lambda: source.view().pods[("ml", "train-0")].labels == {"label_team": "speech"})
    watches = [q for m, path, q in api.requests if path == "/api/v1/pods" and q.get("watch") == "true"]
    assert watches[0]["allowWatchBookmarks"] == "true" and int(watches[0]["resourceVersion"]) > 0
    events = by_label(source.metrics.kube_events)
    assert events[("pods", "MODIFIED")] == 1


def test_relists_when_the_watch_is_too_old(api, started):
    api.apply(pod("a"))
    source = started(api)
    api.go_down()
    api.apply(pod("b"))  # happens while otelgpu is disconnected ...
    api.delete("Pod", "a", "ml")
    api.compact()  # ... and the history it would resume from is gone
    api.come_up()
    view = eventually(lambda: (v := source.view()) and ("ml", "b") in v.pods and v)
    assert view.pods[("ml", "a")].deleted  # missing from the relist: kept for the grace period, holding nothing
    assert by_label(source.metrics.kube_lists)[("pods", "gone")] >= 1
    assert by_label(source.metrics.kube_errors)[("pods", "watch", "gone")] >= 1


def test_bookmarks_move_the_resume_point(started):
    with FakeKubeApi(token="secret", bookmark_interval=0.1) as api:
        api.apply(namespace("ml"))
        api.apply(node(NODE_A))
        source = started(api)
        listed = api.resource_version
        api.apply(namespace("other"))  # moves the global resourceVersion; no pod event follows
        # a bookmark sent before the namespace came carries the list's version: wait for one after it
        pods = next(r for r in source.reflectors if r.spec.resource == "pods")
        eventually(lambda: int(pods.version or 0) > listed)
        assert by_label(source.metrics.kube_events).get(("pods", "BOOKMARK"), 0) >= 1  # only bookmarks moved it
        api.drop_watches()
        resumed = eventually(lambda: [int(q["resourceVersion"]) for _, path, q in api.requests
                                      if path == "/api/v1/pods" and q.get("watch") == "true"][1:])
        assert resumed[0] > listed  # resumed from the bookmark, not from the list


def test_dropped_connection_reconnects_and_misses_nothing(api, started):
    source = started(api)
    api.drop_watches()
    api.apply(pod("after-drop"))
    eventually(lambda: ("ml", "after-drop") in source.view().pods)
    assert by_label(source.metrics.kube_lists) == {("pods", "initial"): 1, ("namespaces", "initial"): 1,
                                                       ("nodes", "initial"): 1}  # resumed, not relisted


def test_silent_stream_is_abandoned_and_resumed(api, started):
    source = started(api, watch_timeout_seconds=1)
    api.silence_watches(True)
    api.apply(pod("during-silence"))
    # The silent stream is given up after watch_timeout_seconds without delivering the change.
    eventually(lambda: by_label(source.metrics.kube_errors).get(("pods", "watch", "timeout"), 0) >= 1,
               timeout=8.0)
    assert ("ml", "during-silence") not in source.view().pods
    api.silence_watches(False)
    eventually(lambda: ("ml", "during-silence") in source.view().pods, timeout=8.0)
    assert by_label(source.metrics.kube_errors)[("pods", "watch", "timeout")] >= 1  # not the server's end


def test_api_down_for_a_while_keeps_facts_and_catches_up(api, started):
    api.apply(pod("a", labels={"team": "vision"}))
    source = started(api)
    api.go_down()
    eventually(lambda: by_label(source.metrics.kube_errors).get(("pods", "watch", "connection"), 0) >= 2,
               timeout=30)  # several failed reconnects with backoff
    assert source.view().pods[("ml", "a")].labels == {"label_team": "vision"}  # last known facts kept
    api.apply(pod("a", labels={"team": "speech"}))
    api.come_up()
    eventually(lambda: source.view().pods[("ml", "a")].labels == {"label_team": "speech"}, timeout=5.0)


def test_missing_rbac_names_verb_and_resource_and_the_rest_goes_on(api, started, caplog):
    api.apply(pod("a"))
    api.forbid("list", "namespaces")
    caplog.set_level(logging.ERROR, logger="otelgpu")
    source = KubeSource(config(api), tags(), SelfMetrics())
    source.start()
    try:
        eventually(lambda: ("ml", "a") in source.view().pods)
        eventually(lambda: by_label(source.metrics.kube_errors).get(("namespaces", "list", "forbidden"), 0) >= 1)
        assert not source.synced()
        eventually(lambda: "refuses to list namespaces" in caplog.text)  # logged after it is counted
        assert 'cannot list resource "namespaces"' in caplog.text
        api.allow("list", "namespaces")
        eventually(source.synced)
        assert source.view().namespace_labels("ml")["label_team"] == "ml-research"
    finally:
        source.shutdown()


def test_node_scope_sees_only_its_node(api, started):
    api.apply(pod("here", node=NODE_A))
    api.apply(pod("there", node=NODE_B))
    source = started(api, scope="node", node_name=NODE_A)
    api.apply(pod("there-too", node=NODE_B))
    api.apply(pod("here-too", node=NODE_A))
    view = eventually(lambda: (v := source.view()) and ("ml", "here-too") in v.pods and v)
    assert set(view.pods) == {("ml", "here"), ("ml", "here-too")}
    assert set(view.nodes) == {NODE_A}
    pod_queries = [q for _, path, q in api.requests if path == "/api/v1/pods"]
    assert pod_queries and all(q["fieldSelector"] == f"spec.nodeName={NODE_A}" for q in pod_queries)


def test_deleted_pod_kept_for_grace_then_forgotten_and_recreated_fresh(api, started):
    now = [time.time()]
    api.apply(pod("job-0", labels={"team": "vision"}))
    source = started(api, clock=lambda: now[0], deleted_pod_grace_seconds=120)
    api.delete("Pod", "job-0", "ml")
    p = eventually(lambda: (q := source.view().pods[("ml", "job-0")]).deleted and q)
    assert p.labels == {"label_team": "vision"}  # its last interval still resolves its tags
    now[0] += 121
    assert ("ml", "job-0") not in source.view().pods
    api.apply(pod("job-0", labels={"team": "speech"}))  # the same name, a new pod
    p = eventually(lambda: source.view().pods[("ml", "job-0")])
    assert not p.deleted and p.labels == {"label_team": "speech"}


def test_owner_chains_resolve_to_workloads(api, started):
    api.apply({"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {
        "name": "serve-7d9f8", "namespace": "ml", "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "Deployment", "name": "serve", "uid": "d", "controller": True}]}})
    api.apply({"apiVersion": "batch/v1", "kind": "Job", "metadata": {
        "name": "nightly-29000000", "namespace": "ml", "ownerReferences": [
            {"apiVersion": "batch/v1", "kind": "CronJob", "name": "nightly", "uid": "c", "controller": True}]}})
    api.apply({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "adhoc", "namespace": "ml"}})
    api.apply(pod("serve-7d9f8-abcde", owner=("ReplicaSet", "serve-7d9f8")))
    api.apply(pod("nightly-29000000-x", owner=("Job", "nightly-29000000")))
    api.apply(pod("adhoc-q", owner=("Job", "adhoc")))
    api.apply(pod("ray-worker", owner=("RayCluster", "llm-pretrain")))
    api.apply(pod("ddp-master-0", owner=("PyTorchJob", "resnet-ddp")))
    api.apply(pod("db-0", owner=("StatefulSet", "db")))
    api.apply(pod("bare"))
    source = started(api)

    def resolved() -> dict:
        v = source.view()
        return {name: workload(ns, name, p, v.owners) for (ns, name), p in v.pods.items()}

    want = {"serve-7d9f8-abcde": ("Deployment", "serve"), "nightly-29000000-x": ("CronJob", "nightly"),
            "adhoc-q": ("Job", "adhoc"), "ray-worker": ("RayCluster", "llm-pretrain"),
            "ddp-master-0": ("PyTorchJob", "resnet-ddp"), "db-0": ("StatefulSet", "db"), "bare": ("Pod", "bare")}
    # serve-7d9f8 also resolves by the template-hash pattern, so wait for the owner facts themselves
    looked_up = {("ml", "ReplicaSet", "serve-7d9f8"), ("ml", "Job", "nightly-29000000"), ("ml", "Job", "adhoc")}
    eventually(lambda: looked_up <= set(source.view().owners))
    assert resolved() == want
    gets = {path for m, path, q in api.requests if "/replicasets/" in path or "/jobs/" in path}
    assert gets == {"/apis/apps/v1/namespaces/ml/replicasets/serve-7d9f8",
                    "/apis/batch/v1/namespaces/ml/jobs/nightly-29000000", "/apis/batch/v1/namespaces/ml/jobs/adhoc"}


def test_owner_lookup_refused_falls_back_to_the_name_pattern(api, started, caplog):
    api.forbid("get", "replicasets")
    caplog.set_level(logging.ERROR, logger="otelgpu")
    api.apply(pod("serve-7d9f8b6c4-xk2pq", owner=("ReplicaSet", "serve-7d9f8b6c4"),
                  labels={"pod-template-hash": "7d9f8b6c4"}))
    source = started(api)
    eventually(lambda: by_label(source.metrics.kube_errors).get(("replicasets", "get", "forbidden")))
    v = source.view()
    assert workload("ml", "serve-7d9f8b6c4-xk2pq", v.pods[("ml", "serve-7d9f8b6c4-xk2pq")], v.owners) == \
        ("Deployment", "serve")
    assert "refuses to get replicasets" in caplog.text


def test_annotations_and_value_caps_in_tags(api, started):
    metrics = SelfMetrics()
    resolver = TagResolver({**default_tags(), "model": TagRule(pod_labels=("model",),
                                                                annotations=("ml.example.com/model",))},
                           TagValues(TagValuesConfig(case="lower", max_length=12, max_distinct=2,
                                                     max_distinct_per_namespace=2), metrics))
    api.apply(pod("a", annotations={"ml.example.com/model": "  Llama 3  70B Instruct ", "other": "x"}))
    source = started(api, tag_resolver=resolver)
    p = source.view().pods[("ml", "a")]
    assert p.annotations == {"annotation_ml_example_com_model": "  Llama 3  70B Instruct "}
    tags = resolver.resolve(p.labels, {}, p.annotations)
    assert tags.values[3] == "llama-3-70b-"  # trimmed, whitespace runs to "-", lower case, cut to 12
    assert resolver.resolve({"label_model": "b"}, {}).values[3] == "b"
    assert resolver.resolve({"label_model": "c"}, {}).values[3] == "other"  # a third distinct value
    assert resolver.resolve({"label_model": "b"}, {}).values[3] == "b"
    assert by_label(metrics.tag_values_capped) == {("model", "length"): 1, ("model", "distinct"): 1}
    assert by_label(metrics.tag_values_capped) == {("model", "length"): 1, ("model", "distinct"): 1}
