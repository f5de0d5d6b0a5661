"""OTLP ExportMetricsServiceRequest -> PointBatch: columnar arrays of interned label codes.

One pass over the request. Unknown metrics are skipped on their name alone; for known metrics
each point becomes one row of flat arrays (no dict or object per point), its value converted to the
stored unit of its metric (a DCGM field may arrive under names in different units). Every point is validated
on its own: a point that cannot be used (no value, a non-finite or absurd value, an empty or huge
label, a timestamp far from this sidecar's clock) is rejected with a reason, counted, and never
stops or alters the rest of the request. Labels otelgpu never reads are not interned at all.
"""

from __future__ import annotations

import math
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Sequence

import numpy as np
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from otelgpu.core.jit import kernel
from otelgpu.receiver.interner import Coded, Interner
from otelgpu.receiver.limits import IDENTITY_KEYS, Limits, value_problem
from otelgpu.receiver.rejection import Rejection, rejection
from otelgpu.receiver.schema import (KNOWN_METRICS, LABEL_CHECKS, LIVENESS_METRIC, METRIC_NAME, OWN_POD_METRICS,
                                    REQUIRED_KEYS, REQUIRED_LABELS, TO_STORED_UNIT)
from otelgpu.receiver.sources import CLOCK, EVERY, KIND_OF_METRIC, untrusted_reason

NO_RECORDED_VALUE = 1


