"""A known cluster's hour, run through a real pipeline that remote-writes its cost series (to a
real Prometheus in the tests that use it): what the report and the dashboards are checked against."""

from __future__ import annotations

import time

from cluster import Cluster, Node, Pod, Unit
from support import feed

from otelgpu.config import parse_config
from otelgpu.enrich.window import NS
from otelgpu.pipeline import Pipeline
from otelgpu.telemetry import by_label

A100 = "NVIDIA A100-SXM4-40GB"
INTERVAL_S = 300


def scenario(align_s: int = INTERVAL_S, provider_id: str = "") -> Cluster:
    """$12 an hour per A100. vision: `train` holds two GPUs all hour and `batch` one GPU from 30 to
    40 and again from 50 to 60 minutes (its series ends in between, and starts again); nlp holds
    one until 25 minutes, serving tenants acme (30 prompt and 10 generation tokens a second) and
globex (7 and 2.5), research one from 35 minutes. The hour starts on a multiple of `align_s`
    (3600: an hour's edge) and ends before now. `provider_id`: the node's spec.providerID."""
    t0_s = int(time.time()) // align_s * align_s - 3600
    node = Node("gpu-1", "p4d.24xlarge", 96, 1152, units=[Unit(f"GPU-{i}", A100) for i in range(4)],
                capacity={"nvidia_com_gpu": 4}, provider_id=provider_id)
    gpu = ("nvidia_com_gpu", 1)
    pods = [Pod("ml", "train", "gpu-1", {"team": "vision"}, gpu=("nvidia_com_gpu", 2), holds=("GPU-0", "GPU-1")),
            Pod("web", "serve", "gpu-1", {"team": "nlp"}, gpu=gpu, holds=("GPU-2",), end_s=1500,
                serves={"acme": (30.0, 10.0), "globex": (7.0, 2.5)}),
            Pod("ml", "batch", "gpu-1", {"team": "vision"}, gpu=gpu, holds=("GPU-2",), start_s=1800, end_s=2400),
            Pod("ml", "batch", "gpu-1", {"team": "vision"}, gpu=gpu, holds=("GPU-2",), start_s=3000, end_s=3600),
            Pod("lab", "eval", "gpu-1", {"team": "research"}, gpu=gpu, holds=("GPU-3",), start_s=2100)]
    return Cluster([node], pods, t0=t0_s * NS)


def run(c: Cluster, write_url: str, cost_models: tuple[str, ...] = ("request",), idle_policy: str = "keep") -> Pipeline:
    """The run of `c`; under `scad`, the p4d.24xlarge instance costs $120 an hour."""
    config = parse_config({
        "cluster": {"name": "one"},
        "receiver": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": {"enabled": False}},
        "attribution": {"interval_seconds": INTERVAL_S, "lateness_seconds": 30, "cost_models": list(cost_models),
                        "idle": {"policy": idle_policy},
                        "prices": {"gpu_hour_by_gpu_model": {A100: 12.0},
                                   "instance_hour_by_instance_type": {"p4d.24xlarge": 120.0}}},
        "exporter": {"prometheus": {"enabled": False},
                     "remote_write": {"url": write_url, "timeout_seconds": 5,
                                      "delivery": {"backoff_initial_seconds": 0.05, "shutdown_timeout_seconds": 20}}}})
    p = Pipeline(config, serve_receivers=False, keep_ended=True)
    feed(p, *c.scrapes(60, 3600))
    p.shutdown()
    assert not by_label(p.metrics.export_failures) and not by_label(p.metrics.export_snapshots_dropped)
    return p


def remote_write(write_url: str, series: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]]) -> None:
    """Remote-write these series (labels with __name__, sorted; samples as (seconds, value))."""
    import urllib.request

    import cramjam

    from otelgpu.exporter.remote_write import requests_reference

    ms = {labels: [(int(t * 1000), v) for t, v in samples] for labels, samples in series.items()}
    for request in requests_reference(ms, 10_000):
        body = bytes(cramjam.snappy.compress_raw(request.SerializeToString()))
        post = urllib.request.Request(write_url, data=body, method="POST", headers={
            "Content-Encoding": "snappy", "Content-Type": "application/x-protobuf",
            "X-Prometheus-Remote-Write-Version": "0.1.0"})
        with urllib.request.urlopen(post, timeout=10) as answer:
            assert answer.status in (200, 204)
