"""The interval watermark follows the majority of scrape targets: a minority ahead cannot close
anyone's interval early, not even when it arrives first; targets that went quiet stop counting
after a while of the receive clock; a stop closes only what the cluster has begun."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from otelgpu.enrich.samples import Samples
from otelgpu.enrich.window import NS, Windows, _Sources
from otelgpu.receiver.decode import PointBatch, decode_reference
from otelgpu.receiver.interner import Interner

DT, LATE = 300, 60
SILENCE = 45.0  # seconds of the receive clock
T0 = 1_700_000_100 * NS // (DT * NS) * (DT * NS)  # an interval start


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def facts(t: int, *sources: str) -> PointBatch:
    """One kube_pod_info row at `t`, as sent by each of `sources` (scrape targets)."""
    req = ExportMetricsServiceRequest()
    for src in sources:
        rm = req.resource_metrics.add()
        rm.resource.attributes.add(key="service.name", value=AnyValue(string_value="ksm"))
        rm.resource.attributes.add(key="service.instance.id", value=AnyValue(string_value=src))
        p = rm.scope_metrics.add().metrics.add(name="kube_pod_info").gauge.data_points.add(time_unix_nano=t, as_double=1)
        p.attributes.extend([KeyValue(key="namespace", value=AnyValue(string_value="ml")),
                             KeyValue(key="pod", value=AnyValue(string_value=src))])
    return decode_reference(req, Interner(), now_ns=t)


def add(w: Windows, batch: PointBatch) -> list[int]:
    w.add(Samples.empty(), batch, facts=batch)
    return [i.start_ns for i in w.due()]


def test_a_minority_ahead_does_not_move_the_watermark():
    w = Windows(DT, LATE)
    add(w, facts(T0 + 10 * NS, "a", "b", "c"))
    add(w, facts(T0 + (10 + 540) * NS, "x", "y"))  # two of five targets nine minutes ahead
    assert w.watermark_ns == T0 + 10 * NS
    closed = add(w, facts(T0 + (DT + LATE + 1) * NS, "a", "b", "c"))
    assert closed == [T0]  # the majority passed the first interval's end plus the lateness


def test_a_target_ahead_that_arrives_before_the_cluster_closes_nothing():
    w = Windows(DT, LATE)
    assert add(w, facts(T0 + 840 * NS, "x")) == []  # alone, it is the cluster, and only its own interval is open
    assert w.watermark_ns == T0 + 840 * NS
    assert add(w, facts(T0 + 10 * NS, "a", "b")) == []  # the cluster arrives: the watermark moves back
    assert w.watermark_ns == T0 + 10 * NS
    closed = add(w, facts(T0 + (DT + LATE + 1) * NS, "a", "b"))
    assert closed == [T0]
    assert w.open_intervals == 2  # the rows at T0 + 840 s stay in their interval, which has not ended


def test_targets_quiet_for_an_interval_and_the_lateness_stop_counting():
    clock = Clock()
    w = Windows(DT, LATE, clock=clock)
    add(w, facts(T0, "a", "b", "c"))
    clock.now += 10
    add(w, facts(T0 + 120 * NS, "a"))
    assert w.watermark_ns == T0  # b and c have not moved: the majority is still at T0
    clock.now += DT + LATE  # b and c were removed with their node
    add(w, facts(T0 + 240 * NS, "a"))
    assert w.watermark_ns == T0 + 240 * NS


def test_a_stop_closes_what_the_cluster_began_and_keeps_what_only_a_minority_reached():
    w = Windows(DT, LATE)
    add(w, facts(T0 + 10 * NS, "a", "b", "c"))
    add(w, facts(T0 + (DT + 20) * NS, "a", "b", "c"))  # the cluster began the second interval
    add(w, facts(T0 + (3 * DT + 5) * NS, "x"))  # one target in the fourth
    closed = [i.start_ns for i in w.due(flush=True)]
    assert closed == [T0, T0 + DT * NS]
    assert w.ahead() == 1 and w.open_intervals == 1


def test_a_stop_closes_what_a_target_scraped_more_often_than_the_rest_reached():
    w = Windows(DT, LATE)
    add(w, facts(T0 + 10 * NS, "kube-state-metrics", "dcgm-exporter"))
    add(w, facts(T0 + (DT + 20) * NS, "dcgm-exporter"))  # one more scrape, in the next interval
    assert w.watermark_ns == T0 + 10 * NS
    assert [i.start_ns for i in w.due(flush=True)] == [T0, T0 + DT * NS]
    assert w.ahead() == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.dictionaries(st.sampled_from("abcdefgh"), st.integers(0, 40), max_size=5),
                          st.integers(0, 30)), min_size=1, max_size=40))
def test_the_median_kept_in_order_is_the_median_of_the_targets(steps):
    """Targets sending in any order (timestamps repeated, going back, new targets, targets falling
    silent and coming back): the watermark read from the ordered timestamps is the one the whole
    set of targets gives, and the silence check forgets exactly the targets a full look forgets."""
    sources, now, heard = _Sources(), 0.0, {}
    for batch, wait in steps:
        now += wait
        sources.update(batch, now)
        heard.update(dict.fromkeys(batch, now))
        sources.forget_silent(now - SILENCE)
        heard = {src: at for src, at in heard.items() if at >= now - SILENCE}
        assert len(sources) == len(heard)
        if len(sources):
            assert sources.median() == sources.median_reference()
