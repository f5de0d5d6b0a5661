"""What the real Collector's prometheus receiver sends, against what otelgpu assumes: live (the
pinned build scraping the fixtures' cluster, untimestamped, into a recording sink) and from the
captured fixtures in tests/data/collector-v0.158.0 (PROVENANCE.md there), which the unit tests
then use as the real shapes. Both decoders read every captured request alike and refuse nothing
under the shipped source-trust defaults; staleness markers end the series they should."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import yaml
from collector_capture import FIXTURES, Scrape, capture, keepers, resource
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from receiver.test_columnar import Both
from support import feed

from otelgpu.config import parse_config
from otelgpu.pipeline import Pipeline
from otelgpu.receiver.interner import Interner
from otelgpu.receiver.decode import decode_reference
from otelgpu.receiver.schema import Metric
from otelgpu.telemetry import by_label

REPO = Path(__file__).resolve().parents[1]
SCOPE = ("github.com/open-telemetry/opentelemetry-collector-contrib/receiver/prometheusreceiver", "0.158.0")
COUNTERS = {"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
            "container_cpu_usage_seconds_total"}
REPORT = {"up"}  # the receiver's own series that reach otelgpu (filter/otelgpu drops its scrape_* series)
FINETUNE = "finetune-job-7xk2p"


def fixture(name: str) -> ExportMetricsServiceRequest:
    return json_format.Parse((FIXTURES / name).read_text(), ExportMetricsServiceRequest())


def fixtures() -> dict[str, ExportMetricsServiceRequest]:
    return {p.name: fixture(p.name) for p in sorted(FIXTURES.glob("*.json"))}


def metrics(req: ExportMetricsServiceRequest) -> dict[str, object]:
    return {m.name: m for rm in req.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}


def points(req: ExportMetricsServiceRequest, name: str) -> list:
    m = metrics(req).get(name)
    return [] if m is None else list(m.sum.data_points if m.HasField("sum") else m.gauge.data_points)


def attrs(p) -> dict[str, str]:  # noqa: ANN001
    return {kv.key: kv.value.string_value for kv in p.attributes}


def shipped_pipeline() -> Pipeline:
    """otelgpu as the gateway runs it (its source-trust defaults), in this process, nothing served."""
    doc = yaml.safe_load((REPO / "k8s" / "gateway" / "otelgpu.yaml").read_text())
    doc["cluster"]["name"] = "shapes"
    doc.pop("kubernetes"), doc.pop("checkpoint")
    doc["receiver"] = {"grpc": {"endpoint": "127.0.0.1:0"}, "http": {"enabled": False}}
    doc["exporter"] = {"prometheus": {"enabled": False}}
    return Pipeline(parse_config(doc), serve_receivers=False)


def check_shapes(by_name: dict[str, ExportMetricsServiceRequest]) -> None:
    """What otelgpu's decoders and source-trust defaults rely on, request by request."""
    jobs = {}
    for name, req in by_name.items():
        (rm,) = req.resource_metrics
        res = resource(rm)
        jobs[name] = res["service.name"]
        assert res["service.instance.id"] and res["url.scheme"] in ("http", "https"), (name, res)
        assert [(sm.scope.name, sm.scope.version) for sm in rm.scope_metrics] == [SCOPE], name
        assert res.get("k8s.node.name"), (name, res)  # the node otelgpu reads a scrape as coming from
        for mname, m in metrics(req).items():
            if mname in COUNTERS:  # cumulative monotonic sums, no start time: otelgpu differences them itself
                assert m.HasField("sum") and m.sum.is_monotonic and m.sum.aggregation_temporality == 2, mname
                assert all(p.start_time_unix_nano == 0 for p in m.sum.data_points), mname
            else:
                assert m.HasField("gauge"), mname
    assert set(jobs.values()) == {
        "dcgm-exporter", "kube-state-metrics", "vllm", "kubelet-cadvisor"}
    # vLLM: the own pod is the resource's (otelgpu's rule), and only the two counters are kept.
    vllm = resource(by_name["otlp_vllm_scrape.json"].resource_metrics[0])
    assert vllm["k8s.namespace.name"] == "team-a" and vllm["k8s.pod.name"].startswith("vllm-llama3-8b")
    assert set(metrics(by_name["otlp_vllm_scrape.json"])) - REPORT == {"vllm:prompt_tokens_total",
                                                                       "vllm:generation_tokens_total"}
    # The pod's end: its series end with staleness markers; GPU 2 comes back without a pod.
    ended = by_name["otlp_dcgm_pod_ended.json"]
    stale = [p for p in points(ended, "DCGM_FI_PROF_GR_ENGINE_ACTIVE") if p.flags & 1]
    assert [attrs(p)["pod"] for p in stale] == [FINETUNE] and not stale[0].HasField("as_double")
    gpu2 = [attrs(p) for p in points(ended, "DCGM_FI_PROF_GR_ENGINE_ACTIVE") if not p.flags & 1 and attrs(p)["gpu"] == "2"]
    assert gpu2 and all("pod" not in a for a in gpu2)
    # A failed scrape: up 0 and a staleness marker on every series of the target.
    failed = by_name["otlp_dcgm_scrape_failed.json"]
    assert [p.as_double for p in points(failed, "up")] == [0.0]
    for mname in set(metrics(failed)) - REPORT:
        assert all(p.flags & 1 for p in points(failed, mname)), mname
    assert len(points(failed, "DCGM_FI_PROF_GR_ENGINE_ACTIVE")) == 9  # 7 whole GPUs and 2 MIG instances


