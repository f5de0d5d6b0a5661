"""Push cost snapshots to the Collector's `otlp/cost` receiver over OTLP/gRPC.

Requests carry cumulative monotonic sums whose start time never moves (Prometheus remote write
drops delta sums), gauges, and `NO_RECORDED_VALUE` on a series' last point, which the SDK's data
model cannot express and which the Collector's prometheusremotewrite exporter turns into a stale
marker. They are written as bytes by `RequestWriter`: each series' attributes encoded once and
kept while the series lives, each point its start, time and value packed beside them, and the
request, scope and metric headers encoded once. `requests_reference` builds the same requests with the
protobuf messages, the readable reference: both give the same bytes (tests/exporter/test_otlp_bytes.py).

One `send()` is one attempt; the delivery queue (`delivery.py`) retries. Failures are classified as
the OTLP specification says: UNAVAILABLE, CANCELLED, DEADLINE_EXCEEDED, ABORTED, OUT_OF_RANGE and
DATA_LOSS are retryable, RESOURCE_EXHAUSTED only when the server sent RetryInfo, and every other
code is final. A server's RetryInfo delay is honoured.
"""

from __future__ import annotations

import logging
import operator
from itertools import chain
from typing import Iterator, Mapping, Optional, Sequence

import grpc
import numpy as np
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
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

from otelgpu.core.attrs import Attrs
from otelgpu.core.byvalue import ByValue
from otelgpu.core.jit import kernel
from otelgpu.exporter.columns import SetTable
from otelgpu.exporter.config import OtlpExporterConfig
from otelgpu.exporter.protowire import arena, len_field, len_head, put_fixed64, put_varint, varint_size
from otelgpu.exporter.sending import DELIVERED, Progress, SendResult
from otelgpu.exporter.store import MetricSpec, Point, Points
from otelgpu.telemetry import ExporterTelemetry, SelfMetrics
from otelgpu.tls import TokenFile, grpc_channel_credentials

log = logging.getLogger(__name__)

# The Collector's OTLP receiver accepts 4 MiB per request by default; a cost point with ~16
# attributes encodes to a few hundred bytes, so this keeps every request well below that limit.
MAX_POINTS_PER_REQUEST = 4000
PAIRS_KEPT = 262_144  # encoded attribute pairs the writer keeps
RETRYABLE = frozenset({grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
                       grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS})
NO_RECORDED_VALUE = DataPointFlags.DATA_POINT_FLAGS_NO_RECORDED_VALUE_MASK
_NO_IDS, _NO_STARTS, _NO_COUNTS = np.zeros(0, np.uint32), np.zeros(0, np.uint32), np.zeros(0, np.int32)  # no store sets


def _kv(key: str, value: str) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(string_value=value))


