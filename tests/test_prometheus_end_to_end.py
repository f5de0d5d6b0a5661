"""otelgpu -> remote write -> a real Prometheus, read back with PromQL: per-team totals over a run,
across a kill -9 and a restart from the checkpoint, and across a remote-write outage.

Timestamps are near the present (Prometheus refuses samples older than its head's window): the
scenario is the last hour, cut at an interval boundary."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cramjam
import pytest
from cluster import Cluster, Node, Pod, Unit
from focuscheck import assert_adds_up
from sidecar import Sidecar
from support import eventually, feed

from otelgpu.alerts import AlertsConfig, rule_groups
from otelgpu.config import parse_config
from otelgpu.core.months import month
from otelgpu.enrich.window import NS
from otelgpu.exporter.remote_write import requests_reference
from otelgpu.pipeline import Pipeline
from otelgpu.report.promql import PromClient
from otelgpu.report import focus
from otelgpu.report.showback import showback
from otelgpu.telemetry import by_label

if TYPE_CHECKING:
    from promserver import PrometheusServer

pytest_plugins = ["promserver"]  # the `prometheus` fixture

A100 = "NVIDIA A100-SXM4-40GB"
INTERVAL_S = 300
PER_INTERVAL = 12.0 * INTERVAL_S / 3600  # one A100 at $12/h for one interval
INSTANCE = "i-0123456789abcdef0"  # gpu-1's EC2 instance
TOTALS = 'sum by (cost_model, team) (max_over_time(gpu_cost_allocated_total{{cluster="{cluster}"}}[2h]))'


def scenario(t0_s: int = 0) -> Cluster:
    """The cluster's hour from `t0_s`, by default the last hour."""
    t0_s = t0_s or int(time.time()) // INTERVAL_S * INTERVAL_S - 3600
    node = Node("gpu-1", "p4d.24xlarge", 96, 1152, units=[Unit(f"GPU-{i}", A100) for i in range(4)],
                capacity={"nvidia_com_gpu": 4}, provider_id=f"aws:///us-east-1a/{INSTANCE}")
    pods = [Pod("ml", "train", "gpu-1", labels={"team": "vision"}, cpu=8, memory_gib=64, gpu=("nvidia_com_gpu", 2),
                holds=("GPU-0", "GPU-1"), activity=0.7, cpu_used=10, memory_used_gib=50),
            Pod("ml", "serve", "gpu-1", labels={"team": "nlp"}, cpu=4, memory_gib=32, gpu=("nvidia_com_gpu", 1),
                holds=("GPU-2",), activity=0.3, end_s=1500, serves={"acme": (30.0, 10.0), "globex": (7.0, 2.5)}),
            Pod("research", "eval", "gpu-1", labels={"team": "research"}, cpu=2, memory_gib=16,
                gpu=("nvidia_com_gpu", 1), holds=("GPU-3",), activity=0.9, start_s=2100)]
    return Cluster([node], pods, t0=t0_s * NS)


def config(cluster: str, write_url: str, queue_size: int = 60, shutdown_timeout_s: float = 20, **extra: Any
           ) -> dict[str, Any]:
    """Every interval's snapshot is delivered (the queue holds the whole hour) unless `queue_size`
    says otherwise: merged snapshots keep the totals but not the per-interval samples that
    `increase()` over a window reads."""
    return {"cluster": {"name": cluster},
            "attribution": {"interval_seconds": INTERVAL_S, "lateness_seconds": 30, "cost_models": ["request", "scad"],
                            "prices": {"gpu_hour_by_gpu_model": {A100: 12.0}}},
            "exporter": {"remote_write": {"url": write_url, "timeout_seconds": 5,
                                          "delivery": {"backoff_initial_seconds": 0.05, "backoff_max_seconds": 0.5,
                                                       "shutdown_timeout_seconds": shutdown_timeout_s,
                                                       "queue_size": queue_size}}},
            **extra}


def in_process(c: Cluster, doc: dict[str, Any], until_s: float = 3600) -> Pipeline:
    """The whole scenario through a pipeline of this process, shut down (flushed) at the end."""
    config = parse_config({**doc, "receiver": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": {"enabled": False}},
                           "exporter": {**doc["exporter"], "prometheus": {"enabled": False}}})
    p = Pipeline(config, serve_receivers=False, keep_ended=True)
    feed(p, *c.scrapes(60, until_s))
    p.shutdown()
    return p


