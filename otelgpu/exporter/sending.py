"""What a sender is: one attempt to deliver a snapshot, its outcome, and the progress it made.

A sender that splits a snapshot into several requests reports each accepted request through the
snapshot's `Progress`; the delivery queue keeps that progress (on disk when it has a directory), so
a retry, in this process or after a restart, resumes after what the receiver already took."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Protocol, Sequence

from otelgpu.exporter.store import MetricSpec, Point


@dataclass(frozen=True)
class SendResult:
    """Outcome of one attempt to deliver a snapshot.

    ok: delivered. Otherwise `retryable` says whether the same snapshot may be sent again (OTLP
    UNAVAILABLE, HTTP 429 and 5xx, connection errors) and `retry_after` carries the server's own
    delay when it gave one (gRPC RetryInfo, HTTP Retry-After), in seconds. `reason` is a short,
    fixed label for counting (`unavailable`, `http_429`, `http_400`, `connection`, ...), `detail`
    the server's message for the log."""

    ok: bool
    retryable: bool = False
    reason: str = ""
    detail: str = ""
    retry_after: Optional[float] = None


DELIVERED = SendResult(ok=True)


class Progress:
    """How much of one snapshot the receiver has accepted: the first `done` items in the sender's
    own deterministic order (remote write: samples, series sorted by labels, each in time order).

    The delivery queue hands the same Progress to every attempt at the same snapshot, never merges
    a snapshot once something of it was accepted, and, with a directory, persists each advance
    (`persist`), so the count always refers to the same items."""

    def __init__(self, done: int = 0, persist: Optional[Callable[[int], None]] = None) -> None:
        self.done = done
        self._persist = persist

    def advance(self, accepted: int) -> None:
        """The receiver accepted the next `n` items. Call it after each accepted request."""
        if accepted <= 0:
            return
        self.done += accepted
        if self._persist is not None:
            self._persist(self.done)


class Sender(Protocol):
    name: str  # exporter label in the self-metrics: "otlp", "remote_write"
    specs: Mapping[str, MetricSpec]  # the metrics it sends: which are cumulative sums, which gauges

    def send(self, points: Sequence[Point], progress: Progress) -> SendResult:
        """One attempt to deliver these points (one snapshot), skipping the first `progress.done`
        items and advancing `progress` after each accepted request. Must not raise."""

    def close(self) -> None:
        """Release connections; a send in progress may fail."""
