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
from typing import Callable, Iterator, Optional, Union

import numpy as np

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from otelgpu import httpserver
from otelgpu.core.lifecycle import grace
from otelgpu.core.settings import split_endpoint
from otelgpu.exporter.config import PrometheusConfig
from otelgpu.exporter.store import CostStore
from otelgpu.telemetry import SelfMetrics
from otelgpu.tls import server_security

_INVALID_LABEL_CHARS = re.compile(r"[^a-zA-Z0-9_]")


def label_name(key: str) -> str:
    """A valid Prometheus label name: the translation the Collector applies (`k8s.pod` -> `k8s_pod`)."""
    name = _INVALID_LABEL_CHARS.sub("_", key) or "_"
    return "key_" + name if name[0].isdigit() else name


def _counter(name: str, doc: str) -> CounterMetricFamily:
    # CounterMetricFamily appends `_total` to the samples itself; strip ours so it is not doubled.
    return CounterMetricFamily(name.removesuffix("_total"), doc)


class CostCollector(Collector):
    """Cost families from the store plus the sidecar's own (`SelfMetrics.registry`). Register it on a
    registry of its own (`cost_registry`): the global one would refuse a second instance."""

    def __init__(self, store: CostStore, metrics: SelfMetrics, cluster: str, cost_series: bool = True) -> None:
        self._store = store
        self._metrics = metrics
        self._cluster = cluster
        self._cost_series = cost_series

    def collect(self) -> Iterator[Metric]:
        if self._cost_series:
            yield from self._cost_families()
        yield from self._metrics.registry.collect()

    def exposition(self) -> bytes:
        """`generate_latest` of a registry holding this collector, byte for byte."""
        self_text = generate_latest(self._metrics.registry)
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

def _escape(value: str) -> str:
    """A label value as the text format quotes it (prometheus_client's escaping)."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


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
        self._stopped = False

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
            if self._server is not None or self._stopped:
                return
            cfg = self.config
            tls, tokens, _ = server_security(cfg, "exporter.prometheus", self._self_metrics)
            server = httpserver.BoundedServer("otelgpu-telemetry", self._host, self._port, self._handle, LIMITS,
                                              screen=self._screen, tls=tls, tokens=tokens, open_paths=OPEN_PATHS)
            server.start()
            self._server, self._port = server, server.port

    def shutdown(self, deadline: Optional[float] = None) -> None:
        """Stop serving; a scrape under way is answered until `deadline` (default: 1 s from now)."""
        with self._lock:
            server, self._server = self._server, None
            self._stopped = self._stopped or server is not None
        if server is not None:
            server.stop(grace=grace(deadline, 1.0))  # .port stays meaningful after shutdown

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
