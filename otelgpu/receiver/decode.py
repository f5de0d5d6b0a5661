"""OTLP ExportMetricsServiceRequest -> PointBatch: columnar arrays of interned label codes.

One pass over the request. Unknown metrics are skipped on their name alone; for known metrics
each point becomes one row of flat arrays (no dict or object per point). A point that cannot be
used is rejected with a reason, counted, and never stops the rest of the request.
"""

from __future__ import annotations

import math
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from otelgpu.receiver.interner import Interner
from otelgpu.receiver.schema import KNOWN_METRICS, REQUIRED_LABELS, VALUE_RANGE

NO_RECORDED_VALUE = 1
# A point stamped further ahead of this clock would drag the interval watermark into the future
# and make every later point "late": it is rejected instead.
MAX_FUTURE_NS = 600 * 1_000_000_000


@dataclass
class PointBatch:
    """Accepted points of one request, as parallel arrays. `attr_*` hold each row's labels."""

    metric: np.ndarray  # int16, Metric codes
    time_ns: np.ndarray  # int64
    value: np.ndarray  # float64, NaN for staleness markers
    stale: np.ndarray  # bool, flags & NO_RECORDED_VALUE
    resource_node: np.ndarray  # int32, code of the resource's k8s.node.name, or -1
    resource_pod: np.ndarray  # int32, code of the resource's k8s.pod.name (the scraped exporter), or -1
    attr_off: np.ndarray  # int64, row i's labels are attr_key/attr_val[attr_off[i]:attr_off[i+1]]
    attr_key: np.ndarray  # int32
    attr_val: np.ndarray  # int32
    rejected: Counter[str] = field(default_factory=Counter)
    ignored: int = 0  # points of metrics otelgpu does not consume

    def __len__(self) -> int:
        return len(self.metric)

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

    def select(self, rows: np.ndarray) -> "PointBatch":
        """A new batch with only `rows` (a boolean mask)."""
        counts = np.diff(self.attr_off)
        keep_attr = np.repeat(rows, counts)
        off = np.zeros(int(rows.sum()) + 1, dtype=np.int64)
        np.cumsum(counts[rows], out=off[1:])
        return PointBatch(
            self.metric[rows], self.time_ns[rows], self.value[rows], self.stale[rows],
            self.resource_node[rows], self.resource_pod[rows], off, self.attr_key[keep_attr], self.attr_val[keep_attr],
        )


def describe_rejections(rejected: Counter[str]) -> str:
    """The partial_success error message: counts by reason, most frequent first."""
    return "; ".join(f"{n} {reason}" for reason, n in rejected.most_common())


def _any_value_str(v) -> str:  # noqa: ANN001 - protobuf AnyValue
    kind = v.WhichOneof("value")
    if kind == "string_value":
        return v.string_value
    if kind is None:
        return ""
    return str(getattr(v, kind))


def decode(request: ExportMetricsServiceRequest, strings: Interner) -> PointBatch:
    metric, stale = array("h"), array("b")
    time_ns, value = array("q"), array("d")
    res_node, res_pod, attr_off = array("i"), array("i"), array("q", [0])
    attr_key, attr_val = array("i"), array("i")
    rejected: Counter[str] = Counter()
    ignored = 0
    code = strings.code
    horizon = time.time_ns() + MAX_FUTURE_NS
    for rm in request.resource_metrics:
        node = own_pod = -1
        for kv in rm.resource.attributes:
            if kv.key == "k8s.node.name":
                node = code(_any_value_str(kv.value))
            elif kv.key == "k8s.pod.name":
                own_pod = code(_any_value_str(kv.value))
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                which = m.WhichOneof("data")
                mcode = KNOWN_METRICS.get(m.name)
                if mcode is None:
                    ignored += len(getattr(m, which).data_points) if which in ("gauge", "sum") else 1
                    continue
                if which not in ("gauge", "sum"):
                    n = len(getattr(m, which).data_points) if which else 0
                    rejected[f"{m.name} arrived as {which or 'no data'}, expected gauge or sum"] += max(n, 1)
                    continue
                required = [code(k) for k in REQUIRED_LABELS[mcode]]
                lo, hi = VALUE_RANGE.get(mcode, (-math.inf, math.inf))
                for p in m.gauge.data_points if which == "gauge" else m.sum.data_points:
                    is_stale = bool(p.flags & NO_RECORDED_VALUE)
                    kind = p.WhichOneof("value")
                    v = math.nan if is_stale or kind is None else (p.as_double if kind == "as_double" else float(p.as_int))
                    if not is_stale:
                        if kind is None:
                            rejected[f"{m.name} point without a value"] += 1
                            continue
                        if not math.isfinite(v):
                            rejected[f"{m.name} non-finite value"] += 1
                            continue
                        if not lo <= v <= hi:
                            rejected[f"{m.name} value outside [{lo:g}, {hi:g}]"] += 1  # fixed key: bounded self-metric
                            continue
                    if p.time_unix_nano == 0:
                        rejected[f"{m.name} point without a timestamp"] += 1
                        continue
                    if p.time_unix_nano > horizon:
                        rejected[f"{m.name} timestamp more than 10 minutes in the future"] += 1
                        continue
                    start = len(attr_key)
                    for kv in p.attributes:
                        attr_key.append(code(kv.key))
                        attr_val.append(code(_any_value_str(kv.value)))
                    present = attr_key[start:]
                    missing = [k for k in required if k not in present]
                    if missing:
                        del attr_key[start:], attr_val[start:]
                        rejected[f"{m.name} missing label {strings.string(missing[0])}"] += 1
                        continue
                    metric.append(mcode)
                    stale.append(is_stale)
                    time_ns.append(p.time_unix_nano)
                    value.append(v)
                    res_node.append(node)
                    res_pod.append(own_pod)
                    attr_off.append(len(attr_key))
    return PointBatch(
        metric=np.frombuffer(metric, dtype=np.int16).copy(),
        time_ns=np.frombuffer(time_ns, dtype=np.int64).copy(),
        value=np.frombuffer(value, dtype=np.float64).copy(),
        stale=np.frombuffer(stale, dtype=np.int8).astype(bool),
        resource_node=np.frombuffer(res_node, dtype=np.int32).copy(),
        resource_pod=np.frombuffer(res_pod, dtype=np.int32).copy(),
        attr_off=np.frombuffer(attr_off, dtype=np.int64).copy(),
        attr_key=np.frombuffer(attr_key, dtype=np.int32).copy(),
        attr_val=np.frombuffer(attr_val, dtype=np.int32).copy(),
        rejected=rejected,
        ignored=ignored,
    )
