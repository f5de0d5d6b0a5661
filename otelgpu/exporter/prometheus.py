"""Expose the cost store and the sidecar's own counters for a Prometheus scrape.

Series carry the same names the Collector's prometheusremotewrite exporter would produce from the
OTLP path (`MetricSpec.prometheus`), so dashboards work against either. A custom collector reads
the store at scrape time: nothing is copied between intervals and no state can drift.

`CostCollector.collect()` gives the families to prometheus_client (the readable reference);
`CostCollector.exposition()` writes the same text with the cost series' labels formatted once
per attribute set rather than once per point through a dict per sample: a 10,000-GPU cluster has
some 200,000 cost series.
"""

from __future__ import annotations

import re
import threading
from typing import Callable, Iterable, Iterator, Mapping, Optional, Union, cast

import numpy as np

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from otelgpu import httpserver
from otelgpu.config import PrometheusConfig, split_endpoint
from otelgpu.exporter.store import CostStore
from otelgpu.telemetry import SelfMetrics
from otelgpu.tls import server_security

_INVALID_LABEL_CHARS = re.compile(r"[^a-zA-Z0-9_]")


def label_name(key: str) -> str:
    """A valid Prometheus label name: the translation the Collector applies (`k8s.pod` -> `k8s_pod`)."""
    name = _INVALID_LABEL_CHARS.sub("_", key) or "_"
    return "key_" + name if name[0].isdigit() else name


def _counter(name: str, doc: str, labels: Iterable[str] = ()) -> CounterMetricFamily:
    # CounterMetricFamily appends `_total` to the samples itself; strip ours so it is not doubled.
    return CounterMetricFamily(name.removesuffix("_total"), doc, labels=list(labels))


# Self-metrics counted by label: (name, SelfMetrics field, labels, help).
_LABELLED_COUNTERS = (
    ("otelgpu_points_rejected_total", "points_rejected", ("reason",),
     "Data points rejected, by reason"),
    ("otelgpu_scad_request_fallbacks_total", "scad_request_fallbacks", ("resource",),
     "Pod-intervals scad charged on requests because no usage was scraped, by resource"),
    ("otelgpu_tag_values_capped_total", "tag_values_capped", ("tag", "reason"),
     "Tag values cut to max_length (reason=length) or replaced by the overflow value "
     "(reason=distinct), by tag"),
    ("otelgpu_kube_watch_events_total", "kube_events", ("resource", "type"),
     "Kubernetes API watch events applied, by resource and type"),
    ("otelgpu_kube_lists_total", "kube_lists", ("resource", "reason"),
     "Kubernetes API full lists, by resource and why (initial; gone: the watch was too far behind, 410)"),
    ("otelgpu_kube_errors_total", "kube_errors", ("resource", "verb", "reason"),
     "Kubernetes API errors, by resource, verb and reason (forbidden, unauthorized, not_found, "
     "connection, timeout, server_error, invalid)"),
    ("otelgpu_requests_total", "requests", ("transport", "outcome"),
     "Export requests received, by transport and outcome"),
    ("otelgpu_receiver_connections_refused_total", "receiver_connections_refused", ("transport", "reason"),
     "Connections (HTTP) or Exports (gRPC) the receivers refused or cut off, by transport and reason "
     "(connection_limit, idle_evicted, idle_timeout, read_timeout, write_timeout, concurrent_requests)"),
    ("otelgpu_exports_total", "exports", ("exporter",),
     "Cost snapshots delivered, by exporter"),
    ("otelgpu_export_failures_total", "export_failures", ("exporter", "reason"),
     "Failed delivery attempts, by exporter and reason"),
    ("otelgpu_export_snapshots_dropped_total", "export_snapshots_dropped", ("exporter", "reason"),
     "Snapshots given up (refused for good, or left at the shutdown deadline)"),
    ("otelgpu_export_points_undeliverable_total", "export_points_undeliverable", ("exporter", "reason"),
     "Points of the snapshots given up"),
    ("otelgpu_export_points_rejected_total", "export_points_rejected", ("exporter",),
     "Points the receiver refused in a partial success"),
    ("otelgpu_export_series_rejected_total", "export_series_rejected", ("exporter", "reason"),
     "Series an exporter left out (e.g. over 70 labels)"),
    ("otelgpu_export_snapshots_merged_total", "export_snapshots_merged", ("exporter",),
     "Snapshots merged because the export queue was full (resolution lost, no cost)"),
    ("otelgpu_export_snapshots_recovered_total", "export_snapshots_recovered", ("exporter",),
     "Undelivered snapshots found in the export queue's directory at start and queued again"),
    ("otelgpu_export_snapshots_persisted_total", "export_snapshots_persisted", ("exporter",),
     "Snapshots not delivered by the shutdown deadline, left on disk for the next start"),
    ("otelgpu_export_outbox_errors_total", "export_outbox_errors", ("exporter", "reason"),
     "Persisted export queue problems, by exporter and reason (corrupt, incompatible: a snapshot file "
     "set aside at start; corrupt_progress; attribute_log_cut; write; delete; read)"),
    ("otelgpu_checkpoint_errors_total", "checkpoint_errors", ("reason",),
     "Checkpoints that could not be written or read, by reason"),
    ("otelgpu_wal_errors_total", "wal_errors", ("error",),
     "Write-ahead log writes that failed (requests answered 'retry later'), by error"),
    ("otelgpu_wal_corruptions_total", "wal_corruptions", ("where",),
     "Torn or corrupt write-ahead log records found at replay, by where (tail: the crash's last write)"),
    ("otelgpu_interval_errors_total", "interval_errors", ("scope",),
     "Intervals (whole) and nodes (node) whose computation failed and fell back (see the log)"),
    ("otelgpu_intervals_ahead_total", "intervals_ahead", ("outcome",),
     "Intervals computed ahead of their close, once every scrape target had sent data past their end, "
     "by outcome: used at the close; redone (late data, facts, prices or Kubernetes API facts changed "
     "before the close); failed (computed at the close instead)"),
    ("otelgpu_work_seconds_total", "work_seconds", ("step",),
     "Wall seconds spent taking intervals out, by step: ahead (computed before the close, used or not), "
     "close (facts, join, attribution, cost series), "
     "commit (staging and checkpoint), send:<exporter> (delivery attempts)"),
    ("otelgpu_tls_reload_errors_total", "tls_reload_errors", ("server",),
     "Changed certificate files a server could not use (the certificate loaded before is kept), by server"),
)


