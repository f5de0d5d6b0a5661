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
from otelgpu.checkpoint import Checkpoint, Identity
from otelgpu.config import Config
from otelgpu.enrich.facts import FactSource, KsmFacts, MergedFacts
from otelgpu.enrich.join import Joiner
from otelgpu.enrich.kube.source import KubeSource
from otelgpu.enrich.labels import TagResolver, TagValues
from otelgpu.enrich.samples import dcgm_samples
from otelgpu.enrich.usage import UsageTracker
from otelgpu.enrich.window import NS, Interval, Windows
from otelgpu.errors import ConfigError
from otelgpu.exporter.delivery import Delivery
from otelgpu.exporter.otlp import OtlpSender
from otelgpu.exporter.prometheus import CostCollector, TelemetryServer
from otelgpu.exporter.store import CostStore, Point
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
    """`keep_ended`: ended series still count in `store.totals()` (run reports: the demo, tests)."""

    def __init__(self, config: Config, *, serve_receivers: bool = True, keep_ended: bool = False) -> None:
        from prometheus_client import CollectorRegistry

        self.config = config
        a = config.attribution
        self.strings = Interner()
        self.metrics = SelfMetrics()
        self.ingest = Ingest(self.strings, config.receiver.queue_size, config.receiver.retry_after_seconds, self.metrics)
        self.facts = KsmFacts(self.strings, ttl_ns=max(FACT_TTL_INTERVALS * a.interval_seconds, 600) * NS)
        self.windows = Windows(a.interval_seconds, a.lateness_seconds)
        self.models = CostModels(a, {name: rule.default for name, rule in config.tags.items()}, self.metrics,
                                 dropped=config.series.dropped)
        self.pricer = Pricer(a.prices)
        self.usage = UsageTracker(self.strings)
        self.tag_values = TagValues(config.tag_values, self.metrics)
        tags = TagResolver(config.tags, self.tag_values)
        self.kube = KubeSource(config.kubernetes, tags, self.metrics) if config.kubernetes.enabled else None
        source: FactSource = MergedFacts(self.facts, self.kube) if self.kube else self.facts
        self.joiner = Joiner(self.strings, source, tags, MigProfiles.load(),
                             self.pricer, a.mig_fraction_rule, pod_resources=self.models.needs_pods(),
                             cpu_only_nodes=a.scad.cpu_only_nodes)
        self.store = CostStore(a.currency, config.series.end_after_intervals, keep_ended=keep_ended)
        self.on_interval: list[Callable[[Interval], None]] = []
        self.deliveries: list[Delivery] = []
        e, cluster = config.exporter, config.cluster.name
        k = config.kubernetes
        instance = k.node_name if k.enabled and k.scope == "node" else ""  # one writer per node
        if e.otlp:
            self.deliveries.append(Delivery(OtlpSender(e.otlp, self.store.specs, self.metrics, cluster, instance),
                                            e.otlp.delivery, self.metrics))
        if e.remote_write:
            # imported here: botocore loads only when remote write is configured
            from otelgpu.exporter.remote_write import RemoteWriteSender

            self.deliveries.append(Delivery(RemoteWriteSender(e.remote_write, self.store.specs, cluster, self.metrics),
                                            e.remote_write.delivery, self.metrics))
        self.checkpoint = (Checkpoint(config.checkpoint.directory, Identity(cluster, a.currency), self.metrics)
                           if config.checkpoint.directory else None)
        self._restore()
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

    def _restore(self) -> None:
        """Continue the series of the last checkpoint, if there is a usable one."""
        state = self.checkpoint.load() if self.checkpoint else None
        if state is None or self.checkpoint is None:
            return
        try:
            self.store.restore(state["store"])
            self.tag_values.restore(state.get("tag_values", {}))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            self.store.restore({"last_time_ns": 0, "attrs": [], "sums": []})
            self.checkpoint.reject("corrupt", f"its content does not restore: {exc!r}")
            return
        self.windows.resume_after(self.store.last_time_ns)
        log.info("continuing %d cost series from %s (last interval ended %s UTC)", self.store.active_series(),
                 self.checkpoint.path, time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.store.last_time_ns / NS)))

    def start_sources(self) -> None:
        """Start the Kubernetes API watches; waits a little for their first lists so the first
        intervals have the API's facts (kube-state-metrics facts serve meanwhile)."""
        if self.kube:
            self.kube.start()
            if not self.kube.wait_synced(KUBE_SYNC_WAIT_S):
                log.warning("Kubernetes API not listed after %.0f s; attributing with what is known and "
                            "retrying in the background", KUBE_SYNC_WAIT_S)

    def start(self) -> None:
        kernels = warm_up()  # the first request must never wait for the JIT
        log.info("kernels ready: %s", ", ".join(f"{name} {how}" for name, how in kernels.items()))
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
        if closed and self.checkpoint:
            self.checkpoint.save({"store": self.store.state(), "tag_values": self.tag_values.state()})
        return len(closed)

    def _close(self, interval: Interval) -> None:
        self._reload_prices()
        use = self.usage.use(interval.pods, interval.start_ns, interval.end_ns) if self.models.needs_pods() else None
        joined = self.joiner.join(interval.samples, interval.start_ns, interval.end_ns, use)
        sums, gauges = self.models.attribute(joined, interval.seconds)
        snapshot = self.store.record(interval.start_ns, interval.end_ns, sums, gauges)
        self._publish(snapshot)
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

    def _publish(self, snapshot: list[Point]) -> None:
        ended = sum(p.ended for p in snapshot)
        if ended:
            self.metrics.add("series_ended", ended)
        self.metrics.set("series_active", "cost", len(snapshot) - ended)
        for delivery in self.deliveries:
            delivery.put(snapshot)

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
        for delivery in self.deliveries:  # all drain side by side, each to its own deadline
            delivery.finish_by(time.monotonic() + delivery.config.shutdown_timeout_seconds)
        if self.deliveries:
            left = sum(delivery.close() for delivery in self.deliveries)
            log.info("shutting down: exports %s after %.1f s", f"gave up {left} snapshot(s)" if left else "delivered",
                     time.monotonic() - began)
        if self.checkpoint:
            self.checkpoint.close()
        if self.kube:
            self.kube.shutdown()
        if self.telemetry:
            self.telemetry.shutdown()
        log.info("stopped after %.1f s", time.monotonic() - began)
