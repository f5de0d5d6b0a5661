"""The sidecar's own telemetry: typed prometheus_client metrics on a registry of their own, served
on /metrics beside the cost series. Thread-safe.

Names follow the Collector's own telemetry: `otelgpu_` where the Collector has `otelcol_`, the
component kind next (`receiver_`, `exporter_`), what is counted and the unit last; the component
and the transport are labels (`receiver="otlp", transport="grpc"`, `exporter="remote_write"`). The
Collector's pairs are all here: points accepted and refused by the receiver, points sent and failed
by each exporter, each exporter's queue size against its capacity, the process's CPU, memory and
start time, and `target_info` naming the service. The `otelgpu_*` series beside them say what no
Collector component can: why points were rejected, what became of each interval, how far in data
time each stage has come (watermark, closed, checkpointed, delivered), what the Kubernetes API, the
write-ahead log and the checkpoint did.

Work computed ahead of its time may be thrown away: `held()` keeps what this thread counts in it
aside until the work is kept (`apply`), so counters never count work twice."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter as Tally
from contextlib import contextmanager
from enum import StrEnum
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Protocol, Union

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, ProcessCollector
from prometheus_client.metrics import disable_created_metrics

import otelgpu
from otelgpu.errors import Refusal
from otelgpu.heap import heap_bytes

if TYPE_CHECKING:
    from otelgpu.memory import MemoryLimiter

# Counters' `_created` series double the series count and no Collector exposes them.
disable_created_metrics()

_holding = threading.local()
Key = Union[str, tuple[str, ...]]


class HeldCounter(Counter):
    """A Counter whose increments a thread inside `SelfMetrics.held()` keeps aside instead of adding."""

    def inc(self, amount: float = 1, exemplar: Optional[dict[str, str]] = None) -> None:
        pending = getattr(_holding, "pending", None)
        if pending is None:
            super().inc(amount, exemplar)
        else:
            pending.append((self, amount))


class SelfMetrics:
    """Every counter and gauge the sidecar keeps about itself, on `self.registry`."""

    def __init__(self, instance: Optional[str] = None) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)

        ProcessCollector(namespace="otelgpu", registry=registry)  # CPU seconds, resident memory, start time
        Info("target", "The service exposing these series", registry=registry).info({
            "service_name": "otelgpu", "service_version": otelgpu.__version__,
            "service_instance_id": instance or socket.gethostname()})
        self._heap()
        self._receivers()
        self._points()
        self._progress()
        self._intervals()
        self._exporters()
        self._durability()
        self._kube()

    def _counter(self, name: str, doc: str, *labels: str) -> HeldCounter:
        return HeldCounter(name, doc, labels, namespace="otelgpu", registry=self.registry)

    def _gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        return Gauge(name, doc, labels, namespace="otelgpu", registry=self.registry)

    def _heap(self) -> None:
        """What malloc's heaps hold (otelgpu/heap.py `heap_bytes`), read at each scrape: beside
        the resident size, whether it is the state (in use) or memory freed and kept (free)."""
        if heap_bytes() is None:
            return
        heap = self._gauge("process_heap_bytes", "Bytes of malloc's heaps in use by allocations (in_use) and freed "
                           "but kept by the allocator (free), by state", "state")
        heap.labels(state="in_use").set_function(lambda: heap_bytes()[0])
        heap.labels(state="free").set_function(lambda: heap_bytes()[1])

    def _receivers(self) -> None:
        """The receivers, in the Collector's terms."""
        self.receiver_accepted_points = self._counter(
            "receiver_accepted_metric_points", "Data points the receiver took into the pipeline (consumed, "
            "ignored or later found late), by receiver and transport", "receiver", "transport")
        self.receiver_refused_points = self._counter(
            "receiver_refused_metric_points", "Data points the receiver refused in a partial success (the reasons "
            "are in otelgpu_points_rejected_total), by receiver and transport; requests refused whole are "
            "counted by otelgpu_requests_total", "receiver", "transport")
        self.requests = self._counter("requests", "Export requests received, by transport and outcome",
                                "transport", "outcome")
        self.receiver_connections_refused = self._counter(
            "receiver_connections_refused", "Connections (HTTP) or Exports (gRPC) the receivers refused or cut off, "
            "by transport and reason (connection_limit, idle_evicted, idle_timeout, read_timeout, write_timeout, "
            "concurrent_requests)", "transport", "reason")
        self.receiver_memory_limit = self._gauge(
            "receiver_memory_limit_bytes", "The receivers' memory limits: resident size at which new requests are "
            "refused (soft) and garbage is collected too (hard); bytes requests in flight may reserve (inflight)",
            "limit")
        self.receiver_inflight = self._gauge(
            "receiver_inflight_bytes", "Bytes reserved by requests in flight: received, being decoded, or decoded "
            "and queued")
        self.tls_reload_errors = self._counter(
            "tls_reload_errors", "Changed certificate files a server could not use (the certificate loaded "
            "before is kept), by server", "server")

    def _points(self) -> None:
        """What became of the points."""
        self.points_received = self._counter("points_received", "Data points of consumed metrics accepted")
        self.points_ignored = self._counter("points_ignored", "Data points of metrics otelgpu does not consume")
        self.points_late = self._counter("points_late", "Accepted points whose interval had already closed")
        self.points_rejected = self._counter(
            "points_rejected", "Data points rejected, by metric (\"\" where not one metric's) and reason (a short "
            "code: receiver/rejection.py)", "metric", "reason")
        self.requests_decoded_by_reference = self._counter(
            "requests_decoded_by_reference",
            "Requests decoded by protobuf instead of the columnar decoder: malformed, or written unusually")

    def _progress(self) -> None:
        """How far the money has come, in data time (unix seconds): each stage's lag behind the last."""
        self.watermark = self._gauge(
            "watermark_timestamp_seconds", "Data time the scrape targets have reached (the median of their newest "
            "timestamps): an interval closes once it passes the interval's end plus the lateness")
        self.interval_closed = self._gauge(
            "interval_closed_timestamp_seconds", "End of the newest interval closed (computed, its snapshot handed "
            "to the exporters)")
        self.interval_checkpointed = self._gauge(
            "interval_checkpointed_timestamp_seconds", "End of the newest interval in the checkpoint (0 without "
            "checkpoint.directory)")
        self.exporter_delivered = self._gauge(
            "exporter_delivered_timestamp_seconds", "Data time through which an exporter has delivered every "
            "interval: the start of the oldest snapshot waiting in its queue, else the end of the newest interval "
            "closed, by exporter", "exporter")

    def _intervals(self) -> None:
        """Intervals and their costs."""
        self.intervals_computed = self._counter("intervals_computed", "Attribution intervals computed")
        self.intervals_skipped = self._counter(
            "intervals_skipped", "Intervals not computed because no data came for longer than the facts are kept")
        self.intervals_ahead = self._counter(
            "intervals_ahead", "Intervals computed ahead of their close, once every scrape target had sent data "
            "past their end, by outcome: used at the close; redone (late data, facts, prices or Kubernetes API "
            "facts changed before the close); failed (computed at the close instead)", "outcome")
        self.interval_errors = self._counter(
            "interval_errors", "Intervals (whole) and nodes (node) whose computation failed and fell back "
            "(see the log)", "scope")
        self.work_seconds = self._counter(
            "work_seconds", "Wall seconds spent taking intervals out, by step: ahead (computed before the close, "
            "used or not), close (facts, join, attribution, cost series), commit (staging and checkpoint), "
            "send:<exporter> (delivery attempts)", "step")
        self.unpriced_gpu_seconds = self._counter("unpriced_gpu_seconds", "GPU-seconds for which no price was found")
        self.gpu_seconds_without_device_data = self._counter(
            "gpu_seconds_without_device_data",
            "GPU-seconds of nodes known only from kube-state-metrics (no DCGM series in the interval)")
        self.gpu_fractions_unheld = self._counter(
            "gpu_fractions_unheld", "Pod-intervals of pods that HAMi or KAI Scheduler granted part of a GPU, or that "
            "reserve one, whose grant could not be placed on a GPU (they hold nothing for it), by reason", "reason")
        self.gpu_seconds_lost = self._counter(
            "gpu_seconds_lost", "GPU-seconds of nodes whose costs could not be computed at all (see the log)")
        self.scad_request_fallbacks = self._counter(
            "scad_request_fallbacks",
            "Pod-intervals scad charged on requests because no usage was scraped, by resource", "resource")
        self.tag_values_capped = self._counter(
            "tag_values_capped", "Tag values cut to max_length (reason=length) or replaced by the overflow value "
            "(reason=distinct), by tag", "tag", "reason")
        self.price_reloads = self._counter("price_reloads", "Price file changes applied")
        self.price_reload_failures = self._counter(
            "price_reload_failures", "Price file changes refused (the previous prices stay in force)")
        self.series_ended = self._counter("series_ended", "Cost series ended with a NO_RECORDED_VALUE point (holder gone)")
        self.series_active = self._gauge("series_active", "Live cost series in the store")
        self.interner_compactions = self._counter(
            "interner_compactions", "String table compactions: label strings of pods, values and nodes gone released")

    def _exporters(self) -> None:
        """The exporters, in the Collector's terms, then in their own."""
        self.exporter_sent_points = self._counter(
            "exporter_sent_metric_points", "Cost points delivered, by exporter", "exporter")
        self.exporter_send_failed_points = self._counter(
            "exporter_send_failed_metric_points", "Cost points of failed delivery attempts (retried unless "
            "otelgpu_export_snapshots_dropped_total says otherwise), by exporter", "exporter")
        self.exporter_queue_size = self._gauge(
            "exporter_queue_size", "Snapshots waiting to be delivered, by exporter", "exporter")
        self.exporter_queue_capacity = self._gauge(
            "exporter_queue_capacity", "Snapshots an exporter's queue holds before it merges the oldest",
            "exporter")
        self.exports = self._counter("exports", "Cost snapshots delivered, by exporter", "exporter")
        self.export_failures = self._counter(
            "export_failures", "Failed delivery attempts, by exporter and reason", "exporter", "reason")
        self.export_snapshots_dropped = self._counter(
            "export_snapshots_dropped", "Snapshots given up (left at the shutdown deadline with no directory to "
            "keep them, or persisted and then unreadable)",
            "exporter", "reason")
        self.export_points_undeliverable = self._counter(
            "export_points_undeliverable", "Points of the snapshots given up", "exporter", "reason")
        self.export_points_rejected = self._counter(
            "export_points_rejected", "Points the receiver refused in a partial success", "exporter")
        self.export_series_rejected = self._counter(
            "export_series_rejected", "Series an exporter left out (e.g. over 70 labels)", "exporter", "reason")
        self.export_snapshots_carried = self._counter(
            "export_snapshots_carried", "Snapshots refused for good (a backend's window for old samples, say) whose "
            "series' last values and end markers went into the next snapshot, stamped at its time", "exporter")
        self.export_snapshots_merged = self._counter(
            "export_snapshots_merged", "Snapshots merged because the export queue was full (resolution lost, "
            "no cost)", "exporter")
        self.export_snapshots_recovered = self._counter(
            "export_snapshots_recovered", "Undelivered snapshots found in the export queue's directory at start "
            "and queued again", "exporter")
        self.export_snapshots_persisted = self._counter(
            "export_snapshots_persisted", "Snapshots not delivered by the shutdown deadline, left on disk for the "
            "next start", "exporter")
        self.export_outbox_errors = self._counter(
            "export_outbox_errors", "Persisted export queue problems, by exporter and reason (corrupt, "
            "incompatible: a snapshot file set aside at start; corrupt_progress; attribute_log_cut; write; "
            "delete; read)", "exporter", "reason")

    def _durability(self) -> None:
        """Durability."""
        self.checkpoints_written = self._counter("checkpoints_written", "Checkpoints written")
        self.checkpoint_errors = self._counter(
            "checkpoint_errors", "Checkpoints that could not be written or read, by reason", "reason")
        self.wal_fsyncs = self._counter("wal_fsyncs", "Write-ahead log group commits (one fsync each)")
        self.wal_records_replayed = self._counter("wal_records_replayed", "Write-ahead log records replayed at start")
        self.wal_segments_removed = self._counter(
            "wal_segments_removed", "Write-ahead log segments removed once a checkpoint covered them")
        self.wal_errors = self._counter(
            "wal_errors", "Write-ahead log writes that failed (requests answered 'retry later'), by error", "error")
        self.wal_corruptions = self._counter(
            "wal_corruptions", "Torn or corrupt write-ahead log records found at replay, by where (tail: the "
            "crash's last write)", "where")

    def _kube(self) -> None:
        """The Kubernetes API."""
        self.kube_events = self._counter(
            "kube_watch_events", "Kubernetes API watch events applied, by resource and type", "resource", "type")
        self.kube_lists = self._counter(
            "kube_lists", "Kubernetes API full lists, by resource and why (initial; gone: the watch was too far "
            "behind, 410)", "resource", "reason")
        self.kube_errors = self._counter(
            "kube_errors", "Kubernetes API errors, by resource, verb and reason (forbidden, unauthorized, "
            "not_found, connection, timeout, server_error, invalid)", "resource", "verb", "reason")
        self.kube_objects = self._gauge("kube_objects", "Kubernetes objects held from the API, by resource", "resource")
        self.kube_synced = self._gauge(
            "kube_synced", "1 once the resource is listed and watched, 0 while it is not", "resource")

    def watch_memory(self, memory: "MemoryLimiter") -> None:
        """Publish a memory limiter's limits and the bytes it has reserved."""
        from otelgpu.memory import NO_BUDGET

        for limit, value in (("soft", memory.soft_bytes), ("hard", memory.hard_bytes),
                             ("inflight", memory.max_inflight_bytes)):
            if value is not None and value < NO_BUDGET:
                self.receiver_memory_limit.labels(limit).set(value)
        self.receiver_inflight.set_function(lambda: memory.inflight)

    def tls_reload_failed(self, server: str) -> Callable[[], None]:
        """What `server` calls when a changed certificate could not be used."""
        return self.tls_reload_errors.labels(server).inc

    @contextmanager
    def held(self) -> Iterator[list[tuple[HeldCounter, float]]]:
        """What this thread counts in the block is kept in the list yielded instead of counted:
        `apply` it once the work it describes is kept, or drop it. Other threads count as usual."""
        pending: list[tuple[HeldCounter, float]] = []
        _holding.pending = pending
        try:
            yield pending
        finally:
            _holding.pending = None

    @staticmethod
    def apply(pending: list[tuple[HeldCounter, float]]) -> None:
        for counter, amount in pending:
            counter.inc(amount)


