"""The columnar decoder: an ExportMetricsServiceRequest's bytes -> PointBatch, with no Python work
per point.

The numba kernel (`wire.scan`) reads the bytes once and matches each point's attributes, by their
wire bytes, against a table of the label sets seen before. A label set is decoded, checked and
interned the first time it is seen; every later point carrying the same bytes (the next scrape of
the same GPU or pod, the other metrics of the same series) reuses it. A set is kept as the ids of
its attribute fields' bytes ("pieces", each kept once with its label's interned codes: the
namespace every pod of it carries is one piece), so a set costs a few bytes per label. What is
left per point is numpy over whole columns: timestamp, label and value checks, the attribute rows
of the accepted points. A point some fast check cannot pass is judged by the reference's own checks
(decode.time_problem, point_problem), so rejections carry the reference's reasons.

Where the kernel is not sure it reads the bytes as protobuf does, `decode` returns None and the
caller uses the reference decoder (decode.py): the two agree on every request protobuf reads, and
on one it refuses for a defect in what otelgpu skips, the columnar decoder takes the rest (see
receiver/wire.py and tests/receiver/test_columnar.py).

The table follows the live cluster: once it has doubled since it was last swept, the label sets
no point has carried for SET_IDLE_NS of data time (pods gone, series ended) are dropped, as a
compaction of the interner drops strings. It holds interned codes, so it is emptied whenever the
interner is compacted. One decode at a time uses it (a lock): the kernel holds the GIL anyway.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from typing import Optional

import numpy as np
from google.protobuf.message import DecodeError
from opentelemetry.proto.metrics.v1.metrics_pb2 import NumberDataPoint
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from otelgpu.core.grouping import gather_runs
from otelgpu.core.jit import kernel
from otelgpu.receiver import wire
from otelgpu.receiver.decode import (
    _RESOURCE_KEYS,
    OWN_POD_KEYS,
    NO_RECORDED_VALUE,
    TOO_MANY_LABELS,
    LabelShape,
    PointBatch,
    _any_value_str,
    is_wanted,
    label_shape,
    own_pod,
    own_pod_problem,
    point_problem,
    select_labels,
    source_of,
    time_problem,
    wanted_labels,
    wrong_type,
)
from otelgpu.receiver.interner import Interner
from otelgpu.receiver.limits import Limits
from otelgpu.receiver.rejection import Rejection
from otelgpu.receiver.sources import CLOCK, EVERY, KIND_OF_METRIC, SourceTrust, untrusted_reason
from otelgpu.receiver.schema import (
    KNOWN_METRICS,
    LIVENESS_METRIC,
    METRIC_NAME,
    OWN_POD_METRICS,
    REQUIRED_LABELS,
    TO_STORED_UNIT,
    VALUE_RANGE,
    Metric,
    quantity_bounds,
)

_CODES = max(int(m) for m in Metric) + 1
_QUANTITY = np.zeros(_CODES, bool)
_QUANTITY[[Metric.POD_REQUESTS, Metric.NODE_CAPACITY]] = True
_OWN_POD = np.zeros(_CODES, bool)
_OWN_POD[list(OWN_POD_METRICS)] = True
_LO = np.full(_CODES, -np.inf)
_HI = np.full(_CODES, np.inf)
for _m, (_lo, _hi) in VALUE_RANGE.items():
    _LO[_m], _HI[_m] = _lo, _hi

MAX_SETS = 1 << 21  # beyond this many label sets (or bytes of pieces x 64) the table starts afresh
MAX_SHAPES = 1 << 12  # distinct label shapes: a few dozen in a cluster; beyond, the table starts afresh
SWEEP_FROM = 1 << 12  # sets before the first sweep
SET_IDLE_NS = 300 * 10**9  # a set no point carried for this long (data time) is dropped at a sweep
MAX_RESOURCES = 4096  # distinct scrape-target resources remembered
SCAN_POINTS = 1 << 16  # consumed points room is made for before a scan; a request with more is scanned again
UNREAD = -3  # a point's set: not looked up (its scrape target may not send its kind)
UNSEEN, UNWANTED = -2, -1  # a piece's key code: not yet read (only sets with a problem used it), a label not read


def _names() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The metric names the kernel recognises: the consumed ones, each reported as its index in
    KNOWN_METRICS (its metric and unit are looked up after the scan), and the liveness metric."""
    names = [(n.encode(), i) for i, n in enumerate(KNOWN_METRICS)] + [(LIVENESS_METRIC.encode(), wire.LIVENESS)]
    blob = np.frombuffer(b"".join(n for n, _ in names), np.uint8).copy()
    off = np.zeros(len(names) + 1, np.int64)
    np.cumsum([len(n) for n, _ in names], out=off[1:])
    return blob, off, np.array([c for _, c in names], np.int64)


