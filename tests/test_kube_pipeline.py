"""The sidecar attributing with pod facts from the Kubernetes API (a local API endpoint, the real
client), alone or beside kube-state-metrics: relabels, namespace label changes, a pod deleted and
recreated under its name, refusals, the API going away, and the demo cluster either way."""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from typing import Any, Optional

import pytest
from cluster import T0, Cluster, Node, Pod, Unit
from kubeapi import FakeKubeApi
from support import eventually, feed, make_config, offline_pipeline

from otelgpu.config import Config
from otelgpu.core.catalog import instance_of
from otelgpu.demo import objects, scenario
from otelgpu.demo.run import demo_config, replay
from otelgpu.enrich.config import KubernetesConfig
from otelgpu.enrich.window import NS
from otelgpu.pipeline import Pipeline
from otelgpu.telemetry import by_label, total

A100 = "NVIDIA A100-SXM4-40GB"
INTERVAL_S = 300
PER_INTERVAL = 12.0 * INTERVAL_S / 3600  # one GPU at $12/h for one interval


def two_gpu_cluster(**train: Any) -> Cluster:
    node = Node("gpu-1", "p4d.24xlarge", 96, 1152, units=[Unit("GPU-0", A100), Unit("GPU-1", A100)],
                capacity={"nvidia_com_gpu": 2})
    pods = [Pod("ml", "train", "gpu-1", labels={"team": "vision", "project": "p", "environment": "prod",
                                                 "model": "m"}, gpu=("nvidia_com_gpu", 1), holds=("GPU-0",), **train),
            Pod("ml", "serve", "gpu-1", labels={"team": "nlp"}, gpu=("nvidia_com_gpu", 1), holds=("GPU-1",))]
    return Cluster([node], pods, namespace_labels={"ml": {"cost-center": "cc-1"}})


def api_config(api: FakeKubeApi, config: Optional[Config] = None, **kube: Any) -> Config:
    cfg = config or make_config(attribution__interval_seconds=INTERVAL_S,
                                attribution__prices__gpu_hour_by_gpu_model={A100: 12.0})
    k = KubernetesConfig(enabled=True, auth="token", api_url=api.url, token="t", backoff_initial_seconds=0.05,
                         backoff_max_seconds=0.2, **kube)
    return replace(cfg, kubernetes=k)


@pytest.fixture
def api():
    with FakeKubeApi(token="t") as server:
        yield server


@pytest.fixture
def sidecar():
    """A pipeline whose Kubernetes API source is started, shut down after the test."""
    started: list[Pipeline] = []

    def start(api: FakeKubeApi, config: Optional[Config] = None, **kube: Any) -> Pipeline:
        p = offline_pipeline(api_config(api, config, **kube))
        # Changes take effect when observed; here that is the data time the scenario has reached.
        p.kube.facts.clock = lambda: p.windows.watermark_ns / NS
        p.start_sources()
        started.append(p)
        return p

    yield start
    for p in started:
        p.shutdown()


def seed(api: FakeKubeApi, cluster: Cluster) -> None:
    for obj in cluster.namespace_objects() + cluster.node_objects() + [cluster.pod_object(p) for p in cluster.pods]:
        api.apply(before_t0(obj))


def before_t0(obj: dict) -> dict:
    """Created an hour before the scenario starts (not when the local API endpoint stores it)."""
    return {**obj, "metadata": {"creationTimestamp": _rfc3339(T0 - 3600 * NS), **obj["metadata"]}}


def run_halves(pipeline: Pipeline, cluster: Cluster, between: Any, ksm: bool = False) -> int:
    """Feed the first half hour, call `between`, feed the rest; returns intervals closed before."""
    feed(pipeline, *cluster.scrapes(60, 1800, ksm=ksm))
    before = total(pipeline.metrics.intervals_computed)
    between()
    feed(pipeline, *cluster.scrapes(60, 3600 + 60, ksm=ksm, from_s=1800))
    pipeline.close_due(flush=True)
    return before


def by(pipeline: Pipeline, *keys: str, metric: str = "allocated") -> dict:
    return {k: round(v, 9) for k, v in pipeline.store.totals(metric, keys, {"cost_model": "request"}).items()}


