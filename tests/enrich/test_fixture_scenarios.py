"""Whole-pipeline behaviour on the shared real-world fixtures (Collector-shaped OTLP and
dcgm-exporter exposition), with expected figures worked out by hand from cost-model.md."""

from __future__ import annotations

import copy

import pytest
from support import DCGM_4_6, feed, offline_pipeline, otlp_fixture, prom_fixture_request, make_config

from otelgpu.attribution.config import PricesConfig
from otelgpu.attribution.prices import Pricer
from otelgpu.telemetry import total

H100 = "NVIDIA H100 80GB HBM3"
P5_NODE = "ip-10-20-3-41.us-west-2.compute.internal"
G5_NODE = "ip-10-20-7-12.us-west-2.compute.internal"
T_SCRAPE1 = 1779350430 * 10**9  # scrape 1; scrape 2 is 30 s later, in the next 60 s interval
PER_GPU_INTERVAL = 12.0 * 60 / 3600  # $12/GPU-h for one 60 s interval
SLICE = PER_GPU_INTERVAL / 7  # a 1g.10gb instance under the compute rule


def run(*requests, **config):
    p = offline_pipeline(make_config(attribution__prices__gpu_hour_by_gpu_model={H100: 12.0}, **config))
    feed(p, *requests)
    p.close_due(flush=True)
    return p


def by_pod(p, metric="allocated"):
    return {k[0]: v for k, v in p.store.totals(metric, ("pod",)).items()}


def ksm():
    return otlp_fixture("otlp_ksm_scrape_collector_v0.142.json")


@pytest.fixture(scope="module")
def fixture_run():
    return run(ksm(), otlp_fixture("otlp_dcgm_scrape1_collector_v0.142.json"),
               otlp_fixture("otlp_dcgm_scrape2_stale_collector_v0.142.json"))


def test_fixture_costs_by_pod(fixture_run):
    alloc = by_pod(fixture_run)
    assert alloc["vllm-llama3-8b-5c9d7b8f6d-k2x7q"] == pytest.approx(2 * PER_GPU_INTERVAL)
    assert alloc["finetune-job-7xk2p"] == pytest.approx(2 * PER_GPU_INTERVAL)
    # The ollama pod held MIG instance 11 for the first interval only (its series went stale).
    assert alloc["ollama-76f687f4cd-xcvvp"] == pytest.approx(SLICE)
    eff = by_pod(fixture_run, "effective")
    assert eff["vllm-llama3-8b-5c9d7b8f6d-k2x7q"] == pytest.approx(0.87321 * 2 * PER_GPU_INTERVAL)
    assert eff["ollama-76f687f4cd-xcvvp"] == pytest.approx(0.412345 * SLICE)


def test_fixture_money_adds_up(fixture_run):
    allocated = fixture_run.store.totals("allocated", ("node",))
    idle = fixture_run.store.totals("idle", ("node",))
    capacity = fixture_run.store.totals("capacity", ("node",))
    assert capacity[(P5_NODE,)] == pytest.approx(8 * 2 * PER_GPU_INTERVAL)
    for node in capacity:
        assert allocated.get(node, 0.0) + idle[node] == pytest.approx(capacity[node], rel=1e-12)
    # In interval 2 instance 11 shows activity but no pod: booked, not idle, with its reason.
    reasons = fixture_run.store.totals("allocated", ("node", "attribution"))
    assert reasons[(P5_NODE, "active_without_pod")] == pytest.approx(SLICE)
    assert idle[(P5_NODE,)] == pytest.approx(capacity[(P5_NODE,)] - 4 * PER_GPU_INTERVAL - 2 * SLICE)


def test_gpu_node_without_dcgm_data_still_costs_its_capacity(fixture_run):
    # kube-state-metrics reports the time-sliced g5.2xlarge, but no DCGM series of it arrived.
    price = Pricer(PricesConfig()).gpu_hour("g5.2xlarge", (), 1).per_gpu_hour * 60 / 3600
    capacity = fixture_run.store.totals("capacity", ("node", "gpu_model"))
    # GFD's label says NVIDIA-A10G-SHARED; the series carry the driver's spelling, as where DCGM reports.
    assert capacity[(G5_NODE, "NVIDIA A10G")] == pytest.approx(2 * price)
    rows = fixture_run.store.totals("allocated", ("pod", "attribution", "unit_kind"))
    assert rows[("chat-api-6f7d9c8b7-4xq2m", "ksm_request", "replica")] == pytest.approx(2 * price / 4)
    assert rows[("embedder-85b4d6f9c-wz8pl", "ksm_request", "replica")] == pytest.approx(2 * price / 4)
    assert fixture_run.store.totals("idle", ("node",))[(G5_NODE,)] == pytest.approx(price)
    assert total(fixture_run.metrics.gpu_seconds_without_device_data) == pytest.approx(2 * 60)


