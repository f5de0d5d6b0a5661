"""Test helpers: the shared fixtures (../shared/fixtures beside the repository), OTLP requests
built from them, and a pipeline wired for tests."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Optional

from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from prometheus_client.parser import text_string_to_metric_families

from otelgpu.config import Config, parse_config
from otelgpu.demo.otlp import request, scrape
from otelgpu.pipeline import Pipeline

REPO = Path(__file__).resolve().parents[1]
DCGM_4_6 = REPO / "tests" / "data" / "dcgm-4.x"  # dcgm-exporter fixtures under DCGM 4.6 field names


def fixtures_dir() -> Path:
    """`OTELGPU_FIXTURES`, else ../shared/fixtures beside the repository root."""
    env = os.environ.get("OTELGPU_FIXTURES")
    path = Path(env) if env else REPO.parent / "shared" / "fixtures"
    if not path.is_dir():
        raise FileNotFoundError(f"shared fixtures not found at {path} (set OTELGPU_FIXTURES)")
    return path


def otlp_fixture(name: str | Path) -> ExportMetricsServiceRequest:
    """A shared fixture of otel/ by its name, or the OTLP/JSON file at a Path (tests/data)."""
    path = name if isinstance(name, Path) else fixtures_dir() / "otel" / name
    text = path.read_text(encoding="utf-8")
    return json_format.Parse(text, ExportMetricsServiceRequest(), ignore_unknown_fields=True)


def prom_fixture_request(rel_path: str | Path, time_ns: int, node: str, job: str = "dcgm-exporter",
                         instance: str = "10.0.0.1:9400") -> ExportMetricsServiceRequest:
    """A Prometheus exposition fixture (a path in the shared fixtures, or a Path) as the Collector's
    prometheus receiver would forward one scrape of it: every sample a gauge point at `time_ns`,
    labels as attributes (parsed by prometheus_client)."""
    path = rel_path if isinstance(rel_path, Path) else fixtures_dir() / rel_path
    text = path.read_text(encoding="utf-8")
    gauges: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            gauges.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return request(scrape(job, instance, node, time_ns, gauges))


def make_config(**overrides: Any) -> Config:
    """Loopback-only config with no listening telemetry and no OTLP export unless asked."""
    doc: dict[str, Any] = {
        # The fixtures and scenarios are stamped months or years ago: no age limit on points.
        "receiver": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": {"endpoint": "127.0.0.1:0"},
                     "max_point_age_seconds": 0},
        "exporter": {"prometheus": {"enabled": False, "endpoint": "127.0.0.1:0"}},
    }
    for path, value in overrides.items():
        node = doc
        keys = path.split("__")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return parse_config(doc)


def offline_pipeline(config: Optional[Config] = None) -> Pipeline:
    """A pipeline fed by calling ingest.consume() and process() directly (no sockets)."""
    return Pipeline(config or make_config(), serve_receivers=False, keep_ended=True)


def feed(pipeline: Pipeline, *requests: ExportMetricsServiceRequest) -> None:
    for req in requests:
        pipeline.ingest.consume(req)
        batch = pipeline.ingest.get(timeout=0)
        if batch is not None:
            pipeline.process(batch)
            pipeline.ingest.task_done()


class CollectorSink:
    """A real in-process OTLP/gRPC MetricsService standing in for the Collector's otlp/cost receiver
    (or for otelgpu's receiver, before the Collector), on `port` of loopback (0: a free one)."""

    def __init__(self, port: int = 0) -> None:
        import threading
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc

        sink = self
        self.requests: list = []
        self._lock = threading.Lock()

        class Servicer(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):  # noqa: N802 - gRPC method name
                with sink._lock:
                    sink.requests.append(request)
                return metrics_service_pb2.ExportMetricsServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()
        self.endpoint = f"127.0.0.1:{self.port}"

    def latest(self, name: str) -> dict:
        """The newest point of each series of metric `name`: attrs (frozenset) -> point."""
        out: dict = {}
        with self._lock:
            for req in self.requests:
                for rm in req.resource_metrics:
                    for sm in rm.scope_metrics:
                        for m in sm.metrics:
                            if m.name != name:
                                continue
                            pts = m.sum.data_points if m.HasField("sum") else m.gauge.data_points
                            for p in pts:
                                key = frozenset((kv.key, kv.value.string_value) for kv in p.attributes)
                                if key not in out or out[key].time_unix_nano <= p.time_unix_nano:
                                    out[key] = p
        return out

    def stop(self) -> None:
        self.server.stop(grace=None)


def poll(check: Any, timeout: float = 5.0, ignoring: tuple[type[BaseException], ...] = (),
         interval: float = 0.02) -> Any:
    """Call `check` until it returns something true, and return that; the last falsy result after
    `timeout` seconds. `ignoring`: exceptions that mean "not yet" (the last one is raised at the
    deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
        except ignoring:
            if time.monotonic() >= deadline:
                raise
            result = None
        if result or time.monotonic() >= deadline:
            return result
        time.sleep(interval)


def eventually(check: Any, timeout: float = 5.0, ignoring: tuple[type[BaseException], ...] = (),
               message: Any = "condition not met in time") -> Any:
    """Poll `check` until it returns something true; fail after `timeout` seconds with `message`
    (a string, or a callable giving one then)."""
    result = poll(check, timeout, ignoring)
    assert result, message() if callable(message) else message
    return result