_NAME_BLOB, _NAME_OFF, _NAME_CODE = _names()
# Per name the kernel reports: its metric, and the factor to that metric's stored unit.
_NAME_METRIC = np.array([int(c) for c in KNOWN_METRICS.values()], np.int16)
_NAME_SCALE = np.array([TO_STORED_UNIT.get(n, 1.0) for n in KNOWN_METRICS])


def _grown(table: np.ndarray, need: int, fill: int = 0) -> np.ndarray:
    """`a` with room for `need` entries: half as large again, so at most a third of a table that
    grew is room (the label-set tables of 100,000 GPUs are some 150 MiB). Room filled with zeros
    is not written: a table of the allocator's mmap threshold or more is mapped apart (`heap.py`),
    and its pages not yet used take no memory until they are."""
    if need <= len(table):
        return table
    size = max(need, len(table) + len(table) // 2)
    out = np.zeros(size, table.dtype) if fill == 0 else np.full(size, fill, table.dtype)
    out[:len(table)] = table
    return out


class _Unsure(Exception):
    """Protobuf must read this request: the reference decoder takes it."""


class ColumnarDecoder:
    """Decodes requests for one interner with one set of limits."""

    def __init__(self, strings: Interner, limits: Optional[Limits] = None) -> None:
        self.strings = strings
        self.limits = limits or Limits()
        self.lock = threading.Lock()
        self.seed = np.uint64(random.getrandbits(64))  # crafted hash collisions cannot be planned
        self.renumbered = 0  # set ids change at every clear and sweep
        self._clear()

    def _clear(self) -> None:
        self.epoch = self.strings.epoch
        self.renumbered += 1
        self.sets = 0
        self.slots = np.full(1 << 12, -1, np.int32)
        self.set_hash = np.zeros(1 << 10, np.uint64)
        self.set_shape = np.zeros(1 << 10, np.int32)
        # Newest time of an accepted point carrying it, in whole seconds (`_seconds`): a sweep keeps
        # what was seen in the last SET_IDLE_NS, and 4 bytes a set where nanoseconds took 8
        self.set_seen = np.zeros(1 << 10, np.uint32)
        self.newest_ns = 0
        self.kept = 0  # sets the last sweep kept
        # Each set as the ids of its attribute fields' distinct bytes ("pieces": a pod's name, a
        # GPU's UUID, the same namespace on every pod of it), each piece kept once with its label's
        # interned key and value: a set's labels are those of its pieces otelgpu reads, in order.
        self.set_pieces = np.zeros(1 << 12, np.int32)
        self.set_off = np.zeros((1 << 10) + 1, np.int32)  # the table starts afresh long before 2**31 pieces
        self.pieces = np.zeros(1 << 14, np.uint8)
        self.piece_off = np.zeros((1 << 10) + 1, np.int64)
        self.piece_hash = np.zeros(1 << 10, np.uint64)
        self.piece_slots = np.full(1 << 11, -1, np.int32)
        self.piece_key = np.full(1 << 10, UNSEEN, np.int32)
        self.piece_val = np.full(1 << 10, UNSEEN, np.int32)
        self.n_pieces = 0
        # Distinct label shapes, with what the vectorised checks need of each.
        self.shapes: list[LabelShape] = []
        self._shape_index: dict[LabelShape, int] = {}
        self.shape_ok = np.zeros((0, _CODES), bool)  # no problem, required keys present, MIG pair whole
        self.shape_q = np.zeros((0, 3))  # quantity bounds of its `resource`: lo, hi, whole
        self._resources: dict[bytes, tuple[int, int, str, int, int]] = {}

    def __len__(self) -> int:
        return self.sets

    def decode(self, raw: bytes, now_ns: Optional[int] = None) -> Optional[PointBatch]:
        """The batch, or None when the reference decoder must read `raw`."""
        lim = self.limits
        now = time.time_ns() if now_ns is None else now_ns
        horizon = now + lim.max_future_ns
        floor = now - lim.max_age_ns if lim.max_age_ns else 1
        buf = np.frombuffer(raw, np.uint8)
        with self.lock:
            epoch = self.strings.epoch
            if (epoch != self.epoch or self.sets > MAX_SETS or self._piece_bytes() > 64 * MAX_SETS
                    or len(self.shapes) > MAX_SHAPES):
                self._clear()
            elif self.sets >= max(SWEEP_FROM, 2 * self.kept):
                self.sweep(self.newest_ns - SET_IDLE_NS)
            cols = self._scan(buf, floor, horizon)
            if cols is None:
                return None
            try:
                resources = [self._resource(raw, int(a), int(b)) for a, b in cols["r_res"]]
                _untrusted(cols, resources)
                self._learn(raw, buf, cols)
            except _Unsure:
                return None
            set_off, set_pieces, piece_key, piece_val = self.set_off, self.set_pieces, self.piece_key, self.piece_val
            shapes, shape_ok, shape_q = self.shapes, self.shape_ok, self.shape_q
            set_shape = self.set_shape[:self.sets]  # a view: sets are only appended, sweeps make new arrays
            numbering = self.renumbered
            own_keys = (self.strings.code(OWN_POD_KEYS[0]), self.strings.code(OWN_POD_KEYS[1]))
        batch, rows = _columns(cols, resources, floor, horizon, set_shape, shapes, shape_ok, shape_q,
                               (set_off, set_pieces, piece_key, piece_val), own_keys, lim.trust)
        if len(rows):
            with self.lock:
                if self.renumbered == numbering:  # not emptied or swept meanwhile
                    np.maximum.at(self.set_seen, cols["p_set"][rows], _seconds(batch.time_ns))
                    self.newest_ns = max(self.newest_ns, int(batch.time_ns.max()))
        batch.epoch = epoch
        return batch

    def table_bytes(self) -> int:
        """What the label-set table's arrays take."""
        with self.lock:
            return sum(a.nbytes for a in vars(self).values() if isinstance(a, np.ndarray))

    def _piece_bytes(self) -> int:
        """What the pieces and the sets' references to them take."""
        return sum(a.nbytes for a in (self.pieces, self.piece_off, self.piece_hash, self.piece_slots, self.set_pieces,
                                      self.piece_key, self.piece_val))

    def sweep(self, cutoff_ns: int) -> None:
        """Drop the label sets no accepted point carried since `cutoff_ns`."""
        n_set = self.sets
        keep = np.flatnonzero(self.set_seen[:n_set] >= _seconds(cutoff_ns))
        set_pieces, set_off = _gather(self.set_pieces, self.set_off, keep)
        self.set_off = set_off.astype(np.int32)
        used, renumbered = np.unique(set_pieces, return_inverse=True)  # the pieces kept sets still use
        self.set_pieces = renumbered.reshape(-1).astype(np.int32)
        self.pieces, self.piece_off = _gather(self.pieces, self.piece_off, used)
        self.piece_hash, self.n_pieces = self.piece_hash[used], len(used)
        self.piece_key, self.piece_val = self.piece_key[used], self.piece_val[used]
        self._rehash_pieces(max(1 << 11, 1 << (2 * self.n_pieces).bit_length()))
        self.set_hash, self.set_shape, self.set_seen = self.set_hash[keep], self.set_shape[keep], self.set_seen[keep]
        self.sets = self.kept = len(keep)
        self.renumbered += 1
        self._rehash(max(1 << 12, 1 << (2 * self.sets).bit_length()))

    def _rehash(self, size: int) -> None:
        """A slot table of `size` (a power of two) holding every set."""
        self.slots = np.full(size, -1, np.int32)
        wire.place_sets(self.slots, self.set_hash, self.sets)

    def _rehash_pieces(self, size: int) -> None:
        """A slot table of `size` (a power of two) holding every piece."""
        self.piece_slots = np.full(size, -1, np.int32)
        wire.place_sets(self.piece_slots, self.piece_hash, self.n_pieces)

    def _scan(self, buf: np.ndarray, floor: int, horizon: int) -> Optional[dict[str, np.ndarray]]:
        cap, rcap = max(16, min(len(buf) // 64, SCAN_POINTS)), 64
        while True:
            columns = {
                "p_metric": np.empty(cap, np.int16), "p_res": np.empty(cap, np.int32),
                "p_time": np.empty(cap, np.int64), "p_value": np.empty(cap, np.float64),
                "p_flags": np.empty(cap, np.int64),
                "p_set": np.empty(cap, np.int32), "p_hash": np.empty(cap, np.uint64),
                "p_dp": np.empty((cap, 2), np.int64),
                "r_res": np.empty((rcap, 2), np.int64), "r_live": np.empty(rcap, np.int64),
                "wrong": np.zeros((len(_NAME_METRIC), len(wire.WHICH)), np.int64),
            }
            status, n_point, nres, ignored = wire.scan(
                buf, _NAME_BLOB, _NAME_OFF, _NAME_CODE, wire.SCHEMA.kind, self.slots, self.set_hash, self.set_pieces,
                self.set_off, self.pieces, self.piece_off, self.seed, floor, horizon, self.limits.max_attributes,
                columns["p_metric"], columns["p_res"], columns["p_time"], columns["p_value"], columns["p_flags"],
                columns["p_set"], columns["p_hash"], columns["p_dp"], columns["r_res"], columns["r_live"],
                columns["wrong"])
            if status != wire.OK:
                return None
            if n_point <= cap and nres <= rcap:
                break
            cap, rcap = max(cap, n_point), max(rcap, nres)
        out = {k: (v[:n_point] if k.startswith("p_") else v[:nres]) for k, v in columns.items() if k != "wrong"}
        name = out["p_metric"]
        with np.errstate(invalid="ignore"):  # a signalling NaN: judged as any NaN
            out["p_metric"], out["p_value"] = _NAME_METRIC[name], out["p_value"] * _NAME_SCALE[name]
        out["wrong"] = np.zeros((_CODES, len(wire.WHICH)), np.int64)
        np.add.at(out["wrong"], _NAME_METRIC, columns["wrong"])
        out["ignored"] = np.int64(ignored)
        return out

    def _learn(self, raw: bytes, buf: np.ndarray, cols: dict[str, np.ndarray]) -> None:
        """Enter the label sets of this request not yet in the table, and point their points at them."""
        p_set, p_hash, p_dp = cols["p_set"], cols["p_hash"], cols["p_dp"]
        unknown = np.flatnonzero(p_set == -1)
        while len(unknown):
            _, first = np.unique(p_hash[unknown], return_index=True)
            for i in unknown[np.sort(first)].tolist():  # in the request's order: strings too are interned so
                self._add(raw, buf, int(p_dp[i, 0]), int(p_dp[i, 1]), p_hash[i])
            found = np.empty(len(unknown), np.int32)
            wire.find_sets(buf, p_dp[unknown], p_hash[unknown], self.limits.max_attributes, self.slots, self.set_hash,
                           self.set_pieces, self.set_off, self.pieces, self.piece_off, found)
            p_set[unknown] = found
            unknown = unknown[found == -1]  # two sets with one hash: the next round enters the other

    def _add(self, raw: bytes, buf: np.ndarray, start: int, end: int, hashed: np.uint64) -> None:
        try:
            point = NumberDataPoint.FromString(raw[start:end])
        except DecodeError:
            raise _Unsure() from None
        labels = wanted_labels(point.attributes, self.limits)
        shape = label_shape(len(point.attributes), labels, self.limits)
        set_id = self.sets
        self.set_hash = _grown(self.set_hash, set_id + 1)
        self.set_shape = _grown(self.set_shape, set_id + 1)
        self.set_seen = _grown(self.set_seen, set_id + 1)
        self.set_off = _grown(self.set_off, set_id + 2)
        at, fields = int(self.set_off[set_id]), self.limits.max_attributes  # a set of more is never entered
        self.set_pieces = _grown(self.set_pieces, at + fields)
        self.piece_hash = _grown(self.piece_hash, self.n_pieces + fields)
        self.piece_key = _grown(self.piece_key, self.n_pieces + fields, UNSEEN)
        self.piece_val = _grown(self.piece_val, self.n_pieces + fields, UNSEEN)
        self.piece_off = _grown(self.piece_off, self.n_pieces + fields + 1)
        self.pieces = _grown(self.pieces, int(self.piece_off[self.n_pieces]) + (end - start))
        if 2 * (self.n_pieces + fields) > len(self.piece_slots):
            self._rehash_pieces(1 << (2 * (self.n_pieces + fields)).bit_length())
        n_piece, self.n_pieces = wire.enter_pieces(buf, start, end, self.seed, self.piece_slots, self.piece_hash,
                                                   self.pieces, self.piece_off, self.n_pieces, self.set_pieces[at:])
        if n_piece != len(point.attributes):
            raise _Unsure()  # the kernel and protobuf count its labels differently
        if not shape.problem:
            self._read_pieces(point, self.set_pieces[at:at + n_piece].tolist())
        self.set_off[set_id + 1] = at + n_piece
        self.set_hash[set_id] = hashed
        self.set_shape[set_id] = self._shape(shape)
        # a set whose points are all refused is swept with the next idle ones
        self.set_seen[set_id] = _seconds(self.newest_ns)
        self.sets = set_id + 1
        if 2 * self.sets > len(self.slots):
            self._rehash(2 * len(self.slots))
        else:
            wire.place_set(self.slots, self.set_hash, set_id)

    def _read_pieces(self, point: NumberDataPoint, pieces: list[int]) -> None:
        """The key and value codes of the pieces of `point`'s attributes (`pieces`, in order) not
        read before; strings are interned in the order of the labels met, as for a whole set."""
        code, key, val = self.strings.code, self.piece_key, self.piece_val
        for piece, kv in zip(pieces, point.attributes):
            if key[piece] == UNSEEN:
                if is_wanted(kv.key, self.limits):
                    key[piece], val[piece] = code(kv.key), code(_any_value_str(kv.value))
                else:
                    key[piece] = val[piece] = UNWANTED

    def _shape(self, shape: LabelShape) -> int:
        index = self._shape_index.get(shape)
        if index is None:
            index = self._shape_index[shape] = len(self.shapes)
            self.shapes.append(shape)
            ok = np.zeros(_CODES, bool)
            if not shape.problem and not shape.mig_half:
                for m in METRIC_NAME:
                    ok[m] = all(k in shape.found for k in REQUIRED_LABELS[Metric(m)])
            self.shape_ok = np.vstack([self.shape_ok, ok[None, :]])
            lo, hi, whole = quantity_bounds(shape.resource)
            self.shape_q = np.vstack([self.shape_q, [[lo, hi, float(whole)]]])
        return index

    def _resource(self, raw: bytes, start: int, end: int) -> tuple[int, int, str, int, int]:
        """(node code, own pod code, source, kinds it may send, own namespace code) of a scrape
        target's Resource at raw[a:b]; the namespace is -1 unless it names both (`own_pod`)."""
        key = raw[start:end] if start >= 0 else b""
        known = self._resources.get(key)
        if known is not None:
            return known
        try:
            attrs = Resource.FromString(key).attributes
        except DecodeError:
            raise _Unsure() from None
        lim, code, trust = self.limits, self.strings.code, self.limits.trust
        keys = _RESOURCE_KEYS | trust.keys if trust is not None else _RESOURCE_KEYS
        res = {kv.key: _any_value_str(kv.value) for kv in attrs if kv.key in keys}
        node = code(res["k8s.node.name"]) if 0 < len(res.get("k8s.node.name", "")) <= lim.max_label_bytes else -1
        pod = code(res["k8s.pod.name"]) if 0 < len(res.get("k8s.pod.name", "")) <= lim.max_label_bytes else -1
        mine = own_pod(res, lim)
        ns = code(mine[0]) if mine is not None else -1
        out = (node, pod, source_of(res), trust.bits(res) if trust is not None else EVERY, ns)
        if len(self._resources) < MAX_RESOURCES:
            self._resources[key] = out
        return out


def _untrusted(cols: dict[str, np.ndarray], resources: list[tuple[int, int, str, int, int]]) -> None:
    """Mark the points of a kind their scrape target may not send (`cols["untrusted"]`): they keep
    no label set (their labels are never read or interned, as the reference decoder never reads
    them) and are refused in `_columns`."""
    metric, p_set = cols["p_metric"].astype(np.int64), cols["p_set"]
    allowed = np.array([r[3] for r in resources], np.int64)
    untrusted = (allowed[cols["p_res"]] & KIND_OF_METRIC[metric]) == 0 if len(metric) else np.zeros(0, bool)
    p_set[untrusted & (p_set == -1)] = UNREAD
    cols["untrusted"] = untrusted


def _labels_numpy(chosen: np.ndarray, set_off: np.ndarray, set_pieces: np.ndarray, piece_key: np.ndarray,
                  piece_val: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_labels` in numpy's operations: what interpreted kernels run, and its reference."""
    pieces, off = _gather(set_pieces, set_off, chosen)
    keys, vals = piece_key[pieces], piece_val[pieces]
    wanted = keys >= 0
    if wanted.all():
        return off, keys, vals
    kept = np.zeros(len(pieces) + 1, np.int64)  # pieces read before each
    np.cumsum(wanted, out=kept[1:])
    return kept[off], keys[wanted], vals[wanted]


@kernel(interpreted=_labels_numpy)
def _labels(chosen, set_off, set_pieces, piece_key, piece_val):  # noqa: ANN001, ANN202 - numba
    """The labels of the sets `chosen` (sets of usable points: every piece of theirs is read), as
    a batch's offsets, key codes and value codes: each set's pieces otelgpu reads, in order. Two
    passes over the sets' pieces, counting then copying, where numpy gathered every piece's
    place, then its key and value, then the ones read."""
    n = len(chosen)
    off = np.zeros(n + 1, np.int64)
    for i in range(n):
        wanted = 0
        for at in range(set_off[chosen[i]], set_off[chosen[i] + 1]):
            wanted += piece_key[set_pieces[at]] >= 0
        off[i + 1] = off[i] + wanted
    keys = np.empty(off[n], piece_key.dtype)
    vals = np.empty(off[n], piece_val.dtype)
    for i in range(n):
        out = off[i]
        for at in range(set_off[chosen[i]], set_off[chosen[i] + 1]):
            piece = set_pieces[at]
            if piece_key[piece] >= 0:
                keys[out] = piece_key[piece]
                vals[out] = piece_val[piece]
                out += 1
    return off, keys, vals


def _seconds(time_ns: np.ndarray | int) -> np.ndarray:
    """Data times as whole seconds, uint32 (up to 2106; before 1970 reads as 0)."""
    return np.clip(np.asarray(time_ns) // 1_000_000_000, 0, np.iinfo(np.uint32).max).astype(np.uint32)


def _gather(values: np.ndarray, off: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The runs values[off[k]:off[k+1]] of the sets `keep`, packed, and their new offsets."""
    counts = off[keep + 1] - off[keep]
    new_off = np.zeros(len(keep) + 1, np.int64)
    np.cumsum(counts, out=new_off[1:])
    return gather_runs(values, off[keep], counts), new_off


def _columns(columns: dict[str, np.ndarray], resources: list[tuple[int, int, str, int, int]], floor: int, horizon: int,
             set_shape: np.ndarray, shapes: list[LabelShape], shape_ok: np.ndarray, shape_q: np.ndarray,
             pieces: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], own_keys: tuple[int, int],
             trust: Optional[SourceTrust] = None) -> tuple[PointBatch, np.ndarray]:
    """The batch, and the scanned points it kept (indices into c's columns). `pieces`: the sets'
    offsets and pieces, the pieces' key and value codes (`_labels`). `own_keys`: the codes of
    `namespace` and `pod`, which points of OWN_POD_METRICS take from their resource."""
    metric, time_ns = columns["p_metric"].astype(np.int64), columns["p_time"]
    value, sets = columns["p_value"], columns["p_set"]
    stale = (columns["p_flags"] & NO_RECORDED_VALUE) != 0
    rejected: Counter[Rejection] = Counter()
    # Points of a kind their scrape target may not send: refused whatever else is wrong with them.
    kind, untrusted = KIND_OF_METRIC[metric], columns["untrusted"]
    if untrusted.any():
        _refused(rejected, trust, resources, kind, untrusted, columns["p_res"])
    # Points that belong to their scrape target's pod, from a target that names none.
    res_ns = np.array([r[4] for r in resources], np.int32)
    own = _OWN_POD[metric] & ~untrusted
    homeless = own & (res_ns[columns["p_res"]] < 0)
    for m, n in zip(*np.unique(metric[homeless], return_counts=True)):
        rejected[own_pod_problem(METRIC_NAME[int(m)])] += int(n)
    ok = _checked(metric, time_ns, value, sets, stale, ~untrusted & ~homeless, floor, horizon, set_shape, shapes,
                  shape_ok, shape_q, rejected)
    for m, which in zip(*np.nonzero(columns["wrong"])):
        rejected[wrong_type(METRIC_NAME[int(m)], wire.WHICH[which])] += int(columns["wrong"][m, which])

    rows = np.flatnonzero(ok)
    res = columns["p_res"][rows]
    res_node = np.array([r[0] for r in resources], np.int32)
    res_pod = np.array([r[1] for r in resources], np.int32)
    off, keys, vals = _labels(sets[rows].astype(np.int64), *pieces)
    times = time_ns[rows]
    batch = PointBatch(metric[rows].astype(np.int16), times, np.where(stale[rows], np.nan, value[rows]),
                       stale[rows], res_node[res] if len(rows) else np.zeros(0, np.int32),
                       res_pod[res] if len(rows) else np.zeros(0, np.int32), off, keys, vals,
                       rejected, int(columns["ignored"]))
    mine = np.flatnonzero(own[rows])
    if len(mine):  # their own pod, whatever the points say
        batch = batch.with_labels(mine, own_keys, np.stack([res_ns[res[mine]], res_pod[res[mine]]], axis=1))
    _clocks(batch, resources, columns["r_live"], res, times)
    return batch, rows


def _refused(rejected: Counter[Rejection], trust: Optional[SourceTrust], resources: list[tuple[int, int, str, int, int]],
             kind: np.ndarray, untrusted: np.ndarray, point_res: np.ndarray) -> None:
    """Count the points of a kind their scrape target may not send, and tell the trust rules."""
    for bit, n in zip(*np.unique(kind[untrusted], return_counts=True)):
        rejected[untrusted_reason(int(bit))] += int(n)
    if trust is not None:
        for r in np.unique(point_res[untrusted]).tolist():
            trust.refused(resources[r][3], int(np.bitwise_or.reduce(kind[untrusted & (point_res == r)])),
                          resources[r][2])


def _checked(metric: np.ndarray, time_ns: np.ndarray, value: np.ndarray, sets: np.ndarray, stale: np.ndarray,
             judged: np.ndarray, floor: int, horizon: int, set_shape: np.ndarray, shapes: list[LabelShape],
             shape_ok: np.ndarray, shape_q: np.ndarray, rejected: Counter[Rejection]) -> np.ndarray:
    """Which of the `judged` points are usable. The checks every usable point passes run over
    whole columns; a point failing one is judged alone, and counted by its reason."""
    known = sets >= 0
    shape = np.where(known, set_shape[np.where(known, sets, 0)] if len(set_shape) else 0, 0)
    ok = known & (time_ns != 0) & (time_ns <= horizon) & (time_ns >= floor)
    if len(shapes):
        ok &= shape_ok[shape, metric]
        bounds = shape_q[shape]
        with np.errstate(invalid="ignore"):
            in_range = np.isfinite(value) & (_LO[metric] <= value) & (value <= _HI[metric])
            whole = (bounds[:, 2] == 0) | (value == np.floor(value))
            quantity = (bounds[:, 0] <= value) & (value <= bounds[:, 1]) & whole
        ok &= stale | (in_range & (~_QUANTITY[metric] | quantity))
    ok &= judged
    for i in np.flatnonzero(~ok & judged).tolist():
        name, code = METRIC_NAME[int(metric[i])], int(metric[i])
        set_id = int(sets[i])
        label = TOO_MANY_LABELS if set_id == -2 else shapes[int(set_shape[set_id])]
        reason = (time_problem(name, int(time_ns[i]), floor, horizon)
                  or point_problem(name, code, label, bool(stale[i]), float(value[i])))
        if reason is not None:
            rejected[reason] += 1
        else:
            ok[i] = True
    return ok


def _clocks(batch: PointBatch, resources: list[tuple[int, int, str, int, int]], live: np.ndarray, res: np.ndarray,
            times: np.ndarray) -> None:
    """Each source's newest timestamp into `batch.sources`. Only the cost sources' clocks move the
    watermark: `up` of a target trusted with none of their kinds, and points of other kinds, are
    left out."""
    newest = np.where(np.array([r[3] for r in resources], np.int64) & CLOCK != 0, live, 0)
    clocked = (KIND_OF_METRIC[batch.metric] & CLOCK) != 0
    np.maximum.at(newest, res[clocked], times[clocked])
    for r in np.flatnonzero(newest).tolist():
        src = resources[r][2]
        batch.sources[src] = max(batch.sources.get(src, 0), int(newest[r]))


def warm_up() -> str:
    """Compile (or load from numba's cache) the decoder's kernels with one small request; returns
    how (see otelgpu.core.jit.how_loaded)."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    from otelgpu.core.jit import how_loaded

    req = ExportMetricsServiceRequest()
    metric = req.resource_metrics.add().scope_metrics.add().metrics.add(name="DCGM_FI_DEV_GPU_UTIL")
    metric.gauge.data_points.add(time_unix_nano=time.time_ns(),
                                 as_double=1.0).attributes.add(key="UUID").value.string_value = "x"
    raw = req.SerializeToString()
    decoder = ColumnarDecoder(Interner())
    decoder.decode(raw)
    decoder.decode(raw)  # again: found in the table this time
    decoder.sweep(0)
    one = np.zeros(1, np.int32)
    select_labels(np.zeros(2, np.int64), one, one, np.zeros(1, np.int64))  # PointBatch.select
    return how_loaded(wire.scan)