@dataclass
class PointBatch(Coded):
    """Accepted points of one request, as parallel arrays. `attr_*` hold each row's labels.

    `sources` gives, per scrape target (resource) of the request, the newest usable timestamp it
    carried: the interval watermark is taken across targets, so one target cannot drag it.
    `wal` is the (start, end) position of the batch's record in the write-ahead log, if logged."""

    metric: np.ndarray  # int16, Metric codes
    time_ns: np.ndarray  # int64
    value: np.ndarray  # float64, NaN for staleness markers
    stale: np.ndarray  # bool, flags & NO_RECORDED_VALUE
    resource_node: np.ndarray  # int32, code of the resource's k8s.node.name, or -1
    resource_pod: np.ndarray  # int32, code of the resource's k8s.pod.name (the scraped exporter), or -1
    attr_off: np.ndarray  # int64, row i's labels are attr_key/attr_val[attr_off[i]:attr_off[i+1]]
    attr_key: np.ndarray  # int32
    attr_val: np.ndarray  # int32
    rejected: Counter[Rejection] = field(default_factory=Counter)
    ignored: int = 0  # points of metrics otelgpu does not consume
    sources: dict[str, int] = field(default_factory=dict)
    wal: Optional[tuple[tuple[int, int], tuple[int, int]]] = None
    epoch: int = 0  # of the interner its codes are from

    CODES: ClassVar[tuple[str, ...]] = ("resource_node", "resource_pod", "attr_key", "attr_val")

    def __len__(self) -> int:
        return len(self.metric)

    @property
    def nbytes(self) -> int:
        """What its columns take."""
        return sum(a.nbytes for a in (self.metric, self.time_ns, self.value, self.stale, self.resource_node,
                                      self.resource_pod, self.attr_off, self.attr_key, self.attr_val))

    @property
    def rejected_count(self) -> int:
        return sum(self.rejected.values())

    def rows_of_attrs(self) -> np.ndarray:
        """For each entry of attr_key/attr_val, the row it belongs to."""
        return np.repeat(np.arange(len(self.metric), dtype=np.int64), np.diff(self.attr_off))

    def column(self, key_code: int) -> np.ndarray:
        """Per row, the value code of label `key_code`, or -1 where the row lacks it."""
        out = np.full(len(self.metric), -1, dtype=np.int32)
        if key_code >= 0 and len(self.attr_key):
            hit = self.attr_key == key_code
            out[self.rows_of_attrs()[hit]] = self.attr_val[hit]
        return out

    def columns(self, key_codes: Sequence[int]) -> list[np.ndarray]:
        """`column` of each of `key_codes`, from one pass over the labels (a batch's labels are
        read once, not once per key)."""
        codes = np.asarray(key_codes, np.int64).reshape(-1)
        wanted = np.unique(codes[codes >= 0])
        out = np.full((len(wanted) + 1, len(self.metric)), -1, np.int32)  # the last row: keys absent (-1)
        if len(wanted) and len(self.attr_key):
            at = np.minimum(np.searchsorted(wanted, self.attr_key), len(wanted) - 1)
            hit = np.flatnonzero(wanted[at] == self.attr_key)
            out[at[hit], self.rows_of_attrs()[hit]] = self.attr_val[hit]
        return list(out[np.where(codes >= 0, np.searchsorted(wanted, codes), len(wanted))])

    def select(self, rows: np.ndarray) -> "PointBatch":
        """A new batch with only `rows` (a boolean mask, or indices in the order wanted). The
        labels are gathered row by row by a kernel (`select_labels`); `select_reference` is the
        same in numpy's operations, which hold two 8-byte indices per label on top."""
        return self._select(rows, select_labels if self.attr_key.dtype == self.attr_val.dtype == np.int32
                            else _select_labels_numpy)  # the kernel is compiled for codes as decoded

    def select_reference(self, rows: np.ndarray) -> "PointBatch":
        """`select` in numpy's operations: every chosen label's index built, then gathered."""
        return self._select(rows, _select_labels_numpy)

    def _select(self, rows: np.ndarray, gather: Callable[..., tuple[np.ndarray, ...]]) -> "PointBatch":
        rows = np.asarray(rows)
        idx = np.flatnonzero(rows) if rows.dtype == bool else rows.astype(np.int64)
        metric = self.metric[idx]  # IndexError for a row that is not there, before any label is read
        if len(idx) and idx.min() < 0:
            idx = np.where(idx < 0, idx + len(self), idx)
        off, key, val = gather(self.attr_off.astype(np.int64, copy=False), self.attr_key, self.attr_val, idx)
        return PointBatch(metric, self.time_ns[idx], self.value[idx], self.stale[idx],
                          self.resource_node[idx], self.resource_pod[idx], off, key, val)

    def with_labels(self, rows: np.ndarray, keys: tuple[int, ...], values: np.ndarray) -> "PointBatch":
        """The batch with rows `rows` (indices) given labels `keys` = `values` (one row of codes per
        row), last, in place of any labels of those keys they carry."""
        n_point, n_key = len(self), len(keys)
        entry_row = self.rows_of_attrs()
        stamped = np.zeros(n_point, bool)
        stamped[rows] = True
        keep = ~(stamped[entry_row] & np.isin(self.attr_key, keys))
        kept = np.bincount(entry_row[keep], minlength=n_point)
        off = np.zeros(n_point + 1, np.int64)
        np.cumsum(kept + stamped * n_key, out=off[1:])
        key, val = np.empty(int(off[-1]), np.int32), np.empty(int(off[-1]), np.int32)
        kept_off = np.concatenate([np.zeros(1, np.int64), np.cumsum(kept)])
        at = off[entry_row[keep]] + np.arange(int(keep.sum())) - kept_off[entry_row[keep]]
        key[at], val[at] = self.attr_key[keep], self.attr_val[keep]
        tail = (off[rows] + kept[rows])[:, None] + np.arange(n_key)
        key[tail], val[tail] = np.asarray(keys, np.int32)[None, :], values
        return PointBatch(self.metric, self.time_ns, self.value, self.stale, self.resource_node, self.resource_pod,
                          off, key, val, self.rejected, self.ignored, self.sources, self.wal, self.epoch)

    @staticmethod
    def concat(parts: list["PointBatch"]) -> "PointBatch":
        """The rows of `parts`, one after the other (labels re-based)."""
        if not parts:
            return empty_batch()
        offs = [np.zeros(1, np.int64)]
        base = 0
        for p in parts:
            offs.append(p.attr_off[1:] + base)
            base += int(p.attr_off[-1])
        return PointBatch(*(np.concatenate([getattr(p, name) for p in parts]) for name in
                            ("metric", "time_ns", "value", "stale", "resource_node", "resource_pod")),
                          np.concatenate(offs), np.concatenate([p.attr_key for p in parts]),
                          np.concatenate([p.attr_val for p in parts]))


def empty_batch() -> PointBatch:
    i32 = np.zeros(0, np.int32)
    return PointBatch(np.zeros(0, np.int16), np.zeros(0, np.int64), np.zeros(0), np.zeros(0, bool),
                      i32, i32, np.zeros(1, np.int64), i32, i32)


def _any_value_str(value) -> str:  # noqa: ANN001 - protobuf AnyValue
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind is None:
        return ""
    return str(getattr(value, kind))


