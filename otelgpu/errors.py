"""One error taxonomy for the whole sidecar, mapped to gRPC and HTTP status in one place.

- ConfigError: the configuration is wrong; reported at start with every problem and its YAML path.
- PermanentError: the input can never be processed (undecodable body, too large); senders must not retry.
- RetryableError: the sidecar cannot take the input now (queue full); senders retry after a delay.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

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


class Refusal(StrEnum):
    """Why a receiver refused a request "retry later" or cut a connection, as
    `receiver_connections_refused{reason}` counts it."""

    QUEUE_FULL = "queue_full"  # the batches waiting for the worker
    WAL = "wal"  # the write-ahead log cannot be written
    MEMORY_LIMIT = "memory_limit"  # resident memory at the soft limit
    BYTES_IN_FLIGHT = "bytes_in_flight"  # the requests in flight would reserve more than their budget
    CONCURRENT_REQUESTS = "concurrent_requests"
    CONNECTION_LIMIT = "connection_limit"  # HTTP: every connection has a request under way
    IDLE_EVICTED = "idle_evicted"  # HTTP: the connection waiting longest closed to make room
    SLOW_EVICTED = "slow_evicted"  # HTTP: a connection sending its body too slowly closed to make room
    IDLE_TIMEOUT = "idle_timeout"  # HTTP: no whole request in time
    READ_TIMEOUT = "read_timeout"  # HTTP: the body not whole in time
    WRITE_TIMEOUT = "write_timeout"  # HTTP: the answer not taken in time
    MALFORMED = "malformed"  # HTTP that cannot be parsed
    UNAUTHENTICATED = "unauthenticated"  # no valid bearer token


class RetryableError(OtelgpuError):
    """The sidecar is overloaded; the sender should retry after `retry_after_s` seconds. `reason`
    names the limit reached, as the receivers count it."""

    def __init__(self, message: str, retry_after_s: float, *, reason: Refusal = Refusal.QUEUE_FULL) -> None:
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