def test_fixture_tags_from_pod_then_namespace_labels(fixture_run):
    teams = fixture_run.store.totals("allocated", ("pod", "team", "cost_center", "instance_type", "capacity_type"))
    assert teams[("vllm-llama3-8b-5c9d7b8f6d-k2x7q", "team-a", "cc-2001", "p5.48xlarge", "on-demand")] > 0
    assert teams[("ollama-76f687f4cd-xcvvp", "platform", "cc-1001", "p5.48xlarge", "on-demand")] > 0


def test_legacy_collector_shape_gives_the_same_costs(fixture_run):
    legacy = run(ksm(), otlp_fixture("otlp_dcgm_scrape1_legacy_v0.125_adjusted.json"),
                 otlp_fixture("otlp_dcgm_scrape2_legacy_v0.125_adjusted.json"))
    # The legacy scrape 2 has no staleness marker: ollama keeps instance 11 for both intervals.
    a, b = by_pod(fixture_run), by_pod(legacy)
    assert b["vllm-llama3-8b-5c9d7b8f6d-k2x7q"] == pytest.approx(a["vllm-llama3-8b-5c9d7b8f6d-k2x7q"])
    assert b["finetune-job-7xk2p"] == pytest.approx(a["finetune-job-7xk2p"])
    assert legacy.store.totals("capacity", ("node",)) == pytest.approx(fixture_run.store.totals("capacity", ("node",)))


def test_resent_batches_are_not_counted_twice(fixture_run):
    s1 = otlp_fixture("otlp_dcgm_scrape1_collector_v0.142.json")
    s2 = otlp_fixture("otlp_dcgm_scrape2_stale_collector_v0.142.json")
    again = run(ksm(), s1, s1, ksm(), s2, s1, s2)
    assert by_pod(again) == pytest.approx(by_pod(fixture_run))
    assert by_pod(again, "effective") == pytest.approx(by_pod(fixture_run, "effective"))


def test_order_of_sources_within_lateness_does_not_matter(fixture_run):
    late_ksm = run(otlp_fixture("otlp_dcgm_scrape1_collector_v0.142.json"), ksm(),
                   otlp_fixture("otlp_dcgm_scrape2_stale_collector_v0.142.json"))
    assert fixture_run.store.totals("allocated", ("pod", "team")) == pytest.approx(
        late_ksm.store.totals("allocated", ("pod", "team")))


def shifted(request, seconds: int):
    """The same scrape `seconds` later (kube-state-metrics is scraped again)."""
    out = copy.deepcopy(request)
    for rm in out.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for dp in getattr(m, m.WhichOneof("data")).data_points:
                    dp.time_unix_nano += seconds * 10**9
    return out


def test_data_later_than_the_allowance_is_counted_late_not_used():
    s1 = otlp_fixture("otlp_dcgm_scrape1_collector_v0.142.json")
    p = offline_pipeline(make_config(attribution__lateness_seconds=0,
                                     attribution__prices__gpu_hour_by_gpu_model={H100: 12.0}))
    # The watermark moves once two targets are past interval 1 (one target alone cannot move it).
    feed(p, ksm(), s1, otlp_fixture("otlp_dcgm_scrape2_stale_collector_v0.142.json"), shifted(ksm(), 30))
    assert total(p.metrics.intervals_computed) == 1  # scrape 2 moved the watermark past interval 1
    before = dict(by_pod(p))
    feed(p, s1)  # a resend of scrape 1 after its interval closed
    assert total(p.metrics.points_late) == 36
    assert by_pod(p) == before


def test_exported_labels_when_the_collector_does_not_honor_labels(fixture_run):
    req = otlp_fixture("otlp_dcgm_scrape1_collector_v0.142.json")
    for rm in req.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for pt in (m.gauge.data_points if m.HasField("gauge") else m.sum.data_points):
                    for kv in pt.attributes:
                        if kv.key in ("pod", "namespace", "container"):
                            kv.key = "exported_" + kv.key
                    own = pt.attributes.add()  # the exporter's own pod, as target labels add it
                    own.key, own.value.string_value = "pod", "nvidia-dcgm-exporter-x7k2p"
    p = run(ksm(), req)
    alloc = by_pod(p)
    assert "nvidia-dcgm-exporter-x7k2p" not in alloc
    assert alloc["vllm-llama3-8b-5c9d7b8f6d-k2x7q"] == pytest.approx(PER_GPU_INTERVAL)


@pytest.mark.parametrize("name", ["dcgm/h100x8_mig_mixed_k8s_v4.prom",
                                  "dcgm/h100x8_mig_mixed_k8s_head_hostname_lowercase.prom",
                                  "dcgm/h100x8_mig_mixed_k8s_v4_pod_labels.prom"])
