"""Every cost model through the whole pipeline (OTLP requests in, cost series out), on hand-worked
clusters: AWS's public SCAD example, unused GPUs, spot nodes, a mixed-MIG H100, a time-sliced
node, a pod that starts mid-interval, and several models side by side."""

from __future__ import annotations

import pytest

from cluster import Cluster, Node, Pod, Unit
from otelgpu.core.catalog import load_catalog
from otelgpu.telemetry import by_label, total
from support import feed, make_config, offline_pipeline

HOUR = 3600


def run(cluster: Cluster, models=("request",), seconds: int = HOUR, every: int = 60, **overrides):
    config = make_config(**{"attribution__interval_seconds": HOUR, "attribution__lateness_seconds": HOUR,
                            "attribution__cost_models": list(models), **overrides})
    p = offline_pipeline(config)
    feed(p, *cluster.scrapes(every, seconds))
    p.close_due(flush=True)
    return p.store


def by(store, metric: str, model: str, *keys: str, **where: str) -> dict:
    got = store.totals(metric, keys, where={"cost_model": model, **where})
    return {k if len(k) != 1 else k[0]: v for k, v in got.items()}


def charge(store, model: str, *keys: str, **where: str) -> dict:
    """allocated + unused: what a holder is charged under the model."""
    out = by(store, "allocated", model, *keys, **where)
    for k, v in by(store, "unused", model, *keys, **where).items():
        out[k] = out.get(k, 0.0) + v
    return out


def assert_conserved(store, model: str) -> None:
    """Per node and resource: allocated + unused + idle = capacity."""
    keys = ("node", "resource")
    cap = by(store, "capacity", model, *keys)
    got = {k: 0.0 for k in cap}
    for metric in ("allocated", "unused", "idle"):
        for k, v in by(store, metric, model, *keys).items():
            got[k] = got.get(k, 0.0) + v
    assert got.keys() == cap.keys()
    for k in cap:
        assert got[k] == pytest.approx(cap[k], rel=1e-9, abs=1e-9), k


# --- AWS's public example: m5.xlarge, $1.00/h, 4 vCPU, 16 GB -------------------------------------

def m5_cluster() -> Cluster:
    node = Node("ip-10-0-1-5", "m5.xlarge", cpu=4, memory_gib=16)
    pods = [Pod("ns1", "P1", node.name, cpu=1, memory_gib=4, cpu_used=0.1, memory_used_gib=3),
            Pod("ns2", "P2", node.name, cpu=1, memory_gib=4, cpu_used=1.9, memory_used_gib=6),
            Pod("ns1", "P3", node.name, cpu=1, memory_gib=2, cpu_used=0.5, memory_used_gib=2),
            Pod("ns2", "P4", node.name, cpu=1, memory_gib=2, cpu_used=0.5, memory_used_gib=2)]
    return Cluster([node], pods)


def test_aws_scad_example_from_kube_state_metrics_and_cadvisor() -> None:
    store = run(m5_cluster(), ("scad",), attribution__scad__cpu_only_nodes=True,
                attribution__prices__instance_hour_by_instance_type={"m5.xlarge": 1.0})
    pods = charge(store, "scad", "pod")
    assert {k: round(v, 6) for k, v in pods.items()} == {
        "P1": 0.229199, "P2": 0.400314, "P3": 0.185243, "P4": 0.185243}
    ns = charge(store, "scad", "namespace")
    assert (round(ns["ns1"], 6), round(ns["ns2"], 6)) == (0.414443, 0.585557)
    assert round(sum(by(store, "unused", "scad", "resource").values()), 6) == 0.038462  # the 2 GB pool
    assert sum(pods.values()) == pytest.approx(1.0, rel=1e-12)
    assert not by(store, "idle", "scad")  # every resource had holders
    # Usage was scraped for every pod and resource: no series says "requests".
    assert set(by(store, "allocated", "scad", "activity_basis")) == {"usage"}
    assert_conserved(store, "scad")


