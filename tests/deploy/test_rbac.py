"""RBAC grants exactly what the code calls. otelgpu's role: its Kubernetes client runs against a
real local API endpoint that refuses everything the rendered ClusterRole does not grant; it must
get every fact it needs without one refusal, and use every grant. The Collector's role: exactly
what its scrape configs' discovery and kubelet scrapes need."""

from __future__ import annotations

import pytest
from kubeapi import BUILTIN, FakeKubeApi, Resource
from manifests import MODES, collector_config, otelgpu_config, pod, render
from support import eventually

from otelgpu.enrich.config import KubernetesConfig, TagValuesConfig, default_tags
from otelgpu.enrich.kube.source import KubeSource
from otelgpu.enrich.labels import TagResolver, TagValues
from otelgpu.enrich.workload import workload
from otelgpu.telemetry import SelfMetrics, by_label

VERBS = ("get", "list", "watch")  # the endpoint serves only GET: a write would fail with 501 anyway


def grants(objects, role: str) -> set[tuple[str, str, str]]:
    """(api group, resource, verb) the named ClusterRole grants, and check it is bound to the pod's
    service account."""
    cluster_role = next(o for o in objects if o["kind"] == "ClusterRole" and o["metadata"]["name"] == role)
    binding = next(o for o in objects if o["kind"] == "ClusterRoleBinding" and o["roleRef"]["name"] == role)
    account = pod(objects).spec["serviceAccountName"]
    namespace = pod(objects).workload["metadata"]["namespace"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]
    out = set()
    for rule in cluster_role["rules"]:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        out |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return out


def called(api: FakeKubeApi) -> set[tuple[str, str, str]]:
    """(api group, resource, verb) of every request the API endpoint answered."""
    out = set()
    for _, path, query in api.requests:
        parts = path.strip("/").split("/")
        group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
        if rest[:1] == ["namespaces"] and len(rest) > 2:
            rest = rest[2:]
        verb = "watch" if query.get("watch") == "true" else "get" if len(rest) == 2 else "list"
        out.add((group, rest[0], verb))
    return out


@pytest.mark.parametrize("mode", MODES)
def test_otelgpu_gets_everything_it_needs_from_exactly_what_its_role_grants(mode, tmp_path, monkeypatch):
    objects = render(mode)
    granted = grants(objects, "otelgpu")
    configured = otelgpu_config(pod(objects), tmp_path, monkeypatch).kubernetes
    here = configured.node_name or "ip-10-0-12-34.ec2.internal"
    dra = [Resource("ResourceClaim", "resource.k8s.io", "v1", "resourceclaims"),
           Resource("ResourceSlice", "resource.k8s.io", "v1", "resourceslices", namespaced=False)]
    with FakeKubeApi(token="t") as api:
        for res in dra:
            api.define(res.kind, res.api_version, res.namespaced)
        for res in BUILTIN + dra:  # refuse every verb the role does not grant, as the API server's RBAC would
            for verb in VERBS:
                if (res.group, res.plural, verb) not in granted:
                    api.forbid(verb, res.plural)
        api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml", "labels": {"team": "vision"}}})
        api.apply({"apiVersion": "v1", "kind": "Node", "metadata": {
            "name": here, "labels": {"node.kubernetes.io/instance-type": "p5.48xlarge"}},
            "status": {"capacity": {"nvidia.com/gpu": "8", "cpu": "192", "memory": "2Ti"}}})
        api.apply({"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {"name": "serve-7d9f8", "namespace": "ml",
                   "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "serve", "uid": "d",
                                        "controller": True}]}})
        api.apply({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "nightly-29000000", "namespace": "ml",
                   "ownerReferences": [{"apiVersion": "batch/v1", "kind": "CronJob", "name": "nightly", "uid": "c",
                                        "controller": True}]}})
        for name, owner in (("serve-7d9f8-abcde", ("ReplicaSet", "serve-7d9f8")),
                            ("nightly-29000000-x", ("Job", "nightly-29000000"))):
            api.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {
                "name": name, "namespace": "ml", "ownerReferences": [{"apiVersion": "v1", "kind": owner[0],
                                                                       "name": owner[1], "uid": "o", "controller": True}]},
                "spec": {"nodeName": here, "containers": [{"name": "main", "resources": {
                    "requests": {"nvidia.com/gpu": "1"}}}]}, "status": {"phase": "Running"}})
        cfg = KubernetesConfig(enabled=True, scope=configured.scope, node_name=configured.node_name, auth="token",
                               api_url=api.url, token="t", resolve_owners=configured.resolve_owners,
                               backoff_initial_seconds=0.05, backoff_max_seconds=0.2)
        metrics = SelfMetrics()
        source = KubeSource(cfg, TagResolver(default_tags(), TagValues(TagValuesConfig())), metrics)
        source.start()
        try:
            assert source.wait_synced(10.0)

            def resolved():
                v = source.view()
                return {name: workload(ns, name, p, v.owners) for (ns, name), p in v.pods.items()}
            eventually(lambda: resolved() == {"serve-7d9f8-abcde": ("Deployment", "serve"),
                                              "nightly-29000000-x": ("CronJob", "nightly")}, timeout=10.0)
            view = source.view()
            assert set(view.nodes) == {here}
            assert view.nodes[here].labels["label_node_kubernetes_io_instance_type"] == "p5.48xlarge"
            assert "ml" in view.namespaces
            eventually(lambda: called(api) >= granted, timeout=10.0,
                       message=lambda: f"granted but not called: {granted - called(api)}")
        finally:
            source.shutdown()
        assert not by_label(metrics.kube_errors), by_label(metrics.kube_errors)
        assert called(api) == granted  # nothing refused, and no grant unused


def test_the_rbac_check_would_catch_a_missing_grant():
    """Without get on replicasets the source falls back (and counts the refusal): the equality
    above would then fail on both sides."""
    granted = grants(render("gateway"), "otelgpu")
    assert ("apps", "replicasets", "get") in granted and ("", "secrets", "get") not in granted


def required_by_scrapes(config: dict) -> set[tuple[str, str, str]]:
    """What Prometheus' Kubernetes discovery (list, watch of each role) and a kubelet scrape over
    the node's address (get on the nodes/metrics subresource) need."""
    plural = {"pod": "pods", "node": "nodes", "service": "services", "endpoints": "endpoints"}
    out = set()
    jobs = [job for name, receiver in config["receivers"].items() if name.startswith("prometheus")
            for job in receiver["config"]["scrape_configs"]]
    for job in jobs:
        for sd in job.get("kubernetes_sd_configs", []):
            out |= {("", plural[sd["role"]], "list"), ("", plural[sd["role"]], "watch")}
            if sd["role"] == "node" and job.get("metrics_path", "/metrics").startswith("/metrics"):
                out.add(("", "nodes/metrics", "get"))  # the kubelet authorizes /metrics* as nodes/metrics
    return out


@pytest.mark.parametrize("mode", MODES)
def test_the_collector_role_is_exactly_what_its_scrapes_need(mode):
    objects = render(mode)
    assert grants(objects, "otelgpu-collector") == required_by_scrapes(collector_config(pod(objects)))


def test_no_role_reads_secrets_or_writes_anything():
    for mode in MODES:
        for o in render(mode):
            if o["kind"] in ("ClusterRole", "Role"):
                for rule in o["rules"]:
                    assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule
                    assert "secrets" not in rule["resources"] and "configmaps" not in rule["resources"], rule