def totals(prom: PrometheusServer, cluster: str, at: float) -> dict[tuple[str, str], float]:
    return {(m["cost_model"], m["team"]): v for m, v in prom.query(TOTALS.format(cluster=cluster), at)}


def test_remote_write_totals_read_back_with_promql(prometheus: PrometheusServer) -> None:
    c = scenario()
    p = in_process(c, config("one", prometheus.write_url))
    end = c.t0 / NS + 3600
    expected = {k: v for k, v in p.store.totals("allocated", ("cost_model", "team")).items()}
    got = totals(prometheus, "one", end)
    assert got == pytest.approx(expected, rel=1e-12)
    assert got[("request", "vision")] == pytest.approx(12 * 2 * PER_INTERVAL)
    assert got[("request", "nlp")] == pytest.approx(5 * PER_INTERVAL)
    assert got[("request", "research")] == pytest.approx(5 * PER_INTERVAL)  # from 35 minutes on
    assert not by_label(p.metrics.export_failures) and by_label(p.metrics.exports)["remote_write"] > 0
    # nlp's pod ended at 25 minutes: its series were ended with a stale marker, so an instant query
    # no longer sees them while the totals above still do.
    live = {m["team"] for m, _ in prometheus.query('gpu_cost_allocated_total{cluster="one"}', end)}
    assert live == {"vision", "research"}
    # The series carry the names and labels dashboards use: cluster, cost_model, resource, tags.
    (labels, value), = prometheus.query(
        'gpu_held_seconds_total{cluster="one", pod="train"}', end)
    assert value == pytest.approx(2 * 3600) and labels["namespace"] == "ml" and labels["team"] == "vision"
    capacity = sum(v for _, v in prometheus.query(
        'sum(max_over_time(gpu_cost_capacity_total{cluster="one", cost_model="request"}[2h]))', end))
    idle = sum(v for _, v in prometheus.query(
        'sum(max_over_time(gpu_cost_idle_total{cluster="one", cost_model="request"}[2h]))', end))
    assert sum(v for (m, _), v in got.items() if m == "request") + idle == pytest.approx(capacity, rel=1e-12)
    assert capacity == pytest.approx(4 * 12 * PER_INTERVAL)


# 2026-10-31 23:30 UTC: the outage below (from 20 to 45 minutes) spans the end of October. A fresh
# Prometheus takes samples of any age until its head holds some.
MONTH_END_S = 1_793_489_400


@pytest.mark.parametrize("t0_s", [0, MONTH_END_S], ids=["last_hour", "across_a_month_end"])
def test_outage_of_the_remote_end_loses_nothing(prometheus: PrometheusServer, t0_s: int) -> None:
    c = scenario(t0_s)
    doc = config("outage", prometheus.write_url, queue_size=3)
    config_ = parse_config({**doc, "receiver": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": {"enabled": False},
                                                "max_point_age_seconds": 0},
                            "exporter": {**doc["exporter"], "prometheus": {"enabled": False}}})
    p = Pipeline(config_, serve_receivers=False, keep_ended=True)
    feed(p, *c.scrapes(60, 1200))
    assert all(d.wait_idle(10) for d in p.deliveries)
    prometheus.stop()  # down for 25 minutes of data: 5 intervals, more than the queue holds
    feed(p, *c.scrapes(60, 2700, from_s=1200))
    eventually(lambda: by_label(p.metrics.export_failures)[("remote_write", "connection")] > 0, timeout=30)
    assert by_label(p.metrics.export_snapshots_merged)["remote_write"] > 0
    prometheus.start(port=prometheus.port)  # back, same address and data
    feed(p, *c.scrapes(60, 3600, from_s=2700))
    p.shutdown()
    assert not by_label(p.metrics.points_rejected)  # the hour is all there: no clock refused a point
    assert not by_label(p.metrics.export_snapshots_dropped)
    expected = p.store.totals("allocated", ("cost_model", "team"))
    assert totals(prometheus, "outage", c.t0 / NS + 3600) == pytest.approx(expected, rel=1e-12)
    # The report reads the same money from the merged snapshots, for the hour and for a window
    # that the outage cuts, and it adds up to the capacity.
    client, t0 = PromClient(prometheus.url), c.t0 / NS
    for model in ("request", "scad"):
        hour = showback(client, t0, t0 + 3600, ["team"], model, {"cluster": "outage"})
        assert {r.key[0]: r.allocated for r in hour.rows} == pytest.approx(
            {team: v for (m, team), v in expected.items() if m == model}, rel=1e-12)
        assert abs(hour.gap) < 1e-9 * hour.capacity
    # The FOCUS dataset in 5-minute charge periods: each period's charges add up to its origin,
    # and over the hour each team's charges to the run's.
    data = focus.collect(client, t0, t0 + 3600, INTERVAL_S, "request", {"cluster": "outage"})
    rows = list(focus.rows(data, focus.Provider()))
    assert_adds_up(rows, {(o.start, o.node): (o.cost, o.gpu_seconds / 3600) for o in data.origins})
    teams: dict[str, float] = {}
    for r in rows:
        if r["AllocatedTags"]:
            team = json.loads(r["AllocatedTags"])["team"]
            teams[team] = teams.get(team, 0.0) + r["BilledCost"]
    assert teams == pytest.approx({team: v for (m, team), v in expected.items() if m == "request"}, rel=1e-12)
    assert sum(r["BilledCost"] for r in rows) == pytest.approx(hour_capacity(p, "request"), rel=1e-12)
    # Each month's bill holds its own capacity: the queue merged no snapshots across the month's end.
    months: dict[float, float] = {}
    for r in rows:
        months[r["BillingPeriodStart"]] = months.get(r["BillingPeriodStart"], 0.0) + r["BilledCost"]
    assert months == pytest.approx({start: hour_capacity(p, "request") * seconds / 3600
                                    for start, seconds in month_seconds(t0, t0 + 3600).items()}, rel=1e-12)


