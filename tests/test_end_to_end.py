"""The sidecar as deployed: real gRPC and HTTP receivers, fed raw Collector-shaped requests and
the shared fixtures, exporting through the OpenTelemetry SDK's OTLP exporter to a real gRPC
server standing in for the Collector, and serving /metrics over HTTP."""

from __future__ import annotations

import gzip

import grpc
import pytest
import requests
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from support import DCGM_4_6, CollectorSink, eventually, fixtures_dir, make_config, otlp_fixture

from otelgpu.pipeline import Pipeline
from otelgpu.telemetry import by_label, total

H100 = "NVIDIA H100 80GB HBM3"
PER_GPU_INTERVAL = 12.0 * 60 / 3600


@pytest.fixture
def sink():
    s = CollectorSink()
    yield s
    s.stop()


@pytest.fixture
def sidecar(sink, request):
    config = make_config(
        attribution__lateness_seconds=getattr(request, "param", 30),
        attribution__prices__gpu_hour_by_gpu_model={H100: 12.0},
        exporter__otlp={"endpoint": sink.endpoint, "tls": {"insecure": True}, "timeout_seconds": 5},
        exporter__prometheus={"enabled": True, "endpoint": "127.0.0.1:0"},
        cluster={"name": "eks-prod-1"},
    )
    p = Pipeline(config)
    p.start()
    yield p
    p.shutdown()


# dcgm-exporter's two scrapes, with the field names of DCGM before 4.6 and of DCGM 4.6 (4.6.1's
# energy in joules): the same cost either way.
SCRAPES = {"dcgm_names": (fixtures_dir() / "otel" / "otlp_dcgm_scrape1_collector_v0.142.json",
                          fixtures_dir() / "otel" / "otlp_dcgm_scrape2_stale_collector_v0.142.json"),
           "dcgm_4_6_names": (DCGM_4_6 / "otlp_dcgm_scrape1_dcgm4.6_names.json",
                              DCGM_4_6 / "otlp_dcgm_scrape2_stale_dcgm4.6_names.json")}


@pytest.mark.parametrize("scrapes", SCRAPES.values(), ids=SCRAPES.keys())
def test_fixtures_in_costs_out(sidecar, sink, scrapes):
    with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc.port}", compression=grpc.Compression.Gzip) as ch:
        stub = metrics_service_pb2_grpc.MetricsServiceStub(ch)
        resp = stub.Export(otlp_fixture("otlp_ksm_scrape_collector_v0.142.json"), timeout=5)
        assert not resp.HasField("partial_success")
        assert not stub.Export(otlp_fixture(scrapes[0]), timeout=5).HasField("partial_success")
    # Scrape 2 arrives over OTLP/HTTP as gzipped JSON, as an otlphttp exporter would send it.
    body = scrapes[1].read_bytes()
    r = requests.post(f"http://127.0.0.1:{sidecar.http.port}/v1/metrics", data=gzip.compress(body),
                      headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}, timeout=5)
    assert r.status_code == 200
    sidecar.drain()
    sidecar.shutdown()  # closes the open intervals and exports them

    allocated = sink.latest("gpu.cost.allocated")
    by_pod = {dict(k).get("pod"): p.as_double for k, p in allocated.items()}
    assert by_pod["vllm-llama3-8b-5c9d7b8f6d-k2x7q"] == pytest.approx(2 * PER_GPU_INTERVAL)
    assert by_pod["ollama-76f687f4cd-xcvvp"] == pytest.approx(PER_GPU_INTERVAL / 7)
    effective = {dict(k).get("pod"): p.as_double for k, p in sink.latest("gpu.cost.effective").items()}
    assert effective["vllm-llama3-8b-5c9d7b8f6d-k2x7q"] == pytest.approx(0.87321 * 2 * PER_GPU_INTERVAL)
    idle = sum(p.as_double for p in sink.latest("gpu.cost.idle").values())
    capacity = sum(p.as_double for p in sink.latest("gpu.cost.capacity").values())
    assert sum(by_pod.values()) + idle == pytest.approx(capacity)
    p5 = sum(p.as_double for k, p in sink.latest("gpu.cost.capacity").items()
             if dict(k)["node"] == "ip-10-20-3-41.us-west-2.compute.internal")
    assert p5 == pytest.approx(16 * PER_GPU_INTERVAL)
    first = sink.requests[0].resource_metrics[0]
    assert {kv.key: kv.value.string_value for kv in first.resource.attributes}["k8s.cluster.name"] == "eks-prod-1"
    metric = next(m for m in first.scope_metrics[0].metrics if m.name == "gpu.cost.allocated")
    assert metric.sum.is_monotonic and metric.sum.aggregation_temporality == 2  # CUMULATIVE
    point = metric.sum.data_points[0]
    assert {kv.key: kv.value.string_value for kv in point.attributes}["cost_model"] == "request"
    assert by_label(sidecar.metrics.points_rejected) == {}


