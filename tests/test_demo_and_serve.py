"""The two user entry points, run as a user would: `otelgpu demo` and `otelgpu serve --config`."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from sidecar import Sidecar
from support import CollectorSink, otlp_fixture

from otelgpu.demo.run import run_demo
from otelgpu.telemetry import by_label, total


def test_demo_reproduces_the_recipe_and_adds_up():
    out = io.StringIO()
    p = run_demo(metrics_port=0, out=out)
    request = {"cost_model": "request"}
    alloc = p.store.totals("allocated", ("team",), request)
    eff = p.store.totals("effective", ("team",), request)
    # The AWS recipe's MIG scenario (cost-model.md section 7), rounded only here at the end.
    assert round(alloc[("bu-a",)], 6) == 5.142857
    assert round(alloc[("bu-b",)], 6) == round(alloc[("bu-c",)], 6) == 3.428571
    assert round(eff[("bu-a",)], 6) == 1.285714
    assert round(eff[("bu-b",)], 6) == 0.857143
    idle = p.store.totals("idle", ("instance_type",), request)
    assert round(idle[("p4d.24xlarge",)], 6) == 84.0
    capacity = sum(p.store.totals("capacity", (), request).values())
    assert sum(alloc.values()) + sum(idle.values()) == pytest.approx(capacity, rel=1e-12)
    # The time-sliced node bills replicas, never whole GPUs; the spot node says so.
    replica = p.store.totals("allocated", ("unit_kind", "capacity_type"), request)
    assert replica[("replica", "spot")] < capacity
    # Every model the demo runs adds up to its own capacity, and scad splits whole instances
    # (GPU, vCPU and memory) with CPU and memory use scraped from cAdvisor.
    for model in p.config.attribution.cost_models:
        where = {"cost_model": model}
        parts = sum(sum(p.store.totals(m, (), where).values()) for m in ("allocated", "unused", "idle"))
        assert parts == pytest.approx(sum(p.store.totals("capacity", (), where).values()), rel=1e-12), model
    scad = p.store.totals("allocated", ("resource", "activity_basis"), {"cost_model": "scad"})
    assert scad[("cpu", "usage")] > 0 and scad[("memory", "usage")] > 0 and not by_label(p.metrics.scad_request_fallbacks)
    assert total(p.metrics.intervals_computed) == 4
    assert not by_label(p.metrics.points_rejected)  # the demo's scrapes are what a Collector sends: all accepted
    text = out.getvalue()
    assert "bu-a" in text and "(idle)" in text and "cluster total" in text and "/metrics" in text
    assert "charge by team and cost model" in text and "opencost" in text
    # The printed coverage is the cluster's (not a namespace's) and matches the exported gauge.
    cluster_all = next(pt.value for pt in p.store.points() if pt.metric == "tag_coverage"
                       and dict(pt.attrs) == {"tag": "all"})
    assert 0 < cluster_all < 1 and f"all five tags {cluster_all:.0%}" in text
    # The 70B server's charge, split among its tenants by tokens (2,100, 1,050 and 200 a second,
    # weights 1 and 1), under every model, and printed.
    for model in p.config.attribution.cost_models:
        where = {"cost_model": model, "pod": "vllm-llama3-70b-0"}
        charged = sum(sum(p.store.totals(m, (), where).values()) for m in ("allocated", "unused"))
        split = {k[0]: v for k, v in p.store.totals("tenant_cost", ("tenant",), where).items()}
        assert split == pytest.approx({t: charged * w / 3350 for t, w in
                                       (("docs-search", 2100), ("chat-assist", 1050), ("internal-eval", 200))},
                                      rel=1e-9), model
    assert "serving pods' charge by tenant" in text and "docs-search" in text


def test_each_interval_logs_one_line_and_the_progress_line_keeps_models_apart(caplog):
    import re

    from otelgpu.demo.run import progress

    caplog.set_level("INFO", logger="otelgpu")
    p = run_demo(metrics_port=0, out=io.StringIO())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("interval ") and "UTC: " in r.getMessage()]
    assert len(lines) == total(p.metrics.intervals_computed) == 4
    received = 0
    for line in lines:
        # GPUs, each model's capacity cost and idle share, and the points of the interval.
        assert re.search(r"UTC: 17 GPUs; request [\d,.]+ USD, idle \d+%; scad [\d,.]+ USD, idle \d+%; opencost", line), line
        received += int(re.search(r"points ([\d,]+) received, 0 rejected, 0 late", line).group(1).replace(",", ""))
    assert received == total(p.metrics.points_received)
    capacity = {m: sum(p.store.totals("capacity", (), {"cost_model": m}).values()) for m in ("request", "scad")}
    assert f"request {capacity['request'] / 4:,.2f} USD" in lines[-1] and f"scad {capacity['scad'] / 4:,.2f} USD" in lines[-1]
    line = progress(p, 0)
    for model in p.config.attribution.cost_models:  # each model's own totals, never a sum across models
        where = {"cost_model": model}
        charged = sum(sum(p.store.totals(m, (), where).values()) for m in ("allocated", "unused"))
        assert f"{model}: charged {charged:.6f}" in line


def test_demo_command_runs():
    res = subprocess.run([sys.executable, "-m", "otelgpu", "demo", "--metrics-port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "5.142857" in res.stdout and "cluster total" in res.stdout


def test_serve_takes_traffic_and_flushes_on_sigterm(tmp_path):
    sink = CollectorSink()
    serve = Sidecar(tmp_path, {
        "cluster": {"name": "serve-test"},
        "receiver": {"max_point_age_seconds": 0},  # the fixtures are stamped months ago
        "attribution": {"prices": {"gpu_hour_by_gpu_model": {"NVIDIA H100 80GB HBM3": 12.0}}},
        "exporter": {"otlp": {"endpoint": sink.endpoint, "tls": {"insecure": True}}},
    })
    try:
        serve.start(timeout=60)
        serve.export(*(otlp_fixture(name) for name in ("otlp_ksm_scrape_collector_v0.142.json",
                                                        "otlp_dcgm_scrape1_collector_v0.142.json")))
        assert serve.stop(timeout=60) == 0, serve.log.read_text()[-6000:]
        allocated = sink.latest("gpu.cost.allocated")
        by_pod = {dict(k).get("pod"): p.as_double for k, p in allocated.items()}
        assert by_pod["finetune-job-7xk2p"] == pytest.approx(12.0 * 60 / 3600)
    finally:
        serve.close()
        sink.stop()


def test_the_example_config_serves_as_it_is_with_nothing_around(tmp_path, monkeypatch):
    """examples/otelgpu.yaml needs no variable, Collector or cluster: fed a live cluster's scrapes
    it serves their cost on /metrics under the cluster name `dev`, logs each interval, and stops
    cleanly. (Only its listening ports are moved to free ones.)"""
    import time

    import yaml
    from cluster import Cluster, Node, Pod, Unit
    from support import REPO, eventually

    from otelgpu.enrich.window import NS

    monkeypatch.delenv("CLUSTER_NAME", raising=False)
    h100 = "NVIDIA H100 80GB HBM3"
    node = Node("gpu-1", "p5.48xlarge", 192, 2048, labels={"nvidia.com/gpu.count": "2"},
                units=[Unit("GPU-0", h100), Unit("GPU-1", h100)], capacity={"nvidia_com_gpu": 2})
    pods = [Pod("ml", "train", "gpu-1", {"team": "vision"}, gpu=("nvidia_com_gpu", 1), holds=("GPU-0",))]
    c = Cluster([node], pods, t0=(time.time_ns() // (60 * NS) - 4) * 60 * NS)
    serve = Sidecar(tmp_path, yaml.safe_load((REPO / "examples" / "otelgpu.yaml").read_text()), "example")
    try:
        serve.start(timeout=60)
        serve.export(*c.scrapes(30, 240))
        eventually(lambda: serve.metric("gpu_cost_allocated_total", cluster="dev", team="vision") > 0, 60)
        scrape = serve.metrics("gpu_cost_allocated_total", "gpu_held_seconds_total", cluster="dev", team="vision")
        assert scrape["gpu_cost_allocated_total"] == pytest.approx(6.88 * scrape["gpu_held_seconds_total"] / 3600)
        assert serve.stop(timeout=60) == 0, serve.log.read_text()[-6000:]
        assert "UTC: 2 GPUs; request" in serve.log.read_text()
    finally:
        serve.close()