def test_scad_falls_back_to_requests_without_usage_and_says_so() -> None:
    c = m5_cluster()
    for p in c.pods:
        p.cpu_used = p.memory_used_gib = None
    p = offline_pipeline(make_config(attribution__interval_seconds=HOUR, attribution__lateness_seconds=HOUR,
                                     attribution__cost_models=["scad"], attribution__scad__cpu_only_nodes=True,
                                     attribution__prices__instance_hour_by_instance_type={"m5.xlarge": 1.0}))
    feed(p, *c.scrapes(60, HOUR))
    p.close_due(flush=True)
    pods = charge(p.store, "scad", "pod")
    # Reserved only: vCPU 1 each of 4 (no unused), memory 4/4/2/2 of 16 (4 GB unused, pro rata).
    unit = 1 / 52
    mem = lambda gb: gb / 12 * 16 * unit  # noqa: E731 - 12 GB reserved shares all 16
    assert pods["P1"] == pytest.approx(9 * unit + mem(4), rel=1e-12)
    assert pods["P3"] == pytest.approx(9 * unit + mem(2), rel=1e-12)
    assert set(by(p.store, "allocated", "scad", "activity_basis")) == {"requests"}
    assert by_label(p.metrics.scad_request_fallbacks) == {"cpu": 4, "memory": 4}


# --- scad on a GPU node with unused GPUs; a CPU-only pod absorbs no GPU cost -------------------

def p4d_cluster(**node_labels: str) -> Cluster:
    node = Node("gpu-1", "p4d.24xlarge", cpu=96, memory_gib=1152, units=[Unit(f"GPU-{i}") for i in range(8)],
                labels={"nvidia.com/gpu.count": "8", **node_labels})
    pods = [Pod("ml", "train", node.name, {"team": "ml"}, cpu=16, memory_gib=128, gpu=("nvidia_com_gpu", 2),
                holds=("GPU-0", "GPU-1"), activity=0.9, cpu_used=20, memory_used_gib=100),
            Pod("web", "serve", node.name, {"team": "web"}, cpu=8, memory_gib=64, gpu=("nvidia_com_gpu", 1),
                holds=("GPU-2",), activity=0.3),
            Pod("etl", "cpu-job", node.name, {"team": "data"}, cpu=4, memory_gib=16, cpu_used=2, memory_used_gib=8)]
    return Cluster([node], pods)


def test_scad_gpu_node_with_unused_gpus_hand_worked() -> None:
    store = run(p4d_cluster(), ("scad",), attribution__prices__instance_hour_by_instance_type={"p4d.24xlarge": 40.0})
    # unit = 40 / (9*8 + 0.9*96 + 0.1*1152) = 40 / 273.6; rates GPU 9u, vCPU 0.9u, GB 0.1u per hour.
    u = 40 / 273.6
    gpu, cpu, gb = 9 * u, 0.9 * u, 0.1 * u
    # A: train GPU 2 / vCPU max(16, 20) / GB max(128, 100); serve 1 / 8 / 64 (no usage: requests);
    # cpu-job 0 / max(4, 2) / max(16, 8). Nothing oversubscribed, so each pays Cap * rate * A / sum A.
    want = {
        "train": 8 * gpu * 2 / 3 + 96 * cpu * 20 / 32 + 1152 * gb * 128 / 208,
        "serve": 8 * gpu * 1 / 3 + 96 * cpu * 8 / 32 + 1152 * gb * 64 / 208,
        "cpu-job": 96 * cpu * 4 / 32 + 1152 * gb * 16 / 208,
    }
    got = charge(store, "scad", "pod")
    assert {k: round(v, 6) for k, v in got.items()} == {"train": 25.276653, "serve": 11.848853, "cpu-job": 2.874494}
    for pod, value in want.items():
        assert got[pod] == pytest.approx(value, rel=1e-12)
    assert sum(got.values()) == pytest.approx(40.0, rel=1e-12)  # the whole instance, nothing idle
    # The CPU-only pod carries no GPU cost at all, split or unused.
    assert not charge(store, "scad", "pod", resource="gpu").get("cpu-job")
    # 5 unheld GPUs' cost went to the two GPU holders 2:1.
    unused_gpu = by(store, "unused", "scad", "pod", resource="gpu")
    assert unused_gpu["train"] == pytest.approx(5 * gpu * 2 / 3, rel=1e-12)
    assert set(by(store, "allocated", "scad", "price_source")) == {"config:scad"}
    assert_conserved(store, "scad")