class RequestOutcome(StrEnum):
    """How an export request was answered: `requests{outcome}`."""

    OK = "ok"
    PARTIAL = "partial"  # taken, some points refused (partial_success)
    INVALID = "invalid"  # never again: malformed, too large (400, 413, 431, 501, 408; INVALID_ARGUMENT)
    UNAVAILABLE = "unavailable"  # retry later (503; UNAVAILABLE)
    UNAUTHENTICATED = "unauthenticated"  # no valid bearer token (401; UNAUTHENTICATED)
    ERROR = "error"  # unexpected (500; INTERNAL)


class ReceiverTelemetry:
    """One OTLP receiver transport's self-metrics (`receiver="otlp"`, `transport`), bound once."""

    def __init__(self, metrics: SelfMetrics, transport: str) -> None:
        self.transport = transport
        self.accepted_points = metrics.receiver_accepted_points.labels("otlp", transport)
        self.refused_points = metrics.receiver_refused_points.labels("otlp", transport)
        self._requests = {o: metrics.requests.labels(transport, o.value) for o in RequestOutcome}
        # A malformed or unauthenticated request is counted by its outcome (invalid, unauthenticated).
        self._refused = {r: metrics.receiver_connections_refused.labels(transport, r.value) for r in Refusal
                         if r not in (Refusal.MALFORMED, Refusal.UNAUTHENTICATED)}

    def request(self, outcome: RequestOutcome) -> None:
        self._requests[RequestOutcome(outcome)].inc()

    def refused(self, reason: Refusal) -> None:
        """A request refused "retry later", or a connection cut, by reason."""
        self._refused[Refusal(reason)].inc()


