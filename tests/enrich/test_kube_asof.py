"""Facts as they were at an earlier time: the Kubernetes API source, through the real `kubernetes`
client against the local API endpoint (tests/kubeapi.py), with a clock the test moves. A change
applies from when it was observed; an object's first version from its creation."""

from __future__ import annotations

import time
from typing import Any

import pytest
from kubeapi import FakeKubeApi
from support import eventually
from test_kube_source import NODE_A, config, namespace, node, pod, tags

from otelgpu.enrich.facts import KsmFacts, MergedFacts
from otelgpu.enrich.kube.source import KubeSource
from otelgpu.receiver.interner import Interner
from otelgpu.telemetry import SelfMetrics, by_label

T = 2_000_000_000.0  # the clock's start, seconds; every object's creation is given relative to it
NS = 1_000_000_000
WAIT_S = 10.0


def at(t: float) -> int:
    return int(t * NS)


def created(obj: dict, t: float | None) -> dict:
    """`obj` with that creationTimestamp (None: served as null, creation unknown)."""
    stamp = None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
    return {**obj, "metadata": {**obj["metadata"], "creationTimestamp": stamp}}


class Clock:
    def __init__(self) -> None:
        self.now = T

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def api():
    with FakeKubeApi(token="secret") as server:
        server.apply(created(namespace("ml", {"team": "ml-research", "cost-center": "cc-7"}), T - 86400))
        server.apply(created(node(NODE_A), T - 86400))
        yield server


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def started(clock):
    sources: list[KubeSource] = []

    def start(api: FakeKubeApi, **kw: Any) -> KubeSource:
        source = KubeSource(config(api, **kw), tags(), SelfMetrics(), clock=clock)
        source.start()
        sources.append(source)
        assert source.wait_synced(WAIT_S), "the first lists did not complete"
        return source

    yield start
    for s in sources:
        s.shutdown()


def team(source: KubeSource, as_of: int | None = None, name: str = "a") -> str | None:
    p = source.view(as_of).pods.get(("ml", name))
    return p.labels.get("label_team") if p else None


def test_a_change_applies_from_when_it_was_observed(api, started, clock):
    api.apply(created(pod("a", labels={"team": "vision"}), T - 3600))
    source = started(api)
    clock.now = T + 100
    api.apply(created(pod("a", labels={"team": "speech"}), T - 3600))
    eventually(lambda: team(source) == "speech", WAIT_S)
    assert team(source, at(T + 100) - 1) == "vision"  # an interval that ended before the relabel
    assert team(source, at(T + 100)) == "vision"  # effective after, not at, the moment it was seen
    assert team(source, at(T + 100) + 1) == "speech"
    merged = MergedFacts(KsmFacts(Interner(), ttl_ns=600 * NS), source)  # the join's source passes it on
    assert merged.view(at(T + 50)).pods[("ml", "a")].labels == {"label_team": "vision"}

    clock.now = T + 200  # the phase and the requests change: the pod finished, its GPU request halves
    api.apply(created(pod("a", labels={"team": "speech"}, phase="Succeeded", gpus=2), T - 3600))
    eventually(lambda: source.view().pods[("ml", "a")].phase == "Succeeded", WAIT_S)
    before, after = source.view(at(T + 150)).pods[("ml", "a")], source.view(at(T + 250)).pods[("ml", "a")]
    assert (before.phase, before.requested("nvidia_com_gpu")) == ("Running", 1.0)
    assert (after.phase, after.requested("nvidia_com_gpu")) == ("Succeeded", 2.0)


def test_a_pod_is_there_from_its_creation_not_from_when_it_was_seen(api, started, clock):
    api.apply(created(pod("old"), T - 3600))  # before otelgpu started: found by the first list
    api.apply(created(pod("unknown-age"), None))
    source = started(api)
    assert ("ml", "old") in source.view(at(T - 1800)).pods
    assert ("ml", "old") not in source.view(at(T - 3600)).pods  # created at as_of: not yet there
    assert ("ml", "unknown-age") in source.view(1).pods  # no creation time: there from the beginning

    clock.now = T + 100
    api.apply(created(pod("new"), T + 90))  # seen by the watch 10 s after its creation
    eventually(lambda: ("ml", "new") in source.view().pods, WAIT_S)
    assert ("ml", "new") not in source.view(at(T + 90)).pods
    assert ("ml", "new") in source.view(at(T + 95)).pods


