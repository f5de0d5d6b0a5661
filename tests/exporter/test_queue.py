"""The export queue's bound through an outage: merges keep each calendar month's money in its own
month, and lose no series' last value."""

from __future__ import annotations

from datetime import datetime, timezone

from otelgpu.core.months import one_month
from otelgpu.exporter.columns import Point
from otelgpu.exporter.queue import SnapshotQueue
from otelgpu.exporter.sending import SendResult
from otelgpu.exporter.store import cost_metrics
from otelgpu.telemetry import ExporterTelemetry, SelfMetrics, by_label

HOUR = 3600 * 10**9
POD = (("namespace", "ml"), ("pod", "train-0"))


def at(*moment: int) -> int:
    return int(datetime(*moment, tzinfo=timezone.utc).timestamp()) * 10**9


def queue(size: int) -> tuple[SnapshotQueue, SelfMetrics]:
    metrics = SelfMetrics()
    return SnapshotQueue(ExporterTelemetry(metrics, "otlp"), cost_metrics(), size, HOUR, None, lambda: None), metrics


def add(q: SnapshotQueue, end_ns: int, value: float) -> None:
    """One hour's snapshot, nothing sent of it (the backend is down): the pod's cumulative cost."""
    q.add([Point("allocated", POD, at(2026, 9, 1), end_ns, value)], end_ns)
    q.release(end_ns)


def test_an_outage_across_a_month_end_merges_each_month_apart() -> None:
    """Hourly snapshots from 20:00 on October 31 to 04:00 on November 1 in a queue of 3: October's
    four merge into one ending at midnight, November's into the other two; each one's value is
    its last hour's."""
    q, metrics = queue(3)
    ends = [at(2026, 10, 31, 21) + i * HOUR for i in range(8)]
    for i, end in enumerate(ends):
        add(q, end, float(i + 1))
    entries = q.take_all()[0]
    assert [(e.from_ns, e.end_ns) for e in entries] == [
        (at(2026, 10, 31, 20), at(2026, 11, 1)), (at(2026, 11, 1), at(2026, 11, 1, 3)),
        (at(2026, 11, 1, 3), at(2026, 11, 1, 4))]
    assert [[(p.time_ns, p.value) for p in e.snapshot] for e in entries] == [
        [(at(2026, 11, 1), 4.0)], [(at(2026, 11, 1, 3), 7.0)], [(at(2026, 11, 1, 4), 8.0)]]
    assert by_label(metrics.export_snapshots_merged) == {"otlp": 5}


def test_more_months_than_the_queue_holds_merge_across_them() -> None:
    """A queue of 2 that must hold three months (an outage of months): the two oldest merge,
    their money in the newer month; none is lost."""
    q, _ = queue(2)
    for i, end in enumerate([at(2026, 9, 30, 1), at(2026, 10, 31, 1), at(2026, 11, 30, 1)]):
        add(q, end, float(i + 1))
    entries = q.take_all()[0]
    assert [(e.from_ns, e.end_ns) for e in entries] == [
        (at(2026, 9, 30), at(2026, 10, 31, 1)), (at(2026, 11, 30), at(2026, 11, 30, 1))]
    assert [p.value for e in entries for p in e.snapshot] == [2.0, 3.0]
    assert not one_month(entries[0].from_ns, entries[0].end_ns)


def test_a_month_whose_pair_is_in_flight_waits_over_the_bound_rather_than_merge_across() -> None:
    """October's two snapshots cannot merge while the older one is being sent; the queue of 3
    holds four (three months) until that attempt fails, then merges October's."""
    q, _ = queue(3)
    add(q, at(2026, 10, 31, 23), 1.0)
    add(q, at(2026, 11, 1), 2.0)
    with q.cond:
        head = q.head()
    add(q, at(2026, 11, 1, 1), 3.0)
    add(q, at(2026, 12, 1, 1), 4.0)
    assert len(q) == 4
    with q.cond:
        q.sent(head, SendResult(False, retryable=True, reason="connection"))
    assert [(e.from_ns, e.end_ns) for e in q.take_all()[0]] == [
        (at(2026, 10, 31, 22), at(2026, 11, 1)), (at(2026, 11, 1), at(2026, 11, 1, 1)),
        (at(2026, 12, 1), at(2026, 12, 1, 1))]


def test_months_are_utc_and_end_exclusive() -> None:
    assert one_month(at(2026, 11, 30, 23), at(2026, 12, 1))  # an interval ending at midnight is November's
    assert not one_month(at(2026, 11, 30, 23), at(2026, 12, 1) + 1)
    assert one_month(at(2026, 12, 31, 23), at(2027, 1, 1)) and not one_month(at(2026, 12, 31), at(2027, 1, 2))
