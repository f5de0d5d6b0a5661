"""GPUs shared by HAMi and KAI Scheduler (Run:ai): docs/cost-model.md section 11's worked
examples through a pipeline, the grants' parsing, and the money adding up to each GPU."""

from __future__ import annotations

import time

import pytest
from cluster import Cluster, Node, Pod, Unit
from hypothesis import given, settings
from hypothesis import strategies as st
from support import CollectorSink, eventually, feed, make_config, offline_pipeline

from otelgpu.enrich.sharing import Claim, hami_devices, model_memory_mib
from otelgpu.enrich.window import NS
from otelgpu.telemetry import by_label

A100 = "NVIDIA A100-SXM4-40GB"
H100 = "NVIDIA H100 80GB HBM3"
HOUR = 3600
HAMI = "hami.io/vgpu-devices-allocated"
RESERVATION = "kai-resource-reservation"


def hami_node() -> Node:
    """Two A100 40GB (40,960 MiB each); HAMi advertises each as 10 vGPUs and GFD is not there."""
    return Node("hami-1", "p4d.24xlarge", 96, 1152, units=[Unit("GPU-a0", A100, busy=0.4, memory_mib=40960),
                                                           Unit("GPU-a1", A100, busy=0.0, memory_mib=40960)],
                capacity={"nvidia_com_gpu": 20})


def hami_pods(second: str = "GPU-a0,NVIDIA,20480,0:") -> list[Pod]:
    vgpu = ("nvidia_com_gpu", 1)  # HAMi pods ask for vGPUs
    return [Pod("team-a", "infer-a", "hami-1", {"team": "a"}, gpu=vgpu, annotations={HAMI: "GPU-a0,NVIDIA,10240,30:"}),
            Pod("team-b", "infer-b", "hami-1", {"team": "b"}, gpu=vgpu, annotations={HAMI: second})]


def kai_cluster(extra: tuple[Pod, ...] = ()) -> Cluster:
    """One H100 80GB (81,920 MiB) that KAI's reservation pod holds (DCGM shows it, 60% active) for
    two fraction pods of its GPU group: half the GPU, and 20 GiB of its memory."""
    node = Node("kai-1", "p5.4xlarge", 16, 256, units=[Unit("GPU-h0", H100, memory_mib=81920)],
                capacity={"nvidia_com_gpu": 1})
    group = {"runai-gpu-group": "g-1"}
    pods = [Pod(RESERVATION, "gpu-reservation-kai-1-x7", "kai-1", group, gpu=("nvidia_com_gpu", 1),
                holds=("GPU-h0",), activity=0.6, annotations={"run.ai/reserve_for_gpu_index": "GPU-h0"}),
            Pod("team-a", "notebook-1", "kai-1", {**group, "team": "a"}, annotations={"gpu-fraction": "0.5"}),
            Pod("team-b", "notebook-2", "kai-1", {**group, "team": "b"}, annotations={"gpu-memory": "20480"}),
            *extra]
    return Cluster([node], pods)


def run(c: Cluster, rule: str = "compute", until_s: int = HOUR):
    p = offline_pipeline(make_config(attribution__interval_seconds=300, attribution__lateness_seconds=0,
                                     attribution__mig_fraction_rule=rule,
                                     attribution__prices__gpu_hour_by_gpu_model={A100: 12.0, H100: 40.0}))
    feed(p, *c.scrapes(60, until_s))
    p.close_due(flush=True)
    return p


def by_pod(p, metric: str, *more: str) -> dict:
    return p.store.totals(metric, ("pod", *more), {"cost_model": "request"})


def test_hami_worked_example():
    """infer-a is limited to 30% of GPU-a0's cores: 0.30 of $12 an hour. infer-b has no core limit
    and 20 GiB of its 40: its memory share, 0.50. The device is 40% active, 80% of it sold: each
    fraction is half used. GPU-a1 and the rest of GPU-a0 are idle; HAMi's 20 vGPUs are not 20 GPUs."""
    p = run(Cluster([hami_node()], hami_pods()))
    assert by_pod(p, "allocated", "unit_kind", "fraction_basis") == pytest.approx({
        ("infer-a", "fraction", "hami_cores"): 0.30 * 12, ("infer-b", "fraction", "hami_memory"): 0.50 * 12}, rel=1e-9)
    assert by_pod(p, "effective") == pytest.approx({("infer-a",): 0.30 * 12 * 0.5, ("infer-b",): 0.50 * 12 * 0.5},
                                                   rel=1e-9)
    assert set(by_pod(p, "allocated", "activity_basis").values()) and \
        {k[1] for k in by_pod(p, "allocated", "activity_basis")} == {"by_fraction"}
    idle = p.store.totals("idle", (), {"cost_model": "request"})[()]
    assert idle == pytest.approx(24.0 - 0.8 * 12, rel=1e-9)
    assert p.store.totals("capacity", (), {"cost_model": "request"})[()] == pytest.approx(24.0, rel=1e-9)
    assert not by_label(p.metrics.gpu_fractions_unheld)


def test_hami_under_the_max_rule_a_memory_grant_larger_than_the_core_limit_sets_the_share():
    p = run(Cluster([hami_node()], hami_pods("GPU-a0,NVIDIA,20480,10:")), rule="max")
    assert by_pod(p, "allocated", "fraction_basis") == pytest.approx({
        ("infer-a", "hami_cores"): 0.30 * 12, ("infer-b", "hami_memory"): 0.50 * 12}, rel=1e-9)
    p = run(Cluster([hami_node()], hami_pods("GPU-a0,NVIDIA,20480,10:")), rule="compute")
    assert by_pod(p, "allocated", "fraction_basis") == pytest.approx({
        ("infer-a", "hami_cores"): 0.30 * 12, ("infer-b", "hami_cores"): 0.10 * 12}, rel=1e-9)


