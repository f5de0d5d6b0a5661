"""What an exporter's sender reports for one attempt, and the queue that retries it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from otelgpu.exporter.store import Point


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


class Sender(Protocol):
    name: str  # exporter label in the self-metrics: "otlp", "remote_write"

    def send(self, points: Sequence[Point]) -> SendResult:
        """One attempt to deliver these points (one snapshot). Must not raise."""

    def close(self) -> None:
        """Release connections; a send in progress may fail."""
