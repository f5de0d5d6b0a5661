"""The series out over OTLP/gRPC with the OpenTelemetry SDK: observable gauges (a counter for the
energy, a cumulative monotonic sum as the Collector makes of dcgm-exporter's counter) whose
callbacks hand over the points of the cycle's reading.

The SDK's PeriodicExportingMetricReader runs without its own timer (an infinite interval): the
agent's cycle reads NVML, hands the points over and flushes, so every export carries one reading,
and a paused agent (a dcgm-exporter answering on the node) exports nothing at all. Series not
observed in a collection are not exported, so a pod that left stops being reported at once.

Instrument names are case-insensitive in OpenTelemetry and the SDK lowercases them; a View per
instrument names its stream as dcgm-exporter spells it (DCGM_FI_DEV_GPU_UTIL), which is what the
sidecar, like any Prometheus query, matches.

The resource says who sends: `service.name` otelgpu-nvml (what the sidecar's default
`sources.dcgm` trusts), `service.instance.id` and `k8s.node.name` the node. OTEL_RESOURCE_ATTRIBUTES
may add attributes (a cluster name), never replace these.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from typing import Iterable, Optional

import grpc
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import View
from opentelemetry.sdk.resources import Resource
from pydantic import ValidationError

from otelgpu import __version__
from otelgpu.core.settings import ClientTLSConfig
from otelgpu.errors import ConfigError
from otelgpu.exporter.config import OtlpExporterConfig
from otelgpu.nvml.series import METRICS, MetricSpec, Point
from otelgpu.tls import grpc_channel_credentials

SERVICE_NAME = "otelgpu-nvml"
SCOPE = "otelgpu.nvml"


def exporter_config(endpoint: str, insecure: Optional[bool] = None, ca_file: Optional[str] = None,
                    cert_file: Optional[str] = None, key_file: Optional[str] = None) -> OtlpExporterConfig:
    """The sidecar's own rules for an OTLP exporter: TLS (verified) unless the endpoint is a
    loopback address or `insecure` says plaintext; ConfigError naming the problem otherwise."""
    try:
        return OtlpExporterConfig(endpoint=endpoint, tls=ClientTLSConfig(insecure=insecure, ca_file=ca_file,
                                                                         cert_file=cert_file, key_file=key_file))
    except (ValidationError, ValueError) as exc:
        errors = exc.errors() if isinstance(exc, ValidationError) else [{"msg": str(exc)}]
        raise ConfigError([f"nvml --endpoint: {e['msg']}" for e in errors]) from None


class OtlpSeries:
    """A MeterProvider whose instruments report the points last handed to `publish`."""

    def __init__(self, config: OtlpExporterConfig, node: str, timeout_s: float = 10.0) -> None:
        target, tls = config.target
        credentials = grpc_channel_credentials(config.tls, "nvml")[0] if tls else None
        exporter = OTLPMetricExporter(endpoint=target, insecure=not tls, credentials=credentials, timeout=timeout_s,
                                      compression=grpc.Compression.Gzip)
        self._reader = PeriodicExportingMetricReader(exporter, export_interval_millis=math.inf)
        resource = Resource.create({"service.name": SERVICE_NAME, "service.version": __version__,
                                    "service.instance.id": node, "k8s.node.name": node})
        views = [View(instrument_name=spec.name.lower(), meter_name=SCOPE, name=spec.name) for spec in METRICS]
        self._provider = MeterProvider(resource=resource, metric_readers=[self._reader], views=views)
        self._timeout_ms = timeout_s * 1000
        self._lock = threading.Lock()
        self._current: dict[str, list[Observation]] = {}
        meter = self._provider.get_meter(SCOPE, __version__)
        for spec in METRICS:
            create = meter.create_observable_counter if spec.counter else meter.create_observable_gauge
            create(spec.name, callbacks=[self._callback(spec)], unit=spec.unit, description=spec.description)

    def _callback(self, spec: MetricSpec):  # noqa: ANN202 - an SDK callback
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            with self._lock:
                return list(self._current.get(spec.name, ()))
        return observe

    def publish(self, points: Iterable[Point]) -> None:
        """Export these points now (the SDK logs a failed export; the next cycle sends afresh)."""
        current: dict[str, list[Observation]] = defaultdict(list)
        for p in points:
            current[p.metric.name].append(Observation(p.value, dict(p.labels)))
        with self._lock:
            self._current = dict(current)
        self._provider.force_flush(timeout_millis=self._timeout_ms)

    def shutdown(self) -> None:
        with self._lock:
            self._current = {}
        self._provider.shutdown()
