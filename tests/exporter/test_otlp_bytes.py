"""The OTLP export requests written as bytes (RequestWriter: each attribute pair encoded once, sets
as the ids of their pairs, one pack per point) are byte for byte the requests the protobuf messages
give (requests_reference, the reference), for any snapshot, in any split, and again from the cache
on the next snapshot."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from otelgpu.exporter.otlp import RequestWriter, requests_reference
from otelgpu.core.attrs import attrs_of
from otelgpu.exporter.store import Point, cost_metrics

SPECS = cost_metrics("EUR")
text = st.text(min_size=1, max_size=12)
attrs = st.dictionaries(st.sampled_from(["team", "pod", "node", "cost_model", "ü", "resource"]), text, max_size=5)
ends = st.integers(min_value=1, max_value=2**63 - 1)


@st.composite
def points(draw) -> Point:  # noqa: ANN001
    metric = draw(st.sampled_from(sorted(SPECS)))
    end = draw(ends)
    start = draw(st.integers(min_value=1, max_value=end))
    ended = draw(st.booleans())
    value = math.nan if ended else draw(st.floats(allow_nan=False, allow_infinity=False))
    return Point(metric, attrs_of(draw(attrs)), start if SPECS[metric].kind == "sum" else end, end, value, ended)


@settings(max_examples=150, deadline=None)
@given(st.lists(points(), max_size=40), st.lists(points(), max_size=40), st.integers(min_value=1, max_value=9),
       st.sampled_from(["", "ip-10-0-0-1"]))
def test_written_bytes_are_the_reference_messages_bytes(first, second, max_points, instance):
    writer = RequestWriter(SPECS, "prod-eu", instance)
    met: set = set()
    for snapshot in (first, second, first):  # the second and third reuse the encoded pairs
        expected = [r.SerializeToString() for r in requests_reference(snapshot, SPECS, "prod-eu", max_points, instance)]
        assert list(writer.requests(snapshot, max_points)) == expected
        met |= {kv for p in snapshot for kv in p.attrs}
        assert set(writer._pairs) == met  # each pair met, once


def test_past_its_bound_the_writer_starts_afresh_and_writes_the_same_bytes(monkeypatch):
    monkeypatch.setattr("otelgpu.exporter.otlp.PAIRS_KEPT", 3)
    writer = RequestWriter(SPECS, "c")
    for n in range(6):
        snapshot = [Point("allocated", attrs_of({"pod": f"p{n}", "team": f"t{k}"}), 1, 2, 1.0) for k in range(3)]
        expected = [r.SerializeToString() for r in requests_reference(snapshot, SPECS, "c")]
        assert list(writer.requests(snapshot)) == expected
        assert len(writer._pairs) <= 3 + 2  # cleared when full; a set's missing pairs are added at once


def test_an_ended_sum_carries_no_value_and_the_flag():
    p = Point("allocated", (("team", "a"),), 10, 20, math.nan, ended=True)
    request = ExportMetricsServiceRequest.FromString(next(RequestWriter(SPECS, "c").requests([p])))
    dp = request.resource_metrics[0].scope_metrics[0].metrics[0].sum.data_points[0]
    assert dp.WhichOneof("value") is None and dp.flags == 1 and dp.start_time_unix_nano == 10