class IntervalScope(StrEnum):
    """What a failed computation fell back from: `interval_errors{scope}`."""

    WHOLE = "whole"  # the interval at once: computed node by node instead
    TENANTS = "tenants"  # its token series: its costs are kept
    NODE = "node"  # one node alone: its GPUs closed as nobody's


class AheadOutcome(StrEnum):
    """What became of an interval computed ahead: `intervals_ahead{outcome}`."""

    USED = "used"
    REDONE = "redone"  # something it read changed before the close
    FAILED = "failed"  # computed at the close instead


class WorkStep(StrEnum):
    """The steps whose wall seconds `work_seconds{step}` counts (send:<exporter> is each exporter's)."""

    AHEAD = "ahead"
    CLOSE = "close"
    COMMIT = "commit"


class IntervalTelemetry:
    """The self-metrics of computing and closing intervals, bound once."""

    def __init__(self, metrics: SelfMetrics) -> None:
        self._errors = {s: metrics.interval_errors.labels(s.value) for s in IntervalScope}
        self._ahead = {o: metrics.intervals_ahead.labels(o.value) for o in AheadOutcome}
        self._seconds = {s: metrics.work_seconds.labels(s.value) for s in WorkStep}
        self._fallbacks = {r: metrics.scad_request_fallbacks.labels(r) for r in ("cpu", "memory")}
        self._unheld = metrics.gpu_fractions_unheld
        self._rejected = metrics.points_rejected

    def failed(self, scope: IntervalScope) -> None:
        self._errors[IntervalScope(scope)].inc()

    def ahead(self, outcome: AheadOutcome) -> None:
        self._ahead[AheadOutcome(outcome)].inc()

    @contextmanager
    def timed(self, step: WorkStep) -> Iterator[None]:
        """The block's wall seconds, counted under `step` however it is left."""
        began = time.monotonic()
        try:
            yield
        finally:
            self._seconds[WorkStep(step)].inc(time.monotonic() - began)

    def request_fallbacks(self, resource: str, pod_intervals: int = 1) -> None:
        """scad charged `resource` (cpu, memory) on requests: no usage was scraped."""
        self._fallbacks[resource].inc(pod_intervals)

    def fractions_unheld(self, reason: str, pods: int) -> None:
        """Grants of part of a GPU that could not be placed, by the join's short reason."""
        self._unheld.labels(reason).inc(pods)

    def batch_failed(self, points: int) -> None:
        """A batch whose processing failed: its points rejected as `internal_error`."""
        self._rejected.labels("", "internal_error").inc(points)