def month_seconds(start: float, end: float) -> dict[float, float]:
    """The seconds of [start, end) in each calendar month (UTC), by the month's first second."""
    out: dict[float, float] = {}
    while start < end:
        first, after = month(start)
        out[first] = min(end, after) - start
        start = after
    return out


def hour_capacity(p: Pipeline, model: str) -> float:
    return sum(p.store.totals("capacity", ("cost_model",), {"cost_model": model}).values())


@pytest.mark.slow
def test_kill_9_and_restart_from_the_checkpoint(prometheus: PrometheusServer, tmp_path: Path) -> None:
    c = scenario()
    end = c.t0 / NS + 3600
    in_process(c, config("reference", prometheus.write_url))  # the same run without a restart

    doc = config("restarted", prometheus.write_url, checkpoint={"directory": str(tmp_path / "state")})
    first = Sidecar(tmp_path, doc, "first").start()
    try:
        first.export(*c.scrapes(60, 1800))  # up to 29 minutes: [0, 25) close, [25, 30) stays open
        first.wait_for("otelgpu_checkpoints_written_total", 5)
        first.wait_for("otelgpu_exports_total", 5)  # Prometheus has every interval up to the kill
        first.kill()
    finally:
        first.close()
    second = Sidecar(tmp_path, doc, "second").start()
    try:
        second.export(*c.scrapes(60, 3600, from_s=1800))  # what the Collector sends from now on
        assert second.stop() == 0
    finally:
        second.close()
    assert "continuing" in second.log.read_text()

    reference, restarted = totals(prometheus, "reference", end), totals(prometheus, "restarted", end)
    # What the killed process had acknowledged of the open interval came back from its log:
    # nothing lost, nothing counted twice.
    assert restarted == pytest.approx(reference, rel=1e-12)
    # The counters continued (same series, no reset), so increase() over a window across the
    # restart reads the same as without it, give or take that one interval.
    no_reset = prometheus.query('resets(gpu_cost_allocated_total{cluster="restarted", team="vision"}[2h])', end)
    assert no_reset and all(v == 0 for _, v in no_reset)
    window = 'sum by (team) (increase(gpu_cost_allocated_total{{cluster="{}", cost_model="request"}}[30m]))'
    at = c.t0 / NS + 2700  # 15 to 45 minutes, across the restart at 30
    ref = {m["team"]: v for m, v in prometheus.query(window.format("reference"), at)}
    got = {m["team"]: v for m, v in prometheus.query(window.format("restarted"), at)}
    assert ref["vision"] > 0 and got == pytest.approx(ref, rel=1e-9)
    # The report across the kill -9 reads to the cent what the run without it reads.
    client = PromClient(prometheus.url)
    for start, stop in ((0, 3600), (900, 2700), (1500, 2100)):
        runs = [showback(client, c.t0 / NS + start, c.t0 / NS + stop, ["team"], "request", {"cluster": name})
                for name in ("reference", "restarted")]
        reference, restarted = ({r.key[0]: r.charged for r in run.rows} for run in runs)
        assert reference and restarted == pytest.approx(reference, rel=1e-12)
        assert (runs[1].capacity, runs[1].idle) == pytest.approx((runs[0].capacity, runs[0].idle), rel=1e-12)
    # So does the FOCUS dataset, charge period by charge period (5 minutes).
    datasets = [focus.collect(client, c.t0 / NS, end, INTERVAL_S, "request", {"cluster": name})
                for name in ("reference", "restarted")]
    charges = [{(r["ChargePeriodStart"], r["AllocatedResourceName"] or r["x_AllocationKind"]): r["BilledCost"]
                for r in focus.rows(d, focus.Provider())} for d in datasets]
    assert len(charges[0]) > 12 and charges[1] == pytest.approx(charges[0], rel=1e-12)