def test_scad_and_opencost_give_the_gpu_different_shares_of_one_node() -> None:
    """docs/cost-model.md: a p4d-like node gets 26.3 % of its price on GPUs under scad, 49.0 % under
    opencost; both split the same instance price and both add up."""
    store = run(p4d_cluster(), ("scad", "opencost"),
                attribution__prices__instance_hour_by_instance_type={"p4d.24xlarge": 40.0})
    scad_gpu = sum(by(store, "capacity", "scad", resource="gpu").values())
    opencost_gpu = sum(by(store, "capacity", "opencost", resource="gpu").values())
    assert round(scad_gpu / 40.0, 3) == 0.263 and round(opencost_gpu / 40.0, 3) == 0.490
    # opencost: GPUs requested x hours x its GPU price; the rest of the GPU cost is idle per node.
    gpu_price = opencost_gpu / 8
    assert by(store, "allocated", "opencost", "pod") == pytest.approx({"train": 2 * gpu_price, "serve": gpu_price})
    assert sum(by(store, "idle", "opencost").values()) == pytest.approx(5 * gpu_price)
    assert set(by(store, "allocated", "opencost", "price_source")) == {"config:opencost"}
    assert_conserved(store, "opencost")


@pytest.mark.parametrize("policy", ["keep", "share", "platform"])
def test_opencost_idle_policies(policy: str) -> None:
    store = run(p4d_cluster(), ("opencost",), attribution__idle__policy=policy,
                attribution__prices__gpu_hour_by_instance_type={"p4d.24xlarge": 4.0})
    alloc = by(store, "allocated", "opencost", "team")
    assert alloc == pytest.approx({"ml": 8.0, "web": 4.0})
    unused = by(store, "unused", "opencost", "team")
    idle = sum(by(store, "idle", "opencost").values())
    if policy == "keep":
        assert idle == pytest.approx(20.0) and not unused
    elif policy == "share":  # weighted by each allocation's GPU cost: 2:1
        assert idle == 0 and unused == pytest.approx({"ml": 20.0 * 2 / 3, "web": 20.0 / 3})
    else:
        assert idle == 0 and unused == pytest.approx({"platform": 20.0})
        assert by(store, "unused", "opencost", "attribution") == pytest.approx({"idle": 20.0})
    assert set(by(store, "allocated", "opencost", "idle_policy")) == {policy}
    assert_conserved(store, "opencost")


# --- spot and committed rates ------------------------------------------------------------------

def test_spot_node_priced_with_discount_and_named_in_price_source() -> None:
    c = p4d_cluster(**{"karpenter.sh/capacity-type": "spot"})
    store = run(c, ("request",), attribution__prices__gpu_hour_by_instance_type={"p4d.24xlarge": 4.0},
                attribution__prices__capacity_types={"spot": {"discount": 0.6}})
    assert by(store, "allocated", "request", "pod") == pytest.approx({"train": 2 * 1.6, "serve": 1.6})
    assert set(by(store, "allocated", "request", "price_source")) == {"config:instance_type+spot_discount"}
    assert set(by(store, "capacity", "request", "capacity_type")) == {"spot"}


def test_spot_node_with_its_own_instance_price() -> None:
    c = p4d_cluster(**{"eks.amazonaws.com/capacityType": "SPOT"})
    store = run(c, ("request", "scad"), attribution__prices__capacity_types={
        "spot": {"instance_hour_by_instance_type": {"p4d.24xlarge": 12.0}, "discount": 0.5}})
    # The spot price itself, not a discount on the on-demand catalog price.
    assert sum(by(store, "capacity", "scad").values()) == pytest.approx(12.0, rel=1e-12)
    assert set(by(store, "capacity", "scad", "price_source")) == {"config:spot.instance:scad"}
    per_gpu = 12.0 * 9 / 273.6
    assert by(store, "allocated", "request", "pod") == pytest.approx({"train": 2 * per_gpu, "serve": per_gpu})