class CostCollector(Collector):
    """Cost families from the store plus `otelgpu_*` self-metrics. Register it on a registry of its
    own (`cost_registry`): the global one would mix in process metrics and refuse a second instance."""

    def __init__(self, store: CostStore, metrics: SelfMetrics, cluster: str, cost_series: bool = True) -> None:
        self._store = store
        self._metrics = metrics
        self._cluster = cluster
        self._cost_series = cost_series

    def collect(self) -> Iterator[Metric]:
        if self._cost_series:
            yield from self._cost_families()
        yield from self._self_families()

    def exposition(self) -> bytes:
        """`generate_latest` of a registry holding this collector, byte for byte."""
        self_text = generate_latest(_Families(self._self_families))
        return (self._cost_text() + self_text) if self._cost_series else self_text

    def _cost_text(self) -> bytes:
        points = self._store.points()
        labels: list[str] = [""] * len(points.attrs)
        for i in np.unique(points.aset).tolist():
            pairs = {label_name(k): v for k, v in points.attrs[i]}
            pairs["cluster"] = self._cluster
            labels[i] = "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(pairs.items())) + "}"
        code = {m: i for i, m in enumerate(points.metrics)}
        out: list[str] = []
        for key, spec in self._store.specs.items():
            doc = spec.description.replace("\\", r"\\").replace("\n", r"\n")
            kind = "counter" if spec.kind == "sum" else "gauge"
            out.append(f"# HELP {spec.prometheus} {doc}\n# TYPE {spec.prometheus} {kind}\n")
            if key not in code:
                continue
            rows = np.flatnonzero(points.metric == code[key])
            out.extend(f"{spec.prometheus}{labels[a]} {floatToGoString(v)}\n"
                       for a, v in zip(points.aset[rows].tolist(), points.value[rows].tolist()))
        return "".join(out).encode("utf-8")

    def _cost_families(self) -> Iterator[Metric]:
        by_metric: dict[str, list[tuple[dict[str, str], float]]] = {}
        for p in self._store.points():
            labels = {label_name(k): v for k, v in p.attrs}
            labels["cluster"] = self._cluster
            by_metric.setdefault(p.metric, []).append((labels, p.value))
        for key, spec in self._store.specs.items():
            family: CounterMetricFamily | GaugeMetricFamily
            if spec.kind == "sum":
                family = _counter(spec.prometheus, spec.description)
            else:
                family = GaugeMetricFamily(spec.prometheus, spec.description)
            for labels, value in by_metric.get(key, []):
                # Samples of one family may carry different label sets (idle has no team), which
                # the exposition format allows; add_sample takes a per-sample label dict.
                sample = family.name + "_total" if spec.kind == "sum" else family.name
                family.add_sample(sample, labels, value)
            yield family

    def _self_families(self) -> Iterator[Metric]:
        s = self._metrics.snapshot()  # one consistent view; the values are typed by field below
        for name, field, doc in (
            ("otelgpu_points_received_total", "points_received", "Data points of consumed metrics accepted"),
            ("otelgpu_points_ignored_total", "points_ignored", "Data points of metrics otelgpu does not consume"),
            ("otelgpu_points_late_total", "points_late", "Accepted points whose interval had already closed"),
            ("otelgpu_intervals_computed_total", "intervals_computed", "Attribution intervals computed"),
            ("otelgpu_unpriced_gpu_seconds_total", "unpriced_gpu_seconds", "GPU-seconds for which no price was found"),
            ("otelgpu_gpu_seconds_without_device_data_total", "gpu_seconds_without_device_data",
             "GPU-seconds of nodes known only from kube-state-metrics (no DCGM series in the interval)"),
            ("otelgpu_price_reloads_total", "price_reloads", "Price file changes applied"),
            ("otelgpu_price_reload_failures_total", "price_reload_failures",
             "Price file changes refused (the previous prices stay in force)"),
            ("otelgpu_series_ended_total", "series_ended",
             "Cost series ended with a NO_RECORDED_VALUE point (holder gone)"),
            ("otelgpu_checkpoints_written_total", "checkpoints_written", "Checkpoints written"),
            ("otelgpu_wal_fsyncs_total", "wal_fsyncs", "Write-ahead log group commits (one fsync each)"),
            ("otelgpu_wal_records_replayed_total", "wal_records_replayed", "Write-ahead log records replayed at start"),
            ("otelgpu_wal_segments_removed_total", "wal_segments_removed",
             "Write-ahead log segments removed once a checkpoint covered them"),
            ("otelgpu_intervals_skipped_total", "intervals_skipped",
             "Intervals not computed because no data came for longer than the facts are kept"),
            ("otelgpu_interner_compactions_total", "interner_compactions",
             "String table compactions: label strings of pods, values and nodes gone released"),
            ("otelgpu_requests_decoded_by_reference_total", "requests_decoded_by_reference",
             "Requests decoded by protobuf instead of the columnar decoder: malformed, or written unusually"),
            ("otelgpu_gpu_seconds_lost_total", "gpu_seconds_lost",
             "GPU-seconds of nodes whose costs could not be computed at all (see the log)"),
        ):
            family = _counter(name, doc)
            family.add_metric([], float(cast(float, s[field])))
            yield family
        for name, field, labels, doc in _LABELLED_COUNTERS:
            yield self._by_label(name, doc, labels, s[field])
        for name, field, label, doc in (
            ("otelgpu_kube_objects", "kube_objects", "resource", "Kubernetes objects held from the API, by resource"),
            ("otelgpu_kube_synced", "kube_synced", "resource",
             "1 once the resource is listed and watched, 0 while it is not"),
            ("otelgpu_export_queue_snapshots", "export_queue", "exporter",
             "Snapshots waiting to be delivered, by exporter"),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=[label])
            for key, value in sorted(cast(Mapping[str, int], s[field]).items()):
                gauge.add_metric([key], float(value))
            yield gauge
        active = GaugeMetricFamily("otelgpu_series_active", "Live cost series in the store")
        active.add_metric([], float(cast(Mapping[str, int], s["series_active"]).get("cost", 0)))
        yield active

    @staticmethod
    def _by_label(name: str, doc: str, labels: Iterable[str], counts: object) -> CounterMetricFamily:
        family = _counter(name, doc, labels)
        for key, value in sorted(cast(Mapping[object, float], counts).items(), key=str):
            values = list(key) if isinstance(key, tuple) else [key]
            family.add_metric([str(v) for v in values], float(value))
        return family