class CheckpointError(StrEnum):
    """Why a checkpoint was not written or not used: `checkpoint_errors{reason}`."""

    CORRUPT = "corrupt"  # set aside at start: unreadable, or its content did not restore
    INCOMPATIBLE = "incompatible"  # set aside at start: a format this version cannot read
    WRITE = "write"  # not written: the directory refused it
    STAGE = "stage"  # held back: an exporter's snapshots could not be written first


class WalCorruption(StrEnum):
    """Where replay found a torn or corrupt write-ahead log record: `wal_corruptions{where}`."""

    TAIL = "tail"  # the crash's last write
    SEGMENT = "segment"  # an older segment: the rest of it is unreadable
    RECORD = "record"  # a whole record whose content does not decode


class DurabilityTelemetry:
    """The write-ahead log's and the checkpoint's self-metrics, bound once."""

    def __init__(self, metrics: SelfMetrics) -> None:
        self.checkpoints_written = metrics.checkpoints_written
        self.wal_fsyncs = metrics.wal_fsyncs
        self.wal_records_replayed = metrics.wal_records_replayed
        self.wal_segments_removed = metrics.wal_segments_removed
        self._checkpoint_errors = {r: metrics.checkpoint_errors.labels(r.value) for r in CheckpointError}
        self._corruptions = {w: metrics.wal_corruptions.labels(w.value) for w in WalCorruption}
        self._wal_errors = metrics.wal_errors

    def checkpoint_failed(self, reason: CheckpointError) -> None:
        self._checkpoint_errors[CheckpointError(reason)].inc()

    def wal_corrupt(self, where: WalCorruption) -> None:
        self._corruptions[WalCorruption(where)].inc()

    def wal_failed(self, exc: OSError) -> None:
        """A write the log could not make, by the error's type (`OSError`, `PermissionError`, ...)."""
        self._wal_errors.labels(type(exc).__name__).inc()