def check_decoded(by_name: dict[str, ExportMetricsServiceRequest]) -> None:
    """Both decoders read each request alike; nothing refused under the shipped trust defaults;
    markers decode as stale rows of the series they end."""
    p = shipped_pipeline()
    limits = p.ingest.limits
    both = Both(limits)
    for name, req in by_name.items():
        now = max(pt.time_unix_nano for rm in req.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
                  for pt in (m.sum.data_points if m.HasField("sum") else m.gauge.data_points))
        rows, rejected, _, sources = both.same(req.SerializeToString(), now=now)
        assert rejected == {}, (name, rejected)
        assert rows, name
        batch = decode_reference(req, strings := Interner(), limits, now_ns=now)
        if name == "otlp_dcgm_scrape_failed.json":
            active = batch.metric == int(Metric.GR_ENGINE_ACTIVE)
            assert active.sum() == 9 and batch.stale[active].all() and all(math.isnan(v) for v in batch.value[active])
        if name == "otlp_dcgm_pod_ended.json":
            stale_pods = {strings.string(int(batch.column(strings.code("pod"))[i])) for i in range(len(batch))
                          if batch.stale[i]}
            assert stale_pods == {FINETUNE}, stale_pods
    # Through the pipeline as a Collector sends them, at their time: all accepted.
    feed(p, *sent_now(list(by_name.values())))
    assert not by_label(p.metrics.points_rejected)


def sent_now(requests: list[ExportMetricsServiceRequest]) -> list[ExportMetricsServiceRequest]:
    """Copies of captured requests moved in time so that their newest point is now, as the
    Collector would send them today: the shipped age limit (a day) judges them as it would then."""
    def data_points(req: ExportMetricsServiceRequest):  # noqa: ANN202
        return [pt for rm in req.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
                for pt in (m.sum.data_points if m.HasField("sum") else m.gauge.data_points)]

    copies = [ExportMetricsServiceRequest.FromString(r.SerializeToString()) for r in requests]
    shift = time.time_ns() - max(pt.time_unix_nano for req in copies for pt in data_points(req))
    for pt in (pt for req in copies for pt in data_points(req)):
        pt.time_unix_nano += shift
        if pt.start_time_unix_nano:
            pt.start_time_unix_nano += shift
    return copies


def test_the_captured_fixtures_have_the_shapes_otelgpu_reads() -> None:
    check_shapes(fixtures())


def test_both_decoders_read_the_captured_fixtures_alike_and_refuse_nothing() -> None:
    check_decoded(fixtures())


@pytest.mark.slow
def test_the_live_collector_sends_what_the_fixtures_show(tmp_path) -> None:
    """The pinned Collector now, against the fixtures captured from it: the same shapes, the same
    metric names per file, the same resource attribute keys."""
    scrapes, events = capture(tmp_path)
    live: dict[str, Scrape] = keepers(scrapes, events)
    requests = {name: s.request for name, s in live.items()}
    check_shapes(requests)
    check_decoded(requests)
    for name, req in fixtures().items():
        got = requests[name]
        assert set(metrics(got)) == set(metrics(req)), name
        assert set(resource(got.resource_metrics[0])) == set(resource(req.resource_metrics[0])), name