def test_a_relist_finds_pods_from_their_creation_and_deletions_when_it_ran(api, started, clock):
    api.apply(created(pod("a"), T - 3600))
    source = started(api)
    api.go_down()
    api.apply(created(pod("b", labels={"team": "vision"}), T + 50))  # while otelgpu is disconnected
    api.delete("Pod", "a", "ml")
    api.compact()  # and the history it would resume from is gone: relist
    clock.now = T + 500
    api.come_up()
    eventually(lambda: ("ml", "b") in source.view().pods, WAIT_S)
    assert team(source, at(T + 60), "b") == "vision"
    assert ("ml", "b") not in source.view(at(T + 50)).pods
    assert not source.view(at(T + 500)).pods[("ml", "a")].deleted  # when it went is not known: when it was found
    assert source.view(at(T + 500) + 1).pods[("ml", "a")].deleted
    assert by_label(source.metrics.kube_lists)[("pods", "gone")] >= 1


def test_a_deleted_pod_is_deleted_only_after_its_deletion(api, started, clock):
    api.apply(created(pod("a", labels={"team": "vision"}), T - 3600))
    source = started(api)
    clock.now = T + 100
    api.delete("Pod", "a", "ml")
    eventually(lambda: source.view().pods[("ml", "a")].deleted, WAIT_S)
    assert not source.view(at(T + 50)).pods[("ml", "a")].deleted
    assert not source.view(at(T + 100)).pods[("ml", "a")].deleted
    assert source.view(at(T + 100) + 1).pods[("ml", "a")].deleted


def test_a_pod_recreated_under_its_name_keeps_its_predecessor_for_earlier_intervals(api, started, clock):
    api.apply(created(pod("job-0", labels={"team": "vision"}, uid="uid-1"), T - 600))
    source = started(api)
    clock.now = T + 100
    api.delete("Pod", "job-0", "ml")
    eventually(lambda: source.view().pods[("ml", "job-0")].deleted, WAIT_S)  # seen at T + 100
    clock.now = T + 110
    api.apply(created(pod("job-0", labels={"team": "speech"}, uid="uid-2"), T + 105))
    eventually(lambda: source.view().pods[("ml", "job-0")].uid == "uid-2", WAIT_S)
    key = ("ml", "job-0")
    for as_of in (None, at(T + 107)):  # now, and as of an interval that ended after the new pod was created
        view = source.view(as_of)
        assert (view.pods[key].uid, view.previous[key].uid) == ("uid-2", "uid-1")
        assert view.pod(key, start_ns=at(T + 60)).labels == {"label_team": "vision"}  # began before it
        assert view.pod(key, start_ns=at(T + 106)).labels == {"label_team": "speech"}
    view = source.view(at(T + 103))  # deleted, not yet replaced
    assert view.pods[key].uid == "uid-1" and view.pods[key].deleted and key not in view.previous
    assert not source.view(at(T + 50)).pods[key].deleted


def test_namespace_and_node_changes_apply_from_when_they_were_observed(api, started, clock):
    source = started(api)
    clock.now = T + 100
    api.apply(created(namespace("ml", {"team": "ml-platform"}), T - 86400))
    api.apply(created(node(NODE_A, instance_type="p5.48xlarge"), T - 86400))
    eventually(lambda: source.view().namespace_labels("ml") == {"label_team": "ml-platform"}, WAIT_S)
    eventually(lambda: "p5" in source.view().nodes[NODE_A].labels["label_node_kubernetes_io_instance_type"], WAIT_S)
    old, new = source.view(at(T + 100)), source.view(at(T + 100) + 1)
    assert old.namespace_labels("ml") == {"label_team": "ml-research", "label_cost_center": "cc-7"}
    assert new.namespace_labels("ml") == {"label_team": "ml-platform"}
    assert old.nodes[NODE_A].labels["label_node_kubernetes_io_instance_type"] == "p4d.24xlarge"
    assert new.nodes[NODE_A].labels["label_node_kubernetes_io_instance_type"] == "p5.48xlarge"

    clock.now = T + 200
    api.delete("Namespace", "ml")
    api.delete("Node", NODE_A)
    api.apply(created(namespace("research"), T + 190))
    eventually(lambda: "research" in (v := source.view()).namespaces and NODE_A not in v.nodes, WAIT_S)
    assert "ml" in source.view(at(T + 200)).namespaces and "ml" not in source.view(at(T + 201)).namespaces
    assert NODE_A in source.view(at(T + 200)).nodes and NODE_A not in source.view(at(T + 201)).nodes
    assert "research" not in source.view(at(T + 190)).namespaces
    assert "research" in source.view(at(T + 195)).namespaces


