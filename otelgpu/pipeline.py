"""Wiring: receivers -> ingest queue -> facts and interval windows -> join -> kernel -> cost store
-> exporters. One worker thread owns every stage after the queue, so stages need no locks."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from otelgpu.attribution.engine import warm_up
from otelgpu.attribution.fractions import MigProfiles
from otelgpu.attribution.models import CostModels
from otelgpu.attribution.prices import Pricer
from otelgpu.config import Config
from otelgpu.errors import ConfigError
from otelgpu.enrich.facts import FactSource, KsmFacts, MergedFacts
from otelgpu.enrich.join import Joiner
from otelgpu.enrich.kube.source import KubeSource
from otelgpu.enrich.labels import TagResolver, TagValues
from otelgpu.enrich.samples import dcgm_samples
from otelgpu.enrich.usage import UsageTracker
from otelgpu.enrich.window import NS, Interval, Windows
from otelgpu.exporter.otlp import OtlpCostExporter
from otelgpu.exporter.prometheus import CostCollector, TelemetryServer
from otelgpu.exporter.store import CostStore
from otelgpu.receiver.decode import PointBatch
from otelgpu.receiver.grpc_server import GrpcReceiver
from otelgpu.receiver.http_server import HttpReceiver
from otelgpu.receiver.ingest import Ingest
from otelgpu.receiver.interner import Interner
from otelgpu.telemetry import SelfMetrics

log = logging.getLogger("otelgpu")

FACT_TTL_INTERVALS = 10  # facts not refreshed for this many intervals are forgotten
KUBE_SYNC_WAIT_S = 10.0  # how long start() waits for the first Kubernetes API lists


class Pipeline:
    def __init__(self, config: Config, *, serve_receivers: bool = True) -> None:
        from prometheus_client import CollectorRegistry

        self.config = config
        a = config.attribution
        self.strings = Interner()
        self.metrics = SelfMetrics()
        self.ingest = Ingest(self.strings, config.receiver.queue_size, config.receiver.retry_after_seconds, self.metrics)
        self.facts = KsmFacts(self.strings, ttl_ns=max(FACT_TTL_INTERVALS * a.interval_seconds, 600) * NS)
        self.windows = Windows(a.interval_seconds, a.lateness_seconds)
        self.models = CostModels(a, {name: rule.default for name, rule in config.tags.items()}, self.metrics)
        self.pricer = Pricer(a.prices)
        self.usage = UsageTracker(self.strings)
        tags = TagResolver(config.tags, TagValues(config.tag_values, self.metrics))
        self.kube = KubeSource(config.kubernetes, tags, self.metrics) if config.kubernetes.enabled else None
        source: FactSource = MergedFacts(self.facts, self.kube) if self.kube else self.facts
        self.joiner = Joiner(self.strings, source, tags, MigProfiles.load(),
                             self.pricer, a.mig_fraction_rule, pod_resources=self.models.needs_pods(),
                             cpu_only_nodes=a.scad.cpu_only_nodes)
        self.store = CostStore(a.currency)
        self.on_interval: list[Callable[[Interval], None]] = []
        self.otlp = (OtlpCostExporter(config.exporter.otlp, self.store, self.metrics, config.cluster.name)
                     if config.exporter.otlp else None)
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(CostCollector(self.store, self.metrics, config.cluster.name))
        self.telemetry = (TelemetryServer(config.exporter.prometheus, self.registry, lambda: self.ready)
                          if config.exporter.prometheus.enabled else None)
        r = config.receiver
        self.grpc = GrpcReceiver(r.grpc, self.ingest, self.metrics) if serve_receivers else None
        self.http = (HttpReceiver(r.http, self.ingest, self.metrics, r.grpc.max_recv_msg_size_mib * 2**20)
                     if serve_receivers and r.http.enabled else None)
        self.ready = False
        self._stop = threading.Event()
        self._worker: Optional[threading.Thread] = None
        self._export_lock = threading.Lock()

    def start_sources(self) -> None:
        """Start the Kubernetes API watches; waits a little for their first lists so the first
        intervals have the API's facts (kube-state-metrics facts serve meanwhile)."""
        if self.kube:
            self.kube.start()
            if not self.kube.wait_synced(KUBE_SYNC_WAIT_S):
                log.warning("Kubernetes API not listed after %.0f s; attributing with what is known and "
                            "retrying in the background", KUBE_SYNC_WAIT_S)

    def start(self) -> None:
        warm_up()  # the first request must never wait for the JIT
        self.start_sources()
        if self.telemetry:
            self.telemetry.start()
        self._worker = threading.Thread(target=self._run, name="otelgpu-pipeline", daemon=True)
        self._worker.start()
        for receiver in (self.grpc, self.http):
            if receiver:
                receiver.start()
        self.ready = True

    def _run(self) -> None:
        while not self._stop.is_set() or self.ingest.depth:
            batch = self.ingest.get(timeout=0.2)
            if batch is None:
                continue
            try:
                self.process(batch)
            except Exception:  # a bad batch must not stop attribution of the next ones
                log.exception("batch processing failed")
                self.metrics.count("points_rejected", "internal error while processing", len(batch))
            finally:
                self.ingest.task_done()

    def process(self, batch: PointBatch) -> None:
        """Apply one decoded batch and close every interval it makes due."""
        self.facts.update(batch)
        samples = dcgm_samples(batch, self.strings)
        pods = self.usage.pod_samples(batch) if self.models.needs_pods() else None
        late = self.windows.add(samples, int(batch.time_ns.max()) if len(batch) else 0, pods)
        if late:
            self.metrics.add("points_late", late)
        self.close_due()

    def close_due(self, flush: bool = False) -> int:
        closed = self.windows.due(flush=flush)
        for interval in closed:
            self._close(interval)
        if closed:
            self.export()
        return len(closed)

    def _close(self, interval: Interval) -> None:
        self._reload_prices()
        use = self.usage.use(interval.pods, interval.start_ns, interval.end_ns) if self.models.needs_pods() else None
        joined = self.joiner.join(interval.samples, interval.start_ns, interval.end_ns, use)
        sums, gauges = self.models.attribute(joined, interval.seconds)
        self.store.record(interval.start_ns, interval.end_ns, sums, gauges)
        self.metrics.add("unpriced_gpu_seconds", joined.unpriced_gpus * interval.seconds)
        self.metrics.add("gpu_seconds_without_device_data", joined.gpus_without_device_data * interval.seconds)
        self.metrics.add("intervals_computed")
        self.facts.expire(interval.end_ns)
        self.usage.expire(interval.end_ns)
        for callback in self.on_interval:
            callback(interval)

    def _reload_prices(self) -> None:
        try:
            if self.pricer.reload_if_changed():
                log.info("prices reloaded from %s", self.pricer.base.file)
                self.metrics.add("price_reloads")
        except ConfigError as exc:
            log.error("price file not applied, previous prices stay in force: %s", exc)
            self.metrics.add("price_reload_failures")

    def export(self) -> None:
        if self.otlp:
            with self._export_lock:
                self.otlp.export()

    def drain(self) -> None:
        """Wait until every batch queued so far has been processed."""
        self.ingest.join()

    def shutdown(self) -> None:
        """Stop taking traffic, process what is queued, close every open interval, export, stop."""
        began = time.monotonic()
        self.ready = False
        for receiver in (self.grpc, self.http):
            if receiver:
                receiver.shutdown()
        log.info("shutting down: receivers stopped after %.1f s, %d batches queued", time.monotonic() - began,
                 self.ingest.depth)
        if self._worker and self._worker.is_alive():
            self.drain()
            self._stop.set()
            self._worker.join(timeout=10)
        closed = self.close_due(flush=True)
        log.info("shutting down: queue drained, %d intervals closed and exported after %.1f s", closed,
                 time.monotonic() - began)
        if self.otlp:
            self.otlp.shutdown()
        if self.kube:
            self.kube.shutdown()
        if self.telemetry:
            self.telemetry.shutdown()
        log.info("stopped after %.1f s", time.monotonic() - began)