def test_grants_beyond_the_gpu_are_scaled_down_together_and_never_sell_it_twice():
    p = run(Cluster([hami_node()], hami_pods("GPU-a0,NVIDIA,4096,90:")))  # 30% + 90% of the cores
    alloc = by_pod(p, "allocated")
    assert alloc == pytest.approx({("infer-a",): 12 * 30 / 120, ("infer-b",): 12 * 90 / 120}, rel=1e-9)
    # What they hold adds up to the GPU: the device's 40% activity is all theirs, in proportion.
    assert by_pod(p, "effective") == pytest.approx({k: 0.4 * v for k, v in alloc.items()}, rel=1e-9)
    assert p.store.totals("idle", (), {"cost_model": "request"})[()] == pytest.approx(12.0, rel=1e-9)  # GPU-a1


def test_kai_worked_example():
    """notebook-1 holds half the H100 ($20 an hour of $40), notebook-2 20 GiB of 80: a quarter ($10).
    The reservation pod holds nothing itself; the last quarter is idle. 60% activity over 75% sold:
    each fraction is 80% used."""
    p = run(kai_cluster())
    assert by_pod(p, "allocated", "namespace", "fraction_basis") == pytest.approx({
        ("notebook-1", "team-a", "kai_fraction"): 20.0, ("notebook-2", "team-b", "kai_memory"): 10.0}, rel=1e-9)
    assert by_pod(p, "effective") == pytest.approx({("notebook-1",): 16.0, ("notebook-2",): 8.0}, rel=1e-9)
    assert p.store.totals("idle", (), {"cost_model": "request"})[()] == pytest.approx(10.0, rel=1e-9)


def test_a_fraction_pod_with_no_reservation_holds_nothing_and_is_counted():
    stray = Pod("team-c", "notebook-3", "kai-1", {"runai-gpu-group": "g-gone"}, annotations={"gpu-fraction": "0.25"})
    broken = Pod("team-c", "notebook-4", "kai-1", {"runai-gpu-group": "g-1"}, annotations={"gpu-fraction": "1.5"})
    p = run(kai_cluster((stray, broken)))
    assert set(by_pod(p, "allocated")) == {("notebook-1",), ("notebook-2",)}
    counted = by_label(p.metrics.gpu_fractions_unheld)
    intervals = HOUR // 300
    assert counted == {"fraction pod without a reservation pod on its node": intervals,
                       "malformed gpu-fraction, gpu-memory or gpu-fraction-num-devices": intervals}


def test_without_dcgm_pod_mapping_the_reservation_pods_gpu_is_still_shared_out():
    """dcgm-exporter without pod mapping: the GPU shows no holder, and the reservation pod's GPU
    request is not placed on it as a whole GPU; its UUID annotation names the GPU."""
    c = kai_cluster()
    c.pods[0].holds = ()
    c.nodes[0].units[0].busy = 0.6
    p = run(c)
    assert by_pod(p, "allocated") == pytest.approx({("notebook-1",): 20.0, ("notebook-2",): 10.0}, rel=1e-9)


def test_on_a_node_without_device_data_grants_take_a_gpu_of_their_own():
    """No DCGM series at all: the node's GPUs are costed from kube-state-metrics; HAMi's grants on
    one GPU hold their fractions of one GPU (memory from the model name: 40 GB), unmeasured."""
    node = hami_node()
    node.units = []
    node.labels = {"nvidia.com/gpu.count": "2", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}
    p = run(Cluster([node], hami_pods()))
    assert by_pod(p, "allocated", "attribution") == pytest.approx({
        ("infer-a", "ksm_request"): 0.30 * 12, ("infer-b", "ksm_request"): 0.50 * 12}, rel=1e-9)
    assert by_pod(p, "unmeasured") == pytest.approx({("infer-a",): 3.6, ("infer-b",): 6.0}, rel=1e-9)


def test_hami_annotation_forms():
    assert hami_devices("GPU-a0,NVIDIA,10240,30:;GPU-a1,NVIDIA,2048,0:GPU-a2,NVIDIA,1,100:;") == [
        ("GPU-a0", 10240.0, 30.0), ("GPU-a1", 2048.0, 0.0), ("GPU-a2", 1.0, 100.0)]
    assert hami_devices("0,GPU-a0,NVIDIA,10240,30:") == [("GPU-a0", 10240.0, 30.0)]  # with the device index
    for bad in ("GPU-a0,NVIDIA,10240:", "nvidia0,NVIDIA,1,1:", "GPU-a0,NVIDIA,1,101:", "GPU-a0,NVIDIA,-1,5:",
                "GPU-a0,NVIDIA,x,5:"):
        with pytest.raises(ValueError):
            hami_devices(bad)


def test_model_memory():
    assert model_memory_mib(H100) == 81920
    assert model_memory_mib("NVIDIA-A100-SXM4-40GB") == 40960
    assert model_memory_mib("Tesla T4") is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.none(), st.floats(0.01, 1.0)), st.one_of(st.none(), st.floats(1, 200_000))),
                min_size=1, max_size=6),
       st.one_of(st.none(), st.floats(1024, 200_000)), st.sampled_from(["compute", "max"]))
def test_a_claim_is_never_more_than_the_gpu(grants, total, rule):
    for compute, memory in grants:
        share, basis = Claim(("ns", "p"), "n", "GPU-x", "hami", compute, memory).fraction(total, rule)
        assert 0.0 <= share <= 1.0
        assert (share > 0) == bool(basis)
        if compute is not None:
            assert share >= compute or rule == "compute"


