"""Push cost snapshots with Prometheus remote write 1.0, straight to Amazon Managed Service for
Prometheus (or any remote-write receiver), for clusters with no Collector to go through.

A request is a snappy *block*-compressed protobuf `WriteRequest`. The message classes are built at
import from a descriptor written here (field numbers of prometheus/prompb `types.proto` and
`remote.proto`), with no generated files to keep in sync. `series_reference` and `requests_reference` are
the readable encoding through the protobuf library; `SeriesWriter`, which sends, gives the same
bytes from the snapshot's columns: each series' label bytes cached while it lasts, the series
ordered by ranks of their label sets, the samples written by one kernel call per request. Series
carry the names of the /metrics endpoint and of the Collector path (`MetricSpec.prometheus`,
`label_name()`), so dashboards work against any of them.

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
import numpy as np
import urllib3
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from otelgpu.core.attrs import Attrs
from otelgpu.core.jit import kernel
from otelgpu.exporter.columns import SetTable
from otelgpu.exporter.config import RemoteWriteConfig
from otelgpu.exporter.prometheus import label_name
from otelgpu.exporter.protowire import arena, len_field, put_fixed64, put_varint, varint_size
from otelgpu.exporter.sending import DELIVERED, Progress, SendResult
from otelgpu.exporter.store import MetricSpec, Point, Points
from otelgpu.telemetry import ExporterTelemetry, SelfMetrics
from otelgpu.tls import TokenFile, client_context

log = logging.getLogger(__name__)

MAX_LABELS = 70  # AMP's limit per series, __name__ included
STALE_NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000002))[0]  # Prometheus' value.StaleNaN
_VALID_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_DETAIL_CHARS = 500


def _message_classes() -> dict[str, Any]:
    """prometheus.WriteRequest and its parts, from a descriptor of the fields we use."""
    field_type = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="otelgpu/prometheus_remote_write.proto",
                                              package="prometheus", syntax="proto3")
    # (message, [(field, number, type, repeated, type name)]), numbers as in prompb.
    schema = [
        ("Sample", [("value", 1, field_type.TYPE_DOUBLE, False, ""),
                    ("timestamp", 2, field_type.TYPE_INT64, False, "")]),
        ("Label", [("name", 1, field_type.TYPE_STRING, False, ""), ("value", 2, field_type.TYPE_STRING, False, "")]),
        ("TimeSeries", [("labels", 1, field_type.TYPE_MESSAGE, True, ".prometheus.Label"),
                        ("samples", 2, field_type.TYPE_MESSAGE, True, ".prometheus.Sample")]),
        # No metadata (field 3), as the Collector's prometheusremotewrite exporter by default.
        ("WriteRequest", [("timeseries", 1, field_type.TYPE_MESSAGE, True, ".prometheus.TimeSeries")]),
    ]
    for name, fields in schema:
        message = file.message_type.add(name=name)
        for field, number, type_, repeated, type_name in fields:
            added = message.field.add(name=field, number=number, type=type_,
                                      label=field_type.LABEL_REPEATED if repeated else field_type.LABEL_OPTIONAL)
            if type_name:  # set only for message fields (an empty one still counts as set)
                added.type_name = type_name
    pool = descriptor_pool.DescriptorPool()  # our own: no clash with any other `prometheus` protos
    pool.Add(file)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"prometheus.{name}"))
            for name, _ in schema}


_CLASSES = _message_classes()
Sample, Label, TimeSeries, WriteRequest = (_CLASSES[n] for n in ("Sample", "Label", "TimeSeries", "WriteRequest"))

Labels = tuple[tuple[str, str], ...]  # sorted by name


def series_reference(points: Sequence[Point], specs: Mapping[str, MetricSpec], cluster: str,
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


def requests_reference(series: Mapping[Labels, list[tuple[int, float]]], max_samples: int) -> Iterator[Any]:
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


class _LabelSet:
    """What a series' attribute set becomes on the wire, without `__name__`: its labels sorted, the
    Label fields before and after where `__name__` goes, order keys and why AMP would refuse it."""

    __slots__ = ("labels", "before", "after", "prefix_key", "suffix_key", "reason")

    def __init__(self, attrs: Attrs, cluster: str, external_labels: Mapping[str, str]) -> None:
        named = {label_name(k): v for k, v in attrs if v != ""}
        for k, v in external_labels.items():
            named.setdefault(k, v)
        named["cluster"] = cluster
        named.pop("__name__", None)  # the metric's name always wins
        self.labels: Labels = tuple(sorted(named.items()))
        split = sum(1 for k, _ in self.labels if k < "__name__")
        fields = [len_field(1, Label(name=k, value=v).SerializeToString()) for k, v in self.labels]
        self.before, self.after = b"".join(fields[:split]), b"".join(fields[split:])
        # Byte strings that sort as the label tuples do: the labels before `__name__` end in 0xFF,
        # above any label, since a series whose labels go on there sorts after `__name__` comes.
        self.prefix_key = b"".join(map(_order_key, self.labels[:split])) + b"\xff"
        self.suffix_key = b"".join(map(_order_key, self.labels[split:]))
        self.reason = _rejection(self.labels + (("__name__", "x"),))


def _order_key(label: tuple[str, str]) -> bytes:
    """A label as bytes that compare as (name, value) tuples of str do: UTF-8 (code point order),
    0x00 and 0x01 escaped, 0x00 after each string."""
    return b"".join(s.encode("utf-8", "surrogatepass").replace(b"\x01", b"\x01\x02").replace(b"\x00", b"\x01\x01")
                    + b"\x00" for s in label)


def _ranks(keys: list[bytes]) -> np.ndarray:
    """Each key's rank among the distinct keys (equal keys share a rank)."""
    order = {k: i for i, k in enumerate(sorted(set(keys)))}
    return np.array([order[k] for k in keys], np.int64)