def test_an_owner_resolved_later_is_there_from_its_creation(api, started, clock):
    api.apply(created({"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {
        "name": "serve-7d9f8", "namespace": "ml", "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "Deployment", "name": "serve", "uid": "d", "controller": True}]}},
        T - 1200))
    api.apply(created(pod("serve-7d9f8-abcde", owner=("ReplicaSet", "serve-7d9f8")), T - 1000))
    source = started(api)
    key = ("ml", "ReplicaSet", "serve-7d9f8")
    eventually(lambda: key in source.view().owners, WAIT_S)
    assert source.view(at(T - 900)).owners[key].name == "serve"
    assert key not in source.view(at(T - 1200)).owners


def test_an_event_that_changes_nothing_kept_adds_no_version(api, started, clock):
    api.apply(created(pod("a", labels={"team": "vision"}), T - 3600))
    source = started(api)
    before = source.facts.versions()
    clock.now = T + 100
    heartbeat = created(pod("a", labels={"team": "vision", "app": "x"}, annotations={"note": "y"}), T - 3600)
    heartbeat["status"]["conditions"] = [{"type": "Ready", "status": "True", "lastProbeTime": "now"}]
    api.apply(heartbeat)  # only fields otelgpu does not keep
    status = created(node(NODE_A), T - 86400)
    status["status"]["conditions"] = [{"type": "Ready", "status": "True", "lastHeartbeatTime": "now"}]
    api.apply(status)
    # Each watch applies its events in order: once these later objects are in, so are the heartbeats.
    api.apply(created(pod("later"), T + 100))
    api.apply(created(node("later"), T + 100))
    eventually(lambda: ("ml", "later") in (v := source.view()).pods and "later" in v.nodes, WAIT_S)
    clock.now = T + 200
    api.apply(created(pod("a", labels={"team": "speech"}), T - 3600))
    api.apply(created(node(NODE_A, instance_type="p5.48xlarge"), T - 86400))
    eventually(lambda: team(source) == "speech", WAIT_S)
    eventually(lambda: "p5" in source.view().nodes[NODE_A].labels["label_node_kubernetes_io_instance_type"], WAIT_S)
    events = by_label(source.metrics.kube_events)
    assert events[("pods", "MODIFIED")] == 2 and events[("nodes", "MODIFIED")] == 2
    after = source.facts.versions()  # one for each new object, one for each real change
    assert (after["pods"], after["nodes"]) == (before["pods"] + 2, before["nodes"] + 2)
    assert source.view(at(T + 150)).pods[("ml", "a")].seen_ns == at(T)  # the version seen at the first list


def test_history_is_bounded_by_the_retention(api, started, clock):
    api.apply(created(pod("a", labels={"team": "v0"}), T - 3600))
    source = started(api, history_seconds=900)
    for i in (1, 2, 3):
        clock.now = T + 10 * i
        api.apply(created(pod("a", labels={"team": f"v{i}"}), T - 3600))
        eventually(lambda: team(source) == f"v{i}", WAIT_S)
    api.delete("Namespace", "ml")  # at T + 30: its deletion is a version too
    eventually(lambda: "ml" not in source.view().namespaces, WAIT_S)
    assert (source.facts.versions()["pods"], source.facts.versions()["namespaces"]) == (4, 2)

    clock.now = T + 20 + 900  # the version of T + 20 is the newest at or before now - retention
    assert [team(source, at(T + t)) for t in (15, 25, 35)] == ["v2", "v2", "v3"]  # older: the oldest kept
    assert source.facts.versions()["pods"] == 2
    clock.now = T + 30 + 900
    source.view()
    assert source.facts.versions() == {"pods": 1, "nodes": 1, "namespaces": 0, "owners": 0, "resourceclaims": 0,
                                      "resourceslices": 0}
    assert team(source, at(T + 15)) == "v3" and "ml" not in source.view(at(T + 15)).namespaces

    for i in range(4, 20):  # changes while no view is taken are bounded too
        clock.now = T + 2000 + 1000 * i
        api.apply(created(pod("a", labels={"team": f"v{i}"}), T - 3600))
        eventually(lambda: source.facts.pods.latest[("ml", "a")].labels == {"label_team": f"v{i}"}, WAIT_S)
        assert source.facts.versions()["pods"] == 2


def test_a_dra_claim_deleted_with_its_pod_still_names_the_gpu_for_the_pods_grace(api, started, clock):
    """A template claim goes with its pod: the interval the pod ended in must still learn which GPU
    it held (the join counts only pods that ran in the interval), for the deleted pods' grace."""
    api.define("ResourceSlice", "resource.k8s.io/v1", namespaced=False)
    api.apply(created({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                       "metadata": {"name": "a-gpu", "namespace": "ml"},
                       "status": {"allocation": {"devices": {"results": [
                           {"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE_A, "device": "gpu-0"}]}},
                           "reservedFor": [{"resource": "pods", "name": "a", "uid": "u"}]}}, T - 3600))
    source = started(api, deleted_pod_grace_seconds=600)
    eventually(lambda: ("ml", "a-gpu") in source.view().claims, WAIT_S)
    clock.now = T + 100
    api.delete("ResourceClaim", "a-gpu", "ml")
    eventually(lambda: source.facts.counts()["resourceclaims"] == 0, WAIT_S)
    assert source.view(at(T + 300)).claims[("ml", "a-gpu")].pods == ("a",)
    clock.now = T + 800
    assert ("ml", "a-gpu") not in source.view(at(T + 800)).claims