def test_a_device_several_pods_hold_at_once_is_split_among_them():
    """A DRA ResourceClaim shared by two pods: dcgm-exporter (with KUBERNETES_ENABLE_DRA) repeats the
    device's series for each pod, on a node whose labels announce no sharing. Each holds half, as
    a replica, and the device's 60% activity is split between them."""
    node = Node("dra-1", "p5.4xlarge", 16, 256, units=[Unit("GPU-h0", H100)])
    pods = [Pod("team-a", "trainer", "dra-1", {"team": "a"}, holds=("GPU-h0",), activity=0.6),
            Pod("team-a", "evaluator", "dra-1", {"team": "a"}, holds=("GPU-h0",), activity=0.6, start_s=1800)]
    p = run(Cluster([node], pods))
    assert by_pod(p, "allocated", "unit_kind", "activity_basis") == pytest.approx({
        ("trainer", "gpu", "device"): 20.0, ("trainer", "replica", "equal_split"): 10.0,
        ("evaluator", "replica", "equal_split"): 10.0}, rel=1e-9)
    assert sum(by_pod(p, "effective").values()) == pytest.approx(0.6 * 40, rel=1e-9)
    assert p.store.totals("idle", (), {"cost_model": "request"})[()] == pytest.approx(0.0, abs=1e-9)


@st.composite
def shared_gpus(draw) -> tuple[Cluster, dict]:
    """Nodes of one H100 each, shared by HAMi, by KAI, by several pods at once, or held whole; and
    the share of the GPU each pod was granted (1 for a whole GPU or a device held by several)."""
    nodes, pods, granted = [], [], {}
    for i in range(draw(st.integers(1, 4))):
        name, uuid = f"n{i}", f"GPU-{i}"
        how = draw(st.sampled_from(["hami", "kai", "several", "whole", "none"]))
        busy = draw(st.floats(0.0, 1.0))
        nodes.append(Node(name, "p5.4xlarge", 16, 256, units=[Unit(uuid, H100, busy=busy, memory_mib=81920)],
                          capacity={"nvidia_com_gpu": 10 if how == "hami" else 1}))  # HAMi: 10 vGPUs
        n = draw(st.integers(1, 4))
        if how == "hami":
            for k in range(n):
                cores, mem = draw(st.integers(0, 100)), draw(st.integers(1, 81920))
                pods.append(Pod("t", f"{name}-h{k}", name, gpu=("nvidia_com_gpu", 1),
                                annotations={HAMI: f"{uuid},NVIDIA,{mem},{cores}:"}))
                granted[pods[-1].name] = max(cores / 100, mem / 81920)  # the most either rule takes
        elif how == "kai":
            group = {"runai-gpu-group": f"g{i}"}
            pods.append(Pod(RESERVATION, f"{name}-reservation", name, group, gpu=("nvidia_com_gpu", 1),
                            holds=(uuid,), activity=busy, annotations={"run.ai/reserve_for_gpu_index": uuid}))
            for k in range(n):
                f = draw(st.sampled_from([0.1, 0.25, 0.5, 0.75, 1.0]))
                pods.append(Pod("t", f"{name}-k{k}", name, group, annotations={"gpu-fraction": str(f)}))
                granted[pods[-1].name] = f
        elif how in ("several", "whole"):
            for k in range(n if how == "several" else 1):
                pods.append(Pod("t", f"{name}-p{k}", name, holds=(uuid,), activity=busy))
                granted[pods[-1].name] = 1.0
    return Cluster(nodes, pods), granted


@settings(max_examples=25, deadline=None)
@given(shared_gpus(), st.sampled_from(["compute", "max"]))
def test_every_way_of_sharing_adds_up_to_each_gpu_and_never_bills_a_fraction_as_a_whole_gpu(drawn, rule):
    c, granted = drawn
    p = run(c, rule=rule, until_s=600)
    hours = 600 / HOUR
    model = {"cost_model": "request"}
    capacity = p.store.totals("capacity", ("node",), model)
    allocated = p.store.totals("allocated", ("node",), model)
    idle = p.store.totals("idle", ("node",), model)
    for node in capacity:
        assert allocated.get(node, 0.0) + idle.get(node, 0.0) == pytest.approx(capacity[node], rel=1e-9, abs=1e-12)
        assert capacity[node] == pytest.approx(40.0 * hours, rel=1e-12)
    for (pod, _), cost in by_pod(p, "allocated", "node").items():
        assert cost <= 40.0 * hours * granted.get(pod, 1.0) * (1 + 1e-9)  # never more than granted; "": nobody
        assert cost >= 0.0
    assert not set(by_pod(p, "allocated")) & {(x.name,) for x in c.pods if x.namespace == RESERVATION}