class KubeVerb(StrEnum):
    LIST = "list"
    WATCH = "watch"
    GET = "get"


class KubeReason(StrEnum):
    """Why a Kubernetes API call failed: `kube_errors{reason}`."""

    UNAUTHORIZED = "unauthorized"  # 401
    FORBIDDEN = "forbidden"  # 403: the role lacks the verb
    NOT_FOUND = "not_found"  # 404: not served (DRA before 1.34), or gone
    GONE = "gone"  # 410: history compacted past the watch's version: relist
    THROTTLED = "throttled"  # 429
    SERVER_ERROR = "server_error"  # 5xx
    INVALID = "invalid"  # another status, or a body that does not parse
    TIMEOUT = "timeout"  # read timeout: a stream silent past the server's own timeout
    CONNECTION = "connection"


class ListReason(StrEnum):
    """Why a resource was listed whole: `kube_lists{reason}`."""

    INITIAL = "initial"
    GONE = "gone"  # the watch was too far behind (410)


class WatchEvent(StrEnum):
    ADDED = "ADDED"
    MODIFIED = "MODIFIED"
    DELETED = "DELETED"
    BOOKMARK = "BOOKMARK"


class KubeTelemetry:
    """One Kubernetes API resource's self-metrics (`resource` bound once)."""

    def __init__(self, metrics: SelfMetrics, resource: str) -> None:
        self.resource, self._errors = resource, metrics.kube_errors
        self._events = {e: metrics.kube_events.labels(resource, e.value) for e in WatchEvent}
        self._lists = {r: metrics.kube_lists.labels(resource, r.value) for r in ListReason}
        self._synced = metrics.kube_synced.labels(resource)
        self.objects = metrics.kube_objects.labels(resource)

    def event(self, kind: WatchEvent) -> None:
        self._events[WatchEvent(kind)].inc()

    def listed(self, reason: ListReason) -> None:
        self._lists[ListReason(reason)].inc()

    def synced(self, synced: bool) -> None:
        self._synced.set(int(synced))

    def failed(self, verb: KubeVerb, reason: KubeReason) -> None:
        self._errors.labels(self.resource, KubeVerb(verb).value, KubeReason(reason).value).inc()