def test_reserved_capacity_block_uses_the_committed_rate() -> None:
    c = p4d_cluster(**{"eks.amazonaws.com/capacityType": "CAPACITY_BLOCK"})
    store = run(c, ("request",), attribution__prices__gpu_hour_by_instance_type={"p4d.24xlarge": 4.0},
                attribution__prices__capacity_types={"reserved": {"gpu_hour_by_instance_type": {"p4d.24xlarge": 2.5}}})
    assert sum(by(store, "capacity", "request").values()) == pytest.approx(8 * 2.5)
    assert set(by(store, "capacity", "request", "price_source")) == {"config:reserved.instance_type"}
    assert set(by(store, "capacity", "request", "capacity_type")) == {"reserved"}


# --- a mixed-MIG H100 ----------------------------------------------------------------------------

def h100_mig_cluster() -> Cluster:
    h100 = "NVIDIA H100 80GB HBM3"
    node = Node("p5-1", "p5.48xlarge", cpu=192, memory_gib=2048, labels={"nvidia.com/gpu.count": "1"},
                units=[Unit("GPU-h", h100, "3g.40gb", "2"), Unit("GPU-h", h100, "2g.20gb", "3"),
                       Unit("GPU-h", h100, "1g.10gb", "9")])
    pods = [Pod("search", "llm", node.name, {"team": "search"}, gpu=("nvidia_com_mig_3g_40gb", 1),
                holds=("GPU-h/2",), activity=0.6),
            Pod("research", "nb", node.name, {"team": "research"}, gpu=("nvidia_com_mig_2g_20gb", 1),
                holds=("GPU-h/3",), activity=0.1)]
    return Cluster([node], pods)


def test_mixed_mig_h100_under_request_hybrid_and_scad() -> None:
    store = run(h100_mig_cluster(), ("request", "hybrid", "scad"),
                attribution__prices__gpu_hour_by_gpu_model={"NVIDIA H100 80GB HBM3": 7.0})
    # request: f = c/7: 3 and 2 dollars; the unheld 1g and the unpartitioned 1/7 are idle ($2).
    assert by(store, "allocated", "request", "team") == pytest.approx({"search": 3.0, "research": 2.0})
    assert sum(by(store, "idle", "request").values()) == pytest.approx(2.0)
    assert by(store, "effective", "request", "team") == pytest.approx({"search": 1.8, "research": 0.2})
    # hybrid (alpha 0.5): use 3*0.6 = 1.8 and 2*0.1 = 0.2 GPU-dollars of 2.0; pool 5.
    assert by(store, "allocated", "hybrid", "team") == pytest.approx(
        {"search": 0.5 * 3 + 0.5 * 5 * 0.9, "research": 0.5 * 2 + 0.5 * 5 * 0.1})
    assert not by(store, "effective", "hybrid")
    # scad splits the instance price (catalog p5.48xlarge: 8 GPU, 192 vCPU, 2048 GiB), not the
    # explicit GPU price; reservations are the fractions held (3/7, 2/7), the unheld 2/7 goes 3:2.
    p5 = load_catalog()["p5.48xlarge"]
    gpu_rate = p5.usd_per_hour * 9 / (9 * 8 + 0.9 * 192 + 0.1 * 2048)
    assert charge(store, "scad", "team", resource="gpu") == pytest.approx(
        {"search": gpu_rate * 3 / 5, "research": gpu_rate * 2 / 5}, rel=1e-12)
    assert set(by(store, "capacity", "scad", "price_source")) == {"catalog:scad"}
    for model in ("request", "hybrid", "scad"):
        assert_conserved(store, model)


def test_scad_without_an_instance_price_prices_gpus_alone_and_says_so() -> None:
    c = h100_mig_cluster()
    c.nodes[0].instance_type = "p5.on-prem"  # in no catalog
    store = run(c, ("scad",), attribution__prices__gpu_hour_by_gpu_model={"NVIDIA H100 80GB HBM3": 7.0})
    assert charge(store, "scad", "team") == pytest.approx({"search": 7.0 * 3 / 5, "research": 7.0 * 2 / 5})
    assert set(by(store, "capacity", "scad", "price_source")) == {"config:gpu_model;gpu_only"}
    assert_conserved(store, "scad")