def test_dcgm_exposition_variants(name):
    p = run(ksm(), prom_fixture_request(name, T_SCRAPE1, node="some-other-resource-node"))
    alloc = p.store.totals("allocated", ("node", "pod", "unit_kind", "mig_profile"))
    assert alloc[(P5_NODE, "ollama-76f687f4cd-xcvvp", "mig", "1g.10gb")] == pytest.approx(SLICE)
    assert alloc[(P5_NODE, "finetune-job-7xk2p", "gpu", "")] == pytest.approx(PER_GPU_INTERVAL)
    assert p.store.totals("capacity", ("node",))[(P5_NODE,)] == pytest.approx(8 * PER_GPU_INTERVAL)


def test_time_sliced_a10g_bills_replicas_not_gpus():
    p = run(ksm(), prom_fixture_request("dcgm/a10g_timesliced_virtual_gpus_v4.8.prom", T_SCRAPE1, node=G5_NODE))
    price = Pricer(PricesConfig()).gpu_hour("g5.2xlarge", (), 1)
    assert price.source == "catalog:scad"
    gpu_interval = price.per_gpu_hour * 60 / 3600
    rows = p.store.totals("allocated", ("pod", "unit_kind", "activity_basis", "capacity_type"))
    assert rows[("chat-api-6f7d9c8b7-4xq2m", "replica", "per_pod", "spot")] == pytest.approx(gpu_interval / 4)
    assert rows[("embedder-85b4d6f9c-wz8pl", "replica", "per_pod", "spot")] == pytest.approx(gpu_interval / 4)
    idle = p.store.totals("idle", ("node",))[(G5_NODE,)]
    assert idle == pytest.approx(gpu_interval / 2)  # 2 of 4 replicas unheld
    assert {k[1] for k in p.store.totals("capacity", ("node", "gpu_model")) if k[0] == G5_NODE} == {"NVIDIA A10G"}
    # chat-api used 52 % of the device while holding a quarter of it: effective is capped at allocated.
    eff = by_pod(p, "effective")
    assert eff["chat-api-6f7d9c8b7-4xq2m"] == pytest.approx(gpu_interval / 4)


MONEY = ("allocated", "effective", "waste", "unmeasured", "idle", "capacity")


def money(p):
    """Every money sum by node, pod and how it was measured."""
    return {(metric, *k): v for metric in MONEY
            for k, v in p.store.totals(metric, ("node", "pod", "unit_kind", "activity_basis")).items()}


def without(request, fragment: str):
    """The request without the metrics whose name contains `fragment` (a cluster that does not send them)."""
    out = copy.deepcopy(request)
    for rm in out.resource_metrics:
        for sm in rm.scope_metrics:
            kept = [m for m in sm.metrics if fragment not in m.name]
            del sm.metrics[:]
            sm.metrics.extend(kept)
    return out


def test_a_cluster_on_dcgm_4_6_names_costs_what_it_costs_on_the_old_names(fixture_run):
    """DCGM 4.6 renamed GR_ENGINE_ACTIVE, GPU_UTIL and POWER_USAGE (the old names stay aliases) and
    4.6.1 gives the energy in joules: the Collector-shaped scrapes under the new names cost the same."""
    renamed = run(ksm(), otlp_fixture(DCGM_4_6 / "otlp_dcgm_scrape1_dcgm4.6_names.json"),
                  otlp_fixture(DCGM_4_6 / "otlp_dcgm_scrape2_stale_dcgm4.6_names.json"))
    assert money(renamed) == pytest.approx(money(fixture_run), rel=1e-12)
    vllm = by_pod(renamed, "effective")["vllm-llama3-8b-5c9d7b8f6d-k2x7q"]
    assert vllm == pytest.approx(0.87321 * 2 * PER_GPU_INTERVAL)
    assert not total(renamed.metrics.points_rejected)


@pytest.mark.parametrize("old, new, node", [
    ("dcgm/h100x8_mig_mixed_k8s_head_hostname_lowercase.prom", "h100x8_mig_mixed_k8s_dcgm4.6_names.prom", P5_NODE),
    ("dcgm/a10g_timesliced_virtual_gpus_v4.8.prom", "a10g_timesliced_virtual_gpus_dcgm4.6_names.prom", G5_NODE)],
    ids=["mig_mixed", "time_sliced"])