def requests_reference(points: Sequence[Point], specs: Mapping[str, MetricSpec], cluster: str,
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


class RequestWriter:
    """`requests_reference` as protobuf bytes, with no message object per point: each (key, value)
    pair is encoded once and kept (what is kept grows with the distinct pairs, some 17,000 at
    10,000 GPUs, not with the series), a snapshot's attribute sets are the ids of their pairs (4
    bytes a pair: a set's bytes are laid out only in the request that carries its point), the
    points of each metric are written by one kernel call from the snapshot's columns, and the
    request, scope and metric headers are encoded once."""

    def __init__(self, specs: Mapping[str, MetricSpec], cluster: str, instance: str = "") -> None:
        self.specs = specs
        first = next(requests_reference([Point(next(iter(specs)), (), 1, 1, 0.0)], specs, cluster, instance=instance))
        rm = first.resource_metrics[0]
        self._resource = len_field(1, rm.resource.SerializeToString())
        self._scope = len_field(1, rm.scope_metrics[0].scope.SerializeToString())
        self._heads: dict[str, tuple[bytes, int, bytes]] = {}  # metric: (Metric fields before data, data field, after points)
        for key, spec in specs.items():
            head = (len_field(1, spec.name.encode()) + len_field(2, spec.description.encode())
                    + len_field(3, spec.unit.encode()))
            tail = b"\x10\x02\x18\x01" if spec.kind == "sum" else b""  # cumulative, monotonic
            self._heads[key] = (head, 7 if spec.kind == "sum" else 5, tail)
        self._rank = {key: i for i, key in enumerate(specs)}
        self._pairs: list[tuple[str, str]] = []  # by their id here: its bytes are _pair_bytes[_pair_off[id]:...]
        self._index = ByValue(self._pairs)  # where a dict took some 20 MiB at 100,000 GPUs
        self._pair_bytes = np.zeros(0, np.uint8)
        self._pair_off = np.zeros(1, np.int64)
        self._afresh = 0  # times the writer started afresh: the ids of before are not its own any more
        # The last store table's list of pairs, and each one's id here (-1: not looked up); the store
        # shares one list until a pair comes or goes, so the next snapshot looks up only new ones.
        self._remap: tuple[Sequence[tuple[str, str]], np.ndarray] = ((), np.zeros(0, np.int32))

    def requests(self, points: Sequence[Point], max_points: int = MAX_POINTS_PER_REQUEST) -> Iterator[bytes]:
        columns = Points.of(points)
        if not len(columns):
            return
        used = np.zeros(len(columns.attrs), dtype=bool)
        used[columns.aset] = True
        sets = self._sets(columns.attrs, used)
        bits = columns.value.view(np.int64)
        body, room = [], max_points
        for key, rows in self._runs(columns):
            while len(rows):  # a request holds `max_points` points, of one metric or of several in turn
                run, rows = rows[:room], rows[room:]
                data = write_points(self._pair_bytes, self._pair_off, *sets, columns.aset[run].astype(np.int64),
                                    columns.start_ns[run], columns.time_ns[run], bits[run], columns.ended[run],
                                    self.specs[key].kind == "sum")
                body.extend(self._metric(key, data))
                room -= len(run)
                if not room:
                    yield self._request(body)
                    body, room = [], max_points
        if body:
            yield self._request(body)

    def _runs(self, columns: Points) -> Iterator[tuple[str, np.ndarray]]:
        """Each metric's points (rows, as they come), metrics in the specs' order: found a metric
        at a time, where a sort of every point would hold three arrays of them at once."""
        codes: dict[str, list[int]] = {}
        for code, metric in enumerate(columns.metrics):
            if metric not in self._rank:
                raise KeyError(metric)
            codes.setdefault(metric, []).append(code)
        for key in sorted(codes, key=self._rank.__getitem__):
            rows = np.flatnonzero(np.isin(columns.metric, codes[key]))
            if len(rows):
                yield key, rows

    def _request(self, body: list) -> bytes:
        """The request of the metrics whose pieces are `body` (`_metric`'s), its bytes laid out
        once: each field's length is summed from its pieces', where nesting the fields would copy
        every point's bytes once per level."""
        scope = len(self._scope) + sum(map(len, body))
        head = len_head(2, scope)
        return b"".join([len_head(1, len(self._resource) + len(head) + scope), self._resource, head, self._scope,
                         *body])

    def _sets(self, table: Sequence[Attrs], used: np.ndarray) -> tuple[np.ndarray, ...]:
        """What `write_points` reads of `table`'s sets, with every pair the `used` ones name
        encoded: the store's sets (`SetTable`: set i < len(codes)) as they are kept, the ids of
        their pairs in the store's runs (`SetCodes`: ids, start, count; not copied) and each
        store pair id's id in the writer (`remap`); the sets after them (plain tuples, a list's
        every set) as the writer's pair ids end to end (`plain_ids`, set i's from
        `plain_off[i - len(codes)]`). Which store pairs the used sets name is read some sets at a
        time (`SetCodes.used_pairs`): no copy of the sets' pair ids (some 40 MiB at 100,000 GPUs)
        is built."""
        codes = table.codes if isinstance(table, SetTable) else None
        coded = len(codes) if codes is not None else 0
        distinct = np.zeros(0, np.int64)  # the pairs the sets use, each once: mapped, not each use
        if codes is not None:
            distinct = codes.used_pairs(np.flatnonzero(used[:coded]), len(table.pairs))
        plain = [table[i] if u else () for i, u in enumerate(used[coded:].tolist(), coded)]
        plain_pairs = list(chain.from_iterable(plain))
        remap, plain_ids = self._ids(table.pairs if codes is not None else (), distinct, plain_pairs)
        plain_off = np.zeros(len(plain) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, plain), np.int64, len(plain)), out=plain_off[1:])
        if codes is None:
            return _NO_IDS, _NO_STARTS, _NO_COUNTS, remap, plain_ids, plain_off
        return (codes.ids, codes.start.astype(np.uint32, copy=False), codes.count.astype(np.int32, copy=False),
                remap, plain_ids, plain_off)

    def _ids(self, pairs: Sequence[tuple[str, str]], distinct: np.ndarray,
             plain_pairs: list[tuple[str, str]]) -> tuple[np.ndarray, np.ndarray]:
        """The writer's id of each of the store's `pairs` at `distinct` (`remap`, by the store's
        pair id: the others -1) and of each plain pair, every one encoded."""
        if self._remap[0] is not pairs:  # pairs came or went: the ids of those at their place stay
            known, kept = self._remap
            remap = np.full(len(pairs), -1, np.int32)
            common = min(len(known), len(pairs))
            same = np.fromiter(map(operator.is_, known[:common], pairs[:common]), bool, common)
            remap[:common][same] = kept[:common][same]
            self._remap = (pairs, remap)
        remap = self._remap[1]
        todo = distinct[remap[distinct] < 0]
        afresh = self._afresh
        ids = self._known([pairs[i] for i in todo.tolist()] + plain_pairs)
        if self._afresh != afresh:  # the ids remap kept are gone with the pairs they named
            self._remap = (pairs, np.full(len(pairs), -1, np.int32))
            remap, todo = self._remap[1], distinct
            ids = self._known([pairs[i] for i in todo.tolist()] + plain_pairs)
        remap[todo] = ids[:len(todo)]
        return remap, ids[len(todo):].astype(np.int32)

    def _known(self, needed: list[tuple[str, str]]) -> np.ndarray:
        """The writer's id of each pair of `needed`, those new to it encoded. Past PAIRS_KEPT pairs
        the writer starts afresh (pods come and go) with those needed now."""
        ids = self._index.find_all(needed)
        missing = np.flatnonzero(ids < 0)
        if not len(missing):
            return ids
        new = list(dict.fromkeys(needed[i] for i in missing.tolist()))
        if len(self._pairs) + len(new) > PAIRS_KEPT:
            self._pairs.clear()
            self._index = ByValue(self._pairs)
            self._pair_bytes, self._pair_off = np.zeros(0, np.uint8), np.zeros(1, np.int64)
            self._afresh += 1
            new, missing = list(dict.fromkeys(needed)), np.arange(len(needed))
        encoded, offsets = arena([len_field(7, _keyvalue(*kv)) for kv in new])
        fresh = dict(zip(new, range(len(self._pairs), len(self._pairs) + len(new))))
        self._pairs.extend(new)
        self._index.put_all(list(fresh.values()), list(map(hash, new)))
        self._pair_bytes = np.concatenate([self._pair_bytes, encoded])
        self._pair_off = np.concatenate([self._pair_off, offsets[1:] + self._pair_off[-1]])
        ids[missing] = [fresh[needed[i]] for i in missing.tolist()]
        return ids

    def _metric(self, key: str, points: np.ndarray) -> list:
        """The pieces of a Metric field (ScopeMetrics field 2) holding `points` (`write_points`'),
        in order: its bytes are the pieces joined."""
        head, data_field, tail = self._heads[key]
        data = len_head(data_field, len(points) + len(tail))
        return [len_head(2, len(head) + len(data) + len(points) + len(tail)), head, data, points, tail]