@pytest.mark.parametrize("sidecar", [0], indirect=True)  # no lateness: scrape 2 closes interval 1
def test_series_keep_their_start_time_and_advance(sidecar, sink):
    with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc.port}") as ch:
        stub = metrics_service_pb2_grpc.MetricsServiceStub(ch)
        stub.Export(otlp_fixture("otlp_ksm_scrape_collector_v0.142.json"), timeout=5)
        stub.Export(otlp_fixture("otlp_dcgm_scrape1_collector_v0.142.json"), timeout=5)
        stub.Export(otlp_fixture("otlp_dcgm_scrape2_stale_collector_v0.142.json"), timeout=5)
    sidecar.drain()
    sidecar.shutdown()
    points = []
    for req in sink.requests:
        for m in req.resource_metrics[0].scope_metrics[0].metrics:
            if m.name == "gpu.cost.allocated":
                points += [p for p in m.sum.data_points
                           if dict((kv.key, kv.value.string_value) for kv in p.attributes).get("pod") == "finetune-job-7xk2p"]
    assert len(points) >= 2
    assert len({p.start_time_unix_nano for p in points}) == 1
    times = [p.time_unix_nano for p in points]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert points[-1].as_double > points[0].as_double


@pytest.mark.parametrize("scrapes", SCRAPES.values(), ids=SCRAPES.keys())
def test_metrics_page_and_self_counters(sidecar, scrapes):
    with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc.port}") as ch:
        stub = metrics_service_pb2_grpc.MetricsServiceStub(ch)
        bad = otlp_fixture(scrapes[0])
        metric = bad.resource_metrics[0].scope_metrics[0].metrics[3]
        assert metric.name in ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO")
        metric.gauge.data_points[0].as_double = 87.0  # a percentage where a ratio belongs
        resp = stub.Export(bad, timeout=5)
        assert resp.partial_success.rejected_data_points == 1
        # Named by the metric's first name, whichever name it came under
        assert "DCGM_FI_PROF_GR_ENGINE_ACTIVE value outside [0, 1]" in resp.partial_success.error_message
    sidecar.drain()
    sidecar.close_due(flush=True)
    eventually(lambda: by_label(sidecar.metrics.exports)["otlp"], 30)
    text = requests.get(sidecar.metrics_server.url, timeout=5).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["otelgpu_points_rejected"].samples[0].value == 1
    work = {s.labels["step"]: s.value for s in families["otelgpu_work_seconds"].samples if s.name.endswith("_total")}
    assert {step for step, seconds in work.items() if seconds > 0} == {"close", "commit", "send:otlp"}
    assert work["ahead"] == 0  # its series is there from the start, at zero, until an interval is computed ahead
    assert any(s.labels.get("cluster") for s in families["gpu_cost_allocated"].samples)
    assert families["otelgpu_intervals_computed"].samples[0].value >= 1
    assert requests.get(sidecar.metrics_server.url.replace("/metrics", "/readyz"), timeout=5).status_code == 200


def test_json_body_over_http_matches_grpc(sidecar):
    doc = json_format.MessageToJson(otlp_fixture("otlp_ksm_scrape_collector_v0.142.json"))
    r = requests.post(f"http://127.0.0.1:{sidecar.http.port}/v1/metrics", data=doc,
                      headers={"Content-Type": "application/json"}, timeout=5)
    assert r.status_code == 200
    sidecar.drain()
    assert total(sidecar.metrics.points_received) == 88


def test_several_cost_models_side_by_side_over_otlp(sink):
    """request and scad from the same fixtures, one export, told apart by cost_model; each adds up."""
    config = make_config(
        attribution__cost_models=["request", "scad"],
        attribution__prices__gpu_hour_by_gpu_model={H100: 12.0},
        exporter__otlp={"endpoint": sink.endpoint, "tls": {"insecure": True}, "timeout_seconds": 5},
    )
    p = Pipeline(config)
    p.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{p.grpc.port}") as ch:
            stub = metrics_service_pb2_grpc.MetricsServiceStub(ch)
            for name in ("otlp_ksm_scrape_collector_v0.142.json", "otlp_dcgm_scrape1_collector_v0.142.json",
                         "otlp_dcgm_scrape2_stale_collector_v0.142.json"):
                stub.Export(otlp_fixture(name), timeout=5)
        p.drain()
    finally:
        p.shutdown()
    totals: dict[tuple[str, str], float] = {}
    for metric in ("allocated", "unused", "idle", "capacity"):
        for key, point in sink.latest(f"gpu.cost.{metric}").items():
            attrs = dict(key)
            assert {"cost_model", "idle_policy", "resource", "price_source"} <= attrs.keys()
            k = (attrs["cost_model"], "capacity" if metric == "capacity" else "parts")
            totals[k] = totals.get(k, 0.0) + point.as_double
    assert {m for m, _ in totals} == {"request", "scad"}
    for model in ("request", "scad"):
        assert totals[(model, "parts")] == pytest.approx(totals[(model, "capacity")], rel=1e-12)
    # scad prices p5.48xlarge from the catalog's whole-instance price, request from the explicit GPU price.
    assert totals[("request", "capacity")] != pytest.approx(totals[("scad", "capacity")])