def test_the_recording_rules_read_the_series_remote_write_delivers(prometheus: PrometheusServer) -> None:
    """`otelgpu rules`' recording expressions, run as PromQL on what a real run wrote: each team's
    charge per hour over the last hour and over 30 days, with the names and labels the series have."""

    c = scenario()
    p = in_process(c, config("one", prometheus.write_url))
    end = c.t0 / NS + 3600
    records = {r["record"]: r["expr"] for g in rule_groups(AlertsConfig()) for r in g["rules"] if "record" in r}
    hourly = {m["team"]: v for m, v in prometheus.query(records["team:gpu_cost_usd_per_hour:rate1h"], end)}
    assert hourly["vision"] == pytest.approx(24.0, rel=1e-9)  # two A100s at $12/h all hour
    assert set(hourly) == {"vision", "nlp", "research"}
    spent = {m["team"]: v for m, v in prometheus.query(records["team:gpu_cost_usd:increase30d"], end)}
    billed = p.store.totals("allocated", ("team",), {"cost_model": "request"})
    assert set(spent) == {team for (team,) in billed}
    for (team,), total in billed.items():
        # increase() reads from each series' first sample, an interval's cost in: it extrapolates
        # back toward zero by at most half an interval.
        first = 12.0 * {"vision": 2, "nlp": 1, "research": 1}[team] * INTERVAL_S / 3600
        assert total - first <= spent[team] <= total + 1e-9, team


def write_now(prom: PrometheusServer) -> None:
    """One sample of another series at the present, as any other writer of the same workspace
    leaves: Prometheus then refuses samples over an hour older (its head's window) as out of bounds."""
    (request,) = requests_reference({(("__name__", "other_writer"),): [(prom.now_ms(), 1.0)]}, 10)
    body = bytes(cramjam.snappy.compress_raw(request.SerializeToString()))
    post = urllib.request.Request(prom.write_url, data=body, headers={
        "Content-Encoding": "snappy", "Content-Type": "application/x-protobuf",
        "X-Prometheus-Remote-Write-Version": "0.1.0"})
    with urllib.request.urlopen(post, timeout=10) as response:
        assert response.status == 204