@kernel
def write_points(pair_bytes: np.ndarray, pair_off: np.ndarray, ids: np.ndarray, start: np.ndarray, count: np.ndarray,
                 remap: np.ndarray, plain_ids: np.ndarray, plain_off: np.ndarray, aset: np.ndarray,
                 start_ns: np.ndarray, time_ns: np.ndarray, bits: np.ndarray, ended: np.ndarray,
                 is_sum: bool) -> np.ndarray:
    """The data_points fields (NumberDataPoint, field 1) of one metric's points, as `_point` of
    the readable writer lays them out: start time (sums), time, the value or, for an ended point,
    the attributes and then flags = NO_RECORDED_VALUE; `bits` are the values' IEEE-754 bits. A
    point's attributes are the pairs of its set (`RequestWriter._sets`: set s < len(start) is
    remap[ids[start[s]:start[s] + count[s]]], a later one plain_ids[plain_off[s - len(start)]:
    plain_off[s - len(start) + 1]]), each pair's KeyValue field pair_bytes[pair_off[p]:pair_off[p + 1]]."""
    n, coded = len(aset), len(start)
    lo, hi = np.empty(n, np.int64), np.empty(n, np.int64)  # each point's pairs: in ids (coded) or in plain_ids
    sizes = np.empty(n, np.int64)
    total = 0
    for i in range(n):
        s = aset[i]
        if s < coded:
            lo[i] = np.int64(start[s])
            hi[i] = lo[i] + np.int64(count[s])
        else:
            lo[i], hi[i] = plain_off[s - coded], plain_off[s - coded + 1]
        attrs = 0
        for j in range(lo[i], hi[i]):
            pair = remap[ids[j]] if s < coded else plain_ids[j]
            attrs += pair_off[pair + 1] - pair_off[pair]
        body = 9 + (9 if is_sum else 0) + attrs + (2 if ended[i] else 9)
        sizes[i] = body
        total += 1 + varint_size(body) + body
    out = np.empty(total, np.uint8)
    at = 0
    for i in range(n):
        out[at] = 0x0A
        at = put_varint(out, at + 1, sizes[i])
        if is_sum:
            at = put_fixed64(out, at, 0x11, start_ns[i])
        at = put_fixed64(out, at, 0x19, time_ns[i])
        if not ended[i]:
            at = put_fixed64(out, at, 0x21, bits[i])
        for j in range(lo[i], hi[i]):
            pair = remap[ids[j]] if aset[i] < coded else plain_ids[j]
            for k in range(pair_off[pair], pair_off[pair + 1]):
                out[at] = pair_bytes[k]
                at += 1
        if ended[i]:
            out[at] = 0x40
            out[at + 1] = 0x01
            at += 2
    return out