def _escape(value: str) -> str:
    """A label value as the text format quotes it (prometheus_client's escaping)."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


class _Families:
    """A collector of the families one function yields (for `generate_latest`)."""

    def __init__(self, families: Callable[[], Iterator[Metric]]) -> None:
        self.collect = families


def cost_registry(store: CostStore, metrics: SelfMetrics, cluster: str, cost_series: bool = True) -> CollectorRegistry:
    """A fresh registry holding one CostCollector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CostCollector(store, metrics, cluster, cost_series))
    return registry


# /metrics is scraped by a few Prometheus servers and probed by the kubelet: a modest fixed bound.
LIMITS = httpserver.Limits(max_connections=16, header_timeout_s=30.0, body_timeout_s=30.0, write_timeout_s=30.0,
                           max_body_bytes=64 * 1024, workers=2, queued=16)
OPEN_PATHS = frozenset({"/healthz", "/readyz"})  # the kubelet's probes carry no token


class TelemetryServer:
    """GET /metrics, /healthz and /readyz on one port (otelgpu.httpserver, within LIMITS; with
    `tls`, HTTPS or mutual TLS; with `auth`, /metrics needs a bearer token, the probes never do).
    Binds in start() so port 0 works. `self_metrics` counts TLS reload errors."""

    def __init__(self, config: PrometheusConfig, metrics: Union[CollectorRegistry, Callable[[], bytes]],
                 ready: Callable[[], bool], self_metrics: Optional[SelfMetrics] = None) -> None:
        """`metrics`: what /metrics serves, a registry or a function writing the text format."""
        self.config = config
        self._host, self._port = split_endpoint(config.endpoint)
        self._render = metrics if callable(metrics) else lambda: generate_latest(metrics)
        self._ready = ready
        self._self_metrics = self_metrics
        self._server: Optional[httpserver.BoundedServer] = None
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self._host in ("0.0.0.0", "") else ("::1" if self._host == "::" else self._host)
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if self.config.tls else 'http'}://{host}:{self.port}/metrics"

    def start(self) -> None:
        with self._lock:
            if self._server is not None:
                return
            cfg = self.config
            tls, tokens, _ = server_security(cfg, "exporter.prometheus", self._self_metrics)
            server = httpserver.BoundedServer("otelgpu-telemetry", self._host, self._port, self._handle, LIMITS,
                                              screen=self._screen, tls=tls, tokens=tokens, open_paths=OPEN_PATHS)
            server.start()
            self._server, self._port = server, server.port

    def shutdown(self) -> None:
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.stop(grace=1.0)  # .port stays meaningful after shutdown

    def _screen(self, request: httpserver.Request) -> Optional[httpserver.Response]:
        """Everything but /metrics is answered from the headers, on the loop: probes never wait
        behind a scrape."""
        if request.method not in ("GET", "HEAD"):
            return _text(405, b"use GET\n", {"Allow": "GET, HEAD"})
        if request.path == "/healthz":
            return _text(200, b"ok\n")
        if request.path == "/readyz":
            try:
                ok = bool(self._ready())
            except Exception:  # a failing check means not ready, never a 500 loop
                ok = False
            return _text(200, b"ready\n") if ok else _text(503, b"not ready\n")
        if request.path != "/metrics":
            return _text(404, b"not found\n")
        return None

    def _handle(self, request: httpserver.Request) -> httpserver.Response:
        return httpserver.Response(200, self._render(), {"Content-Type": CONTENT_TYPE_LATEST})


def _text(status: int, body: bytes, headers: Optional[dict[str, str]] = None) -> httpserver.Response:
    return httpserver.Response(status, body, {"Content-Type": "text/plain; charset=utf-8", **(headers or {})})
