"""Push cost snapshots with Prometheus remote write 1.0, straight to Amazon Managed Service for
Prometheus (or any remote-write receiver), for clusters with no Collector to go through.

A request is a snappy *block*-compressed protobuf `WriteRequest`. The message classes are built at
import from a descriptor written here (field numbers of prometheus/prompb `types.proto` and
`remote.proto`) and the protobuf library does the encoding: no hand-written wire format and no
generated files to keep in sync. Series carry the names of the /metrics endpoint and of the
Collector path (`MetricSpec.prometheus`, `label_name()`), so dashboards work against any of them.

A series' last point (`Point.ended`) becomes the Prometheus stale marker, a NaN with one exact bit
pattern, so the series disappears from queries at once instead of five minutes later. A series AMP
would refuse (more than 70 labels, a label name Prometheus cannot store) is left out and counted;
the rest of the snapshot still goes.

One `send()` is one attempt; the delivery queue (`delivery.py`) retries a whole snapshot after a
retryable failure: HTTP 429 (honouring Retry-After), 5xx, connection errors and timeouts. Other 4xx
answers are final. A snapshot split into several requests may fail part-way; sent again, it leaves
out what the receiver already accepted, since Prometheus refuses a sample older than a series'
newest one, even an identical one. What was accepted is the snapshot's `Progress`, a count of
samples in the encoding's fixed order, which the delivery queue persists beside the snapshot, so a
restarted process resumes where the dead one stopped.

With `sigv4` set, every request is signed with botocore's SigV4 (`sigv4.py`, imported only then:
botocore costs some 8 MiB), using the standard AWS credential chain, re-read per request so that
rotating credentials (IRSA) stay valid.
"""

from __future__ import annotations

import email.utils
import importlib.metadata
import logging
import re
import struct
import time
from collections import Counter
from datetime import timezone
from typing import Any, Iterator, Mapping, Optional, Sequence

import cramjam
import urllib3
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from otelgpu.config import RemoteWriteConfig
from otelgpu.exporter.sending import DELIVERED, Progress, SendResult
from otelgpu.exporter.prometheus import label_name
from otelgpu.exporter.store import MetricSpec, Point
from otelgpu.telemetry import SelfMetrics

log = logging.getLogger(__name__)

MAX_LABELS = 70  # AMP's limit per series, __name__ included
STALE_NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000002))[0]  # Prometheus' value.StaleNaN
_VALID_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_DETAIL_CHARS = 500


def _message_classes() -> dict[str, Any]:
    """prometheus.WriteRequest and its parts, from a descriptor of the fields we use."""
    f = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="otelgpu/prometheus_remote_write.proto",
                                              package="prometheus", syntax="proto3")
    # (message, [(field, number, type, repeated, type name)]), numbers as in prompb.
    schema = [
        ("Sample", [("value", 1, f.TYPE_DOUBLE, False, ""), ("timestamp", 2, f.TYPE_INT64, False, "")]),
        ("Label", [("name", 1, f.TYPE_STRING, False, ""), ("value", 2, f.TYPE_STRING, False, "")]),
        ("TimeSeries", [("labels", 1, f.TYPE_MESSAGE, True, ".prometheus.Label"),
                        ("samples", 2, f.TYPE_MESSAGE, True, ".prometheus.Sample")]),
        # No metadata (field 3), as the Collector's prometheusremotewrite exporter by default.
        ("WriteRequest", [("timeseries", 1, f.TYPE_MESSAGE, True, ".prometheus.TimeSeries")]),
    ]
    for name, fields in schema:
        message = file.message_type.add(name=name)
        for field, number, type_, repeated, type_name in fields:
            added = message.field.add(name=field, number=number, type=type_,
                                      label=f.LABEL_REPEATED if repeated else f.LABEL_OPTIONAL)
            if type_name:  # set only for message fields (an empty one still counts as set)
                added.type_name = type_name
    pool = descriptor_pool.DescriptorPool()  # our own: no clash with any other `prometheus` protos
    pool.Add(file)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"prometheus.{name}"))
            for name, _ in schema}


_CLASSES = _message_classes()
Sample, Label, TimeSeries, WriteRequest = (_CLASSES[n] for n in ("Sample", "Label", "TimeSeries", "WriteRequest"))

Labels = tuple[tuple[str, str], ...]  # sorted by name