class IngestTelemetry:
    """What became of the points the receivers took in, bound once."""

    def __init__(self, metrics: SelfMetrics) -> None:
        self.received, self.ignored = metrics.points_received, metrics.points_ignored
        self.decoded_by_reference = metrics.requests_decoded_by_reference
        self._rejected = metrics.points_rejected

    def rejected(self, metric: str, reason: str, points: int) -> None:
        """`points` of `metric` ("" where not one metric's) rejected for `reason`, a short code
        (receiver/rejection.py)."""
        self._rejected.labels(metric, reason).inc(points)


class TagCap(StrEnum):
    """How a tag value was capped: `tag_values_capped{reason}`."""

    LENGTH = "length"  # cut to max_length
    DISTINCT = "distinct"  # replaced by the overflow value: the tag has its most distinct values


class TagTelemetry:
    """The tag values' self-metrics."""

    def __init__(self, metrics: SelfMetrics) -> None:
        self._capped = metrics.tag_values_capped

    def capped(self, tag: str, reason: TagCap) -> None:
        self._capped.labels(tag, TagCap(reason).value).inc()


class ExportResult(Protocol):
    """What an export operation records of its result (exporter/sending.py's SendResult)."""

    ok: bool
    reason: str


class ExportOperation:
    """One attempt to deliver `items` points (`ExporterTelemetry.export_operation`)."""

    def __init__(self, telemetry: "ExporterTelemetry", items: int) -> None:
        self._telemetry, self.items = telemetry, items
        self.recorded = False

    def finished(self, result: ExportResult) -> None:
        """Record how it went: the snapshot and its points delivered, or the failure by reason and
        the points it failed to send."""
        telemetry, self.recorded = self._telemetry, True
        if result.ok:
            telemetry.exports.inc()
            telemetry.sent_points.inc(self.items)
        else:
            telemetry.failed(result.reason or "unknown", self.items)


class OutboxError(StrEnum):
    """A problem of an exporter's persisted queue: `export_outbox_errors{reason}`."""

    CORRUPT = "corrupt"  # a snapshot file set aside at start: unreadable
    INCOMPATIBLE = "incompatible"  # a snapshot file set aside at start: a format this version cannot read
    CORRUPT_PROGRESS = "corrupt_progress"  # how far a snapshot was sent is unreadable: sent from its start
    ATTRIBUTE_LOG_CUT = "attribute_log_cut"  # the attribute log's torn tail dropped
    WRITE = "write"
    DELETE = "delete"
    READ = "read"  # the directory is unreadable: nothing recovered


