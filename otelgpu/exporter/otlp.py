"""Push the cost store to the Collector's `otlp/cost` receiver over OTLP/gRPC.

The OpenTelemetry SDK's exporter does the sending so retry with backoff and jitter, RetryInfo,
deadlines, gzip, TLS and headers behave exactly as in every other OpenTelemetry client. This module
only turns `CostStore.points()` into the SDK's data model: cumulative monotonic sums whose start
time never moves (Prometheus remote write drops delta sums) and gauges.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

import grpc
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Metric,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from otelgpu.config import OtlpExporterConfig
from otelgpu.exporter.store import CostStore, MetricSpec, Point
from otelgpu.telemetry import SelfMetrics

log = logging.getLogger(__name__)

EXPORTER = "otlp"  # key in SelfMetrics.exports / export_failures
SCOPE = InstrumentationScope("otelgpu")
# The Collector's OTLP receiver accepts 4 MiB per request by default; a cost point with ~16
# attributes encodes to a few hundred bytes, so this keeps every request well below that limit.
MAX_POINTS_PER_REQUEST = 4000


def _headers(config: OtlpExporterConfig) -> dict[str, str]:
    # gRPC rejects metadata keys with upper-case letters ("Authorization" fails the call).
    return {k.lower(): v for k, v in config.headers.items()}


def _compression(config: OtlpExporterConfig) -> grpc.Compression:
    return grpc.Compression.Gzip if config.compression == "gzip" else grpc.Compression.NoCompression


def build_metrics_data(store: CostStore, cluster: str) -> Optional[MetricsData]:
    """The store's points as one ResourceMetrics, one Metric per spec; None when there is nothing."""
    by_metric: dict[str, list[Point]] = {}
    for p in store.points():
        by_metric.setdefault(p.metric, []).append(p)
    if not by_metric:
        return None
    metrics = []
    for key, spec in store.specs.items():  # spec order keeps requests stable for golden tests
        points = by_metric.get(key)
        if not points:
            continue
        data_points = [
            NumberDataPoint(attributes=dict(p.attrs), start_time_unix_nano=p.start_ns,
                            time_unix_nano=p.time_ns, value=float(p.value))
            for p in points
        ]
        data: Sum | Gauge
        if spec.kind == "sum":
            data = Sum(data_points=data_points, aggregation_temporality=AggregationTemporality.CUMULATIVE,
                       is_monotonic=True)
        else:
            data = Gauge(data_points=data_points)
        metrics.append(Metric(name=spec.name, description=spec.description, unit=spec.unit, data=data))
    # Resource(...) rather than Resource.create(): OTEL_* environment variables must not be able to
    # rename the service or the cluster the cost lands under.
    resource = Resource({"k8s.cluster.name": cluster, "service.name": "otelgpu"})
    scope = ScopeMetrics(scope=SCOPE, metrics=metrics, schema_url="")
    return MetricsData(resource_metrics=[ResourceMetrics(resource=resource, scope_metrics=[scope], schema_url="")])


class OtlpCostExporter:
    """Sends the whole cumulative store on every `export()`; a failed export loses nothing, since
    the next one carries the same totals, grown."""

    def __init__(self, config: OtlpExporterConfig, store: CostStore, metrics: SelfMetrics,
                 cluster: str) -> None:
        self._store = store
        self._metrics = metrics
        self._cluster = cluster
        self._lock = threading.Lock()
        self._closed = False
        self._exporter = OTLPMetricExporter(
            endpoint=config.endpoint,
            insecure=config.insecure,
            headers=_headers(config),
            timeout=config.timeout_seconds,
            compression=_compression(config),
            max_export_batch_size=MAX_POINTS_PER_REQUEST,
        )

    def export(self) -> bool:
        """Send every series once. True on success or when the store is empty; never raises."""
        if self._closed:
            self._metrics.count("export_failures", EXPORTER)
            return False
        try:
            data = build_metrics_data(self._store, self._cluster)
            if data is None:
                return True
            ok = self._exporter.export(data) is MetricExportResult.SUCCESS
        except Exception:  # an encoding bug must not take the pipeline down with it
            log.exception("OTLP cost export failed")
            ok = False
        self._metrics.count("exports" if ok else "export_failures", EXPORTER)
        return ok

    def shutdown(self) -> None:
        """Close the channel; interrupts a retry wait in progress. Safe to call more than once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._exporter.shutdown()
