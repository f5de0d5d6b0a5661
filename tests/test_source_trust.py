"""Source trust on the worst day: a pod that got itself scraped under another job (with
honor_labels, as an annotation-driven scrape job allows) and a rogue client of the receiver try
every move that would shift money: relabel another team's pod, invent an 8-GPU node, claim a GPU
another pod holds, request GPUs for a pod that does not exist, mint tag values by the thousand.
Every team's money stays what the clean run says, and every refused point is counted."""

from __future__ import annotations

import grpc
import pytest
from cluster import Cluster, Node, Pod, Unit
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from support import feed, make_config, offline_pipeline

from otelgpu.demo.otlp import request, scrape
from otelgpu.enrich.window import NS
from otelgpu.pipeline import Pipeline
from otelgpu.receiver.sources import untrusted_reason, BIT
from otelgpu.telemetry import by_label, total

A100 = "NVIDIA A100-SXM4-40GB"
KSM_REFUSED = untrusted_reason(BIT["kube_state_metrics"])[:2]  # (metric, reason): the labels of points_rejected
DCGM_REFUSED = untrusted_reason(BIT["dcgm"])[:2]
CADVISOR_REFUSED = untrusted_reason(BIT["cadvisor"])[:2]


def cluster() -> Cluster:
    node = Node("gpu-1", "p4d.24xlarge", 96, 1152, labels={"nvidia.com/gpu.count": "4"},
                units=[Unit(f"GPU-{i}", A100) for i in range(4)], capacity={"nvidia_com_gpu": 4})
    pods = [Pod("ml", "train", "gpu-1", {"team": "vision"}, gpu=("nvidia_com_gpu", 2), holds=("GPU-0", "GPU-1")),
            Pod("web", "serve", "gpu-1", {"team": "nlp"}, gpu=("nvidia_com_gpu", 1), holds=("GPU-2",))]
    return Cluster([node], pods)


def rogue(t: int, job: str = "kubernetes-pods", teams: int = 2000) -> list:
    """What a hostile target sends, shaped as kube-state-metrics and dcgm-exporter series."""
    ksm = {
        # Relabel another team's pod, and give a pod that does not exist a GPU on the real node.
        "kube_pod_labels": [({"namespace": "ml", "pod": "train", "uid": "uid-ml-train", "label_team": "nlp"}, 1.0),
                            *(({"namespace": "mint", "pod": f"p{i}", "uid": f"u{i}", "label_team": f"t{i}"}, 1.0)
                              for i in range(teams))],
        "kube_pod_info": [({"namespace": "evil", "pod": "ghost", "uid": "g", "node": "gpu-1"}, 1.0)],
        "kube_pod_status_phase": [({"namespace": "evil", "pod": "ghost", "uid": "g", "phase": "Running"}, 1.0)],
        "kube_pod_container_resource_requests": [({"namespace": "evil", "pod": "ghost", "uid": "g", "container": "c",
                                                   "node": "gpu-1", "resource": "nvidia_com_gpu", "unit": "integer"}, 1.0)],
        # An 8-GPU p5 node that does not exist.
        "kube_node_labels": [({"node": "invented", "label_node_kubernetes_io_instance_type": "p5.48xlarge",
                               "label_nvidia_com_gpu_count": "8"}, 1.0)],
        "kube_node_status_capacity": [({"node": "invented", "resource": "nvidia_com_gpu", "unit": "integer"}, 8.0)],
    }
    dcgm = {"DCGM_FI_PROF_GR_ENGINE_ACTIVE": [  # claim the GPU `train` holds, and the idle one
        ({"Hostname": "gpu-1", "UUID": "GPU-0", "gpu": "0", "modelName": A100, "namespace": "evil", "pod": "ghost"}, 1.0),
        ({"Hostname": "gpu-1", "UUID": "GPU-3", "gpu": "3", "modelName": A100, "namespace": "evil", "pod": "ghost"}, 1.0)]}
    return [request(scrape(job, "10.9.9.9:8080", "gpu-1", t, ksm), scrape(job, "10.9.9.9:9400", "gpu-1", t, dcgm))]


def charged(p: Pipeline) -> dict:
    return {k: v for k, v in p.store.totals("allocated", ("team", "namespace", "pod")).items() if v}