def warm_up() -> str:
    """Compile (or load from numba's cache) the writer's kernel; returns how (otelgpu.core.jit.how_loaded)."""
    from otelgpu.core.jit import how_loaded
    from otelgpu.exporter.store import cost_metrics

    next(RequestWriter(cost_metrics(), "warm-up").requests([Point("allocated", (("team", "a"),), 1, 2, 1.0)]))
    return how_loaded(write_points)


def _keyvalue(key: str, value: str) -> bytes:
    return len_field(1, key.encode()) + len_field(2, len_field(1, value.encode()))


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


class OtlpSender:
    """One OTLP/gRPC channel to the Collector; `send()` delivers a snapshot or says why not."""

    name = "otlp"

    def __init__(self, config: OtlpExporterConfig, specs: Mapping[str, MetricSpec], metrics: SelfMetrics,
                 cluster: str, instance: str = "") -> None:
        self._config = config
        self.specs = specs
        self._telemetry = ExporterTelemetry(metrics, self.name)
        # gRPC rejects metadata keys with upper-case letters ("Authorization" fails the call).
        self._headers = tuple((k.lower(), v) for k, v in config.headers.items())
        self._token = TokenFile(config.bearer_token_file, "exporter.otlp") if config.bearer_token_file else None
        self._compression = grpc.Compression.Gzip if config.compression == "gzip" else grpc.Compression.NoCompression
        target, tls = config.target
        if tls:
            credentials, options = grpc_channel_credentials(config.tls, "exporter.otlp")
            self._channel = grpc.secure_channel(target, credentials, options=options)
        else:
            # Plaintext is allowed only over the loopback: never through an HTTP proxy the
            # environment names (http_proxy, grpc_proxy), which would carry it off the host.
            self._channel = grpc.insecure_channel(target, options=[("grpc.enable_http_proxy", 0)])
        self._writer = RequestWriter(specs, cluster, instance)
        self._export = self._channel.unary_unary(
            "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export", request_serializer=None,
            response_deserializer=ExportMetricsServiceResponse.FromString)

    def send(self, points: Sequence[Point], progress: Optional[Progress] = None) -> SendResult:
        """`progress` is not used: an attempt sends the whole snapshot again. A cumulative point
        repeated with the same timestamp, start time and value is a no-op for OTLP consumers.

        The next request is built while the one before it is on its way (at most two in flight,
        their points in different series): building takes about as long as sending."""
        calls: list[grpc.Future] = []
        metadata = self._headers + (("authorization", self._token.header()),) if self._token else self._headers
        try:
            for request in self._writer.requests(points):  # built as the loop asks: while the last call is out
                calls.append(self._export.future(request, metadata=metadata,
                                                 timeout=self._config.timeout_seconds, compression=self._compression))
                if len(calls) == 2:
                    self._answered(calls.pop(0).result())
            while calls:
                self._answered(calls.pop(0).result())
        except grpc.RpcError as error:
            code = error.code()  # type: ignore[attr-defined]
            delay = _retry_delay(error)
            retryable = code in RETRYABLE or (code is grpc.StatusCode.RESOURCE_EXHAUSTED and delay is not None)
            return SendResult(ok=False, retryable=retryable, reason=code.name.lower(),
                              detail=error.details() or "", retry_after=delay)  # type: ignore[attr-defined]
        except Exception as exc:  # an encoding bug must not take the exporter thread down
            log.exception("OTLP cost export failed")
            return SendResult(ok=False, retryable=False, reason="encode", detail=str(exc))
        finally:
            for call in calls:
                call.cancel()  # still out when an earlier one failed: the retry sends the whole snapshot
        return DELIVERED

    def _answered(self, response: ExportMetricsServiceResponse) -> None:
        rejected = response.partial_success.rejected_data_points
        if rejected:  # accepted in part: never resent (the receiver would refuse them again)
            self._telemetry.points_rejected.inc(rejected)
            log.error("the OTLP receiver refused %d cost points: %s", rejected, response.partial_success.error_message)

    def close(self) -> None:
        self._channel.close()  # fails a call in flight with CANCELLED