def test_mig_max_rule_normalises_the_gpu() -> None:
    store = run(h100_mig_cluster(), ("request",), attribution__mig_fraction_rule="max",
                attribution__prices__gpu_hour_by_gpu_model={"NVIDIA H100 80GB HBM3": 8.0})
    # max(c/7, m/8): 3g.40gb 4/8, 2g.20gb 2/7, 1g.10gb 1/7 -> sum 13/14 <= 1, no normalising needed.
    assert by(store, "allocated", "request", "team") == pytest.approx({"search": 4.0, "research": 8 * 2 / 7})


# --- a time-sliced node ------------------------------------------------------------------------

def timesliced_cluster() -> Cluster:
    node = Node("g5-1", "g5.2xlarge", cpu=8, memory_gib=32, units=[Unit("GPU-a10", "NVIDIA A10G")],
                labels={"nvidia.com/gpu.count": "1", "nvidia.com/gpu.replicas": "4",
                        "nvidia.com/gpu.sharing-strategy": "time-slicing"})
    pods = [Pod("t", f"tenant-{i}", node.name, {"team": f"team-{i}"}, cpu=2, memory_gib=8,
                gpu=("nvidia_com_gpu", 1), holds=("GPU-a10",), activity=0.4) for i in range(3)]
    return Cluster([node], pods)


def test_time_sliced_node_bills_replicas_not_gpus() -> None:
    store = run(timesliced_cluster(), ("request", "scad"), attribution__prices__gpu_hour_by_instance_type={"g5.2xlarge": 2.0},
                attribution__prices__instance_hour_by_instance_type={"g5.2xlarge": 1.2})
    # request: each holds 1 of 4 replicas: $0.50; the fourth replica is idle.
    assert by(store, "allocated", "request", "team") == pytest.approx({f"team-{i}": 0.5 for i in range(3)})
    assert sum(by(store, "idle", "request").values()) == pytest.approx(0.5)
    assert set(by(store, "allocated", "request", "activity_basis")) == {"equal_split"}
    # scad: g5.2xlarge 1 GPU / 8 vCPU / 32 GiB from the catalog; each tenant reserves 1/4 GPU, 2 vCPU,
    # 8 GiB: 3 of 4 of everything, so each pays a third of the instance.
    charged = charge(store, "scad", "team")
    assert charged == pytest.approx({f"team-{i}": 1.2 / 3 for i in range(3)}, rel=1e-12)
    for model in ("request", "scad"):
        assert_conserved(store, model)


# --- partial intervals ---------------------------------------------------------------------------

def test_a_forty_minute_job_costs_forty_minutes() -> None:
    c = p4d_cluster()
    c.pods[0].start_s, c.pods[0].end_s = 1200, 3600  # train starts 20 minutes in
    c.pods[2].start_s, c.pods[2].end_s = 0, 2400  # the CPU job ends at minute 40
    store = run(c, ("request", "scad"), attribution__prices__gpu_hour_by_instance_type={"p4d.24xlarge": 4.0},
                attribution__prices__instance_hour_by_instance_type={"p4d.24xlarge": 40.0})
    assert by(store, "allocated", "request", "pod") == pytest.approx({"train": 2 * 4.0 * 40 / 60, "serve": 4.0})
    held = store.totals("held", ("pod",))
    assert held[("train",)] == pytest.approx(2 * 2400)
    u = 40 / 273.6
    # scad CPU: train holds max(16, 20) vCPU for 40 minutes, cpu-job 4 for 40 minutes, serve 8 all hour.
    a = {"train": 20 * 40 / 60, "serve": 8.0, "cpu-job": 4 * 40 / 60}
    cpu = charge(store, "scad", "pod", resource="cpu")
    for pod, qty in a.items():
        assert cpu[pod] == pytest.approx(96 * 0.9 * u * qty / sum(a.values()), rel=1e-9)


