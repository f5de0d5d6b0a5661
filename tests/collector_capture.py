"""What the real Collector sends otelgpu: the pinned build runs the shipped gateway config against
the fixtures' cluster (tests/scrapecluster.py) serving untimestamped exposition, as the real
exporters do, and its `otlp_grpc/otelgpu` exporter sends to a recording OTLP/gRPC sink. Along the
way the fine-tuning pod ends (its DCGM series disappear) and one dcgm-exporter scrape fails.

`capture()` returns one request per scrape (the Collector's batches split by resource), in the order
scraped, with what happened before it. `python tests/collector_capture.py DIR` writes the scrapes
the tests keep as fixtures into DIR (tests/data/collector-v0.158.0) as OTLP/JSON."""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import otelcol
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.metrics.v1.metrics_pb2 import ResourceMetrics
from scrapecluster import GpuCluster
from sidecar import free_port
from support import CollectorSink, eventually

FIXTURES = Path(__file__).resolve().parent / "data" / "collector-v0.158.0"
SCRAPE_INTERVAL = "1s"


@dataclass
class Scrape:
    job: str  # service.name
    instance: str  # service.instance.id
    time_ns: int
    request: ExportMetricsServiceRequest

    def points(self, name: str) -> list:
        return [p for rm in self.request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
                if m.name == name for p in (m.sum.data_points if m.HasField("sum") else m.gauge.data_points)]

    @property
    def up(self) -> float:
        return self.points("up")[0].as_double


def resource(rm: ResourceMetrics) -> dict[str, str]:
    return {kv.key: kv.value.string_value for kv in rm.resource.attributes}


def capture(workdir: Path) -> tuple[list[Scrape], dict[str, int]]:
    """The scrapes the Collector sent, oldest first, and when (ns) the pod ended and the scrape failed."""
    cluster = GpuCluster(workdir / "cluster", timestamps=False)
    sink = CollectorSink()
    telemetry = free_port()
    config = otelcol.shipped_config("gateway", workdir, cluster.api.url, sink.endpoint, "127.0.0.1:9",
                                    free_port(), "http://127.0.0.1:9/api/v1/write", telemetry, SCRAPE_INTERVAL)
    # Only the gpu pipeline: what reaches otelgpu. The cost and self pipelines stay out of it.
    config["service"]["pipelines"] = {"metrics/gpu": config["service"]["pipelines"]["metrics/gpu"]}
    config["service"]["extensions"].remove("sigv4auth")
    for kind, name in (("receivers", "prometheus/self"), ("receivers", "otlp/cost"),
                       ("exporters", "prometheus_remote_write/amp"), ("extensions", "sigv4auth")):
        del config[kind][name]
    col = otelcol.Collector(workdir, config, {"DCGM_EXPORTER_NAMESPACE": "gpu-operator",
                                              "KUBE_STATE_METRICS_NAMESPACE": "kube-system"},
                            telemetry_port=telemetry)
    events: dict[str, int] = {}
    try:
        col.start()
        for target in cluster.targets:
            cluster.wait_served(target, 0)
        last = cluster.wait_served("dcgm-a", cluster.served("dcgm-a")[-1].at_ms).at_ms
        cluster.end_gpu_holding("2/")
        events["pod_ended_ms"] = cluster.wait_served("dcgm-a", last).at_ms
        cluster.fail_next_scrape("dcgm-a")
        failed = eventually(lambda: cluster.served("dcgm-a", failed=True), 30)[0].at_ms
        events["failed_ms"] = failed
        recovered = cluster.wait_served("dcgm-a", failed).at_ms
        cluster.wait_served("dcgm-a", recovered)
        # Until every scrape the tests keep has reached the sink: the Collector's batches come
        # when they come, and a scrape served is not yet a scrape sent.
        eventually(lambda: _all_kept(_scrapes(list(sink.requests)), events), 60,
                   message=lambda: f"the sink never got every scrape kept: {col.tail()}")
        assert col.stop() == 0, col.tail()  # SIGTERM: the batch processor flushes what it holds
    finally:
        col.close()
        cluster.close()
        sink.stop()
    return _scrapes(sink.requests), events


def _all_kept(scrapes: list[Scrape], events: dict[str, int]) -> bool:
    try:
        keepers(scrapes, events)
    except StopIteration:
        return False
    return True


def _scrapes(requests: list[ExportMetricsServiceRequest]) -> list[Scrape]:
    """One request per scrape, split from the Collector's batches by resource, in the order scraped."""
    scrapes = []
    for req in requests:
        for rm in req.resource_metrics:
            times = [p.time_unix_nano for sm in rm.scope_metrics for m in sm.metrics
                     for p in (m.sum.data_points if m.HasField("sum") else m.gauge.data_points)]
            res = resource(rm)
            one = ExportMetricsServiceRequest()
            one.resource_metrics.add().CopyFrom(rm)
            scrapes.append(Scrape(res.get("service.name", ""), res.get("service.instance.id", ""), min(times), one))
    scrapes.sort(key=lambda s: (s.time_ns, s.job))
    return scrapes


def keepers(scrapes: list[Scrape], events: dict[str, int]) -> dict[str, Scrape]:
    """The scrapes kept as fixtures, by file name."""
    dcgm = [s for s in scrapes if s.job == "dcgm-exporter" and s.instance.endswith(".11:9400")]
    ended = next(s for s in dcgm if s.time_ns >= events["pod_ended_ms"] * 1_000_000 - 5 * 10**8 and s.up == 1
                 and any(p.flags & 1 for p in s.points("DCGM_FI_PROF_GR_ENGINE_ACTIVE")))
    failed = next(s for s in dcgm if s.up == 0)
    return {"otlp_dcgm_scrape.json": dcgm[0],
            "otlp_dcgm_pod_ended.json": ended,
            "otlp_dcgm_scrape_failed.json": failed,
            "otlp_dcgm_recovered.json": next(s for s in dcgm if s.time_ns > failed.time_ns),
            "otlp_dcgm_timesliced.json": next(s for s in scrapes if s.job == "dcgm-exporter" and s is not dcgm[0]
                                              and s.instance.endswith(".12:9400")),
            "otlp_ksm_scrape.json": next(s for s in scrapes if s.job == "kube-state-metrics"),
            "otlp_vllm_scrape.json": next(s for s in scrapes if s.job == "vllm"),
            "otlp_kubelet_cadvisor.json": next(s for s in scrapes if s.job == "kubelet-cadvisor")}


def write(directory: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        scrapes, events = capture(Path(tmp))
    directory.mkdir(parents=True, exist_ok=True)
    for name, s in keepers(scrapes, events).items():
        (directory / name).write_text(json_format.MessageToJson(s.request, indent=1) + "\n")
        print(f"{name}: {s.job} {s.instance}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURES)