@pytest.mark.slow
def test_the_worked_examples_through_the_real_sidecar_with_grants_from_the_kubernetes_api(tmp_path):
    """`otelgpu serve` fed the HAMi and KAI nodes' dcgm-exporter scrapes over OTLP/gRPC, the pods'
    grants read by the real kubernetes client from a local API endpoint (no kube-state-metrics):
    the figures of the two worked examples, and each node's capacity = allocated + idle."""
    from kubeapi import FakeKubeApi
    from sidecar import Sidecar

    hami, kai = Cluster([hami_node()], hami_pods()), kai_cluster()
    c = Cluster(hami.nodes + kai.nodes, hami.pods + kai.pods)
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(c.t0 // NS - 3600))
    sink = CollectorSink()
    with FakeKubeApi(token="t") as api:
        for obj in c.namespace_objects() + c.node_objects() + [c.pod_object(p) for p in c.pods]:
            api.apply({**obj, "metadata": {**obj["metadata"], "creationTimestamp": created}})
        serve = Sidecar(tmp_path, {
            "receiver": {"max_point_age_seconds": 0},
            "attribution": {"interval_seconds": 300, "lateness_seconds": 0,
                            "prices": {"gpu_hour_by_gpu_model": {A100: 12.0, H100: 40.0}}},
            "kubernetes": {"enabled": True, "auth": "token", "api_url": api.url, "token": "t"},
            "exporter": {"otlp": {"endpoint": sink.endpoint, "tls": {"insecure": True}}}})
        try:
            serve.start(timeout=90)
            serve.export(*c.scrapes(60, HOUR, ksm=False))
            assert serve.stop(timeout=60) == 0, serve.log.read_text()[-6000:]
        finally:
            serve.close()
            sink.stop()

    assert _sink_totals(sink, "gpu.cost.allocated", "pod", "fraction_basis") == pytest.approx({
        ("infer-a", "hami_cores"): 3.6, ("infer-b", "hami_memory"): 6.0,
        ("notebook-1", "kai_fraction"): 20.0, ("notebook-2", "kai_memory"): 10.0}, rel=1e-9)
    assert _sink_totals(sink, "gpu.cost.effective", "pod") == pytest.approx({
        ("infer-a",): 1.8, ("infer-b",): 3.0, ("notebook-1",): 16.0, ("notebook-2",): 8.0}, rel=1e-9)
    capacity, allocated, idle = (_sink_totals(sink, m, "node") for m in ("gpu.cost.capacity", "gpu.cost.allocated", "gpu.cost.idle"))
    assert capacity == pytest.approx({("hami-1",): 24.0, ("kai-1",): 40.0}, rel=1e-9)
    for node, value in capacity.items():
        assert allocated[node] + idle[node] == pytest.approx(value, rel=1e-9)


def dra_objects(c: Cluster) -> list[dict]:
    """The DRA driver's ResourceSlice for node dra-1 (two GPUs and a MIG device), and two claims:
    GPU-d0 for `trainer`, GPU-d1 shared by `svc-1` and `svc-2` (reservedFor lists both)."""
    def device(name: str, **attributes: str) -> dict:
        return {"name": name, "attributes": {k: {"string": v} for k, v in attributes.items()}}

    def claim(namespace: str, name: str, gpu: str, pods: list[str], admin: bool = False) -> dict:
        result = {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "dra-1", "device": gpu}
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": namespace},
                "status": {"allocation": {"devices": {"results": [{**result, "adminAccess": True} if admin else result]}},
                    "reservedFor": [{"resource": "pods", "name": p, "uid": f"uid-{namespace}-{p}"} for p in pods]}}

    slice_ = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "dra-1-gpu-x9"},
              "spec": {"driver": "gpu.nvidia.com", "nodeName": "dra-1", "pool": {"name": "dra-1", "generation": 1,
                                                                                  "resourceSliceCount": 1},
                       "devices": [device("gpu-0", type="gpu", uuid="GPU-d0", productName=H100),
                                   device("gpu-1", type="gpu", uuid="GPU-d1", productName=H100),
                                   device("gpu-1-mig-1g10gb-0", type="mig", uuid="MIG-d1-0", parentUUID="GPU-d1",
                                          profile="1g.10gb")]}}
    slice_["spec"]["devices"].append(device("gpu-2", type="gpu", uuid="GPU-d2", productName=H100))
    return [slice_, claim("team-a", "trainer-gpu", "gpu-0", ["trainer"]),
            claim("team-b", "shared-gpu", "gpu-1", ["svc-1", "svc-2"]),
            claim("monitoring", "monitor-gpu-0", "gpu-0", ["monitor"], admin=True)]


