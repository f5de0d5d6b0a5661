"""The OTLP sink fixture and a small cost store to export."""

from __future__ import annotations

from typing import Iterator

import pytest
from otlpsink import MetricsSink, serve_sink

from otelgpu.exporter.store import CostStore


@pytest.fixture
def otlp_sink() -> Iterator[MetricsSink]:
    sink = MetricsSink()
    with serve_sink(sink):
        yield sink


MIN = 60 * 10**9
T0 = 1_700_000_000 * 10**9
TEAM_A = (("namespace", "ml"), ("pod", "train-0"), ("team", "a"))
TEAM_A_COST = (("cost_model", "request"), *TEAM_A)
IDLE = (("cost_model", "request"), ("gpu_model", "H100"), ("node", "n1"))


class Intervals:
    """Feeds one-minute intervals into a store the way the attribution stage does."""

    T0, MIN = T0, MIN

    def __init__(self, store: CostStore) -> None:
        self.store = store

    def record(self, i: int, cost: float = 1.5) -> list:
        """Interval i: allocated/held for team a, idle on node n1, an activity gauge. Returns the
        interval's snapshot."""
        return self.store.record(T0 + i * MIN, T0 + (i + 1) * MIN,
                          sums={"allocated": {TEAM_A_COST: cost}, "held": {TEAM_A: 60.0}, "idle": {IDLE: 0.25}},
                          gauges={"activity": {TEAM_A: 0.5 + 0.1 * i}})


@pytest.fixture
def store() -> CostStore:
    return CostStore()


@pytest.fixture
def intervals(store: CostStore) -> Intervals:
    # Fixtures rather than `from conftest import ...`: that import breaks under
    # --import-mode=importlib and when another test directory has a conftest of its own.
    return Intervals(store)
