"""One error taxonomy for the whole sidecar, mapped to gRPC and HTTP status in one place.

- ConfigError: the configuration is wrong; reported at start with every problem and its YAML path.
- PermanentError: the input can never be processed (undecodable body, too large); senders must not retry.
- RetryableError: the sidecar cannot take the input now (queue full); senders retry after a delay.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc


class OtelgpuError(Exception):
    """Base class of every error the sidecar raises on purpose."""


class ConfigError(OtelgpuError):
    """Invalid configuration. `problems` holds one `path: message` line per problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  {p}" for p in self.problems))


class PermanentError(OtelgpuError):
    """Input that will never be accepted; retrying the same bytes cannot help."""

    def __init__(self, message: str, *, too_large: bool = False) -> None:
        super().__init__(message)
        self.too_large = too_large


class RetryableError(OtelgpuError):
    """The sidecar is overloaded; the sender should retry after `retry_after_s` seconds. `reason`
    names the limit reached, as the receivers count it (queue_full, wal, memory_limit, ...)."""

    def __init__(self, message: str, retry_after_s: float, *, reason: str = "queue_full") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason


@dataclass(frozen=True)
class Status:
    grpc_code: grpc.StatusCode
    http_status: int


def status_for(err: OtelgpuError) -> Status:
    """The wire status for an error, as the OTLP specification asks for it."""
    if isinstance(err, RetryableError):
        return Status(grpc.StatusCode.UNAVAILABLE, 503)
    if isinstance(err, PermanentError):
        if err.too_large:
            # gRPC's own "too large" is a bare RESOURCE_EXHAUSTED, which a Collector drops without
            # retry; INVALID_ARGUMENT says the same thing ("never retry") without the ambiguity.
            return Status(grpc.StatusCode.INVALID_ARGUMENT, 413)
        return Status(grpc.StatusCode.INVALID_ARGUMENT, 400)
    return Status(grpc.StatusCode.INTERNAL, 500)