def test_a_backend_refusing_old_samples_loses_no_series(prometheus: PrometheusServer) -> None:
    """Two hours of data replayed into a Prometheus that has a sample of the present: every
    snapshot of the first hour is refused (400, out of bounds), during an outage with a small
    queue (snapshots merged) and after a restart. A pod ends in that hour: its series end there
    and are in no later snapshot. Each refused snapshot's last values go with the next one, so the
    first snapshot Prometheus takes carries them: every total, the ended pod's included, is read
    back with PromQL."""
    t0_s = int(time.time()) // INTERVAL_S * INTERVAL_S - 7200
    c = scenario()
    c = Cluster(c.nodes, c.pods, t0=t0_s * NS)
    write_now(prometheus)
    doc = config("refusing", prometheus.write_url, queue_size=3)
    config_ = parse_config({**doc, "receiver": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": {"enabled": False}},
                            "exporter": {**doc["exporter"], "prometheus": {"enabled": False}}})
    p = Pipeline(config_, serve_receivers=False, keep_ended=True)
    feed(p, *c.scrapes(60, 900))
    eventually(lambda: by_label(p.metrics.export_snapshots_carried)["remote_write"] > 0, timeout=30)
    prometheus.stop()  # down while the pod ends, at 25 minutes: snapshots queue and merge
    feed(p, *c.scrapes(60, 2700, from_s=900))
    eventually(lambda: by_label(p.metrics.export_failures)[("remote_write", "connection")] > 0, timeout=30)
    prometheus.start(port=prometheus.port)  # back, with its data: still refusing the first hour
    feed(p, *c.scrapes(60, 7200, from_s=2700))
    p.shutdown()
    assert by_label(p.metrics.export_failures)[("remote_write", "http_400")] > 0
    assert not by_label(p.metrics.export_snapshots_dropped)
    end = c.t0 / NS + 7200
    for metric in ("allocated", "waste", "idle"):
        expected = p.store.totals(metric, ("cost_model", "team") if metric != "idle" else ("cost_model",))
        promql = (f'sum by (cost_model{", team" if metric != "idle" else ""}) '
                  f'(max_over_time(gpu_cost_{metric}_total{{cluster="refusing"}}[3h]))')
        got = {tuple(m[k] for k in ("cost_model", "team") if k in m): v for m, v in prometheus.query(promql, end)}
        assert got == pytest.approx(expected, rel=1e-12), metric
    # The pod that ended in the refused hour: its held GPU-seconds and waste, to the cent.
    (_, held), = prometheus.query('max_over_time(gpu_held_seconds_total{cluster="refusing", pod="serve"}[3h])', end)
    assert held == pytest.approx(1500)
    waste = sum(v for _, v in prometheus.query(
        'max_over_time(gpu_cost_waste_total{cluster="refusing", pod="serve", cost_model="request"}[3h])', end))
    assert waste == pytest.approx(0.7 * 12 * 1500 / 3600)


@pytest.mark.slow
def test_kill_9_while_a_refused_snapshot_is_carried_loses_no_series(prometheus: PrometheusServer,
                                                                      tmp_path: Path) -> None:
    """The refusing backend above, with the real `otelgpu serve` killed with `kill -9` while
    refused snapshots are carried and the pod that ended in the refused hour is in no later
    snapshot: the restarted process resends the carried values from its persisted queue, and
    PromQL reads the same money as a run without the kill."""
    t0_s = int(time.time()) // INTERVAL_S * INTERVAL_S - 7200
    c = scenario()
    c = Cluster(c.nodes, c.pods, t0=t0_s * NS)
    write_now(prometheus)
    end = c.t0 / NS + 7200
    reference = in_process(c, config("reference", prometheus.write_url, queue_size=3), until_s=7200)
    assert by_label(reference.metrics.export_snapshots_carried)["remote_write"] > 0

    doc = config("killed", prometheus.write_url, queue_size=3, checkpoint={"directory": str(tmp_path / "state")})
    first = Sidecar(tmp_path, doc, "first").start()
    try:
        first.export(*c.scrapes(60, 2400))  # 40 minutes, all of it in the refused hour; the pod ends at 25
        first.wait_for("otelgpu_checkpoints_written_total", 7)
        first.wait_for("otelgpu_export_snapshots_carried_total", 3)
        first.kill()
    finally:
        first.close()
    second = Sidecar(tmp_path, doc, "second").start()
    try:
        second.export(*c.scrapes(60, 7200, from_s=2400))
        assert second.stop() == 0
    finally:
        second.close()
    for metric, by in (("allocated", "cost_model, team"), ("waste", "cost_model, team"), ("idle", "cost_model")):
        read = {cluster: {tuple(sorted(m.items())): v for m, v in prometheus.query(
            f'sum by ({by}) (max_over_time(gpu_cost_{metric}_total{{cluster="{cluster}"}}[3h]))', end)}
            for cluster in ("reference", "killed")}
        assert read["reference"] and read["killed"] == pytest.approx(read["reference"], rel=1e-12), metric
    (_, held), = prometheus.query('max_over_time(gpu_held_seconds_total{cluster="killed", pod="serve"}[3h])', end)
    assert held == pytest.approx(1500)