class SeriesWriter:
    """`requests_reference(after(series_reference(...)))` serialized, from the snapshot's columns."""

    def __init__(self, specs: Mapping[str, MetricSpec], cluster: str, external_labels: Mapping[str, str]) -> None:
        self.specs, self.cluster, self.external_labels = specs, cluster, dict(external_labels)
        names = sorted({spec.prometheus for spec in specs.values()})
        self._name_rank = {n: i for i, n in enumerate(names)}
        blobs = [len_field(1, Label(name="__name__", value=n).SerializeToString()) for n in names]
        self._names, self._name_offsets = arena(blobs)
        self._sets: dict[Attrs | int, _LabelSet] = {}  # the last snapshot's, by set (the store's: by serial)

    def requests(self, points: Sequence[Point], done: int,
                 max_samples: int) -> tuple[Iterator[tuple[int, bytes]], Counter[str]]:
        """The requests left after the first `done` samples, each with its sample count, written
        as they are asked for (one request's bytes at a time), and the series left out by reason."""
        columns = Points.of(points)
        rejected: Counter[str] = Counter()
        cached, self._sets = self._sets, {}
        name = np.array([self._name_rank[self.specs[m].prometheus] if m in self.specs else -1
                         for m in columns.metrics], np.int64)[columns.metric] if len(columns) else np.zeros(0, np.int64)
        known = name >= 0
        if not known.all():
            rejected["unknown_metric"] += int((~known).sum())
        rows = np.flatnonzero(known)
        if not len(rows):
            return iter(()), rejected
        sets, lid = self._label_sets(columns, rows, cached)
        row_lid = lid[columns.aset[rows]]
        prefix, suffix = _ranks([s.prefix_key for s in sets]), _ranks([s.suffix_key for s in sets])
        n_names, n_sets = len(self._name_rank), len(sets)
        key = (prefix[row_lid] * n_names + name[rows]) * n_sets + suffix[row_lid]  # the series' sort key
        keys, series = np.unique(key, return_inverse=True)
        series = series.reshape(-1)
        series_lid = np.zeros(len(keys), np.int64)
        series_lid[series] = row_lid
        series_name = (keys // n_sets) % n_names
        refused = np.array([bool(s.reason) for s in sets])[series_lid]
        for i in np.flatnonzero(refused).tolist():
            rejected[sets[series_lid[i]].reason] += 1
        keep = ~refused[series]
        rows, series = rows[keep], series[keep]
        # Each series' samples in time order (ties as they come); of two in one millisecond, the later.
        order = np.lexsort((columns.time_ns[rows], series))
        rows, series = rows[order], series[order]
        ms = columns.time_ns[rows] // 1_000_000
        last = np.ones(len(rows), bool)
        last[:-1] = (series[1:] != series[:-1]) | (ms[1:] != ms[:-1])
        rows, series, ms = rows[last][done:], series[last][done:], ms[last][done:]
        bits = np.where(columns.ended[rows], _STALE_BITS, columns.value[rows].view(np.int64))
        return self._bodies(_label_arena(sets), series_lid, series_name, series, ms, bits, max_samples), rejected

    def _bodies(self, label_arena: tuple[np.ndarray, np.ndarray, np.ndarray], series_lid: np.ndarray,
                series_name: np.ndarray, series: np.ndarray, ms: np.ndarray, bits: np.ndarray,
                max_samples: int) -> Iterator[tuple[int, bytes]]:
        for lo in range(0, len(series), max_samples):
            hi = min(lo + max_samples, len(series))
            body = write_series(*label_arena, self._names, self._name_offsets, series_lid, series_name, series[lo:hi],
                                ms[lo:hi].view(np.uint64), bits[lo:hi])
            yield hi - lo, body.tobytes()

    def _label_sets(self, points: Points, rows: np.ndarray,
                    cached: dict[Attrs | int, _LabelSet]) -> tuple[list[_LabelSet], np.ndarray]:
        """The distinct label sets of `rows`' attribute sets (those of the last snapshot kept), and
        per attribute set its label set's index. A set of the store's (`SetTable`) is known by its
        serial, and built only when new."""
        distinct: dict[Labels, int] = {}
        sets: list[_LabelSet] = []
        table = points.attrs
        coded = len(table.codes) if isinstance(table, SetTable) else 0
        lid = np.zeros(len(table), np.int64)
        for a in np.unique(points.aset[rows]).tolist():
            key = int(table.serials[a]) if a < coded else table[a]
            ls = self._sets.get(key) or cached.get(key) or _LabelSet(table[a], self.cluster, self.external_labels)
            self._sets[key] = ls
            lid[a] = distinct.setdefault(ls.labels, len(distinct))
            if lid[a] == len(sets):
                sets.append(ls)
        return sets, lid


_STALE_BITS = np.float64(STALE_NAN).view(np.int64)


def _encode_failed(exc: Exception) -> SendResult:
    log.exception("remote write: encoding failed")
    return SendResult(ok=False, retryable=False, reason="encode", detail=str(exc))


def _label_arena(sets: list[_LabelSet]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each set's Label fields (before, then after `__name__`) in one array, and where `__name__` goes."""
    labels, offsets = arena([s.before + s.after for s in sets])
    return labels, offsets, offsets[:-1] + np.array([len(s.before) for s in sets], np.int64)


@kernel(inline=True)
def _sample_size(bits: int, ms: int) -> int:
    """A Sample's bytes: value (fixed64) when not 0.0, timestamp (varint) when not 0 (proto3 leaves
    zeros out)."""
    return (9 if bits != 0 else 0) + (1 + varint_size(ms) if ms != 0 else 0)


@kernel
def write_series(labels: np.ndarray, label_offsets: np.ndarray, splits: np.ndarray, names: np.ndarray,
                 name_offsets: np.ndarray, series_lid: np.ndarray, series_name: np.ndarray, series: np.ndarray,
                 ms: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """A WriteRequest: a TimeSeries (field 1) per run of samples of one series, its Label fields
    with `__name__`'s at its place, then its samples (field 2); `ms` as uint64 (two's complement),
    `bits` IEEE-754."""
    n = len(series)
    runs = np.zeros(n + 1, np.int64)  # where each run of one series' samples starts
    sizes = np.zeros(n, np.int64)  # its TimeSeries' bytes
    n_runs, total, i = 0, 0, 0
    while i < n:
        s = series[i]
        body = label_offsets[series_lid[s] + 1] - label_offsets[series_lid[s]]
        body += name_offsets[series_name[s] + 1] - name_offsets[series_name[s]]
        runs[n_runs] = i
        while i < n and series[i] == s:
            body += 2 + _sample_size(bits[i], ms[i])
            i += 1
        sizes[n_runs] = body
        total += 1 + varint_size(body) + body
        n_runs += 1
    runs[n_runs] = n
    out = np.empty(total, np.uint8)
    at = 0
    for r in range(n_runs):
        lid, nm = series_lid[series[runs[r]]], series_name[series[runs[r]]]
        out[at] = 0x0A
        at = put_varint(out, at + 1, sizes[r])
        for k in range(label_offsets[lid], splits[lid]):
            out[at] = labels[k]
            at += 1
        for k in range(name_offsets[nm], name_offsets[nm + 1]):
            out[at] = names[k]
            at += 1
        for k in range(splits[lid], label_offsets[lid + 1]):
            out[at] = labels[k]
            at += 1
        for k in range(runs[r], runs[r + 1]):
            out[at] = 0x12
            out[at + 1] = _sample_size(bits[k], ms[k])
            at += 2
            if bits[k] != 0:
                at = put_fixed64(out, at, 0x09, bits[k])
            if ms[k] != 0:
                out[at] = 0x10
                at = put_varint(out, at + 1, ms[k])
    return out


def warm_up() -> str:
    """Compile (or load from numba's cache) the writer's kernel; returns how (otelgpu.core.jit.how_loaded)."""
    from otelgpu.core.jit import how_loaded
    from otelgpu.exporter.store import cost_metrics

    list(SeriesWriter(cost_metrics(), "warm-up", {}).requests([Point("allocated", (("team", "a"),), 1, 2, 1.0)], 0,
                                                             10)[0])
    return how_loaded(write_series)


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
        self.specs = specs
        self._cluster = cluster
        self._telemetry = ExporterTelemetry(metrics, self.name) if metrics is not None else None
        self.rejected_series: Counter[str] = Counter()
        self._logged: set[str] = set()
        self._writer = SeriesWriter(specs, cluster, config.external_labels)
        self._headers = {"Content-Encoding": "snappy", "Content-Type": "application/x-protobuf",
                         "X-Prometheus-Remote-Write-Version": "0.1.0", "User-Agent": _user_agent(),
                         **config.headers}
        self._signer: Optional[Any] = None
        if config.sigv4 is not None:
            from otelgpu.exporter.sigv4 import Signer

            self._signer = Signer(config.sigv4.region, config.sigv4.service)
        self._token = TokenFile(config.bearer_token_file, "exporter.remote_write") if config.bearer_token_file else None
        tls = config.tls
        self._pool = urllib3.PoolManager(ssl_context=client_context(tls, "exporter.remote_write"),
                                         server_hostname=tls.server_name_override,
                                         assert_hostname=False if tls.insecure_skip_verify else None)

    def send(self, points: Sequence[Point], progress: Optional[Progress] = None) -> SendResult:
        """One attempt, starting after the first `progress.done` samples and advancing `progress`
        after each accepted request (a fresh Progress when None: the whole snapshot)."""
        progress = Progress() if progress is None else progress
        try:
            todo, rejected = self._writer.requests(points, progress.done, self._config.max_samples_per_request)
            self._count_rejected(rejected)
        except Exception as exc:  # an encoding bug must not take the exporter thread down
            return _encode_failed(exc)
        # One after the other, each written and compressed as it is sent (one request's bytes at a
        # time); the first failure stops the send and the queue sends the snapshot
        # again later. Prometheus takes a sample identical to a series' newest stored one (same
        # timestamp, same value bits) as a no-op, but refuses any older sample, identical or not, as
        # "out of order sample" (400, and the whole request is rolled back), as the tests against a
        # real Prometheus show. So each accepted request advances the progress, and a resend
        # (here or after a restart) starts after it. A process killed between an accepted request
        # and its advance resends that one request: a no-op where it holds one sample per series
        # (an interval's snapshot); a merged snapshot's older samples may then be refused (400,
        # counted), and the next snapshot carries every total again.
        requests = ((samples, bytes(cramjam.snappy.compress_raw(body))) for samples, body in todo)
        while True:
            try:
                samples, body = next(requests, (0, b""))
            except Exception as exc:  # noqa: BLE001 - as above
                return _encode_failed(exc)
            if not samples:
                return DELIVERED
            try:
                result = self._post(body)
            except Exception as exc:  # a bug would fail the same way again: not retried
                log.exception("remote write: sending failed")
                return SendResult(ok=False, retryable=False, reason="error", detail=str(exc))
            if not result.ok:
                return result
            progress.advance(samples)

    def close(self) -> None:
        self._pool.clear()

    def _count_rejected(self, rejected: Counter[str]) -> None:
        for reason, n in rejected.items():
            self.rejected_series[reason] += n
            if self._telemetry is not None:
                self._telemetry.series_rejected(reason, n)
            if reason not in self._logged:
                self._logged.add(reason)
                log.error("remote write: left out %d series (%s): AMP takes at most %d labels per series, "
                          "named [a-zA-Z_][a-zA-Z0-9_]* and not starting with __; later ones are only counted "
                          "(otelgpu_export_series_rejected_total)", n, reason, MAX_LABELS)

    def _post(self, body: bytes) -> SendResult:
        headers = self._headers
        if self._token is not None:
            headers = {**headers, "Authorization": self._token.header()}
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