def run(with_rogue: bool, **config) -> Pipeline:
    c = cluster()
    p = offline_pipeline(make_config(attribution__prices__gpu_hour_by_gpu_model={A100: 12.0}, **config))
    for t_s in range(0, 1800, 30):
        feed(p, c.scrape(t_s))
        if with_rogue:
            feed(p, *rogue(c.t0 + t_s * NS))
    p.close_due(flush=True)
    return p


def test_spoofed_facts_from_other_scrape_targets_move_no_money() -> None:
    clean, attacked = run(False), run(True)
    assert charged(attacked) == pytest.approx(charged(clean), rel=1e-12)
    assert charged(clean)[("vision", "ml", "train")] == pytest.approx(12.0)  # two GPUs, half an hour
    for metric in ("capacity", "idle"):
        assert attacked.store.totals(metric, ("node",)) == pytest.approx(clean.store.totals(metric, ("node",)))
    assert ("invented",) not in attacked.store.totals("capacity", ("node",))
    rejected = by_label(attacked.metrics.points_rejected)
    scrapes = 60
    assert rejected[KSM_REFUSED] == scrapes * (2001 + 1 + 1 + 1 + 1 + 1)
    assert rejected[DCGM_REFUSED] == scrapes * 2
    assert not by_label(attacked.metrics.tag_values_capped)  # the minted values never reached the tag budget
    assert not any(reason.startswith("untrusted_") for _, reason in by_label(clean.metrics.points_rejected))


def clock_pushers(t: int, targets: int = 20) -> list:
    """Scrape targets outside every source, outnumbering the real ones, whose `up` says an hour later."""
    return [request(*(scrape("kubernetes-pods", f"10.9.{i}.1:8080", "gpu-1", t + 3600 * NS, {})
                      for i in range(targets)))]


def test_targets_outside_every_source_do_not_move_the_interval_clock() -> None:
    """The watermark that closes intervals is the median of the targets' clocks: `up` of targets
    trusted with nothing would let them close every interval before its data came."""
    def pushed(**config) -> Pipeline:
        c = cluster()
        p = offline_pipeline(make_config(attribution__prices__gpu_hour_by_gpu_model={A100: 12.0}, **config))
        for t_s in range(0, 1800, 30):
            feed(p, c.scrape(t_s), *clock_pushers(c.t0 + t_s * NS))
        p.close_due(flush=True)
        return p

    clean, trusted = run(False), pushed()
    assert charged(trusted) == pytest.approx(charged(clean), rel=1e-12)
    assert total(trusted.metrics.points_late) == 0 == total(clean.metrics.points_late)
    # Without source trust the same `up` points run the clock an hour ahead: the real scrapes arrive late.
    everyone = [{}]
    untrusting = pushed(sources={"dcgm": everyone, "kube_state_metrics": everyone, "cadvisor": everyone})
    assert total(untrusting.metrics.points_late) > 0
    assert sum(charged(untrusting).values()) < 0.9 * sum(charged(clean).values())


def test_a_trusted_job_name_can_be_changed_and_is_then_the_only_one_trusted() -> None:
    # The cluster's kube-state-metrics scrape job is called "ksm" here: the default refuses it.
    c = cluster()
    p = offline_pipeline(make_config(attribution__prices__gpu_hour_by_gpu_model={A100: 12.0},
                                     sources={"kube_state_metrics": [{"service.name": "ksm"}]}))
    for t_s in range(0, 600, 30):
        req = c.scrape(t_s)
        for rm in req.resource_metrics:
            for kv in rm.resource.attributes:
                if kv.key == "service.name" and kv.value.string_value == "kube-state-metrics":
                    kv.value.string_value = "ksm"
        feed(p, req, *rogue(c.t0 + t_s * NS, job="kube-state-metrics", teams=10))
    p.close_due(flush=True)
    assert by_label(p.metrics.points_rejected)[KSM_REFUSED] == 20 * (11 + 5)
    assert {k[0] for k in charged(p)} == {"vision", "nlp"}


