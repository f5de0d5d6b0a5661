"""numba kernels over the protobuf bytes of an ExportMetricsServiceRequest.

`scan` walks the request once and writes one row per data point of a consumed gauge or sum
metric (its metric code, scrape target, timestamp, value, flags and the label set its attributes
match in the label-set table), without making a Python object per point. What otelgpu does not
read is skipped on its framing alone: the metrics it does not consume (their points are counted,
never opened), scopes, descriptions, units, exemplars, schema URLs.

The kernels never decide a request is undecodable. Wherever their reading of what otelgpu reads
could differ from protobuf's (a truncated or overrunning field, a field repeated where protobuf
keeps the last, a field of an unexpected wire type, a group, a oneof given twice) they answer
UNSURE, and the request is decoded by the reference decoder (receiver/decode.py), whose answer
stands. So on every request protobuf reads, both decoders give the same columns. A request
protobuf refuses only for a defect inside what otelgpu skips (bad UTF-8 in the description of a
metric it ignores, say) is refused whole by the reference decoder; the columnar decoder takes its
other points, as the Collector's own receiver, which does not check UTF-8, would. The strings
otelgpu does read (resources, the labels of consumed points) are parsed by protobuf once per
distinct label set, so they are checked as protobuf checks them.

The schema table (`SCHEMA`: the wire type of each field) comes from the protobuf descriptors.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from otelgpu.core.jit import kernel, load_u64

OK, UNSURE = 0, 1

# Field kinds in the schema tables.
UNKNOWN, VARINT, I64, I32, STRING, BYTES, MESSAGE = range(7)
MAX_FIELD = 16  # OTLP's metric messages number their fields below this; higher ones are unknown

_VARINT_TYPES = {3, 4, 5, 8, 13, 14, 17, 18}  # int64 uint64 int32 bool uint32 enum sint32 sint64
_I64_TYPES = {1, 6, 16}  # double fixed64 sfixed64
_I32_TYPES = {2, 7, 15}  # float fixed32 sfixed32


class Schema(NamedTuple):
    kind: np.ndarray  # int8 [type, field]
    child: np.ndarray  # int32 [type, field]: message type of a MESSAGE field
    types: dict[str, int]  # message full name -> type index


def _schema() -> Schema:
    order: dict[str, int] = {}
    found = []

    def walk(descriptor) -> None:  # noqa: ANN001 - a protobuf Descriptor
        if descriptor.full_name in order:
            return
        order[descriptor.full_name] = len(found)
        found.append(descriptor)
        for f in descriptor.fields:
            if f.message_type is not None:
                walk(f.message_type)

    walk(ExportMetricsServiceRequest.DESCRIPTOR)
    kind = np.zeros((len(found), MAX_FIELD), np.int8)
    child = np.full((len(found), MAX_FIELD), -1, np.int32)
    for t, d in enumerate(found):
        for f in d.fields:
            if f.number >= MAX_FIELD:
                raise AssertionError(f"{d.full_name}.{f.name} is numbered {f.number}: raise MAX_FIELD")
            if f.type in _VARINT_TYPES:
                kind[t, f.number] = VARINT
            elif f.type in _I64_TYPES:
                kind[t, f.number] = I64
            elif f.type in _I32_TYPES:
                kind[t, f.number] = I32
            elif f.type == 9:
                kind[t, f.number] = STRING
            elif f.type == 12:
                kind[t, f.number] = BYTES
            elif f.type == 11:
                kind[t, f.number], child[t, f.number] = MESSAGE, order[f.message_type.full_name]
            else:  # groups: never in OTLP
                raise AssertionError(f"{d.full_name}.{f.name} has protobuf type {f.type}")
    return Schema(kind, child, order)


SCHEMA = _schema()
_T = SCHEMA.types
T_RM = _T["opentelemetry.proto.metrics.v1.ResourceMetrics"]
T_SM = _T["opentelemetry.proto.metrics.v1.ScopeMetrics"]
T_METRIC = _T["opentelemetry.proto.metrics.v1.Metric"]
T_NDP = _T["opentelemetry.proto.metrics.v1.NumberDataPoint"]
# Metric's `data` oneof: field number -> its message type, in WhichOneof's names (decode.py).
DATA_FIELDS = {5: "gauge", 7: "sum", 9: "histogram", 10: "exponential_histogram", 11: "summary"}
DATA_TYPES = np.full(MAX_FIELD, -1, np.int32)
for _f in DATA_FIELDS:
    DATA_TYPES[_f] = SCHEMA.child[T_METRIC, _f]
# Codes of the data kinds in the `wrong` counts: 0 is "no data", then the oneof's fields in order.
WHICH = (None, *DATA_FIELDS.values())
_WHICH_OF_FIELD = np.zeros(MAX_FIELD, np.int64)
for _i, _f in enumerate(DATA_FIELDS):
    _WHICH_OF_FIELD[_f] = _i + 1

BEYOND = np.int64(2**63 - 1)  # a time past int64: ahead of any clock
# Metric name codes beyond the consumed metrics' own (schema.Metric): not consumed.
IGNORED, LIVENESS = -1, -2


@kernel
def _varint(buf, i, end):  # noqa: ANN001, ANN202 - numba
    """(value, position after it); position -1 when the varint is truncated or longer than 10 bytes."""
    result = np.uint64(0)
    shift = np.uint64(0)
    for _ in range(10):
        if i >= end:
            return np.uint64(0), -1
        b = buf[i]
        i += 1
        result |= np.uint64(b & 0x7F) << shift
        if b < 0x80:
            return result, i
        shift += np.uint64(7)
    return np.uint64(0), -1


def fixed64_as_written(buf, at):  # noqa: ANN001, ANN202
    """The little-endian unsigned 64-bit integer at buf[at:at + 8]: what `_fixed64` reads, byte by byte."""
    word = np.uint64(0)
    for k in range(8):
        word |= np.uint64(buf[at + k]) << np.uint64(8 * k)
    return word


def _fixed64_interpreted(buf, at):  # noqa: ANN001, ANN202
    """_fixed64 in one step for Python (the loop above takes 40 operations interpreted)."""
    return np.uint64(int.from_bytes(buf[at:at + 8].tobytes(), "little"))


_load_u64 = load_u64()  # one unaligned load compiled; None when the kernels are interpreted


@kernel(interpreted=_fixed64_interpreted)
def _fixed64(buf, i):  # noqa: ANN001, ANN202
    """The little-endian unsigned 64-bit integer at buf[i:i + 8] (`fixed64_as_written`), in one load."""
    return _load_u64(buf, i)


@kernel
def _as_double(buf, i):  # noqa: ANN001, ANN202
    one = np.empty(1, np.uint64)
    one[0] = _fixed64(buf, i)
    return one.view(np.float64)[0]


@kernel(inline=True)
def _field(buf, i, end):  # noqa: ANN001, ANN202
    """The field at i: (number, wire type, content start, content end, next position); next -1
    when it is not one the kernels read with certainty (then the caller answers UNSURE)."""
    if i < end and buf[i] < 0x80:  # one-byte tags: fields 1 to 15, nearly every field of OTLP
        tag = np.int64(buf[i])
        i += 1
    else:
        big, i = _varint(buf, i, end)
        if i < 0 or big > np.uint64(0xFFFFFFFF):
            return 0, 0, 0, 0, -1
        tag = np.int64(big)
    number = tag >> 3
    wire = tag & 7
    if number == 0:
        return 0, 0, 0, 0, -1
    if wire == 2:
        if i < end and buf[i] < 0x80:
            n = np.int64(buf[i])
            i += 1
        else:
            big, i = _varint(buf, i, end)
            if i < 0 or big > np.uint64(end - i):
                return 0, 0, 0, 0, -1
            n = np.int64(big)
        if n > end - i:
            return 0, 0, 0, 0, -1
        return number, wire, i, i + n, i + n
    if wire == 0:
        _, j = _varint(buf, i, end)
        return number, wire, i, j, j
    if wire == 1:
        return (number, wire, i, i + 8, i + 8) if i + 8 <= end else (0, 0, 0, 0, -1)
    if wire == 5:
        return (number, wire, i, i + 4, i + 4) if i + 4 <= end else (0, 0, 0, 0, -1)
    return 0, 0, 0, 0, -1  # groups (3, 4) and the invalid wire types 6 and 7


@kernel(inline=True)
def _wire_of(kind):  # noqa: ANN001, ANN202
    if kind == 1:
        return 0
    if kind == 2:
        return 1
    if kind == 3:
        return 5
    return 2


@kernel(inline=True)
def _next_known(buf, i, end, kind, t):  # noqa: ANN001, ANN202
    """The field at i of a message of type t, as _field; number 0 for a field the schema does not
    know (to skip), next -1 also for a known field of another wire type."""
    number, wire, a, b, nxt = _field(buf, i, end)
    if nxt < 0:
        return 0, 0, 0, 0, -1
    k = kind[t, number] if number < MAX_FIELD else 0
    if k == 0:
        return 0, wire, a, b, nxt
    if wire != _wire_of(k):
        return 0, 0, 0, 0, -1
    return number, wire, a, b, nxt


@kernel
def _count_points(buf, a, b):  # noqa: ANN001, ANN202
    """How many data points (fields numbered 1, of wire type 2) the Gauge, Sum, Histogram, ... at
    buf[a:b] holds, reading only its framing; -1 when the framing is broken."""
    n = 0
    while a < b:
        number, wire, _, _, a = _field(buf, a, b)
        if a < 0:
            return -1
        if number == 1 and wire == 2:
            n += 1
    return n


@kernel
def hash_step(h, w):  # noqa: ANN001, ANN202
    h = (h ^ w) * np.uint64(0x9E3779B97F4A7C15)
    return h ^ (h >> np.uint64(29))


@kernel
def hash_span(buf, a, b, h):  # noqa: ANN001, ANN201
    """Mix buf[a:b] into the hash h, eight bytes at a time."""
    i = a
    while i + 8 <= b:
        h = hash_step(h, _fixed64(buf, i))
        i += 8
    w = np.uint64(b - a)
    k = 0
    while i < b:
        w ^= np.uint64(buf[i]) << np.uint64(8 + 8 * k)  # k < 7: the length stays in the low byte
        i += 1
        k += 1
    return hash_step(h, w)


@kernel
def _same_bytes(buf, i, end, table, j):  # noqa: ANN001, ANN202
    """Whether buf[i:end] is table[j:j + end - i], eight bytes at a time."""
    while i + 8 <= end:
        if _fixed64(buf, i) != _fixed64(table, j):
            return False
        i += 8
        j += 8
    while i < end:
        if buf[i] != table[j]:
            return False
        i += 1
        j += 1
    return True


@kernel
def _is_piece(buf, i, end, p, pieces, piece_off):  # noqa: ANN001, ANN202
    """Whether buf[i:end] is piece p (one attribute field's bytes: pieces[piece_off[p]:piece_off[p+1]])."""
    return end - i == piece_off[p + 1] - piece_off[p] and _same_bytes(buf, i, end, pieces, piece_off[p])


@kernel
def _same(buf, spans, n, set_pieces, a, b, pieces, piece_off):  # noqa: ANN001, ANN202
    """Whether the attribute fields buf[spans[k,0]:spans[k,1]], k < n, are, in order, the pieces
    set_pieces[a:b]."""
    if b - a != n:
        return False
    for k in range(n):
        if not _is_piece(buf, spans[k, 0], spans[k, 1], set_pieces[a + k], pieces, piece_off):
            return False
    return True


@kernel
def find_set(buf, spans, n, h, slots, set_hash, set_pieces, set_off, pieces, piece_off):  # noqa: ANN001, ANN201
    """The label set whose attribute fields are the n spans of buf, or -1. Set s is the pieces
    set_pieces[set_off[s]:set_off[s+1]]."""
    mask = len(slots) - 1
    at = np.int64(h & np.uint64(mask))
    while True:
        s = slots[at]
        if s < 0:
            return -1
        if set_hash[s] == h and _same(buf, spans, n, set_pieces, set_off[s], set_off[s + 1], pieces, piece_off):
            return s
        at = (at + 1) & mask


@kernel
def enter_pieces(buf, a, b, seed, piece_slots, piece_hash, pieces, piece_off, n_pieces, out):  # noqa: ANN001, ANN201
    """The pieces of the NumberDataPoint at buf[a:b]: the id of each of its attribute fields (number
    7, each whole: tag, length and content), in order, written into `out`. A field no piece holds
    yet becomes piece `n_pieces` (then the next). The caller leaves room for every field in `out`,
    piece_hash, piece_off and pieces, and a slot table at most half full after. Returns (fields,
    pieces known after)."""
    mask = len(piece_slots) - 1
    n = 0
    i = a
    while i < b:
        number, wire, _, _, nxt = _field(buf, i, b)
        if nxt < 0:
            break
        if number == 7 and wire == 2:
            h = hash_span(buf, i, nxt, seed)
            at = np.int64(h & np.uint64(mask))
            while True:
                p = piece_slots[at]
                if p < 0:
                    p = n_pieces
                    n_pieces += 1
                    start = piece_off[p]
                    pieces[start:start + nxt - i] = buf[i:nxt]
                    piece_off[p + 1] = start + nxt - i
                    piece_hash[p] = h
                    piece_slots[at] = p
                    break
                if piece_hash[p] == h and _is_piece(buf, i, nxt, p, pieces, piece_off):
                    break
                at = (at + 1) & mask
            out[n] = p
            n += 1
        i = nxt
    return n, n_pieces


@kernel
def place_set(slots, set_hash, s):  # noqa: ANN001, ANN201
    """Enter set s (its hash in set_hash[s]) in the open-addressing table `slots`."""
    mask = len(slots) - 1
    at = np.int64(set_hash[s] & np.uint64(mask))
    while slots[at] >= 0:
        at = (at + 1) & mask
    slots[at] = s


@kernel
def place_sets(slots, set_hash, n):  # noqa: ANN001, ANN201
    """place_set for the sets 0..n-1 (a table built afresh)."""
    for s in range(n):
        place_set(slots, set_hash, s)


@kernel(inline=True)
def _metric_head(buf, a, b, kind):  # noqa: ANN001, ANN202
    """The Metric at buf[a:b]: (sure, name span, data field number (0 without data), data span).
    Not sure when the name or the data oneof comes twice (protobuf keeps the last)."""
    name_a, name_b, data_field, data_a, data_b = 0, 0, 0, 0, 0
    named = False
    while a < b:
        number, _, g, h, a = _next_known(buf, a, b, kind, T_METRIC)
        if a < 0:
            return False, 0, 0, 0, 0, 0
        if number == 1:
            if named:
                return False, 0, 0, 0, 0, 0
            named, name_a, name_b = True, g, h
        elif number > 0 and DATA_TYPES[number] >= 0:
            if data_field:
                return False, 0, 0, 0, 0, 0
            data_field, data_a, data_b = number, g, h
    return True, name_a, name_b, data_field, data_a, data_b


@kernel(inline=True)
def _read_point(buf, a, b, kind, spans, max_attributes):  # noqa: ANN001, ANN202
    """The NumberDataPoint at buf[a:b]: (sure, time, value, flags, attribute fields, adjacent),
    the first max_attributes + 1 attribute fields' spans written into `spans`; adjacent when each
    of those fields begins where the one before it ends (the attributes are one run of bytes).
    Value is as_double, or as_int as a float, NaN without either. Not sure when a singular field
    comes twice or both values are given (protobuf keeps the last)."""
    t = np.uint64(0)
    value = np.nan
    flags = np.uint64(0)
    seen = 0
    nattr = 0
    adjacent = True
    while a < b:
        number, _, va, vb, nxt = _next_known(buf, a, b, kind, T_NDP)
        if nxt < 0:
            return False, t, value, flags, nattr, adjacent
        if number == 7:
            if nattr <= max_attributes:
                spans[nattr, 0] = a
                spans[nattr, 1] = nxt
                if nattr and spans[nattr - 1, 1] != a:
                    adjacent = False
            nattr += 1
        elif number != 0 and number != 5:  # exemplars are not read
            bit = 1 << (4 if number == 6 else number)  # as_double and as_int: one value oneof
            if seen & bit:
                return False, t, value, flags, nattr, adjacent
            seen |= bit
            if number == 3:
                t = _fixed64(buf, va)
            elif number == 4:
                value = _as_double(buf, va)
            elif number == 6:
                value = np.float64(np.int64(_fixed64(buf, va)))
            elif number == 8:
                v, _ = _varint(buf, va, vb)
                flags = v & np.uint64(0xFFFFFFFF)
        a = nxt
    return True, t, value, flags, nattr, adjacent


@kernel(inline=True)
def _hash_spans(buf, spans, n, seed):  # noqa: ANN001, ANN202
    """The hash of a point's attribute fields: each of the n spans mixed in, in order."""
    h = seed
    for k in range(n):
        h = hash_span(buf, spans[k, 0], spans[k, 1], h)
    return h


@kernel
def _metric_code(buf, a, b, names, names_off, names_code):  # noqa: ANN001, ANN202
    n = b - a
    for k in range(len(names_code)):
        s = names_off[k]
        if names_off[k + 1] - s != n:
            continue
        same = True
        for i in range(n):
            if buf[a + i] != names[s + i]:
                same = False
                break
        if same:
            return names_code[k]
    return IGNORED


@kernel
def scan(buf, names, names_off, names_code, kind,  # noqa: ANN001, ANN201, C901
         slots, set_hash, set_pieces, set_off, pieces, piece_off, seed, floor, horizon, max_attributes,
         p_metric, p_res, p_time, p_value, p_flags, p_set, p_hash, p_dp,
         r_res, r_live, wrong):
    """One pass over the request. Returns (status, points, scrape targets, ignored points).

    Per point of a consumed gauge or sum (up to the arrays' length; the count goes on, so a caller
    can size them and scan again): p_metric (its name's entry in names_code), p_res (target index),
    p_time, p_value (as_double, or as_int as a float, NaN without either), p_flags, p_set (label
    set, -1 if not in the table, -2 if more than max_attributes), p_hash (of the attribute
    fields), p_dp (the point's byte span). Per target: r_res (span of its Resource, -1 without
    one), r_live (newest liveness `up` time within floor..horizon, else 0). wrong[name's entry,
    which] counts points of consumed metrics that arrived as another kind of data (see WHICH).

    A scrape target's metrics list its series in one order (dcgm-exporter's: each GPU and MIG
    instance in turn, the Collector keeping the order), so a point's attributes are most often
    those of the point at its place in the target's largest metric before it. Where they are,
    byte for byte (both one run of bytes, `_same_bytes`: a comparison of bytes just read), the point
    takes that point's set and hash; elsewhere its attributes are hashed and looked up in the
    table (`find_set`, which reads the set's pieces where they lie). The rows are the same either
    way: only the bytes compared decide."""
    cap, rcap = len(p_metric), len(r_live)
    spans = np.empty((max_attributes + 1, 2), np.int64)
    run = np.empty((cap, 2), np.int64)  # each row's attributes as one run of bytes; start -1 if not one
    npts = 0
    nres = 0
    ignored = 0
    i = 0
    end = len(buf)
    while i < end:
        number, wire, a, b, i = _field(buf, i, end)
        if i < 0:
            return UNSURE, 0, 0, 0
        if kind[0, number if number < MAX_FIELD else 0] == 0:
            continue
        if number != 1 or wire != 2:
            return UNSURE, 0, 0, 0
        r = nres
        nres += 1
        if r < rcap:
            r_res[r, 0] = -1
            r_res[r, 1] = -1
            r_live[r] = 0
        j = a
        seen_resource = False
        model, model_n = 0, 0  # the rows of the target's largest metric yet (the latest of them)
        while j < b:  # ResourceMetrics
            number, wire, c, d, j = _next_known(buf, j, b, kind, T_RM)
            if j < 0:
                return UNSURE, 0, 0, 0
            if number == 0:
                continue
            if number == 1:  # the resource: read by the caller, once per target
                if seen_resource:
                    return UNSURE, 0, 0, 0
                seen_resource = True
                if r < rcap:
                    r_res[r, 0] = c
                    r_res[r, 1] = d
                continue
            if number != 2:  # schema_url: not read
                continue
            m = c
            while m < d:  # ScopeMetrics
                number, wire, e, f, m = _next_known(buf, m, d, kind, T_SM)
                if m < 0:
                    return UNSURE, 0, 0, 0
                if number != 2:  # unknown fields, the scope, schema_url: not read
                    continue
                ok, name_a, name_b, data_field, data_a, data_b = _metric_head(buf, e, f, kind)
                if not ok:
                    return UNSURE, 0, 0, 0
                code = _metric_code(buf, name_a, name_b, names, names_off, names_code)
                numeric = data_field == 5 or data_field == 7
                if not data_field:
                    if code >= 0:
                        wrong[code, 0] += 1
                    else:
                        ignored += 1
                    continue
                dtype = DATA_TYPES[data_field]
                if (code < 0 and code != LIVENESS) or not numeric:
                    # Not read: skipped on its framing, its points only counted.
                    n = _count_points(buf, data_a, data_b)
                    if n < 0:
                        return UNSURE, 0, 0, 0
                    if code >= 0:
                        wrong[code, _WHICH_OF_FIELD[data_field]] += max(n, 1)
                    else:
                        ignored += n if numeric else 1
                    continue
                s = data_a
                first = npts
                while s < data_b:  # Gauge or Sum
                    number, wire, pa, pb, s = _next_known(buf, s, data_b, kind, dtype)
                    if s < 0:
                        return UNSURE, 0, 0, 0
                    if number != 1:  # unknown fields, aggregation_temporality, is_monotonic
                        continue
                    ok, t, value, flags, nattr, adjacent = _read_point(buf, pa, pb, kind, spans, max_attributes)
                    if not ok:
                        return UNSURE, 0, 0, 0
                    if code == LIVENESS:
                        ignored += 1
                        tt = np.int64(t)
                        if t <= np.uint64(0x7FFFFFFFFFFFFFFF) and floor <= tt <= horizon and r < rcap:
                            if tt > r_live[r]:
                                r_live[r] = tt
                        continue
                    if npts < cap:
                        p_metric[npts] = code
                        p_res[npts] = r
                        p_time[npts] = np.int64(t) if t <= np.uint64(0x7FFFFFFFFFFFFFFF) else BEYOND
                        p_value[npts] = value
                        p_flags[npts] = np.int64(flags)
                        p_dp[npts, 0] = pa
                        p_dp[npts, 1] = pb
                        one_run = adjacent and nattr <= max_attributes
                        ra, rb = (spans[0, 0], spans[nattr - 1, 1]) if one_run and nattr else (pa, pa)
                        run[npts, 0] = ra if one_run else -1
                        run[npts, 1] = rb
                        like = model + npts - first
                        if (one_run and npts - first < model_n
                                and run[like, 0] >= 0 and run[like, 1] - run[like, 0] == rb - ra
                                and _same_bytes(buf, ra, rb, buf, run[like, 0])):
                            p_set[npts] = p_set[like]
                            p_hash[npts] = p_hash[like]
                        else:
                            hashed = _hash_spans(buf, spans, min(nattr, max_attributes + 1), seed)
                            p_hash[npts] = hashed
                            p_set[npts] = -2 if nattr > max_attributes else find_set(
                                buf, spans, nattr, hashed, slots, set_hash, set_pieces, set_off, pieces, piece_off)
                    npts += 1
                if npts - first >= model_n:  # the largest yet: the next metrics' model
                    model, model_n = first, npts - first
    return OK, npts, nres, ignored



@kernel
def find_sets(buf, dp, hashes, max_attributes, slots, set_hash, set_pieces, set_off, pieces, piece_off,  # noqa: ANN001, ANN201
              out):
    """find_set for the NumberDataPoints at the byte spans `dp` (their attribute hashes given)."""
    spans = np.empty((max_attributes + 1, 2), np.int64)
    for p in range(len(hashes)):
        n = 0
        i, end = dp[p, 0], dp[p, 1]
        while i < end:
            number, wire, _, _, nxt = _field(buf, i, end)
            if number == 7 and wire == 2 and n <= max_attributes:
                spans[n, 0] = i
                spans[n, 1] = nxt
                n += 1
            i = nxt
        out[p] = find_set(buf, spans, n, hashes[p], slots, set_hash, set_pieces, set_off, pieces, piece_off)