@pytest.mark.parametrize("profiling", [True, False], ids=["profiling", "no_profiling"])
def test_dcgm_exposition_under_4_6_names_costs_the_same(old, new, node, profiling):
    """Without profiling metrics activity is DCGM_FI_DEV_GPU_UTIL_RATIO, a 0..100 percentage despite
    its name: read as one, effective cost is the old name's, not a hundredth or a hundred times it."""
    def priced(request):
        return run(ksm(), request if profiling else without(request, "GR_ENGINE"))

    before = priced(prom_fixture_request(old, T_SCRAPE1, node=node))
    after = priced(prom_fixture_request(DCGM_4_6 / new, T_SCRAPE1, node=node))
    costs = money(after)
    assert costs == pytest.approx(money(before), rel=1e-12)
    assert sum(v for k, v in costs.items() if k[0] == "effective") > 0 and not total(after.metrics.points_rejected)
    if node == P5_NODE:  # vLLM's GPU: 0.87321 engine activity, 87 % utilisation; MIG instances have no GPU_UTIL
        activity = 0.87321 if profiling else 0.87
        vllm = by_pod(after, "effective")["vllm-llama3-8b-5c9d7b8f6d-k2x7q"]
        assert vllm == pytest.approx(activity * PER_GPU_INTERVAL)
        unmeasured_mig = sum(v for k, v in costs.items() if k[:2] == ("unmeasured", P5_NODE) and k[3] == "mig")
        assert (unmeasured_mig == 0) == profiling


def test_holders_placed_from_kube_state_metrics_when_dcgm_names_no_pod():
    req = otlp_fixture("otlp_dcgm_scrape1_collector_v0.142.json")
    for rm in req.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for pt in (m.gauge.data_points if m.HasField("gauge") else m.sum.data_points):
                    keep = [copy.deepcopy(kv) for kv in pt.attributes if kv.key not in ("pod", "namespace", "container")]
                    del pt.attributes[:]
                    pt.attributes.extend(keep)
    p = run(ksm(), req)
    rows = p.store.totals("allocated", ("pod", "attribution"))
    assert rows[("vllm-llama3-8b-5c9d7b8f6d-k2x7q", "ksm_request")] == pytest.approx(PER_GPU_INTERVAL)
    assert rows[("finetune-job-7xk2p", "ksm_request")] == pytest.approx(PER_GPU_INTERVAL)
    assert rows[("ollama-76f687f4cd-xcvvp", "ksm_request")] == pytest.approx(SLICE)
    # Succeeded and Pending pods hold nothing.
    assert not any(k[0] in ("finetune-job-old-9z8y7", "mig-pending-5d8c7b6a9-qq2ws") for k in rows)
    # Where the device is unknown, activity is not invented.
    unmeasured = p.store.totals("unmeasured", ("node", "attribution"))[(P5_NODE, "ksm_request")]
    assert unmeasured == pytest.approx(2 * PER_GPU_INTERVAL + SLICE)


def test_pod_unknown_to_kube_state_metrics_is_kept_with_a_reason():
    p = run(otlp_fixture("otlp_dcgm_scrape1_collector_v0.142.json"))  # no KSM at all
    rows = p.store.totals("allocated", ("pod", "attribution", "team"))
    assert rows[("vllm-llama3-8b-5c9d7b8f6d-k2x7q", "pod_unknown", "unallocated")] == pytest.approx(PER_GPU_INTERVAL)
    coverage = {dict(pt.attrs)["tag"]: pt.value for pt in p.store.points() if pt.metric == "tag_coverage"}
    assert coverage["all"] == 0.0


def test_a_point_from_the_future_is_rejected_and_does_not_move_the_watermark():
    import time

    req = otlp_fixture("otlp_dcgm_scrape1_collector_v0.142.json")
    rogue = req.resource_metrics[0].scope_metrics[0].metrics[3].gauge.data_points[0]
    rogue.time_unix_nano = time.time_ns() + 3600 * 10**9
    p = offline_pipeline(make_config(attribution__prices__gpu_hour_by_gpu_model={H100: 12.0}))
    _, rejected, message = p.ingest.consume(req)
    assert rejected == 1 and "ahead of the receive clock" in message
    feed(p, ksm(), otlp_fixture("otlp_dcgm_scrape2_stale_collector_v0.142.json"))
    assert total(p.metrics.points_late) == 0 and p.windows.watermark_ns < time.time_ns()


def test_a_gpu_missing_from_dcgm_is_still_capacity():
    # The node's GFD label says 8 GPUs; drop GPU 7's series from the scrape.
    req = otlp_fixture("otlp_dcgm_scrape1_collector_v0.142.json")
    for m in req.resource_metrics[0].scope_metrics[0].metrics:
        pts = m.gauge.data_points if m.HasField("gauge") else m.sum.data_points
        keep = [p for p in pts if not any(kv.key == "gpu" and kv.value.string_value == "7" for kv in p.attributes)]
        del pts[:]
        pts.extend(keep)
    p = run(ksm(), req)
    assert p.store.totals("capacity", ("node",))[(P5_NODE,)] == pytest.approx(8 * PER_GPU_INTERVAL)
    assert total(p.metrics.gpu_seconds_without_device_data) == pytest.approx(2 * 60)  # GPU 7, and the g5 node
