"""One retry backoff for everything that retries (each exporter's delivery, the Kubernetes API
watches): exponential from `initial`, doubling at each failure up to `maximum`, with jitter so
that many retrying at once spread out, and started again after a success."""

from __future__ import annotations

import random
from typing import Callable, Optional


class Backoff:
    """`spread`: the jitter, a fraction of the step either way (0.5: 50 % to 150 % of it)."""

    def __init__(self, initial: float, maximum: float, spread: float,
                 rng: Callable[[], float] = random.random) -> None:
        self.initial, self.maximum, self.spread, self.rng = initial, maximum, spread, rng
        self.attempt = 0  # failures since the last success

    def next(self, told: Optional[float] = None) -> float:
        """The wait after one more failure: `told` where the server said how long (RetryInfo,
        Retry-After), else the step of this attempt with its jitter."""
        self.attempt += 1
        if told is not None:
            return told
        step = min(self.initial * 2 ** min(self.attempt - 1, 32), self.maximum)
        return step * (1 - self.spread + 2 * self.spread * self.rng())

    def reset(self) -> None:
        self.attempt = 0