def build_series(points: Sequence[Point], specs: Mapping[str, MetricSpec], cluster: str,
                 external_labels: Mapping[str, str]) -> tuple[dict[Labels, list[tuple[int, float]]], Counter[str]]:
    """The points as series, sorted by labels, each with its (ms timestamp, value) samples in time
    order, and the count of series left out by reason. Labels: `__name__`, the attributes under
    their Prometheus names, external labels (a series' own label wins, as in Prometheus) and
    `cluster`. Two points of a series in one millisecond keep the later one."""
    samples: dict[Labels, dict[int, float]] = {}
    rejected: Counter[str] = Counter()
    for p in sorted(points, key=lambda p: p.time_ns):
        spec = specs.get(p.metric)
        if spec is None:
            rejected["unknown_metric"] += 1
            continue
        labels = {label_name(k): v for k, v in p.attrs if v != ""}
        for k, v in external_labels.items():
            labels.setdefault(k, v)
        labels["cluster"] = cluster  # always cluster.name, as on /metrics
        labels["__name__"] = spec.prometheus
        key = tuple(sorted(labels.items()))
        samples.setdefault(key, {})[p.time_ns // 1_000_000] = STALE_NAN if p.ended else float(p.value)
    out = {}
    # Sorted series, each in time order: the same points always encode to the same samples in the
    # same order, which is what makes a Progress count (samples accepted) meaningful on a resend.
    for key in sorted(samples):
        reason = _rejection(key)
        if reason:
            rejected[reason] += 1
        else:
            out[key] = sorted(samples[key].items())
    return out, rejected


def _rejection(labels: Labels) -> str:
    if len(labels) > MAX_LABELS:
        return "too_many_labels"
    if any(not _VALID_LABEL.match(k) or (k.startswith("__") and k != "__name__") for k, _ in labels):
        return "invalid_label_name"
    return ""


def after(series: Mapping[Labels, list[tuple[int, float]]], done: int) -> dict[Labels, list[tuple[int, float]]]:
    """The series without their first `done` samples, in series order: what is left to send of a
    snapshot whose first `done` samples the receiver accepted."""
    out = {}
    for labels, samples in series.items():
        if done >= len(samples):
            done -= len(samples)
            continue
        out[labels], done = samples[done:], 0
    return out


def build_requests(series: Mapping[Labels, list[tuple[int, float]]], max_samples: int) -> Iterator[Any]:
    """WriteRequests of at most `max_samples` samples, in series order. A series that does not fit
    is split, its earlier samples in the earlier request."""
    request, room = WriteRequest(), max_samples
    for labels, samples in series.items():
        at = 0
        while at < len(samples):
            if room == 0:
                yield request
                request, room = WriteRequest(), max_samples
            part = samples[at:at + room]
            ts = request.timeseries.add()
            ts.labels.extend(Label(name=k, value=v) for k, v in labels)
            ts.samples.extend(Sample(timestamp=t, value=v) for t, v in part)
            at, room = at + len(part), room - len(part)
    if room < max_samples:
        yield request


def retry_after(value: Optional[str], now: Optional[float] = None) -> Optional[float]:
    """Seconds to wait from a Retry-After header: delay-seconds or an HTTP-date; None if absent or bad."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _user_agent() -> str:
    try:
        return f"otelgpu/{importlib.metadata.version('otelgpu')}"
    except importlib.metadata.PackageNotFoundError:
        return "otelgpu/dev"


class RemoteWriteSender:
    """One connection pool to the receiver; `send()` delivers a snapshot or says why not.

    `rejected_series` counts, by reason, the series left out of the sends so far (each send of a
    snapshot counts its series again); the first of each reason is logged."""

    name = "remote_write"

    def __init__(self, config: RemoteWriteConfig, specs: Mapping[str, MetricSpec], cluster: str,
                 metrics: Optional[SelfMetrics] = None) -> None:
        self._config = config
        self._specs = specs
        self._cluster = cluster
        self._metrics = metrics
        self.rejected_series: Counter[str] = Counter()
        self._logged: set[str] = set()
        self._headers = {"Content-Encoding": "snappy", "Content-Type": "application/x-protobuf",
                         "X-Prometheus-Remote-Write-Version": "0.1.0", "User-Agent": _user_agent(),
                         **config.headers}
        self._signer: Optional[Any] = None
        if config.sigv4 is not None:
            from otelgpu.exporter.sigv4 import Signer

            self._signer = Signer(config.sigv4.region, config.sigv4.service)
        self._pool = (urllib3.PoolManager(cert_reqs="CERT_NONE") if config.insecure_skip_tls_verify
                      else urllib3.PoolManager(cert_reqs="CERT_REQUIRED", ca_certs=config.ca_file))

    def send(self, points: Sequence[Point], progress: Optional[Progress] = None) -> SendResult:
        """One attempt, starting after the first `progress.done` samples and advancing `progress`
        after each accepted request (a fresh Progress when None: the whole snapshot)."""
        progress = Progress() if progress is None else progress
        try:
            series, rejected = build_series(points, self._specs, self._cluster, self._config.external_labels)
            self._count_rejected(rejected)
            todo = build_requests(after(series, progress.done), self._config.max_samples_per_request)
            requests = [(sum(len(ts.samples) for ts in r.timeseries),
                         bytes(cramjam.snappy.compress_raw(r.SerializeToString()))) for r in todo]
        except Exception as exc:  # an encoding bug must not take the exporter thread down
            log.exception("remote write: encoding failed")
            return SendResult(ok=False, retryable=False, reason="encode", detail=str(exc))
        # One after the other; the first failure stops the send and the queue sends the snapshot
        # again later. Prometheus takes a sample identical to a series' newest stored one (same
        # timestamp, same value bits) as a no-op, but refuses any older sample, identical or not, as
        # "out of order sample" (400, and the whole request is rolled back), as the tests against a
        # real Prometheus show. So each accepted request advances the progress, and a resend
        # (here or after a restart) starts after it. A process killed between an accepted request
        # and its advance resends that one request: a no-op where it holds one sample per series
        # (an interval's snapshot); a merged snapshot's older samples may then be refused (400,
        # counted), and the next snapshot carries every total again.
        for n, body in requests:
            try:
                result = self._post(body)
            except Exception as exc:  # a bug would fail the same way again: not retried
                log.exception("remote write: sending failed")
                return SendResult(ok=False, retryable=False, reason="error", detail=str(exc))
            if not result.ok:
                return result
            progress.advance(n)
        return DELIVERED

    def close(self) -> None:
        self._pool.clear()

    def _count_rejected(self, rejected: Counter[str]) -> None:
        for reason, n in rejected.items():
            self.rejected_series[reason] += n
            if self._metrics is not None:
                self._metrics.count("export_series_rejected", (self.name, reason), n)
            if reason not in self._logged:
                self._logged.add(reason)
                log.error("remote write: left out %d series (%s): AMP takes at most %d labels per series, "
                          "named [a-zA-Z_][a-zA-Z0-9_]* and not starting with __; later ones are only counted "
                          "(otelgpu_export_series_rejected_total)", n, reason, MAX_LABELS)

    def _post(self, body: bytes) -> SendResult:
        headers = self._headers
        if self._signer is not None:
            try:
                headers = self._signer.headers(headers, self._config.url, body)
            except self._signer.CredentialsUnavailable as exc:  # STS down, token file being rotated
                return SendResult(ok=False, retryable=True, reason="credentials", detail=str(exc))
        try:
            response = self._pool.request("POST", self._config.url, body=body, headers=headers, retries=False,
                                          timeout=urllib3.Timeout(total=self._config.timeout_seconds))
        except urllib3.exceptions.NewConnectionError as exc:  # before TimeoutError: urllib3 2 derives it from that
            return SendResult(ok=False, retryable=True, reason="connection", detail=str(exc))
        except urllib3.exceptions.TimeoutError as exc:
            return SendResult(ok=False, retryable=True, reason="timeout", detail=str(exc))
        except urllib3.exceptions.SSLError as exc:
            return SendResult(ok=False, retryable=True, reason="tls", detail=str(exc))
        except urllib3.exceptions.HTTPError as exc:  # reset, refused, closed without an answer
            return SendResult(ok=False, retryable=True, reason="connection", detail=str(exc))
        return _result(response)


def _result(response: urllib3.BaseHTTPResponse) -> SendResult:
    code = response.status
    if 200 <= code < 300:
        return DELIVERED
    detail = response.data[:_DETAIL_CHARS * 4].decode("utf-8", "replace")[:_DETAIL_CHARS].strip()
    retryable = code == 429 or code >= 500  # quota and throttling, or the receiver's own trouble
    return SendResult(ok=False, retryable=retryable, reason=f"http_{code}", detail=detail,
                      retry_after=retry_after(response.headers.get("Retry-After")) if retryable else None)