@pytest.mark.slow
def test_gpus_dra_claims_allocate_are_held_by_the_claims_pods_through_the_real_sidecar(tmp_path):
    """dcgm-exporter without DRA support names no pod on a node's two H100 ($40 an hour each), and
    no pod requests a GPU: the ResourceClaims (from the Kubernetes API) say who holds them.
    `trainer` holds GPU-d0 (50% active): $40, effective $20. svc-1 and svc-2 share GPU-d1's claim
    (20% active): $20 each as replicas, effective $4 each. A monitoring pod's admin-access claim on
    GPU-d0 holds nothing. `job` asks the device plugin for a GPU: it gets GPU-d2, the one no claim
    allocates ($40, unmeasured). Nothing is idle."""
    from kubeapi import FakeKubeApi
    from sidecar import Sidecar

    node = Node("dra-1", "p5.48xlarge", 192, 2048, labels={"nvidia.com/gpu.count": "3"},
                units=[Unit("GPU-d0", H100, busy=0.5), Unit("GPU-d1", H100, busy=0.2), Unit("GPU-d2", H100, busy=0.3)])
    c = Cluster([node], [Pod("team-a", "trainer", "dra-1", {"team": "a"}), Pod("team-b", "svc-1", "dra-1"),
                         Pod("team-b", "svc-2", "dra-1"), Pod("monitoring", "monitor", "dra-1"),
                         Pod("team-c", "job", "dra-1", gpu=("nvidia_com_gpu", 1))])
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(c.t0 // NS - 3600))
    sink = CollectorSink()
    with FakeKubeApi(token="t") as api:
        api.define("ResourceSlice", "resource.k8s.io/v1", namespaced=False)
        for obj in c.namespace_objects() + c.node_objects() + [c.pod_object(p) for p in c.pods] + dra_objects(c):
            api.apply({**obj, "metadata": {**obj["metadata"], "creationTimestamp": created}})
        serve = Sidecar(tmp_path, {
            "receiver": {"max_point_age_seconds": 0},
            "attribution": {"interval_seconds": 300, "lateness_seconds": 0,
                            "prices": {"gpu_hour_by_gpu_model": {H100: 40.0}}},
            "kubernetes": {"enabled": True, "auth": "token", "api_url": api.url, "token": "t"},
            "exporter": {"otlp": {"endpoint": sink.endpoint, "tls": {"insecure": True}}}})
        try:
            serve.start(timeout=90)
            eventually(lambda: serve.metric("otelgpu_kube_objects", resource="resourceclaims") == 3, 30)
            serve.export(*c.scrapes(60, HOUR, ksm=False))
            assert serve.stop(timeout=60) == 0, serve.log.read_text()[-6000:]
        finally:
            serve.close()
            sink.stop()
    allocated = _sink_totals(sink, "gpu.cost.allocated", "pod", "attribution", "unit_kind")
    assert allocated == pytest.approx({("trainer", "dra_claim", "gpu"): 40.0, ("svc-1", "dra_claim", "replica"): 20.0,
                                       ("svc-2", "dra_claim", "replica"): 20.0, ("job", "ksm_request", "gpu"): 40.0},
                                      rel=1e-9)
    assert _sink_totals(sink, "gpu.cost.effective", "pod") == pytest.approx(
        {("trainer",): 20.0, ("svc-1",): 4.0, ("svc-2",): 4.0, ("job",): 0.0}, rel=1e-9)
    assert sum(_sink_totals(sink, "gpu.cost.idle", "node").values()) == pytest.approx(0.0, abs=1e-9)


def _sink_totals(sink, metric: str, *keys: str) -> dict:
    """The request model's last cumulative values of `metric` at the sink, summed by `keys`."""
    out: dict = {}
    for attrs, point in sink.latest(metric).items():
        a = dict(attrs)
        if a.get("cost_model") == "request":
            k = tuple(a.get(key, "") for key in keys)
            out[k] = out.get(k, 0.0) + point.as_double
    return out



# The worst day: grants that are wrong, forged or out of place -----------------------------------


def one_h100(*pods: Pod, units: int = 1, advertised: int | None = None, busy: float = 0.0) -> Cluster:
    node = Node("n1", "p5.48xlarge", 192, 2048, labels={"nvidia.com/gpu.count": str(units)},  # GFD's count
                units=[Unit(f"GPU-h{i}", H100, busy=busy, memory_mib=81920) for i in range(units)],
                capacity={"nvidia_com_gpu": advertised or units})
    return Cluster([node], list(pods))


@pytest.mark.parametrize("policy", ["keep", "share"])
def test_a_grant_a_pod_writes_itself_cannot_cut_what_dcgm_shows_it_holds(policy):
    """`greedy` holds GPU-h0 alone (dcgm-exporter maps it) and writes a 1% HAMi grant on its own
    pod: it pays the whole GPU, and its neighbour pays nothing of it under idle policy share."""
    greedy = Pod("t", "greedy", "n1", gpu=("nvidia_com_gpu", 1), holds=("GPU-h0",), annotations={HAMI: "GPU-h0,NVIDIA,1,1:"})
    honest = Pod("u", "honest", "n1", gpu=("nvidia_com_gpu", 1), holds=("GPU-h1",))
    for advertised in (2, 20):  # a node without HAMi, and one that advertises vGPUs
        p = offline_pipeline(make_config(attribution__interval_seconds=300, attribution__lateness_seconds=0,
                                         attribution__idle__policy=policy,
                                         attribution__prices__gpu_hour_by_gpu_model={H100: 40.0}))
        feed(p, *one_h100(greedy, honest, units=2, advertised=advertised).scrapes(60, HOUR))
        p.close_due(flush=True)
        assert by_pod(p, "allocated") == pytest.approx({("greedy",): 40.0, ("honest",): 40.0}, rel=1e-9)
        assert sum(by_pod(p, "unused").values()) == pytest.approx(0.0, abs=1e-9)


def test_a_pod_dcgm_shows_on_a_gpu_keeps_its_holding_and_grants_share_what_it_leaves():
    """On a node that advertises HAMi's vGPUs, dcgm-exporter shows `owner` holding GPU-h0 all hour
    and `short` holding GPU-h1 for the first 120 s; `infer-0` has a HAMi grant of 30% of GPU-h0,
    `infer-1` of 90% of GPU-h1. What dcgm-exporter shows stands: owner pays all of GPU-h0 and
    infer-0's grant holds nothing there (counted); in the first interval short holds 0.4 of GPU-h1
    and infer-1 the 0.6 it leaves, then its 90%."""
    pods = [Pod("t", "owner", "n1", gpu=("nvidia_com_gpu", 1), holds=("GPU-h0",)),
            Pod("t", "short", "n1", gpu=("nvidia_com_gpu", 1), holds=("GPU-h1",), end_s=120),
            Pod("u", "infer-0", "n1", gpu=("nvidia_com_gpu", 1), annotations={HAMI: "GPU-h0,NVIDIA,1024,30:"}),
            Pod("u", "infer-1", "n1", gpu=("nvidia_com_gpu", 1), annotations={HAMI: "GPU-h1,NVIDIA,1024,90:"})]
    p = run(one_h100(*pods, units=2, advertised=20, busy=0.5))
    assert by_pod(p, "allocated") == pytest.approx({
        ("owner",): 40.0, ("short",): 40 * 0.4 * 300 / HOUR, ("infer-1",): 40 * (0.6 * 300 + 0.9 * 3300) / HOUR},
        rel=1e-9)
    assert p.store.totals("idle", (), {"cost_model": "request"})[()] == pytest.approx(40 * 0.1 * 3300 / HOUR, rel=1e-9)
    assert by_label(p.metrics.gpu_fractions_unheld) == {"grant on a GPU that pods dcgm-exporter shows hold whole":
                                                        HOUR // 300}


def test_a_hami_grant_on_a_node_that_advertises_no_vgpus_is_not_taken_and_is_counted():
    """dcgm-exporter maps no pods; the node advertises its one GPU, so HAMi does not share it: the
    pod's own GPU request places it, whatever its annotation says."""
    p = run(one_h100(Pod("t", "job", "n1", gpu=("nvidia_com_gpu", 1), annotations={HAMI: "GPU-h0,NVIDIA,1,1:"}),
                     busy=0.9))
    assert by_pod(p, "allocated", "attribution") == pytest.approx({("job", "ksm_request"): 40.0}, rel=1e-9)
    assert by_label(p.metrics.gpu_fractions_unheld) == {"HAMi grant on a node that advertises no vGPUs": HOUR // 300}


@pytest.mark.parametrize("annotations", [{"gpu-fraction": "lots"}, {"gpu-fraction": "nan"}, {"gpu-fraction": "-1"},
                                         {HAMI: "GPU-h0,NVIDIA,x,5:"}, {HAMI: "GPU-h0[1g.10gb-0],NVIDIA,100,0:"},
                                         {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"}])
def test_a_grant_that_cannot_be_used_leaves_the_pod_paying_its_request(annotations):
    p = run(one_h100(Pod("t", "job", "n1", gpu=("nvidia_com_gpu", 1), annotations=annotations), advertised=10, busy=0.9))
    assert by_pod(p, "allocated") == pytest.approx({("job",): 40.0}, rel=1e-9)
    assert sum(by_label(p.metrics.gpu_fractions_unheld).values()) == HOUR // 300


def test_a_reservation_pod_is_never_charged_even_when_its_fraction_pods_are_gone():
    c = kai_cluster()
    del c.pods[1:]
    p = run(c)
    assert by_pod(p, "allocated") == {}
    assert p.store.totals("idle", (), {"cost_model": "request"})[()] == pytest.approx(40.0, rel=1e-9)
    assert by_label(p.metrics.gpu_fractions_unheld) == {"GPU a reservation pod holds with no fraction pod on it":
                                                        HOUR // 300}


def test_a_gpu_kai_shares_out_takes_no_whole_gpu_request():
    """dcgm-exporter maps no pods: `trainer`'s request goes to the GPU nobody gives out, not to the
    one KAI's reservation names."""
    group = {"runai-gpu-group": "g-1"}
    c = one_h100(Pod(RESERVATION, "resv", "n1", group, gpu=("nvidia_com_gpu", 1),
                     annotations={"run.ai/reserve_for_gpu_index": "GPU-h0"}),
                 Pod("t", "nb", "n1", group, annotations={"gpu-fraction": "0.5"}),
                 Pod("t", "trainer", "n1", gpu=("nvidia_com_gpu", 1)), units=2, busy=0.5)
    p = run(c)
    assert by_pod(p, "allocated", "unit_kind") == pytest.approx({("trainer", "gpu"): 40.0, ("nb", "fraction"): 20.0},
                                                                rel=1e-9)


def test_a_fraction_pod_pays_for_the_part_of_the_interval_it_ran():
    """A job with half of the GPU runs 60 s of a 300 s interval (the kube-state-metrics phases say
    so): it pays 60 s, not the interval."""
    c = kai_cluster((Pod("team-c", "job", "kai-1", {"runai-gpu-group": "g-1"}, annotations={"gpu-fraction": "0.25"},
                         start_s=60, end_s=120),))
    p = run(c, until_s=300)
    assert by_pod(p, "allocated")[("job",)] == pytest.approx(0.25 * 40 * 60 / 3600, rel=1e-9)
    assert by_pod(p, "allocated")[("notebook-1",)] == pytest.approx(0.5 * 40 * 300 / 3600, rel=1e-9)


def test_hami_s_vgpus_are_never_counted_as_gpus():
    """A p4d.24xlarge (8 A100) whose HAMi device plugin advertises 80 vGPUs, no GFD: 8 GPUs whether
    HAMi pods run or not, and whether or not dcgm-exporter reports (the instance type's count)."""
    node = Node("hami-8", "p4d.24xlarge", 96, 1152, labels={"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"},
                units=[Unit(f"GPU-a{i}", A100) for i in range(8)], capacity={"nvidia_com_gpu": 80})
    for pods in ([], hami_pods()):
        for units in (node.units, []):
            for pod in pods:
                pod.node = "hami-8"
            p = run(Cluster([Node(**{**node.__dict__, "units": units})], pods))
            assert p.store.totals("capacity", (), {"cost_model": "request"})[()] == pytest.approx(8 * 12.0, rel=1e-9)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.none(), st.text(max_size=40), st.sampled_from([
           "GPU-h0,NVIDIA,nan,inf:", "GPU-h0,NVIDIA,1e308,100:GPU-h1,NVIDIA,1,1:", "GPU-h0,NVIDIA,0,0:", ";;::",
           "0,GPU-h0,NVIDIA,5,5:", "GPU-h0,NVIDIA,5,5,5,5:", "GPU-h0[1-0],NVIDIA,1,1:"])),
                          st.one_of(st.none(), st.sampled_from(["nan", "inf", "-1", "0", "1e-320", "0.5", "１", ""]),
                                    st.text(max_size=6)),
                          st.sampled_from(["g-1", "", "g-2"]), st.booleans()), min_size=1, max_size=5),
       st.one_of(st.none(), st.sampled_from(["GPU-h0", "GPU-h9", "", "MIG-x", "GPU-" + "a" * 70])))
def test_hostile_grants_never_break_an_interval_and_every_gpu_adds_up(specs, reserve):
    pods = []
    if reserve is not None:
        pods.append(Pod(RESERVATION, "resv", "n1", {"runai-gpu-group": "g-1"}, gpu=("nvidia_com_gpu", 1),
                        holds=("GPU-h0",), annotations={"run.ai/reserve_for_gpu_index": reserve}))
    for i, (hami, fraction, group, holds) in enumerate(specs):
        annotations = {k: v for k, v in ((HAMI, hami), ("gpu-fraction", fraction)) if v}
        pods.append(Pod("t", f"p{i}", "n1", {"runai-gpu-group": group} if group else {}, gpu=("nvidia_com_gpu", 1),
                        holds=("GPU-h1",) if holds else (), annotations=annotations))
    p = run(one_h100(*pods, units=2, advertised=20, busy=0.5), until_s=600)
    assert not by_label(p.metrics.interval_errors)
    m = {"cost_model": "request"}
    capacity = p.store.totals("capacity", (), m)[()]
    assert capacity == pytest.approx(2 * 40 * 600 / 3600, rel=1e-12)
    assert sum(p.store.totals("allocated", (), m).values()) + p.store.totals("idle", (), m).get((), 0.0) == \
        pytest.approx(capacity, rel=1e-9)



def test_a_kai_fraction_of_several_gpus_holds_its_share_of_each():
    """KAI's `gpu-fraction-num-devices: 2` pod names its second GPU group in a `runai-gpu-group/<g>`
    label: half of each H100 ($40 in all); the reservation pods pay nothing."""
    group = {"runai-gpu-group": "g-0", "runai-gpu-group/g-0": "g-0", "runai-gpu-group/g-1": "g-1"}
    pods = [Pod(RESERVATION, f"resv-{i}", "n1", {"runai-gpu-group": f"g-{i}"}, gpu=("nvidia_com_gpu", 1),
                holds=(f"GPU-h{i}",), annotations={"run.ai/reserve_for_gpu_index": f"GPU-h{i}"}) for i in (0, 1)]
    multi = Pod("t", "multi", "n1", group, annotations={"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"})
    p = run(one_h100(*pods, multi, units=2, busy=0.5))
    assert by_pod(p, "allocated", "fraction_basis") == pytest.approx({("multi", "kai_fraction"): 40.0}, rel=1e-9)
    assert p.store.totals("idle", (), {"cost_model": "request"})[()] == pytest.approx(40.0, rel=1e-9)
    one_short = Pod("t", "multi", "n1", group, annotations={"gpu-fraction": "0.5", "gpu-fraction-num-devices": "3"})
    p = run(one_h100(*pods, one_short, units=2, busy=0.5))
    assert by_pod(p, "allocated") == {}
    assert by_label(p.metrics.gpu_fractions_unheld) == {
        "KAI fraction of several GPUs without a reservation pod for each": HOUR // 300,
        "GPU a reservation pod holds with no fraction pod on it": 2 * HOUR // 300}


def test_kais_nvfractions_memory_request_is_preferred_to_the_legacy_annotations():
    """KAI 0.17's `nvidia.com/container.<name>.gpu-memory.request: 20Gi` (of 80 GiB) wins over a
    `gpu-fraction` the pod also carries: a quarter of the H100."""
    c = kai_cluster()
    c.pods[1].annotations = {"nvidia.com/container.main.gpu-memory.request": "20Gi", "gpu-fraction": "0.5"}
    p = run(c)
    assert by_pod(p, "allocated", "fraction_basis") == pytest.approx({
        ("notebook-1", "kai_memory"): 10.0, ("notebook-2", "kai_memory"): 10.0}, rel=1e-9)


def test_the_api_source_keeps_the_keys_sharing_reads_by_their_beginning():
    from otelgpu.enrich import sharing
    from otelgpu.enrich.kube.objects import pod_facts

    pod = pod_facts({"metadata": {"name": "p", "namespace": "t", "labels": {"runai-gpu-group/g-1": "g-1", "x": "y"},
                                  "annotations": {"nvidia.com/container.main.gpu-memory.request": "1Gi",
                                                  "nvidia.com/other": "z"}}},
                    sharing.LABEL_KEYS, sharing.ANNOTATION_KEYS, 0, sharing.LABEL_PREFIXES, sharing.ANNOTATION_PREFIXES)
    assert pod.labels == {"label_runai_gpu_group_g_1": "g-1"}
    assert pod.annotations == {"annotation_nvidia_com_container_main_gpu_memory_request": "1Gi"}


def test_a_pod_that_requests_a_whole_gpu_cannot_join_a_kai_group_to_pay_less():
    """dcgm-exporter maps no pods; `cheat` runs on a whole GPU through the device plugin and labels
    itself into KAI's group with a 1% fraction: KAI's fraction pods request no GPU, so its own
    request still places it ($40), and the grant is counted."""
    group = {"runai-gpu-group": "g-1"}
    c = one_h100(Pod(RESERVATION, "resv", "n1", group, gpu=("nvidia_com_gpu", 1),
                     annotations={"run.ai/reserve_for_gpu_index": "GPU-h0"}),
                 Pod("a", "nb", "n1", group, annotations={"gpu-fraction": "0.5"}),
                 Pod("t", "cheat", "n1", group, gpu=("nvidia_com_gpu", 1), annotations={"gpu-fraction": "0.01"}),
                 units=2, busy=0.5)
    p = run(c)
    assert by_pod(p, "allocated") == pytest.approx({("cheat",): 40.0, ("nb",): 20.0}, rel=1e-9)
    assert by_label(p.metrics.gpu_fractions_unheld) == {"KAI grant on a pod that requests GPUs": HOUR // 300}


def test_a_grant_naming_a_gpu_its_node_does_not_report_leaves_the_pod_its_request():
    p = run(one_h100(Pod("t", "job", "n1", gpu=("nvidia_com_gpu", 1), annotations={HAMI: "GPU-elsewhere,NVIDIA,1,1:"}),
                     advertised=10, busy=0.9))
    assert by_pod(p, "allocated") == pytest.approx({("job",): 40.0}, rel=1e-9)
    assert by_label(p.metrics.gpu_fractions_unheld) == {"grant naming a GPU its node does not report": HOUR // 300}


@pytest.mark.parametrize("node", ["mig-single", "dead-gpu"])
def test_nodes_that_advertise_more_gpus_than_they_report_are_not_hami_nodes(node):
    """A MIG single-strategy node advertises its 7 instances as nvidia.com/gpu; a p5.48xlarge with
    a GPU fallen off the bus advertises 8 and reports 7. Neither is HAMi's: a forged HAMi grant
    there is ignored (counted), and the pod pays what its request places."""
    if node == "mig-single":
        n = Node("n1", "p4d.24xlarge", 96, 1152, labels={"nvidia.com/gpu.count": "1", "nvidia.com/mig.strategy": "single",
                                                         "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"},
                 units=[Unit("GPU-m0", A100, profile="1g.5gb", gi=str(i + 1), busy=0.5) for i in range(7)],
                 capacity={"nvidia_com_gpu": 7})
    else:
        n = Node("n1", "p5.48xlarge", 192, 2048, units=[Unit(f"GPU-h{i}", H100, busy=0.9) for i in range(7)],
                 capacity={"nvidia_com_gpu": 8})
    honest, forged = ({}, {HAMI: f"{n.units[0].uuid},NVIDIA,1,1:"})
    paid = [run(Cluster([n], [Pod("t", "job", "n1", gpu=("nvidia_com_gpu", 1), annotations=a)]))
            for a in (honest, forged)]
    assert by_pod(paid[0], "allocated")[("job",)] > 0
    assert by_pod(paid[1], "allocated") == pytest.approx(by_pod(paid[0], "allocated"), rel=1e-9)
    assert by_label(paid[1].metrics.gpu_fractions_unheld) == {"HAMi grant on a node that advertises no vGPUs":
                                                              HOUR // 300}


def test_grants_that_follow_each_other_in_an_interval_are_not_scaled_as_if_they_overlapped():
    """A Deployment's pod with 3/4 of the GPU is replaced mid-interval: each held 3/4 for its 150 s."""
    c = kai_cluster()
    del c.pods[1:]
    group = {"runai-gpu-group": "g-1"}
    c.pods += [Pod("t", "svc-old", "kai-1", group, annotations={"gpu-fraction": "0.75"}, end_s=150),
               Pod("t", "svc-new", "kai-1", group, annotations={"gpu-fraction": "0.75"}, start_s=150)]
    p = offline_pipeline(make_config(attribution__interval_seconds=300, attribution__lateness_seconds=0,
                                     attribution__prices__gpu_hour_by_gpu_model={H100: 40.0}))
    feed(p, *c.scrapes(30, 300))
    p.close_due(flush=True)
    assert by_pod(p, "allocated") == pytest.approx({("svc-old",): 0.75 * 40 * 150 / 3600,
                                                    ("svc-new",): 0.75 * 40 * 150 / 3600}, rel=1e-9)


def test_hamis_own_resources_in_kube_state_metrics_are_bounded_in_their_units():
    """A HAMi pod asks for vGPUs (nvidia.com/gpu) and, per GPU, memory in MiB (nvidia.com/gpumem)
    or a percentage of it (nvidia.com/gpumem-percentage), a percentage of its cores
    (nvidia.com/gpucores) and a priority (nvidia.com/priority): kube-state-metrics reports each as
    a request. None is a count of GPUs: every scrape is taken whole and the worked example's money
    stands. A request HAMi itself would refuse is still refused, counted with its reason."""
    def priced(first: dict[str, float], second: dict[str, float]):  # noqa: ANN202 - a Pipeline
        pods = hami_pods()
        pods[0].extended, pods[1].extended = first, second
        return run(Cluster([hami_node()], pods))

    worked = {("infer-a", "fraction", "hami_cores"): 0.30 * 12, ("infer-b", "fraction", "hami_memory"): 0.50 * 12}
    p = priced({"nvidia_com_gpumem": 10240, "nvidia_com_gpucores": 30},
               {"nvidia_com_gpumem_percentage": 50, "nvidia_com_priority": 1})
    assert not by_label(p.metrics.points_rejected)
    assert by_pod(p, "allocated", "unit_kind", "fraction_basis") == pytest.approx(worked, rel=1e-9)

    p = priced({"nvidia_com_gpumem": 2.0**31, "nvidia_com_gpucores": 30},  # beyond HAMi's int32
               {"nvidia_com_gpumem_percentage": 50.5, "nvidia_com_gpucores": 150})
    scrapes = HOUR // 60
    request = "kube_pod_container_resource_requests"
    assert by_label(p.metrics.points_rejected) == {(request, "bad_quantity"): 3 * scrapes}
    assert by_pod(p, "allocated", "unit_kind", "fraction_basis") == pytest.approx(worked, rel=1e-9)
