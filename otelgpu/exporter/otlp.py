"""Push cost snapshots to the Collector's `otlp/cost` receiver over OTLP/gRPC.

Requests are built straight from the store's points with the OTLP protobuf messages: cumulative
monotonic sums whose start time never moves (Prometheus remote write drops delta sums), gauges, and
`NO_RECORDED_VALUE` on a series' last point, which the SDK's data model cannot express and which
the Collector's prometheusremotewrite exporter turns into a stale marker.

One `send()` is one attempt; the delivery queue (`delivery.py`) retries. Failures are classified as
the OTLP specification says: UNAVAILABLE, CANCELLED, DEADLINE_EXCEEDED, ABORTED, OUT_OF_RANGE and
DATA_LOSS are retryable, RESOURCE_EXHAUSTED only when the server sent RetryInfo, and every other
code is final. A server's RetryInfo delay is honoured.
"""

from __future__ import annotations

import logging
from typing import Iterator, Mapping, Optional, Sequence

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2_grpc import MetricsServiceStub
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    AggregationTemporality,
    DataPointFlags,
    Metric,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from otelgpu.config import OtlpExporterConfig
from otelgpu.exporter.sending import DELIVERED, Progress, SendResult
from otelgpu.exporter.store import MetricSpec, Point
from otelgpu.telemetry import SelfMetrics

log = logging.getLogger(__name__)

# The Collector's OTLP receiver accepts 4 MiB per request by default; a cost point with ~16
# attributes encodes to a few hundred bytes, so this keeps every request well below that limit.
MAX_POINTS_PER_REQUEST = 4000
RETRYABLE = frozenset({grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
                       grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS})
NO_RECORDED_VALUE = DataPointFlags.DATA_POINT_FLAGS_NO_RECORDED_VALUE_MASK


def _kv(key: str, value: str) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(string_value=value))


def build_requests(points: Sequence[Point], specs: Mapping[str, MetricSpec], cluster: str,
                   max_points: int = MAX_POINTS_PER_REQUEST, instance: str = "") -> Iterator[ExportMetricsServiceRequest]:
    """The points as OTLP requests of at most `max_points` points, one Metric per spec and
    request, in spec order (stable requests for tests and goldens). `instance` (a per-node
    sidecar's node) becomes service.instance.id, so each writer's resource, and the `instance`
    and `target_info` series the Collector derives from it, are its own."""
    by_metric: dict[str, list[Point]] = {}
    for p in points:
        by_metric.setdefault(p.metric, []).append(p)
    ordered = [(key, p) for key in specs for p in by_metric.get(key, ())]
    # The resource names the cluster; not Resource.create(): OTEL_* variables must not rename it.
    resource = Resource(attributes=[_kv("k8s.cluster.name", cluster), _kv("service.name", "otelgpu")]
                        + ([_kv("service.instance.id", instance)] if instance else []))
    for begin in range(0, len(ordered), max_points):
        metrics: dict[str, Metric] = {}
        for key, p in ordered[begin:begin + max_points]:
            spec = specs[key]
            metric = metrics.get(key)
            if metric is None:
                metric = metrics[key] = Metric(name=spec.name, description=spec.description, unit=spec.unit)
                if spec.kind == "sum":
                    metric.sum.aggregation_temporality = AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
                    metric.sum.is_monotonic = True
                else:
                    metric.gauge.SetInParent()
            dp = NumberDataPoint(attributes=[_kv(k, v) for k, v in p.attrs], time_unix_nano=p.time_ns,
                                 start_time_unix_nano=p.start_ns if spec.kind == "sum" else 0)
            if p.ended:
                dp.flags = NO_RECORDED_VALUE  # no value: the series ends here
            else:
                dp.as_double = p.value
            (metric.sum if spec.kind == "sum" else metric.gauge).data_points.append(dp)
        scope = ScopeMetrics(scope=InstrumentationScope(name="otelgpu"), metrics=list(metrics.values()))
        yield ExportMetricsServiceRequest(resource_metrics=[ResourceMetrics(resource=resource, scope_metrics=[scope])])


def _retry_delay(error: grpc.RpcError) -> Optional[float]:
    """RetryInfo's delay from the rich status, or from the `google.rpc.retryinfo-bin` trailer."""
    blobs = []
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
        if status is not None:
            blobs += [d.value for d in status.details if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR)]
    except ValueError:  # a status whose details contradict its code: ignore the details
        pass
    trailers = dict(error.trailing_metadata() or ())  # type: ignore[attr-defined]
    if "google.rpc.retryinfo-bin" in trailers:
        blobs.append(trailers["google.rpc.retryinfo-bin"])
    for blob in blobs:
        info = error_details_pb2.RetryInfo.FromString(blob)
        return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return None


def _target(endpoint: str, insecure: bool) -> tuple[str, bool]:
    """host:port and whether to use TLS, for `host:port` and `http(s)://host:port` endpoints."""
    if endpoint.startswith("https://"):
        return endpoint[len("https://"):].rstrip("/"), True
    if endpoint.startswith("http://"):
        return endpoint[len("http://"):].rstrip("/"), False
    return endpoint, not insecure


class OtlpSender:
    """One OTLP/gRPC channel to the Collector; `send()` delivers a snapshot or says why not."""

    name = "otlp"

    def __init__(self, config: OtlpExporterConfig, specs: Mapping[str, MetricSpec], metrics: SelfMetrics,
                 cluster: str, instance: str = "") -> None:
        self._config = config
        self._specs = specs
        self._metrics = metrics
        self._cluster, self._instance = cluster, instance
        # gRPC rejects metadata keys with upper-case letters ("Authorization" fails the call).
        self._headers = tuple((k.lower(), v) for k, v in config.headers.items())
        self._compression = grpc.Compression.Gzip if config.compression == "gzip" else grpc.Compression.NoCompression
        target, tls = _target(config.endpoint, config.insecure)
        self._channel = (grpc.secure_channel(target, grpc.ssl_channel_credentials()) if tls
                         else grpc.insecure_channel(target))
        self._stub = MetricsServiceStub(self._channel)

    def send(self, points: Sequence[Point], progress: Optional[Progress] = None) -> SendResult:
        """`progress` is not used: an attempt sends the whole snapshot again. A cumulative point
        repeated with the same timestamp, start time and value is a no-op for OTLP consumers."""
        try:
            for request in build_requests(points, self._specs, self._cluster, instance=self._instance):
                response = self._stub.Export(request, metadata=self._headers, timeout=self._config.timeout_seconds,
                                             compression=self._compression)
                rejected = response.partial_success.rejected_data_points
                if rejected:  # accepted in part: never resent (the receiver would refuse them again)
                    self._metrics.count("export_points_rejected", self.name, rejected)
                    log.error("the OTLP receiver refused %d cost points: %s", rejected,
                              response.partial_success.error_message)
        except grpc.RpcError as error:
            code = error.code()  # type: ignore[attr-defined]
            delay = _retry_delay(error)
            retryable = code in RETRYABLE or (code is grpc.StatusCode.RESOURCE_EXHAUSTED and delay is not None)
            return SendResult(ok=False, retryable=retryable, reason=code.name.lower(),
                              detail=error.details() or "", retry_after=delay)  # type: ignore[attr-defined]
        except Exception as exc:  # an encoding bug must not take the exporter thread down
            log.exception("OTLP cost export failed")
            return SendResult(ok=False, retryable=False, reason="encode", detail=str(exc))
        return DELIVERED

    def close(self) -> None:
        self._channel.close()  # fails a call in flight with CANCELLED