def source_of(resource_attrs: dict[str, str]) -> str:
    """A scrape target's identity: job and instance, as the prometheus receiver names them."""
    instance = (resource_attrs.get("service.instance.id") or resource_attrs.get("k8s.pod.name")
                or resource_attrs.get("k8s.node.name") or "")
    return f"{resource_attrs.get('service.name', '')}/{instance}"


_RESOURCE_KEYS = frozenset(("k8s.node.name", "k8s.namespace.name", "k8s.pod.name", "service.name",
                            "service.instance.id"))
OWN_POD_KEYS = ("namespace", "pod")


def own_pod_problem(name: str) -> Rejection:
    return rejection(name, "no_own_pod", "from a scrape target without k8s.namespace.name and k8s.pod.name")


def wrong_type(name: str, which: str) -> Rejection:
    return rejection(name, "wrong_type", f"arrived as {which or 'no data'}, expected gauge or sum")


def own_pod(res: dict[str, str], lim: Limits) -> Optional[tuple[str, str]]:
    """The (namespace, pod) a scrape target's resource names, if it names both within the limits."""
    ns, pod = res.get("k8s.namespace.name", ""), res.get("k8s.pod.name", "")
    ok = 0 < len(ns) <= lim.max_label_bytes and 0 < len(pod) <= lim.max_label_bytes
    return (ns, pod) if ok else None


class _Columns:
    """The growing columns of one decode."""

    def __init__(self) -> None:
        self.metric, self.stale = array("h"), array("b")
        self.time_ns, self.value = array("q"), array("d")
        self.res_node, self.res_pod, self.attr_off = array("i"), array("i"), array("q", [0])
        self.attr_key, self.attr_val = array("i"), array("i")

    def batch(self, rejected: Counter[Rejection], ignored: int, sources: dict[str, int]) -> PointBatch:
        def arr(values: array, dtype: type) -> np.ndarray:
            return np.frombuffer(values, dtype=dtype).copy() if len(values) else np.zeros(0, dtype)

        return PointBatch(arr(self.metric, np.int16), arr(self.time_ns, np.int64), arr(self.value, np.float64),
                          arr(self.stale, np.int8).astype(bool), arr(self.res_node, np.int32),
                          arr(self.res_pod, np.int32), arr(self.attr_off, np.int64), arr(self.attr_key, np.int32),
                          arr(self.attr_val, np.int32), rejected, ignored, sources)


def decode_reference(request: ExportMetricsServiceRequest, strings: Interner, limits: Optional[Limits] = None,
                     now_ns: Optional[int] = None) -> PointBatch:
    """The reference decoder, read with protobuf: the columnar decoder's yardstick, and what
    production falls back on where protobuf must read the bytes. `now_ns` is the receive clock the
    timestamps are checked against (default: now)."""
    epoch = strings.epoch
    now = time.time_ns() if now_ns is None else now_ns
    decoding = _Decoding(strings, limits or Limits(), now)
    for rm in request.resource_metrics:
        decoding.resource(rm)
    batch = decoding.cols.batch(decoding.rejected, decoding.ignored, decoding.sources)
    batch.epoch = epoch
    return batch