def test_provisioned_gpu_seconds_count_physical_gpus_whatever_the_sharing() -> None:
    # Eight whole GPUs for an hour; one H100 cut into MIG slices is one GPU; held never exceeds it.
    for cluster, gpus in ((p4d_cluster(), 8), (h100_mig_cluster(), 1)):
        store = run(cluster, ("request", "scad"))
        provisioned = store.totals("provisioned", ("node",))
        assert provisioned == pytest.approx({(cluster.nodes[0].name,): gpus * HOUR})
        assert 0 < sum(store.totals("held", ("node",)).values()) < gpus * HOUR
        assert all("cost_model" not in dict(p.attrs) for p in store.points() if p.metric == "provisioned")


# --- several models side by side, over OTLP ------------------------------------------------------

def test_all_models_side_by_side_each_adds_up() -> None:
    store = run(p4d_cluster(), ("request", "scad", "opencost", "hybrid"), attribution__idle__policy="share",
                attribution__prices__instance_hour_by_instance_type={"p4d.24xlarge": 40.0})
    models = {dict(p.attrs).get("cost_model") for p in store.points() if p.metric == "allocated"}
    assert models == {"request", "scad", "opencost", "hybrid"}
    for model in models:
        assert_conserved(store, model)
    # GPU-seconds are the same whatever the model: one series per holding, no cost_model.
    assert all("cost_model" not in dict(p.attrs) for p in store.points() if p.metric == "held")
    # Share policy: everything a GPU node costs under request lands on its GPU holders.
    assert sum(charge(store, "request", "team").values()) == pytest.approx(
        sum(by(store, "capacity", "request").values()))


# --- prices that change while running ------------------------------------------------------------

def test_price_file_change_applies_from_the_next_interval_and_keeps_accrued_cost(tmp_path) -> None:
    import os

    prices = tmp_path / "prices.yaml"
    prices.write_text("gpu_hour_by_instance_type: {p4d.24xlarge: 4.0}\n")
    c = p4d_cluster()
    p = offline_pipeline(make_config(attribution__interval_seconds=900, attribution__lateness_seconds=0,
                                     attribution__prices__file=str(prices)))
    feed(p, *(c.scrape(t) for t in range(0, 1801, 60)))  # closes [0, 900) and [900, 1800)
    assert total(p.metrics.intervals_computed) == 2 and total(p.metrics.price_reloads) == 1
    before = by(p.store, "allocated", "request", "pod")["serve"]
    assert before == pytest.approx(2 * 4.0 / 4)

    prices.write_text("gpu_hour_by_instance_type: {p4d.24xlarge: 8.0}\n")
    os.utime(prices, ns=(10**18, 10**18))  # a new modification time even on coarse clocks
    feed(p, *(c.scrape(t) for t in range(1860, 2701, 60)))  # closes [1800, 2700) at the new price
    assert by(p.store, "allocated", "request", "pod")["serve"] == pytest.approx(before + 8.0 / 4)

    prices.write_text("gpu_hour_by_instance_type: {p4d.24xlarge: lots}\n")
    os.utime(prices, ns=(2 * 10**18, 2 * 10**18))
    feed(p, *(c.scrape(t) for t in range(2760, 3600, 60)))
    p.close_due(flush=True)
    assert total(p.metrics.price_reload_failures) == 1 and total(p.metrics.price_reloads) == 2
    # The bad file changed nothing: the last interval kept the $8.00 price.
    assert by(p.store, "allocated", "request", "pod")["serve"] == pytest.approx(before + 2 * 8.0 / 4)
    assert_conserved(p.store, "request")


def gpu_a() -> Cluster:
    """docs/cost-model.md's example node (section 2): p4d.24xlarge from the catalog, one hour."""
    units = [Unit(f"GPU-{i}") for i in range(8)]
    pods = [Pod("ml", "train", "gpu-a", labels={"team": "research"}, cpu=32, memory_gib=256,
                gpu=("nvidia_com_gpu", 4), holds=tuple(f"GPU-{i}" for i in range(4)), activity=0.8,
                cpu_used=40, memory_used_gib=300),
            Pod("ml", "serve", "gpu-a", labels={"team": "search"}, cpu=16, memory_gib=128,
                gpu=("nvidia_com_gpu", 2), holds=("GPU-4", "GPU-5"), activity=0.2, cpu_used=8, memory_used_gib=100),
            Pod("ml", "notebook", "gpu-a", labels={"team": "research"}, cpu=4, memory_gib=32,
                gpu=("nvidia_com_gpu", 1), holds=("GPU-6",), activity=0.0),
            Pod("logging", "fluent-bit", "gpu-a", labels={"team": "observability"}, cpu=1, memory_gib=2,
                cpu_used=0.5, memory_used_gib=1.5)]
    return Cluster([Node("gpu-a", "p4d.24xlarge", 96, 1152, units=units, capacity={"nvidia_com_gpu": 8})], pods)


