"""Wiring: receivers -> ingest queue -> facts and interval windows -> join -> kernel -> cost store
-> exporters. One worker thread owns every stage after the queue, so stages need no locks."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Optional

from otelgpu import telemetry
from otelgpu.attribution.models import CostModels
from otelgpu.attribution.prices import Pricer
from otelgpu.checkpoint import Checkpoint, Identity
from otelgpu.commit import Committer
from otelgpu.compute import Costs, IntervalCosts
from otelgpu.config import Config
from otelgpu.core import jit
from otelgpu.core.attrs import Attrs, named_sets
from otelgpu.core.mig import MigProfiles
from otelgpu.core.state import States, Undo
from otelgpu.enrich import sharing
from otelgpu.enrich.devices import DeviceMemory
from otelgpu.enrich.facts import KsmFacts, MergedFacts, fact_rows
from otelgpu.enrich.join import Joiner
from otelgpu.enrich.labels import NODE_LABELS, TagResolver, TagValues
from otelgpu.enrich.model import FactSource, FactsView
from otelgpu.enrich.reported import Hardware
from otelgpu.enrich.samples import dcgm_samples
from otelgpu.enrich.usage import UsageTracker
from otelgpu.enrich.window import NS, Interval, Windows
from otelgpu.errors import ConfigError
from otelgpu.exporter.config import DeliveryConfig
from otelgpu.exporter.delivery import Delivery
from otelgpu.exporter.otlp import OtlpSender
from otelgpu.exporter.prometheus import CostCollector, TelemetryServer
from otelgpu.exporter.sending import Sender
from otelgpu.exporter.store import CostStore, Points
from otelgpu.heap import collector_paused, give_back, page_out, page_out_files
from otelgpu.kernels import warm_up
from otelgpu.memory import limiter_of
from otelgpu.receiver.decode import PointBatch
from otelgpu.receiver.grpc_server import GrpcReceiver
from otelgpu.receiver.http_server import HttpReceiver
from otelgpu.receiver.ingest import Ingest
from otelgpu.receiver.interner import Interner
from otelgpu.receiver.limits import Limits, wanted_keys
from otelgpu.receiver.record import RecordError, decode_batch
from otelgpu.telemetry import (AheadOutcome, CheckpointError, DurabilityTelemetry, IntervalTelemetry, SelfMetrics,
                               WalCorruption, WorkStep)
from otelgpu.wal import Position, Wal

if TYPE_CHECKING:
    from otelgpu.enrich.kube.source import KubeSource

log = logging.getLogger("otelgpu")

WORKER_NOTICE_S = 5.0  # a stop logs every this many seconds it waits for the worker's step in progress
FACT_TTL_INTERVALS = 10  # facts not refreshed for this many intervals are forgotten
# The string interner is compacted once it holds this many strings and twice what the last
# compaction kept: amortised, each string is copied a bounded number of times.
COMPACT_STRINGS_FROM = 65_536


@dataclass
class _Ahead:
    """An interval computed before its close, with what it was computed from and how to undo it."""

    index: int
    end_ns: int
    version: int  # of the interval's window
    facts_version: int
    prices: int  # price files applied
    api: Optional[FactsView]  # the Kubernetes API's facts as of the interval's end
    costs: Optional[Costs]
    counts: list[tuple]  # its self-metrics, counted if it is used
    undo: Optional[Undo]  # puts back what computing it changed


def interval_summary(sums: Mapping[str, Mapping[Attrs, float]], seconds: float, platform_idle: bool = False
                     ) -> tuple[float, dict[str, tuple[float, float]]]:
    """GPUs provisioned in an interval, and per cost model its capacity cost and the part of it
    nobody held: idle, or with `platform_idle` (idle policy `platform`) the unused cost booked
    to the platform tags (the only policy that books unheld capacity there)."""
    gpus = sum(sums.get("provisioned", {}).values()) / seconds
    models: dict[str, list[float]] = {}
    for metric, column in (("capacity", 0), ("idle", 1), *((("unused", 1),) if platform_idle else ())):
        series = sums.get(metric, {})
        attribution = label_of_each(series, "attribution") if metric == "unused" else repeat("idle")
        for model, booked, value in zip(label_of_each(series, "cost_model"), attribution, series.values()):
            if booked == "idle":
                models.setdefault(model, [0.0, 0.0])[column] += value
    return gpus, {model: (c, i) for model, (c, i) in models.items()}


def label_of_each(series: Mapping[Attrs, float], key: str) -> Iterator[str]:
    """Each series' value of label `key` ("" where it has none), in the series' order; of sets
    named by their parts (the cost models' `Packed`), read from the parts, so that no set is
    built (at 100,000 GPUs, building them took half a second of each interval's close)."""
    named = named_sets(series)
    return named.label(key) if named is not None else (dict(attrs).get(key, "") for attrs in series)


def _clock(ns: int) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(ns / NS))


def _upgraded(document: dict) -> dict:
    """A checkpoint document in today's layout: the store's entry is required; the windows'
    closed time was the store's last interval end, and token counters had an entry of their own."""
    if "store" not in document:
        raise KeyError("store")
    out = dict(document)
    windows = dict(out.get("windows") or {})
    windows.setdefault("closed_ns", int(out["store"]["last_time_ns"]))
    out["windows"] = windows
    if isinstance(out.get("usage"), list):
        out["usage"] = {"cpu": out["usage"], "tokens": out.get("tokens", [])}
    return out


def _put_back(ahead: _Ahead) -> None:
    """Undo what computing `a` changed, last change first; its costs are forgotten."""
    if ahead.undo is not None:
        ahead.undo()
    ahead.costs, ahead.undo = None, None


class Pipeline:
    """`keep_ended`: ended series still count in `store.totals()` (run reports: the demo, tests)."""

    def __init__(self, config: Config, *, serve_receivers: bool = True, keep_ended: bool = False) -> None:
        self.config = config
        self.strings = Interner()  # the receivers' (Ingest.compact_strings), read by every stage
        self.metrics = SelfMetrics()
        self.telemetry, self.durability = IntervalTelemetry(self.metrics), DurabilityTelemetry(self.metrics)
        tags = self._stages(config, keep_ended)
        self.on_interval: list[Callable[[Interval], None]] = []
        directory = Path(config.checkpoint.directory) if config.checkpoint.directory else None
        self.checkpoint = (Checkpoint(directory, Identity(config.cluster.name, config.attribution.currency),
                                      self.metrics) if directory else None)
        # What the worker keeps from one interval to the next, in the order it restores.
        self.states = States([self.store, self.tag_values, self.facts, self.usage, self.devices, self.windows])
        if self.checkpoint is not None:
            self.facts.spill = self.checkpoint.spill  # a mark's facts wait in its directory (KsmFacts.mark)
        log_from = self._restore() if directory else None
        self.wal = Wal(directory / "wal", self.metrics) if directory else None
        self.deliveries = self._deliveries(directory)
        self.committer = Committer(self.deliveries, self.checkpoint, self.wal, self.metrics)
        self.ingest = self._ingest(config, tags)
        self._processed: Optional[Position] = None  # log position through which batches are processed
        self._ahead: Optional[_Ahead] = None  # the interval that closes next, computed ahead
        self._skipped_reported = 0
        self._points_logged = (0, 0, 0)  # received, rejected, late at the last interval's log line
        self._strings_kept = 0  # strings the last compaction kept
        for delivery in self.deliveries:
            delivery.recover(self.store.last_time_ns)  # committed snapshots again; uncommitted ones dropped
        if log_from is not None:
            self._replay(*log_from)
        self._serving(config, serve_receivers)
        self.ready = False
        self._stop = threading.Event()
        self._worker: Optional[threading.Thread] = None

    def _stages(self, config: Config, keep_ended: bool) -> TagResolver:
        """Enrich (facts, windows, usage, tag values, the Kubernetes API, device memory, the join),
        attribution (prices, cost models) and the cost store. Returns the tag rules."""
        attribution = config.attribution
        remembered_ns = max(FACT_TTL_INTERVALS * attribution.interval_seconds,
                            600) * NS  # facts and devices not reported
        self.facts = KsmFacts(self.strings, ttl_ns=remembered_ns)
        self.windows = Windows(attribution.interval_seconds, attribution.lateness_seconds,
                               max_gap_intervals=FACT_TTL_INTERVALS, fold_rows=attribution.fold_rows)
        self.models = CostModels(attribution, {name: rule.default for name, rule in config.tags.items()}, self.metrics,
                                 dropped=config.series.dropped)
        self.pricer = pricer = Pricer(attribution.prices)
        self.pricer_version = 0  # price files applied since start
        self.tenants = config.tenants if config.tenants.enabled else None
        self.usage = UsageTracker(self.strings, self.tenants.labels if self.tenants else (),
                                  self.tenants.reserved if self.tenants else frozenset())
        self.tag_values = TagValues(config.tag_values, self.metrics, release_after=FACT_TTL_INTERVALS)
        tags = TagResolver(config.tags, self.tag_values)
        self.kube: Optional[KubeSource] = None
        if config.kubernetes.enabled:  # the kubernetes client costs some 20 MiB: imported only when used
            from otelgpu.enrich.kube import source as kube_source

            self.kube = kube_source.KubeSource(config.kubernetes, tags, self.metrics)
        source: FactSource = MergedFacts(self.facts, self.kube) if self.kube else self.facts
        hardware = Hardware(pricer.catalog, MigProfiles.load(), attribution.mig_fraction_rule)
        self.devices = DeviceMemory(self.strings, remembered_ns)
        self.store = CostStore(attribution.currency, config.series.end_after_intervals, keep_ended=keep_ended)
        self.joiner = Joiner(self.strings, source, tags, hardware, self.devices,
                             pod_resources=self.models.needs_pods(),
                             cpu_only=(lambda info: pricer.prices_instance(info.instance_type, info.capacity_type,
                                                                           info.instance_id))
                             if attribution.scad.cpu_only_nodes else None, kept=self.store.kept)
        self.costs = IntervalCosts(self.joiner, self.pricer, self.models, self.strings, self.metrics, self.tenants)
        return tags

    def _ingest(self, config: Config, tags: TagResolver) -> Ingest:
        """The receivers' queue, its memory limit, and the label keys it keeps (those the tag rules,
        sharing and tenants read)."""
        wanted = wanted_keys(tags.pod_label_keys | tags.namespace_label_keys | tags.annotation_keys | NODE_LABELS
                             | sharing.ANNOTATION_KEYS | sharing.LABEL_KEYS
                             | set(self.tenants.labels if self.tenants else ()))
        self.memory = limiter_of(config.receiver.memory_limiter, config.receiver.retry_after_seconds)
        self.metrics.watch_memory(self.memory)
        return Ingest(self.strings, config.receiver.queue_size, config.receiver.retry_after_seconds,
                      self.metrics, Limits.of(config.receiver, wanted, config.sources, sharing.KEY_PREFIXES),
                      self.wal, self.memory)

    def _serving(self, config: Config, serve_receivers: bool) -> None:
        """/metrics (the cost series and otelgpu's own) and the OTLP receivers."""
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=True)
        collector = CostCollector(self.store, self.metrics, config.cluster.name, config.exporter.prometheus.cost_series)
        self.registry.register(collector)
        self.metrics_server = (TelemetryServer(config.exporter.prometheus, collector.exposition, lambda: self.ready,
                                               self_metrics=self.metrics)
                               if config.exporter.prometheus.enabled else None)
        receiver = config.receiver
        self.grpc = GrpcReceiver(receiver.grpc, self.ingest, self.metrics, self.memory) if serve_receivers else None
        self.http = (HttpReceiver(receiver.http, self.ingest, self.metrics,
                                  receiver.grpc.max_recv_msg_size_mib * 2**20, self.memory)
                     if serve_receivers and receiver.http.enabled else None)

    def _deliveries(self, directory: Optional[Path]) -> list[Delivery]:
        """One delivery queue per exporter, persisted under the checkpoint directory if there is one."""
        exporters, cluster, kube = self.config.exporter, self.config.cluster.name, self.config.kubernetes
        instance = kube.node_name if kube.enabled and kube.scope == "node" else ""  # one writer per node
        senders: list[tuple[Sender, DeliveryConfig]] = []
        if exporters.otlp:
            senders.append((OtlpSender(exporters.otlp, self.store.specs, self.metrics, cluster, instance),
                            exporters.otlp.delivery))
        if exporters.remote_write:
            # imported here: botocore loads only when remote write is configured
            from otelgpu.exporter.remote_write import RemoteWriteSender

            sender = RemoteWriteSender(exporters.remote_write, self.store.specs, cluster, self.metrics)
            senders.append((sender, exporters.remote_write.delivery))
        return [Delivery(sender, cfg, self.metrics, interval_s=self.config.attribution.interval_seconds,
                         directory=directory / "exports" / sender.name if directory else None)
                for sender, cfg in senders]

    def _restore(self) -> Optional[tuple[Position, Position]]:
        """Continue from the last checkpoint. Returns where to replay the write-ahead log from and
        through where the checkpoint already holds its effects; None when the checkpoint was set
        aside, and then the log is set aside with it (its records belong to that state)."""
        assert self.checkpoint is not None
        existed = self.checkpoint.exists()
        state = self.checkpoint.load()
        if state is None:
            if existed:
                self._set_log_aside()
            return (0, 0), (0, 0)  # no checkpoint yet: the whole log, if a run died before its first
        try:
            self._restore_state(state)
            wal = state.get("wal") or {}
            replay_from = tuple(int(x) for x in wal.get("replay_from", (0, 0)))
            processed = tuple(int(x) for x in wal.get("processed", (0, 0)))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            self.states.restore({})  # each part afresh
            self.checkpoint.reject(CheckpointError.CORRUPT, f"its content does not restore: {exc!r}")
            self._set_log_aside()
            return None
        log.info("continuing %d cost series from %s (last interval ended %s UTC)", self.store.active_series(),
                 self.checkpoint.path, time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.store.last_time_ns / NS)))
        return replay_from, processed  # type: ignore[return-value]

    def _set_log_aside(self) -> None:
        assert self.checkpoint is not None
        logdir = self.checkpoint.directory / "wal"
        if logdir.exists():
            aside = logdir.with_name(f"wal.rejected-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
            logdir.rename(aside)
            log.error("write-ahead log %s set aside with the checkpoint, moved to %s", logdir, aside)

    def _restore_state(self, state: dict) -> None:
        self.states.restore(_upgraded(state))
        self.metrics.watermark.set(self.windows.watermark_ns / NS)
        for gauge in (self.metrics.interval_closed, self.metrics.interval_checkpointed):
            gauge.set(self.store.last_time_ns / NS)  # the checkpoint's last interval

    def _replay(self, start: Position, processed: Position) -> None:
        assert self.wal is not None
        records = points = 0
        for first, end, payload in self.wal.replay(start):
            try:
                batch = decode_batch(payload, self.strings)
            except RecordError as exc:
                self.durability.wal_corrupt(WalCorruption.RECORD)
                log.error("write-ahead log record at %s not replayed: %s", first, exc)
                continue
            batch.wal = (first, end)
            self.process(batch, replayed=end <= processed)
            records, points = records + 1, points + len(batch)
        if records:
            self.durability.wal_records_replayed.inc(records)
            log.info("replayed %d write-ahead log records (%d points) from %s", records, points, start)

    def _checkpoint_state(self) -> dict:
        return {**self.states.state(),
                "wal": {"replay_from": list(self._replay_from()), "processed": list(self._processed or (0, 0))}}

    def _replay_from(self) -> Position:
        first = self.windows.replay_from()
        if first is not None:
            return first
        return self._processed if self._processed is not None else (self.wal.position if self.wal else (0, 0))

    def start_sources(self) -> None:
        """Start the Kubernetes API watches; waits a little for their first lists so the first
        intervals have the API's facts (kube-state-metrics facts serve meanwhile)."""
        if self.kube:
            self.kube.start()
            wait = self.config.kubernetes.initial_sync_timeout_seconds
            if not self.kube.wait_synced(wait):
                log.warning("Kubernetes API not listed after %.0f s; attributing with what is known and "
                            "retrying in the background", wait)

    def start(self) -> None:
        kernels = warm_up(self.config)  # the first request and the first export must never wait for the JIT
        log.info("kernels ready: %s", ", ".join(f"{name} {how}" for name, how in kernels.items()))
        if jit.mode() == "compiled":
            released = page_out("libllvmlite")  # LLVM's code: loading the kernels was its last use
            log.debug("%.0f MiB of LLVM's resident pages handed back", released / 2**20)
        released = page_out_files()  # what starting ran of every library, before sources and receivers start
        log.debug("%.0f MiB of the libraries' resident pages handed back", released / 2**20)
        self.start_sources()
        if self.metrics_server:
            self.metrics_server.start()
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
                self.telemetry.batch_failed(len(batch))
            finally:
                self.ingest.task_done()
            if not self.ingest.depth and self.config.attribution.compute_ahead and not self._stop.is_set():
                self.compute_ahead()  # nothing waiting: the next close's work, while its data is all in

    def process(self, batch: PointBatch, replayed: bool = False) -> None:
        """Apply one decoded batch and close every interval it makes due. `replayed`: a log
        record whose effects the checkpoint already holds, for the intervals it closed."""
        samples = dcgm_samples(batch, self.strings)
        # Pods' phases always (how long a GPU grant's or claim's pod ran); their use for scad; tokens.
        pods = self.usage.pod_samples(batch, use=self.models.needs_pods(), tokens=self.tenants is not None, phases=True)
        facts = batch.select(fact_rows(batch))
        late, late_facts = self.windows.add(samples, batch, pods, facts)
        self.metrics.watermark.set(self.windows.watermark_ns / NS)
        if len(late_facts):
            self._drop_ahead(AheadOutcome.REDONE)  # it changed the facts these apply to: put them back first
            self.facts.update(late_facts)  # newer than what any later interval starts from
        if late and not replayed:
            self.metrics.points_late.inc(late)
        if batch.wal is not None:
            self._processed = batch.wal[1]
        self.close_due()
        if len(self.strings) >= max(COMPACT_STRINGS_FROM, 2 * self._strings_kept):
            self.compact_strings()

    def compact_strings(self) -> None:
        """Forget the strings of pods, label values and nodes that are gone: keep only what the
        queued batches and the open intervals still refer to. Runs in the one thread that
        processes batches, between two of them; receivers wait meanwhile to queue theirs."""
        before = len(self.strings)
        self._strings_kept = self.ingest.compact_strings([self.windows])
        self.metrics.interner_compactions.inc()
        log.info("string table compacted: %d strings kept of %d", self._strings_kept, before)

    def close_due(self, flush: bool = False) -> int:
        ahead = self._ahead_for(self.windows.due_indices(flush)) if self._ahead_pending() else None
        closed = self.windows.due(flush=flush, computed=frozenset([ahead[0]]) if ahead else frozenset())
        # The costs computed ahead, by interval: let go as their interval is recorded, not held
        # through the staging and the checkpoint that follow (at 100,000 GPUs, 2 million series).
        computed = dict([ahead]) if ahead else {}
        del ahead
        if self.windows.skipped > self._skipped_reported:
            skipped = self.windows.skipped - self._skipped_reported
            self._skipped_reported = self.windows.skipped
            self.metrics.intervals_skipped.inc(skipped)
            log.warning("no data for %d intervals in a row: those intervals are not computed (facts that old "
                        "would only guess their costs)", skipped)
        if not closed:
            return 0
        n_closed = len(closed)
        with collector_paused():
            # Each interval is let go once recorded, before its snapshot is staged: several close at
            # once at a stop, each computed at its close, and its samples and facts would otherwise
            # be held through the next one's computation and the checkpoint.
            while closed:
                interval = closed.pop(0)
                with self.telemetry.timed(WorkStep.CLOSE):
                    end_ns, snapshot = interval.end_ns, self._close(interval, computed.pop(interval.index, None))
                    del interval
                    self.committer.add(end_ns, snapshot)
                    del snapshot
                    self.metrics.interval_closed.set(end_ns / NS)
                if closed:
                    give_back()  # what this one built and dropped, before the next is computed
            with self.telemetry.timed(WorkStep.COMMIT):
                self.committer.commit(self._checkpoint_state, self._replay_from())
        give_back()  # what the close built and dropped
        return n_closed

    def _compute(self, interval: Interval) -> Costs:
        self.facts.update(interval.fact_rows)  # the kube-state-metrics rows stamped in this interval, a piece at a time
        use, tokens = self.usage.use_and_tokens(interval.pods, interval.start_ns, interval.end_ns)
        return self.costs.compute(interval, use, tokens)

    def compute_ahead(self) -> bool:
        """Compute the interval that closes next now if it is complete (`Windows.next_complete`),
        so that its close has only its cost series, checkpoint and export left to do. Everything
        the computation changes (facts, device memory, counters' last points, tag values, its
        self-metrics) can be put back: if anything it read changes before the close (a straggler's
        or a resent sample, late facts, a price file, the Kubernetes API's facts as of the
        interval's end), the close puts it all back and computes the interval again, exactly as if
        it had never been computed ahead. Returns whether it computed."""
        index = self.windows.next_complete()
        if index is None or (self._ahead is not None and self._ahead.index == index):
            return False  # once per interval: one that was redone closes the plain way
        self._drop_ahead()
        interval = self.windows.peek(index)
        undo = self.states.mark()
        api = self.kube.view(interval.end_ns) if self.kube else None
        with self.telemetry.timed(WorkStep.AHEAD):  # used or not: CPU spent
            with self.metrics.held() as counts, collector_paused():
                try:
                    costs: Optional[Costs] = self._compute(interval).packed()  # held until the close
                    costs.plan = self.store.plan(costs.sums)  # no other interval is recorded before its close
                    if self.checkpoint is not None:
                        self.facts.encode_ahead()  # the close's checkpoint, in a file (facts.spill)
                except Exception:  # noqa: BLE001 - the close computes it again and reports what fails
                    log.debug("interval ending %d not computed ahead", interval.end_ns, exc_info=True)
                    costs = None
            give_back()  # what the computation built and dropped: held no longer than the close's
        if self.kube and self.kube.view(interval.end_ns) != api:
            costs = None  # the API's facts moved while it computed: which ones it read is not known
        self._ahead = _Ahead(interval.index, interval.end_ns, interval.version, self.facts.version,
                             self.pricer_version, api, costs, counts, undo)
        if costs is None:
            _put_back(self._ahead)
            self.telemetry.ahead(AheadOutcome.FAILED)
        return costs is not None

    def _ahead_pending(self) -> bool:
        return self._ahead is not None and self._ahead.costs is not None

    def _ahead_for(self, closing: list[int]) -> Optional[tuple[int, Costs]]:
        """(index, costs) of the interval computed ahead if it is the first of `closing` and
        nothing it was computed from changed: it then closes bare (its parts never built). If it
        is not the first (an earlier interval opened late, before the first close) or something
        changed, everything its computation changed is put back first."""
        ahead = self._ahead
        if ahead is None or ahead.costs is None or not closing:
            return None
        self._reload_prices()  # the close's price read; the closes that follow find no change
        same = (closing[0] == ahead.index and ahead.version == self.windows.version_of(ahead.index)
                and ahead.facts_version == self.facts.version and ahead.prices == self.pricer_version
                and (self.kube is None or self.kube.view(ahead.end_ns) == ahead.api))
        if not same:
            self._drop_ahead(AheadOutcome.REDONE)
            return None
        self.metrics.apply(ahead.counts)
        self.telemetry.ahead(AheadOutcome.USED)
        costs, ahead.costs, ahead.undo = ahead.costs, None, None
        return ahead.index, costs

    def _drop_ahead(self, outcome: Optional[AheadOutcome] = None) -> None:
        """Put back what a computation ahead changed, forget its costs and its counts, and count
        the `outcome` if there was one to drop."""
        if self._ahead_pending():
            _put_back(self._ahead)
            if outcome:
                self.telemetry.ahead(outcome)

    def _close(self, interval: Interval, costs: Optional[Costs] = None) -> Points:
        """`costs`: the interval's, computed ahead (it closed bare)."""
        self._reload_prices()  # at each close, computed ahead or not: prices as of the close
        if costs is None:
            costs = self._compute(interval)
        snapshot = self.store.record(interval.start_ns, interval.end_ns, costs.sums, costs.gauges, costs.plan)
        self._count(snapshot)
        self._log_interval(interval, costs, snapshot)
        self.metrics.unpriced_gpu_seconds.inc(costs.unpriced_gpus * interval.seconds)
        self.metrics.gpu_seconds_without_device_data.inc(costs.gpus_without_device_data * interval.seconds)
        for reason, pods in costs.fraction_problems.items():
            self.telemetry.fractions_unheld(reason, pods)
        self.metrics.intervals_computed.inc()
        self.states.expire(interval.end_ns)
        for callback in self.on_interval:
            callback(interval)
        return snapshot

    def _log_interval(self, interval: Interval, costs: Costs, snapshot: Points) -> None:
        """One line per closed interval: GPUs, each model's capacity cost and idle share, and the
        points received, rejected and late since the last line."""
        metrics = self.metrics
        counted = (metrics.points_received, metrics.points_rejected, metrics.points_late)
        points = tuple(int(telemetry.total(c)) for c in counted)
        received, rejected, late = (a - b for a, b in zip(points, self._points_logged))
        self._points_logged = points
        gpus, models = interval_summary(costs.sums, interval.seconds,
                                        self.config.attribution.idle.policy == "platform")
        cost = "; ".join(f"{model} {capacity:,.2f} {self.config.attribution.currency}, idle {idle / capacity:.0%}"
                         if capacity else f"{model} 0 (unpriced)" for model, (capacity, idle) in models.items())
        log.info("interval %s-%s UTC: %s GPUs; %s; points %s received, %s rejected, %s late; %s series",
                 _clock(interval.start_ns), _clock(interval.end_ns), f"{gpus:,.0f}", cost or "no capacity",
                 f"{received:,}", f"{rejected:,}", f"{late:,}", f"{len(snapshot) - int(snapshot.ended.sum()):,}")

    def _reload_prices(self) -> None:
        try:
            if self.pricer.reload_if_changed():
                self.pricer_version += 1
                log.info("prices reloaded from %s", self.pricer.base.file)
                self.metrics.price_reloads.inc()
        except ConfigError as exc:
            log.error("price file not applied, previous prices stay in force: %s", exc)
            self.metrics.price_reload_failures.inc()

    def _count(self, snapshot: Points) -> None:
        ended = int(snapshot.ended.sum())
        if ended:
            self.metrics.series_ended.inc(ended)
        self.metrics.series_active.set(len(snapshot) - ended)

    def drain(self) -> None:
        """Wait until every batch queued so far has been processed."""
        self.ingest.join()

    def _join_worker(self) -> None:
        """Wait for the worker to stop. Its step in progress (a close, or computing an interval
        ahead: tens of seconds at 100,000 GPUs) changes the state that closing the open intervals
        changes, so they are closed only once it has stopped, however long that takes."""
        waited = 0.0
        while self._worker is not None:
            self._worker.join(timeout=WORKER_NOTICE_S)
            if not self._worker.is_alive():
                return
            waited += WORKER_NOTICE_S
            log.warning("shutting down: the open intervals close once the step in progress ends (%.0f s so far)",
                        waited)

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
            self._stop.set()  # the worker processes what is queued, computes nothing ahead, and stops
            self._join_worker()
        closed = self.close_due(flush=True)
        ahead = self.windows.ahead()
        if ahead:
            kept = "kept in the write-ahead log for the next start" if self.wal else "counted as late"
            log.warning("shutting down: %d points of intervals only targets ahead of the cluster reached: %s",
                        ahead, kept)
            if not self.wal:
                self.metrics.points_late.inc(ahead)
        log.info("shutting down: queue drained, %d intervals closed and exported after %.1f s", closed,
                 time.monotonic() - began)
        for delivery in self.deliveries:  # all drain side by side, each to its own deadline
            delivery.finish_by(time.monotonic() + delivery.config.shutdown_timeout_seconds)
        if self.deliveries:
            left = sum(delivery.close() for delivery in self.deliveries)
            kept = "kept on disk for the next start" if self.checkpoint else "gave up"
            log.info("shutting down: exports %s after %.1f s", f"{kept}: {left} snapshot(s)" if left else "delivered",
                     time.monotonic() - began)
        if self.wal:
            self.wal.close()
        if self.checkpoint:
            self.checkpoint.close()
        if self.kube:
            self.kube.shutdown()
        if self.metrics_server:
            self.metrics_server.shutdown()
        log.info("stopped after %.1f s", time.monotonic() - began)