class _Decoding:
    """One request's points as columns, what was rejected by reason, and each source's clock."""

    def __init__(self, strings: Interner, limits: Limits, now_ns: int) -> None:
        self.code, self.lim = strings.code, limits
        self.horizon = now_ns + limits.max_future_ns
        self.floor = now_ns - limits.max_age_ns if limits.max_age_ns else 1
        self.cols, self.rejected, self.ignored = _Columns(), Counter[Rejection](), 0
        self.sources: dict[str, int] = {}
        self.keys = _RESOURCE_KEYS | limits.trust.keys if limits.trust is not None else _RESOURCE_KEYS

    def resource(self, rm: Any) -> None:
        lim, code = self.lim, self.code
        res = {kv.key: _any_value_str(kv.value) for kv in rm.resource.attributes if kv.key in self.keys}
        node = code(res["k8s.node.name"]) if 0 < len(res.get("k8s.node.name", "")) <= lim.max_label_bytes else -1
        res_pod = code(res["k8s.pod.name"]) if 0 < len(res.get("k8s.pod.name", "")) <= lim.max_label_bytes else -1
        allowed = lim.trust.bits(res) if lim.trust is not None else EVERY
        mine = own_pod(res, lim)
        newest = 0
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                newest = max(newest, self._metric(m, res, allowed, mine, node, res_pod))
        if newest:
            src = source_of(res)
            self.sources[src] = max(self.sources.get(src, 0), newest)

    def _metric(self, metric: Any, res: dict[str, str], allowed: int, mine: Any, node: int, res_pod: int) -> int:
        """Take one metric's points; returns the newest timestamp of those that keep the source's clock."""
        which = metric.WhichOneof("data")
        mcode = KNOWN_METRICS.get(metric.name)
        points = getattr(metric, which).data_points if which in ("gauge", "sum") else ()
        if mcode is None:
            self.ignored += len(points) if which in ("gauge", "sum") else 1
            if metric.name == LIVENESS_METRIC and allowed & CLOCK:  # only the cost sources' clocks count
                return max([0] + [p.time_unix_nano for p in points if self.floor <= p.time_unix_nano <= self.horizon])
            return 0
        name = METRIC_NAME[mcode]  # in reasons: one name per metric, whichever it arrived under
        if which not in ("gauge", "sum"):
            n_point = len(getattr(metric, which).data_points) if which else 0
            self.rejected[wrong_type(name, which)] += max(n_point, 1)
            return 0
        kind = int(KIND_OF_METRIC[mcode])
        if not allowed & kind:
            if points:
                self.rejected[untrusted_reason(kind)] += len(points)
                self.lim.trust.refused(allowed, kind, source_of(res))  # type: ignore[union-attr]
            return 0
        if mcode in OWN_POD_METRICS and mine is None:
            if points:
                self.rejected[own_pod_problem(name)] += len(points)
            return 0
        scale = TO_STORED_UNIT.get(metric.name, 1.0)
        newest = 0
        for p in points:
            if self._point(name, mcode, p, scale, mine, node, res_pod) and kind & CLOCK:
                newest = max(newest, p.time_unix_nano)
        return newest

    def _point(self, name: str, mcode: int, point: Any, scale: float, mine: Any, node: int, res_pod: int) -> bool:
        """Take one point, or count why not; whether it was taken."""
        stale = bool(point.flags & NO_RECORDED_VALUE)
        value = math.nan if stale else _value(point) * scale
        reason, labels = _check(name, mcode, point, value, self.lim, self.floor, self.horizon)
        if reason is not None:
            self.rejected[reason] += 1  # fixed codes per metric: a bounded self-metric
            return False
        if mcode in OWN_POD_METRICS:  # its own pod, whatever the point says
            labels = [kv for kv in labels if kv[0] not in OWN_POD_KEYS] + list(zip(OWN_POD_KEYS, mine))
        cols, code = self.cols, self.code
        for k, v in labels:
            cols.attr_key.append(code(k))
            cols.attr_val.append(code(v))
        cols.metric.append(mcode)
        cols.stale.append(stale)
        cols.time_ns.append(point.time_unix_nano)
        cols.value.append(value)
        cols.res_node.append(node)
        cols.res_pod.append(res_pod)
        cols.attr_off.append(len(cols.attr_key))
        return True


def _value(point) -> float:  # noqa: ANN001 - protobuf NumberDataPoint
    kind = point.WhichOneof("value")
    return point.as_double if kind == "as_double" else float(point.as_int) if kind == "as_int" else math.nan


def _check(name: str, mcode: int, point, value: float, lim: Limits, floor: int,  # noqa: ANN001 - NumberDataPoint
           horizon: int) -> tuple[Optional[Rejection], list[tuple[str, str]]]:
    """(why the point is rejected, None if usable; the labels kept, as strings). `value` is the
    point's, in its metric's stored unit (NaN for a staleness marker)."""
    reason = time_problem(name, point.time_unix_nano, floor, horizon)
    if reason is not None:
        return reason, []
    labels = wanted_labels(point.attributes, lim)
    shape = label_shape(len(point.attributes), labels, lim)
    reason = point_problem(name, mcode, shape, bool(point.flags & NO_RECORDED_VALUE), value)
    return reason, ([] if reason is not None else labels)


# The checks of a point, in the order they are made; the columnar decoder (receiver/columnar.py)
# makes the same ones, the label checks once per distinct label set.

