"""otelgpu.core.backoff: the one retry backoff the exporters and the Kubernetes watches share."""

from __future__ import annotations

import pytest

from otelgpu.core.backoff import Backoff


def test_steps_double_up_to_the_maximum_and_start_again_after_a_success():
    b = Backoff(0.5, 4.0, 0.5, rng=lambda: 0.5)  # the middle of the jitter: the step itself
    assert [b.next() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert b.attempt == 6
    b.reset()
    assert b.next() == 0.5 and b.attempt == 1


@pytest.mark.parametrize(("spread", "low", "high"), [(0.5, 0.5, 1.5), (0.2, 0.8, 1.2)])
def test_the_jitter_spreads_a_step_either_way(spread, low, high):
    assert Backoff(2.0, 8.0, spread, rng=lambda: 0.0).next() == pytest.approx(2.0 * low)
    assert Backoff(2.0, 8.0, spread, rng=lambda: 1.0).next() == pytest.approx(2.0 * high)


def test_a_delay_the_server_gave_is_taken_and_counts_as_an_attempt():
    drawn = []
    b = Backoff(1.0, 60.0, 0.5, rng=lambda: drawn.append(1) or 0.5)
    assert b.next(told=7.0) == 7.0 and b.attempt == 1 and not drawn  # no jitter drawn for it
    assert b.next() == 2.0  # the next step goes on from the attempts so far