def test_pod_relabelled_mid_run(api, sidecar):
    cluster = two_gpu_cluster()
    seed(api, cluster)
    p = sidecar(api)
    train = cluster.pods[0]

    def relabel() -> None:
        api.apply(cluster.pod_object(replace(train, labels={**train.labels, "team": "speech"})))
        eventually(lambda: p.kube.view().pods[("ml", "train")].labels["label_team"] == "speech")

    before = run_halves(p, cluster, relabel)
    totals = by(p, "pod", "team")
    intervals = total(p.metrics.intervals_computed)
    assert 0 < before < intervals
    assert totals[("train", "vision")] == pytest.approx(before * PER_INTERVAL)
    assert totals[("train", "speech")] == pytest.approx((intervals - before) * PER_INTERVAL)
    assert totals[("serve", "nlp")] == pytest.approx(intervals * PER_INTERVAL)
    workloads = by(p, "workload_kind", "workload_name")
    assert set(workloads) == {("Pod", "train"), ("Pod", "serve")}


def test_namespace_label_change_moves_the_cost_center(api, sidecar):
    cluster = two_gpu_cluster()
    seed(api, cluster)
    p = sidecar(api)
    def change() -> None:
        api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml", "labels": {"cost-center": "cc-2"}}})
        eventually(lambda: p.kube.view().namespace_labels("ml") == {"label_cost_center": "cc-2"})

    before = run_halves(p, cluster, change)
    totals = by(p, "cost_center")
    n = total(p.metrics.intervals_computed)
    assert totals[("cc-1",)] == pytest.approx(2 * before * PER_INTERVAL)
    assert totals[("cc-2",)] == pytest.approx(2 * (n - before) * PER_INTERVAL)


def test_pod_deleted_and_recreated_under_its_name(api, sidecar):
    cluster = two_gpu_cluster(end_s=1800)
    old = cluster.pods[0]
    new = replace(old, labels={**old.labels, "team": "speech"}, start_s=1800, end_s=float("inf"))
    cluster.pods.append(new)
    seed(api, replace(cluster, pods=cluster.pods[:2]))
    api.apply({**cluster.pod_object(old), "metadata": {**cluster.pod_object(old)["metadata"],
                                                       "creationTimestamp": _rfc3339(T0 - 60 * NS)}})
    p = sidecar(api)
    def recreate() -> None:
        api.delete("Pod", "train", "ml")
        obj = cluster.pod_object(new)
        obj["metadata"].update(uid="uid-ml-train-2", creationTimestamp=_rfc3339(T0 + 1800 * NS))
        api.apply(obj)
        eventually(lambda: p.kube.view().pods[("ml", "train")].uid == "uid-ml-train-2")

    before = run_halves(p, cluster, recreate)
    totals = by(p, "pod", "team")
    n = total(p.metrics.intervals_computed)
    assert before < 6  # the interval the old pod ended in closed after the new pod appeared ...
    assert totals[("train", "vision")] == pytest.approx(6 * PER_INTERVAL)  # ... and is still the old pod's
    assert totals[("train", "speech")] == pytest.approx((n - 6) * PER_INTERVAL)


