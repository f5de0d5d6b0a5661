"""CPU counters to rates at interval close, and per-pod use, on hand-made samples."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otelgpu.enrich.usage import CPU, MAX_RATE_GAP_NS, MEMORY, PROMPT, RUNNING, PodSamples, PodUses, UsageTracker
from otelgpu.receiver.interner import Interner

S = 1_000_000_000


def samples(*rows) -> PodSamples:
    """rows: (kind, t_s, pod, container, series, value)."""
    k, t, pod, c, series, v = (np.array(x) for x in zip(*rows))
    return PodSamples(k.astype(np.int8), (t * S).astype(np.int64), np.zeros(len(k), np.int32), pod.astype(np.int32),
                      c.astype(np.int32), series.astype(np.int32), v.astype(float), np.zeros(len(k)),
                      np.full(len(k), -1, np.int32))


def interner(n: int = 10) -> Interner:
    """Codes 0..n-1 stand for strings (the tracker keeps counters by their strings)."""
    strings = Interner()
    for i in range(n):
        strings.code(f"s{i}")
    return strings


def test_rates_across_intervals_resets_and_stale_points() -> None:
    tracker = UsageTracker(interner())
    # Interval 1: pod 1 uses 2 cores (counter 0, 120, 240 at 0, 60, 120 s), arriving out of order.
    first = tracker.use(samples((CPU, 120, 1, 5, 9, 240.0), (CPU, 0, 1, 5, 9, 0.0), (CPU, 60, 1, 5, 9, 120.0)), 0, 180 * S)
    assert first[(0, 1)].cpu_cores == pytest.approx(2.0)
    # Interval 2: differenced against 240 at 120 s; a point from interval 1 arriving late is ignored;
    # the counter resets (container restart in the same cgroup) at 240 s: 30 core-seconds since 180 s.
    second = tracker.use(samples((CPU, 180, 1, 5, 9, 300.0), (CPU, 60, 1, 5, 9, 120.0), (CPU, 240, 1, 5, 9, 30.0)),
                         180 * S, 360 * S)
    assert second[(0, 1)].cpu_cores == pytest.approx((60 + 30) / 120)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.sets(st.integers(1, 6), min_size=1)), min_size=1, max_size=12))
def test_counters_that_come_and_go_keep_their_own_last_points(intervals: list[tuple[int, set[int]]]) -> None:
    """Pod p's counter grows p cores: every interval it sends two points in, it uses p cores,
    whether its last point is an interval old, gone with a gap past MAX_RATE_GAP_NS (and its row
    given to another series), put back by a mark's undo, or read back from a checkpoint."""
    plain, driven = UsageTracker(interner()), UsageTracker(interner())
    start = 0
    for k, (gap, pods) in enumerate(intervals):
        start += gap * 300 * S  # a pod away 15 minutes, or 10 and then 5, is forgotten
        points = samples(*[(CPU, start // S + at, p, 5, 9, float(p * (start // S + at))) for p in pods for at in (10, 40)])
        undo = driven.mark()
        driven.use(points, start, start + 60 * S)  # computed ahead, then put back
        undo()
        if k % 2:
            state, driven = driven.state(), UsageTracker(interner())
            driven.restore(state)
        for tracker in (plain, driven):
            got = tracker.use(points, start, start + 60 * S)
            assert {pod: got[(0, pod)].cpu_cores for pod in pods} == pytest.approx({pod: float(pod) for pod in pods})
            tracker.expire(start + 60 * S)
    assert (2 * 300 - 30) * S < MAX_RATE_GAP_NS < (3 * 300 - 30) * S  # from a point at 40 s to one at 10 s


def test_token_series_that_read_alike_are_one_series_and_the_next_series_keeps_its_own_point() -> None:
    """A token series' model code -1 reads "" as the code of "" does: both are one series with one
    last point, and a series met later has a place of its own."""
    strings = interner()
    empty = strings.code("")
    tracker = UsageTracker(strings)
    tracker.use_and_tokens(samples((PROMPT, 10, 1, -1, -1, 100.0), (PROMPT, 20, 1, empty, -1, 150.0)), 0, 60 * S)
    tracker.use(samples((CPU, 70, 2, 5, 9, 140.0), (CPU, 100, 2, 5, 9, 200.0)), 60 * S, 120 * S)
    _, tokens = tracker.use_and_tokens(samples((PROMPT, 130, 1, empty, -1, 190.0)), 120 * S, 180 * S)
    assert tokens[("s0", "s1")][("", "s0")] == [40.0, 0.0]  # since 150 at 20 s (no tenant label: the namespace)


def test_running_share_and_memory_summed_over_containers() -> None:
    got = UsageTracker(Interner()).use(samples(
        (RUNNING, 0, 1, -1, -1, 1.0), (RUNNING, 0, 2, -1, -1, 0.0),
        (RUNNING, 30, 1, -1, -1, 0.0), (RUNNING, 30, 2, -1, -1, 1.0),
        (MEMORY, 0, 1, 5, -1, 100.0), (MEMORY, 30, 1, 5, -1, 300.0), (MEMORY, 0, 1, 6, -1, 50.0)), 0, 60 * S)
    assert got[(0, 1)].running_share == pytest.approx(0.5) and got[(0, 2)].running_share == pytest.approx(0.5)
    assert got[(0, 1)].memory_bytes == pytest.approx(200.0 + 50.0)
    assert np.isnan(got[(0, 2)].memory_bytes) and np.isnan(got[(0, 1)].cpu_cores)


def test_an_interval_whose_counter_points_were_all_counted_before_gives_no_rate() -> None:
    tracker = UsageTracker(interner())
    tracker.use(samples((CPU, 60, 1, 5, 9, 120.0), (CPU, 120, 1, 5, 9, 240.0)), 0, 180 * S)
    again = tracker.use(samples((CPU, 60, 1, 5, 9, 120.0), (MEMORY, 60, 1, 5, -1, 8.0)), 0, 180 * S)
    assert np.isnan(again[(0, 1)].cpu_cores) and again[(0, 1)].memory_bytes == pytest.approx(8.0)


def test_the_pods_uses_read_as_a_mapping_of_each_pods_use() -> None:
    got = UsageTracker(Interner()).use(samples(
        (RUNNING, 0, 7, -1, -1, 1.0), (MEMORY, 0, 3, 5, -1, 10.0), (RUNNING, 30, 3, -1, -1, 1.0),
        (MEMORY, 30, 7, 5, -1, 20.0), (MEMORY, 30, 7, 6, -1, 2.0)), 0, 60 * S)
    assert list(got) == [(0, 3), (0, 7)] and len(got) == 2  # in the order of their codes
    seven, three = got[(0, 7)], got.get((0, 3))
    assert (seven.running_share, seven.memory_bytes) == (0.5, 22.0) and np.isnan(seven.cpu_cores)
    assert three is not None and (three.running_share, three.memory_bytes) == (0.5, 10.0)
    assert got.get((0, 5)) is None and got.get((1, 7)) is None and (0, 4) not in got and (0, 3) in got
    uses = PodUses(np.array([1, 2], np.int32), np.array([7, 7], np.int32), np.array([[0.5, 1.0, 2.0], [1.0, 3.0, 4.0]]))
    by_numpy = uses.get((np.int32(2), np.int32(7)))  # numpy codes find the same pod
    assert by_numpy is not None and (by_numpy.cpu_cores, by_numpy.memory_bytes) == (3.0, 4.0)
    with pytest.raises(KeyError):
        got[(7, 0)]  # noqa: B018 - the read itself raises
    assert dict(got.items()).keys() == {(0, 7), (0, 3)}
    empty = UsageTracker(interner()).use(samples((CPU, 0, 1, 5, 9, 0.0)), 0, 60 * S)  # a first point: no rate
    assert len(empty) == 0 and empty.get((0, 1)) is None and not empty