class ExporterTelemetry:
    """One exporter's self-metrics, its `exporter` label bound once (as the Collector binds its
    component's attributes); reasons are short fixed codes."""

    def __init__(self, metrics: SelfMetrics, exporter: str) -> None:
        self.exporter = exporter
        self.queue_size = metrics.exporter_queue_size.labels(exporter)
        self.queue_capacity = metrics.exporter_queue_capacity.labels(exporter)
        self.delivered_through = metrics.exporter_delivered.labels(exporter)
        self.exports = metrics.exports.labels(exporter)
        self.sent_points = metrics.exporter_sent_points.labels(exporter)
        self.send_failed_points = metrics.exporter_send_failed_points.labels(exporter)
        self.points_rejected = metrics.export_points_rejected.labels(exporter)
        self.snapshots_merged = metrics.export_snapshots_merged.labels(exporter)
        self.snapshots_carried = metrics.export_snapshots_carried.labels(exporter)
        self.snapshots_recovered = metrics.export_snapshots_recovered.labels(exporter)
        self.snapshots_persisted = metrics.export_snapshots_persisted.labels(exporter)
        self.send_seconds = metrics.work_seconds.labels(f"send:{exporter}")
        self._outbox_errors = {r: metrics.export_outbox_errors.labels(exporter, r.value) for r in OutboxError}
        # Given up: undelivered at a stop with no directory to keep them (refused for good they are carried).
        self._dropped = metrics.export_snapshots_dropped.labels(exporter, "shutdown")
        self._undeliverable = metrics.export_points_undeliverable.labels(exporter, "shutdown")
        self._series_rejected, self._failures = metrics.export_series_rejected, metrics.export_failures
        self._dropped_by, self._undeliverable_by = metrics.export_snapshots_dropped, metrics.export_points_undeliverable

    def outbox_error(self, reason: OutboxError) -> None:
        self._outbox_errors[OutboxError(reason)].inc()

    def series_rejected(self, reason: str, series: int) -> None:
        """Series the sender left out, by its short code (too_many_labels, unknown_metric, ...)."""
        self._series_rejected.labels(self.exporter, reason).inc(series)

    def gave_up(self, points: int) -> None:
        """A snapshot given up at a stop, undelivered, with no directory to keep it."""
        self._dropped.inc()
        self._undeliverable.inc(points)

    def unreadable(self, points: int) -> None:
        """A persisted snapshot whose file did not read back when it was to be sent or merged."""
        self._dropped_by.labels(self.exporter, "unreadable").inc()
        self._undeliverable_by.labels(self.exporter, "unreadable").inc(points)

    def failed(self, reason: str, points: int) -> None:
        """A failed attempt, by the sender's code: the gRPC status (`unavailable`), `http_<status>`,
        `connection`, `timeout`, `tls`, `credentials`, `encode`, `error`, `unknown`."""
        self._failures.labels(self.exporter, reason).inc()
        self.send_failed_points.inc(points)

    @contextmanager
    def export_operation(self, items: int) -> Iterator[ExportOperation]:
        """Around one attempt to deliver `items` points: its time, and what `finished` records
        (a block left without it, by an exception, is a failure)."""
        operation = ExportOperation(self, items)
        began = time.monotonic()
        try:
            yield operation
        finally:
            self.send_seconds.inc(time.monotonic() - began)
            if not operation.recorded:
                self.failed("unknown", items)


def by_label(metric: Union[Counter, Gauge]) -> Tally[Key]:
    """A labelled metric's values now: the label value (one label) or the tuple of them -> value.
    A counter's zeros are left out (a series is made at its first use, even a held one)."""
    out: Tally[Key] = Tally()
    for family in metric.collect():
        for sample in family.samples:
            if sample.name == family.name + "_total" and sample.value == 0:
                continue
            if sample.name in (family.name, family.name + "_total"):
                values = tuple(sample.labels.values())
                out[values[0] if len(values) == 1 else values] = sample.value
    return out


def total(metric: Union[Counter, Gauge]) -> float:
    """An unlabelled metric's value now, or a labelled one's sum over its labels."""
    return sum(by_label(metric).values())