def test_cadvisor_is_taken_from_prometheus_examples_kubelet_job_and_never_from_its_pods_job() -> None:
    """Prometheus's example Kubernetes configuration scrapes the kubelets' cAdvisor as job
    kubernetes-cadvisor (node discovery: no pod can be a target) and any pod that asks as
    kubernetes-pods. The default sources take the first as they take `kubelet`; the second's
    container use is refused, counted, and scad charges requests instead."""
    c = cluster()
    for p in c.pods:
        p.cpu, p.memory_gib, p.cpu_used, p.memory_used_gib = 8, 64, 40, 400  # using far beyond the requests

    def scad_as(job: str) -> Pipeline:
        p = offline_pipeline(make_config(attribution__prices__gpu_hour_by_gpu_model={A100: 12.0},
                                         attribution__prices__instance_hour_by_instance_type={"p4d.24xlarge": 40.0},
                                         attribution__cost_models=["scad"]))
        for t_s in range(0, 600, 30):
            req = c.scrape(t_s)
            for rm in req.resource_metrics:
                for kv in rm.resource.attributes:
                    if kv.key == "service.name" and kv.value.string_value == "kubelet":
                        kv.value.string_value = job
            feed(p, req)
        p.close_due(flush=True)
        return p

    kubelet, example, pods = scad_as("kubelet"), scad_as("kubernetes-cadvisor"), scad_as("kubernetes-pods")
    assert charged(example) == pytest.approx(charged(kubelet), rel=1e-12)
    assert not by_label(example.metrics.points_rejected) and not by_label(example.metrics.scad_request_fallbacks)
    # 20 scrapes of 2 pods' 3 series: CPU of the container and of its pod's cgroup, memory
    assert by_label(pods.metrics.points_rejected) == {CADVISOR_REFUSED: 20 * 2 * 3}
    assert by_label(pods.metrics.scad_request_fallbacks)
    assert charged(pods) != pytest.approx(charged(kubelet))


def test_a_rogue_client_of_the_receiver_is_refused_without_the_token(tmp_path) -> None:
    """The same moves sent straight to the receiver, claiming to be kube-state-metrics: without the
    Collector's bearer token they are refused before they are read."""
    token = tmp_path / "token"
    token.write_text("collector-token\n")
    c = cluster()
    p = Pipeline(make_config(attribution__prices__gpu_hour_by_gpu_model={A100: 12.0},
                             receiver__grpc={"endpoint": "127.0.0.1:0", "auth": {"bearer_token_file": str(token)}},
                             receiver__http={"enabled": False}),
                 keep_ended=True)
    p.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{p.grpc.port}") as channel:
            stub = metrics_service_pb2_grpc.MetricsServiceStub(channel)
            for t_s in range(0, 600, 30):
                stub.Export(c.scrape(t_s), metadata=(("authorization", "Bearer collector-token"),), timeout=10)
                for req in rogue(c.t0 + t_s * NS, job="kube-state-metrics", teams=10):
                    with pytest.raises(grpc.RpcError) as refused:
                        stub.Export(req, timeout=10)
                    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        p.drain()
    finally:
        p.shutdown()
    assert by_label(p.metrics.requests)[("grpc", "unauthenticated")] == 20
    assert by_label(p.metrics.requests)[("grpc", "ok")] + by_label(p.metrics.requests)[("grpc", "partial")] == 20
    assert {k[0] for k in charged(p)} == {"vision", "nlp"}


def test_tag_values_of_pods_that_carry_no_cost_take_no_place_in_the_budget() -> None:
    """kube-state-metrics itself reports 300 pods on the GPU node that request and use nothing,
    each with a team of its own; under scad (which charges pods for vCPU and memory) they cost
    nothing and must not fill the tag budget before the real holders' values get in."""
    c = cluster()
    c.pods += [Pod("noise", f"sidecar-{i}", "gpu-1", {"team": f"noise-{i}"}) for i in range(300)]
    p = offline_pipeline(make_config(attribution__prices__gpu_hour_by_gpu_model={A100: 12.0},
                                     attribution__prices__instance_hour_by_instance_type={"p4d.24xlarge": 120.0},
                                     attribution__cost_models=["request", "scad"],
                                     tag_values={"max_distinct": 20}))
    for t_s in range(0, 600, 30):
        feed(p, c.scrape(t_s))
    p.close_due(flush=True)
    assert not by_label(p.metrics.tag_values_capped)
    teams = {k[0] for k, v in p.store.totals("allocated", ("team",), {"cost_model": "scad"}).items() if v}
    assert teams == {"vision", "nlp"}