def test_the_docs_worked_example_reproduces() -> None:
    """The gpu-a tables of docs/cost-model.md sections 2.1 to 2.3, rounded at the end only."""
    store = run(gpu_a(), ("request", "scad", "opencost"), every=30)
    r6 = lambda d: {k: round(v, 6) for k, v in d.items()}  # noqa: E731
    assert r6(by(store, "allocated", "request", "pod", resource="gpu")) == {
        "train": 2.889163, "serve": 1.444582, "notebook": 0.722291}
    assert r6(by(store, "idle", "request", "node")) == {"gpu-a": 0.722291}
    assert r6(by(store, "capacity", "request", "node")) == {"gpu-a": 5.778327}
    assert r6(charge(store, "scad", "pod")) == {
        "train": 13.852238, "serve": 6.031177, "notebook": 1.920532, "fluent-bit": 0.153695}
    assert r6(charge(store, "scad", "resource")) == {"gpu": 5.778327, "cpu": 6.933992, "memory": 9.245323}
    assert r6(charge(store, "scad", "team")) == {"research": 15.77277, "search": 6.031177, "observability": 0.153695}
    assert r6(by(store, "allocated", "opencost", "pod")) == {"train": 5.377724, "serve": 2.688862, "notebook": 1.344431}
    assert r6(by(store, "capacity", "opencost", "node")) == {"gpu-a": 10.755447}


@pytest.mark.parametrize("weight, train, serve", [
    ("used", 4 + 2 / 3, 1 + 1 / 3),  # pool 6P split 3.2 : 0.4 (activity x GPUs held)
    ("activity", 4.4, 1.6),          # pool 6P split 0.8 : 0.2 (activity alone)
])
def test_hybrid_weights(weight: str, train: float, serve: float) -> None:
    c = gpu_a()
    c.pods = [p for p in c.pods if p.name in ("train", "serve")]
    store = run(c, ("request", "hybrid"), attribution__hybrid_weight=weight)
    P = by(store, "allocated", "request", "pod")["serve"] / 2
    got = by(store, "allocated", "hybrid", "pod")
    assert got == {"train": pytest.approx(train * P), "serve": pytest.approx(serve * P)}
    assert sum(got.values()) == pytest.approx(6 * P)  # the node's allocated total is conserved


def test_scad_stops_charging_a_pod_when_kube_state_metrics_drops_it() -> None:
    """A pod that finished at 25 minutes: its kube-state-metrics series stop (its facts linger for
    their TTL), so from then on it pays no CPU or memory; the rest of the hour is unused capacity
    handed to the pods still running."""
    c = gpu_a()
    c.pods = [p for p in c.pods if p.name in ("serve", "fluent-bit")]
    c.pods[0].end_s = 1500
    c.pods[0].cpu_used = c.pods[0].memory_used_gib = None
    store = run(c, ("scad",), attribution__interval_seconds=300, attribution__lateness_seconds=30)
    unit = 21.957642 / 273.6  # the p4d.24xlarge's SCAD unit price per hour, from the catalog
    split = by(store, "allocated", "scad", "pod", "resource")
    assert split[("serve", "cpu")] == pytest.approx(16 * 0.9 * unit * 25 / 60, rel=1e-6)
    assert split[("serve", "memory")] == pytest.approx(128 * 0.1 * unit * 25 / 60, rel=1e-6)
    assert split[("fluent-bit", "cpu")] == pytest.approx(1 * 0.9 * unit, rel=1e-6)
    assert_conserved(store, "scad")