def time_problem(name: str, time_ns: int, floor: int, horizon: int) -> Optional[Rejection]:
    if time_ns == 0:
        return rejection(name, "no_timestamp", "point without a timestamp")
    if time_ns > horizon:
        return rejection(name, "from_the_future", "timestamp ahead of the receive clock")
    if time_ns < floor:
        return rejection(name, "too_old", "timestamp older than the age limit")
    return None


def wanted_labels(attributes, lim: Limits) -> list[tuple[str, str]]:  # noqa: ANN001 - repeated KeyValue
    return [(kv.key, _any_value_str(kv.value)) for kv in attributes if is_wanted(kv.key, lim)]


def is_wanted(key: str, lim: Limits) -> bool:
    """Whether otelgpu reads the label `key` (the others are never interned)."""
    wanted, prefixes = lim.wanted, lim.wanted_prefixes
    return wanted is None or key in wanted or bool(prefixes and key.startswith(prefixes))


@dataclass(frozen=True)
class LabelShape:
    """What the checks need of a point's labels: the first problem with them ("" if none), the
    required keys present, whether only one of the MIG pair is, the last `resource` value."""

    problem: str = ""
    found: frozenset[str] = frozenset()
    mig_half: bool = False
    resource: str = ""


TOO_MANY_LABELS = LabelShape("has too many labels")


def label_shape(n_attributes: int, labels: list[tuple[str, str]], lim: Limits) -> LabelShape:
    if n_attributes > lim.max_attributes:
        return TOO_MANY_LABELS
    found: set[str] = set()  # a set, not a count: a hostile point may repeat a key
    resource, mig_labels = "", 0
    for k, v in labels:
        if len(v) > lim.max_label_bytes or len(k) > lim.max_label_bytes:
            return LabelShape(f"label value longer than {lim.max_label_bytes}")
        if not v and k in IDENTITY_KEYS:  # the Collector drops empty labels; an empty name is no name
            return LabelShape(f"empty label {k}")
        if k in REQUIRED_KEYS:
            found.add(k)
        if k in LABEL_CHECKS:
            problem = LABEL_CHECKS[k](v)
            if problem:
                return LabelShape(problem)
            mig_labels |= 1 if k == "GPU_I_ID" else 2 if k == "GPU_I_PROFILE" else 0
        if k == "resource":
            resource = v
    return LabelShape("", frozenset(found), mig_labels in (1, 2), resource)


def point_problem(name: str, mcode: int, shape: LabelShape, stale: bool, value: float) -> Optional[Rejection]:
    """Why a point with a usable timestamp cannot be used (None when it can)."""
    if shape.problem:
        return rejection(name, "too_many_labels" if shape is TOO_MANY_LABELS else "bad_label", shape.problem)
    required = REQUIRED_LABELS[mcode]
    for k in required:
        if k not in shape.found:
            return rejection(name, "missing_label", f"missing label {k}")
    if shape.mig_half:
        return rejection(name, "mig_pair_incomplete", "has only one of GPU_I_ID and GPU_I_PROFILE")
    if not stale:
        code, problem = value_problem(mcode, value, shape.resource)
        if code:
            return rejection(name, code, problem)
    return None


def _select_labels_numpy(attr_off: np.ndarray, attr_key: np.ndarray, attr_val: np.ndarray,
                         idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`select_labels` in numpy's operations: what interpreted kernels run (a loop per label in
    Python would cost far more)."""
    counts = attr_off[idx + 1] - attr_off[idx]
    off = np.zeros(len(idx) + 1, dtype=np.int64)
    np.cumsum(counts, out=off[1:])
    entries = np.repeat(attr_off[idx] - off[:-1], counts) + np.arange(int(off[-1]), dtype=np.int64)
    return off, attr_key[entries], attr_val[entries]


@kernel(interpreted=_select_labels_numpy)
def select_labels(attr_off: np.ndarray, attr_key: np.ndarray, attr_val: np.ndarray,
                  idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The labels of rows `idx`, in that order: their offsets, keys and values."""
    n = len(idx)
    off = np.zeros(n + 1, np.int64)
    for j in range(n):
        r = idx[j]
        off[j + 1] = off[j] + attr_off[r + 1] - attr_off[r]
    key = np.empty(off[n], attr_key.dtype)
    val = np.empty(off[n], attr_val.dtype)
    for j in range(n):
        r = idx[j]
        at = off[j]
        for k in range(attr_off[r], attr_off[r + 1]):
            key[at] = attr_key[k]
            val[at] = attr_val[k]
            at += 1
    return off, key, val

