"""Durable state: the cumulative cost series, checkpointed after every interval.

A restart (kill -9 included) continues every series from the last checkpoint with its original
start time and value, and the interval windows resume after the last interval counted, so
`increase()` across the restart shows neither a gap nor a double count beyond the interval that was
open when the process died.

The file is `checkpoint.json` in the configured directory: a header line with the format version
and the SHA-256 of the body, then the body as JSON. It is written to a temporary file, fsynced and
renamed over the old one (then the directory is fsynced), so a crash leaves either the old or the
new checkpoint, never a mix. A lock file keeps two processes off one directory. A checkpoint that
is corrupt or was written for another cluster, currency or format version is never reused: it is
renamed aside (`checkpoint.json.rejected-<time>`), the reason is logged and counted, and the run
starts afresh.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from otelgpu.errors import ConfigError
from otelgpu.telemetry import SelfMetrics

log = logging.getLogger(__name__)

FORMAT = "otelgpu-checkpoint"
VERSION = 1
FILE = "checkpoint.json"
LOCK = ".lock"


class CheckpointRejected(Exception):
    """A checkpoint that must not be reused; `reason` is `corrupt` or `incompatible`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Identity:
    """What a checkpoint must match to be continued."""

    cluster: str
    currency: str


def encode(identity: Identity, state: Mapping[str, Any], written_ns: int) -> bytes:
    body = json.dumps({"cluster": identity.cluster, "currency": identity.currency, "written_ns": written_ns,
                       **state}, separators=(",", ":"), allow_nan=False).encode()
    header = f"{FORMAT} v{VERSION} sha256={hashlib.sha256(body).hexdigest()}\n".encode()
    return header + body


def decode(data: bytes, identity: Identity) -> dict[str, Any]:
    """The state in a checkpoint file's bytes; CheckpointRejected saying why it cannot be used."""
    header, sep, body = data.partition(b"\n")
    parts = header.decode("ascii", "replace").split(" ")
    if not sep or len(parts) != 3 or parts[0] != FORMAT or not parts[2].startswith("sha256="):
        raise CheckpointRejected("corrupt", "not an otelgpu checkpoint (bad header line)")
    if parts[1] != f"v{VERSION}":
        raise CheckpointRejected("incompatible", f"format {parts[1]} is not readable by this otelgpu (reads v{VERSION})")
    if hashlib.sha256(body).hexdigest() != parts[2][len("sha256="):]:
        raise CheckpointRejected("corrupt", "checksum mismatch: the file is truncated or altered")
    try:
        state = json.loads(body)
    except ValueError as exc:
        raise CheckpointRejected("corrupt", f"body is not valid JSON: {exc}") from None
    if not isinstance(state, dict):
        raise CheckpointRejected("corrupt", "body is not a JSON object")
    for key, expected in (("cluster", identity.cluster), ("currency", identity.currency)):
        if state.get(key) != expected:
            raise CheckpointRejected("incompatible",
                                     f"written for {key} {state.get(key)!r}, this run is {key} {expected!r}")
    return state


class Checkpoint:
    """One checkpoint directory, locked for this process while it runs."""

    def __init__(self, directory: str | Path, identity: Identity, metrics: SelfMetrics) -> None:
        self.directory = Path(directory)
        self.path = self.directory / FILE
        self.identity = identity
        self.metrics = metrics
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ConfigError([f"checkpoint.directory: {str(self.directory)!r} is not usable: {exc}"]) from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise ConfigError([f"checkpoint.directory: {str(self.directory)!r} is in use by another otelgpu "
                               "process (each replica needs a directory of its own)"]) from None

    def load(self) -> Optional[dict[str, Any]]:
        """The saved state, or None when there is none or it was set aside."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._reject(CheckpointRejected("corrupt", f"unreadable: {exc}"))
            return None
        try:
            return decode(data, self.identity)
        except CheckpointRejected as exc:
            self._reject(exc)
            return None

    def reject(self, reason: str, message: str) -> None:
        """Set the current checkpoint aside (its content did not restore)."""
        self._reject(CheckpointRejected(reason, message))

    def _reject(self, exc: CheckpointRejected) -> None:
        aside = self.path.with_name(f"{FILE}.rejected-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
        try:
            os.replace(self.path, aside)
            where = f"moved to {aside}"
        except OSError as move_error:
            where = f"could not be moved aside ({move_error}); it will be overwritten"
        self.metrics.count("checkpoint_errors", exc.reason)
        log.error("checkpoint %s not used (%s): %s; %s. Cost counters start afresh.", self.path, exc.reason, exc, where)

    def save(self, state: Mapping[str, Any]) -> bool:
        """Write atomically; False (logged, counted) when the write fails, the old file stays."""
        tmp = self.directory / f".{FILE}.tmp"
        try:
            data = encode(self.identity, state, time.time_ns())
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            dir_fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)  # the rename itself must survive a power loss
            finally:
                os.close(dir_fd)
        except (OSError, ValueError) as exc:
            self.metrics.count("checkpoint_errors", "write")
            log.error("checkpoint not written to %s: %s (the previous one stays)", self.path, exc)
            return False
        self.metrics.add("checkpoints_written")
        return True

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = -1