def _rfc3339(t_ns: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_ns // NS))


def test_refused_pods_fall_back_to_kube_state_metrics_then_the_api_takes_over(api, sidecar, caplog):
    cluster = two_gpu_cluster()
    seed(api, cluster)
    api.apply(before_t0(cluster.pod_object(replace(cluster.pods[0], labels={**cluster.pods[0].labels,
                                                                             "cost-center": "cc-9"}))))
    api.forbid("list", "pods")
    p = sidecar(api, initial_sync_timeout_seconds=0.5)  # pods are refused: the start waits in vain
    def allow() -> None:
        assert by_label(p.metrics.kube_errors)[("pods", "list", "forbidden")] >= 1
        api.allow("list", "pods")
        eventually(p.kube.synced)

    before = run_halves(p, cluster, allow, ksm=True)
    totals = by(p, "pod", "cost_center")
    n = total(p.metrics.intervals_computed)
    # kube-state-metrics facts (namespace cc-1) while pods were refused; the API's pod label after
    assert totals[("train", "cc-1")] == pytest.approx(before * PER_INTERVAL)
    assert totals[("train", "cc-9")] == pytest.approx((n - before) * PER_INTERVAL)
    assert "refuses to list pods" in caplog.text


def test_api_down_for_a_while_attribution_goes_on(api, sidecar):
    cluster = two_gpu_cluster()
    seed(api, cluster)
    p = sidecar(api)
    def outage() -> None:
        api.go_down()
        feed(p, *cluster.scrapes(60, 2700, ksm=False, from_s=1800))  # attributed on the last known facts
        api.come_up()

    run_halves(p, cluster, outage)
    totals = by(p, "pod", "team")
    n = total(p.metrics.intervals_computed)
    assert n == 13  # 12 full intervals and the one the last scrape opened
    assert totals[("train", "vision")] == pytest.approx(n * PER_INTERVAL)
    assert ("train", "unallocated") not in totals
    assert by_label(p.metrics.kube_errors)[("pods", "watch", "connection")] >= 1


def test_demo_cluster_costs_the_same_from_the_api_as_from_kube_state_metrics():
    nodes, ns_labels = scenario.build()
    start_ns = T0
    results = {}
    with FakeKubeApi(token="t") as api:
        for obj in objects.objects(nodes, ns_labels):
            api.apply(before_t0(obj))
        for source in ("kube-state-metrics", "api"):
            config = demo_config(metrics_port=0)
            if source == "api":
                config = replace(config, kubernetes=KubernetesConfig(enabled=True, auth="token", api_url=api.url,
                                                                     token="t"))
            config = replace(config, receiver=replace(config.receiver, max_point_age_seconds=0,  # T0 is years ago
                                                      grpc=replace(config.receiver.grpc, endpoint="127.0.0.1:0")),
                             exporter=replace(config.exporter, prometheus=replace(config.exporter.prometheus,
                                                                                  enabled=False)))
            p = Pipeline(replace(config, receiver=replace(config.receiver, http=replace(config.receiver.http,
                                                                                         enabled=False))))
            p.start()
            try:
                replay(p, start_ns, 3600, kube_state_metrics=(source == "kube-state-metrics"))
                p.drain()
                p.close_due(flush=True)
                results[source] = {m: p.store.totals(m, ("cost_model", "team", "cost_center", "workload_name"))
                                   for m in ("allocated", "unused", "idle", "effective")}
                results[source]["capacity"] = p.store.totals("capacity", ("cost_model", "node", "instance_id"))
            finally:
                p.shutdown()
    ksm, api_path = results["kube-state-metrics"], results["api"]
    for metric in ksm:
        assert set(ksm[metric]) == set(api_path[metric]), metric
        for key, value in ksm[metric].items():
            assert api_path[metric][key] == pytest.approx(value, abs=1e-9), (metric, key)
    # each node's instance, from kube_node_info's provider_id or the Node's spec.providerID
    assert {(node, instance) for _, node, instance in ksm["capacity"]} == \
        {(n.name, instance_of(n.provider_id)) for n in nodes}
    teams = {k[1] for k in ksm["allocated"]}
    assert {"bu-a", "bu-b", "bu-c"} <= teams and sum(v for k, v in ksm["allocated"].items() if k[0] == "request") > 0


def test_coverage_per_namespace_and_unattributed_reasons(api, sidecar):
    cluster = two_gpu_cluster()
    cluster.nodes[0].units.append(Unit("GPU-2", A100))
    cluster.pods.append(Pod("ml", "ghost", "gpu-1", holds=("GPU-2",)))  # DCGM shows it; the API never had it
    seed(api, replace(cluster, pods=[p for p in cluster.pods if p.name != "ghost"]))
    p = sidecar(api)
    feed(p, *cluster.scrapes(60, 3600, ksm=False))
    p.close_due(flush=True)
    n = total(p.metrics.intervals_computed)
    unattributed = p.store.totals("unattributed", ("namespace", "reason"))
    assert unattributed == {("ml", "pod_unknown"): pytest.approx(n * PER_INTERVAL),
                            ("ml", "tag_missing"): pytest.approx(n * PER_INTERVAL)}  # serve: team only
    coverage = {(dict(pt.attrs).get("namespace", ""), dict(pt.attrs)["tag"]): pt.value
                for pt in p.store.points() if pt.metric == "tag_coverage"}
    assert coverage[("", "team")] == pytest.approx(2 / 3)  # train and serve have a team; ghost does not
    assert coverage[("ml", "model")] == pytest.approx(1 / 3)  # only train has a model label
    assert coverage[("ml", "all")] == pytest.approx(1 / 3)  # train: four labels and the namespace's cost center
    assert coverage[("", "cost_center")] == 1.0  # the namespace label reaches even the unknown pod


def scad_config() -> Config:
    """Minute intervals under scad, a p4d.24xlarge at $32.77 an hour: its CPU and memory are
    split among the pods that request them."""
    return make_config(attribution__interval_seconds=60, attribution__lateness_seconds=30,
                       attribution__cost_models=["scad"],
                       attribution__prices__instance_hour_by_instance_type={"p4d.24xlarge": 32.77})


def ending_pod_cluster() -> Cluster:
    """Three pods run all along; `batch`, the largest CPU and memory request, ends at 630 s, where
    its kube-state-metrics series end with staleness markers."""
    node = Node("gpu-1", "p4d.24xlarge", 96, 1152, units=[Unit("GPU-0", A100), Unit("GPU-1", A100)],
                capacity={"nvidia_com_gpu": 2})
    pods = [Pod("ml", "train", "gpu-1", {"team": "vision"}, cpu=16, memory_gib=64, gpu=("nvidia_com_gpu", 1),
                holds=("GPU-0",)),
            Pod("ml", "serve", "gpu-1", {"team": "nlp"}, cpu=8, memory_gib=32, gpu=("nvidia_com_gpu", 1),
                holds=("GPU-1",)),
            Pod("web", "api", "gpu-1", {"team": "web"}, cpu=24, memory_gib=96),
            Pod("ml", "batch", "gpu-1", {"team": "vision"}, cpu=32, memory_gib=512, end_s=630, ksm_stale_s=630)]
    return Cluster([node], pods)


def charged(p: Pipeline) -> dict:
    """Allocated + unused per pod and resource under scad."""
    out: dict = {}
    for metric in ("allocated", "unused"):
        for key, value in p.store.totals(metric, ("pod", "resource"), {"cost_model": "scad"}).items():
            out[key] = out.get(key, 0.0) + value
    return out


def without_the_api(c: Cluster) -> dict:
    p = offline_pipeline(scad_config())
    feed(p, *c.scrapes(30, 1800))
    p.close_due(flush=True)
    return charged(p)


def test_a_pod_the_api_never_listed_stops_being_charged_when_its_series_end(api, sidecar):
    """`batch` was deleted before otelgpu's first list (a restart while the Collector replays its
    queue): only kube-state-metrics knows it. Its staleness markers end it at 630 s: it pays for
    the interval it ended in, to the scrape resolution of its phases, and nothing after; the
    pods that run on share the node's CPU and memory as they do with the API off."""
    c = ending_pod_cluster()
    seed(api, replace(c, pods=[pod for pod in c.pods if pod.name != "batch"]))
    p = sidecar(api, scad_config())
    feed(p, *c.scrapes(30, 720))
    before = charged(p)
    feed(p, *c.scrapes(30, 1800, from_s=720))
    p.close_due(flush=True)
    after = charged(p)
    assert {k: v for k, v in after.items() if k[0] == "batch"} == \
        pytest.approx({k: v for k, v in before.items() if k[0] == "batch"}, rel=1e-12)
    assert after == pytest.approx(without_the_api(c), rel=1e-9)


@pytest.mark.parametrize("deleted_s", [630, 1200])
def test_a_pod_the_api_deletes_is_charged_for_the_interval_it_ended_in_and_no_longer(api, sidecar, deleted_s):
    """The API listed `batch` and deletes it when it ends, or (its watch down) ten minutes later:
    either way it pays what it pays with the API off."""
    c = ending_pod_cluster()
    seed(api, c)
    p = sidecar(api, scad_config())
    feed(p, *c.scrapes(30, deleted_s + 1))  # the clock of the API's changes is the data time reached
    api.delete("Pod", "batch", "ml")
    eventually(lambda: p.kube.view().pods[("ml", "batch")].deleted)
    feed(p, *c.scrapes(30, 1800, from_s=deleted_s + 30))
    p.close_due(flush=True)
    assert charged(p) == pytest.approx(without_the_api(c), rel=1e-9)


def without_ksm(req, first: bool):
    """`req` with kube-state-metrics' scrape failed: staleness markers on every series of the
    target the `first` time, as the prometheus receiver reports it, then nothing."""
    out = copy.deepcopy(req)
    for i in reversed(range(len(out.resource_metrics))):
        rm = out.resource_metrics[i]
        if {kv.key: kv.value.string_value for kv in rm.resource.attributes}["service.name"] != "kube-state-metrics":
            continue
        if not first:
            del out.resource_metrics[i]
            continue
        for m in rm.scope_metrics[0].metrics:
            for dp in m.gauge.data_points:
                dp.ClearField("as_double")
                dp.flags = 1
    return out


@pytest.mark.parametrize("with_api", [False, True])
def test_a_failed_kube_state_metrics_scrape_ends_no_pod(api, sidecar, with_api):
    """kube-state-metrics is not scraped from 600 s to 840 s: every series stale at once, then
    nothing. Every pod goes on as before, with the API source or without."""
    c = ending_pod_cluster()
    c.pods[-1] = replace(c.pods[-1], end_s=float("inf"), ksm_stale_s=None)
    scrapes = [req if not 600 <= 30 * k < 840 else without_ksm(req, first=30 * k == 600)
               for k, req in enumerate(c.scrapes(30, 1800))]
    if with_api:
        seed(api, c)
        p = sidecar(api, scad_config())
    else:
        p = offline_pipeline(scad_config())
    feed(p, *scrapes)
    p.close_due(flush=True)
    assert charged(p) == pytest.approx(without_the_api(c), rel=1e-9)
