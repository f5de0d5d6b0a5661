"""The remote-write writer that sends (`SeriesWriter`, columns and a kernel) against the readable
encoding through the protobuf library (`series_reference`, `after`, `requests_reference`): the same bytes,
request by request, and the same series left out, on any snapshot and any resume point."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from otelgpu.exporter.remote_write import MAX_LABELS, SeriesWriter, after, requests_reference, series_reference
from otelgpu.core.attrs import attrs_of
from otelgpu.exporter.store import Point, Points, cost_metrics

SPECS = cost_metrics()
# Keys that the Prometheus translation maps onto one another or onto reserved names, that sort
# before `__name__` (upper case, "_"), that Prometheus refuses ("__x"), and plain ones.
KEYS = ["team", "k8s.pod.name", "k8s_pod_name", "A", "Zone", "_", "__x", "__name__", "cluster", "1gpu", "ü", "node"]
text = st.text(st.characters(blacklist_categories=["Cs"]) | st.sampled_from(["\x00", "\x01", "\x02", "\xff"]),
               min_size=0, max_size=6)
attrs = st.dictionaries(st.sampled_from(KEYS), text, max_size=5).map(attrs_of)
MS = 1_000_000


@st.composite
def points(draw) -> Point:  # noqa: ANN001
    metric = draw(st.sampled_from(sorted(SPECS) + ["not_a_metric"]))
    time_ns = draw(st.sampled_from([0, 1, MS - 1, MS, 5 * MS + 3, -MS, 2**62]) | st.integers(-2**40, 2**62))
    ended = draw(st.booleans())
    value = math.nan if ended else draw(st.sampled_from([0.0, -0.0, 1.5]) | st.floats(allow_nan=False))
    return Point(metric, draw(attrs), min(time_ns, 0), time_ns, value, ended)


def reference(snapshot: list[Point], done: int, max_samples: int, external: dict[str, str]):  # noqa: ANN201
    series, rejected = series_reference(snapshot, SPECS, "prod", external)
    return [(sum(len(ts.samples) for ts in r.timeseries), r.SerializeToString())
            for r in requests_reference(after(series, done), max_samples)], rejected


def written(writer: SeriesWriter, snapshot, done: int, max_samples: int):  # noqa: ANN001, ANN201
    requests, rejected = writer.requests(snapshot, done, max_samples)
    return list(requests), rejected


@settings(max_examples=300, deadline=None)
@given(st.lists(points(), max_size=30), st.integers(0, 12), st.integers(1, 7),
       st.sampled_from([{}, {"region": "eu"}, {"team": "external", "A": "x"}]))
def test_written_bytes_are_the_reference_requests_bytes(snapshot, done, max_samples, external) -> None:
    writer = SeriesWriter(SPECS, "prod", external)
    assert written(writer, snapshot, done, max_samples) == reference(snapshot, done, max_samples, external)
    # Again from the columns of the snapshot in another order (the cache of the first call in use):
    # a series' samples of one millisecond may then keep another one, as in the reference.
    shuffled = Points.of(snapshot[::-1])
    assert written(writer, shuffled, done, max_samples) == reference(snapshot[::-1], done, max_samples, external)


def test_a_series_over_the_label_limit_is_left_out_and_the_rest_written() -> None:
    wide = attrs_of({f"k{i}": "v" for i in range(MAX_LABELS)})  # with __name__ and cluster: 72
    snapshot = [Point("allocated", wide, 0, 60 * MS, 1.0), Point("allocated", (("team", "a"),), 0, 60 * MS, 2.0)]
    requests, rejected = written(SeriesWriter(SPECS, "prod", {}), snapshot, 0, 10)
    assert rejected == {"too_many_labels": 1} and [n for n, _ in requests] == [1]
    assert (requests, rejected) == reference(snapshot, 0, 10, {})
