"""Lag on /metrics, as an operator reads it: the data-time watermark and the end of the last
interval closed, checkpointed and delivered per exporter, through a pipeline exporting to a real
OTLP/gRPC sink and a real Prometheus. Delivery stops while the backends are down and catches up
when they are back; after a restart the persisted queue says how far delivery had come."""

from __future__ import annotations

import time
from typing import Any, Optional

import requests
from cluster import Cluster, Node, Pod, Unit
from otlpsink import MetricsSink, serve_sink
from prometheus_client.parser import text_string_to_metric_families
from support import eventually, feed, make_config, offline_pipeline

from otelgpu.enrich.window import NS
from otelgpu.pipeline import Pipeline
from otelgpu.telemetry import by_label

pytest_plugins = ["promserver"]  # the `prometheus` fixture

A100 = "NVIDIA A100-SXM4-40GB"
INTERVAL = 60
FAST = {"backoff_initial_seconds": 0.05, "backoff_max_seconds": 0.2, "shutdown_timeout_seconds": 0.5}


def cluster() -> Cluster:
    """Two GPUs held all along, on a grid of whole minutes ending ten minutes from now (Prometheus
    takes samples near its present only)."""
    node = Node("gpu-1", "p4d.24xlarge", 96, 1152, units=[Unit("GPU-0", A100), Unit("GPU-1", A100)],
                capacity={"nvidia_com_gpu": 2})
    pods = [Pod("ml", "train", "gpu-1", {"team": "vision"}, gpu=("nvidia_com_gpu", 1), holds=("GPU-0",)),
            Pod("ml", "serve", "gpu-1", {"team": "nlp"}, gpu=("nvidia_com_gpu", 1), holds=("GPU-1",))]
    return Cluster([node], pods, t0=(int(time.time()) // INTERVAL * INTERVAL - 600) * NS)


def pipeline(directory, otlp: str, remote_write: Optional[str] = None) -> Pipeline:
    exporters: dict[str, Any] = {"exporter__otlp": {"endpoint": otlp, "delivery": FAST},
                                 "exporter__prometheus__enabled": True}
    if remote_write:
        exporters["exporter__remote_write"] = {"url": remote_write, "timeout_seconds": 2, "delivery": FAST}
    p = offline_pipeline(make_config(attribution__interval_seconds=INTERVAL, attribution__lateness_seconds=30,
                                     attribution__prices__gpu_hour_by_gpu_model={A100: 12.0},
                                     checkpoint__directory=str(directory), **exporters))
    assert p.metrics_server is not None
    p.metrics_server.start()
    return p


GAUGES = {"otelgpu_watermark_timestamp_seconds": "watermark", "otelgpu_interval_closed_timestamp_seconds": "closed",
          "otelgpu_interval_checkpointed_timestamp_seconds": "checkpointed"}


def lag(p: Pipeline) -> dict[str, Any]:
    """The lag gauges as /metrics serves them (unix seconds of data time)."""
    assert p.metrics_server is not None
    out: dict[str, Any] = {"delivered": {}}
    for family in text_string_to_metric_families(requests.get(p.metrics_server.url, timeout=5).text):
        for s in family.samples:
            if s.name == "otelgpu_exporter_delivered_timestamp_seconds":
                out["delivered"][s.labels["exporter"]] = s.value
            elif s.name in GAUGES:
                out[GAUGES[s.name]] = s.value
    return out


def since(t0_ns: int, gauges: dict[str, Any]) -> dict[str, Any]:
    """The gauges in seconds after the cluster's start."""
    t0 = t0_ns / NS
    return {k: ({e: round(v - t0) for e, v in sorted(v.items())} if isinstance(v, dict) else round(v - t0))
            for k, v in gauges.items()}


def caught_up(p: Pipeline, exporters: tuple[str, ...]) -> Any:
    g = lag(p)
    return g if set(g["delivered"]) == set(exporters) and all(v == g["closed"] for v in g["delivered"].values()) \
        else None


def test_lag_gauges_advance_as_intervals_close_and_deliver_and_delivery_stops_while_the_backends_are_down(
        tmp_path, prometheus):
    c = cluster()
    both = ("otlp", "remote_write")
    sink = MetricsSink()
    with serve_sink(sink) as port:
        p = pipeline(tmp_path / "state", sink.endpoint, prometheus.write_url)
        try:
            feed(p, *c.scrapes(30, 300))  # the last scrape at 270 s: intervals ending by 240 s close
            eventually(lambda: caught_up(p, both), timeout=20, message=lambda: f"not caught up: {lag(p)}")
            assert since(c.t0, lag(p)) == {"watermark": 270, "closed": 240, "checkpointed": 240,
                                           "delivered": {"otlp": 240, "remote_write": 240}}
        except BaseException:
            p.shutdown()
            raise
    try:
        prometheus.stop()  # both backends down
        failed = dict(by_label(p.metrics.export_failures))
        feed(p, *c.scrapes(30, 600, from_s=300))
        # Closed and checkpointed move on; every exporter has tried, failed and tried again.
        eventually(lambda: all(sum(n for (e, _), n in by_label(p.metrics.export_failures).items() if e == name)
                               >= sum(n for (e, _), n in failed.items() if e == name) + 3 for name in both),
                   timeout=20, message="the exporters did not retry")
        assert since(c.t0, lag(p)) == {"watermark": 570, "closed": 540, "checkpointed": 540,
                                       "delivered": {"otlp": 240, "remote_write": 240}}
        assert by_label(p.metrics.exporter_queue_size) == {"otlp": 5, "remote_write": 5}

        prometheus.start(prometheus.port)  # back, on the same address
        with serve_sink(sink, port):
            eventually(lambda: caught_up(p, both), timeout=30, message=lambda: f"not caught up: {lag(p)}")
            assert since(c.t0, lag(p))["delivered"] == {"otlp": 540, "remote_write": 540}
            # What the gauge says was delivered is what the backends hold.
            newest = max(dp.time_unix_nano for r in sink.received for m in r.request.resource_metrics[0]
                         .scope_metrics[0].metrics for dp in (m.sum.data_points or m.gauge.data_points))
            assert newest == c.t0 + 540 * NS
            (_, stored), = prometheus.query("max(timestamp(gpu_cost_capacity_total))", c.t0 / NS + 600)
            assert stored == c.t0 / NS + 540
    finally:
        p.shutdown()


def test_after_a_restart_the_persisted_queue_says_how_far_delivery_had_come(tmp_path):
    """Stopped with five snapshots undelivered, the sidecar starts again from its checkpoint: closed
    and checkpointed are the checkpoint's, delivered the start of the oldest snapshot waiting, and
    it catches up once the Collector is back."""
    c = cluster()
    sink = MetricsSink()
    with serve_sink(sink) as port:
        p = pipeline(tmp_path / "state", sink.endpoint)
        try:
            feed(p, *c.scrapes(30, 300))
            eventually(lambda: caught_up(p, ("otlp",)), timeout=20, message=lambda: f"not caught up: {lag(p)}")
        except BaseException:
            p.shutdown()
            raise
    feed(p, *c.scrapes(30, 600, from_s=300))
    p.shutdown()  # the stop closes the interval the last scrape began: [540 s, 600 s)
    assert by_label(p.metrics.export_snapshots_persisted) == {"otlp": 6}

    again = pipeline(tmp_path / "state", sink.endpoint)
    try:
        assert since(c.t0, lag(again)) == {"watermark": 600, "closed": 600, "checkpointed": 600,
                                           "delivered": {"otlp": 240}}
        with serve_sink(sink, port):
            eventually(lambda: caught_up(again, ("otlp",)), timeout=20,
                       message=lambda: f"not caught up: {lag(again)}")
        assert since(c.t0, lag(again))["delivered"] == {"otlp": 600}
    finally:
        again.shutdown()
