"""Durable state: the cumulative cost series, checkpointed after every interval.

A restart (kill -9 included) continues every series from the last checkpoint with its original
start time and value, and the interval windows resume after the last interval counted, so
`increase()` across the restart shows neither a gap nor a double count beyond the interval that was
open when the process died.

The file is `checkpoint.bin` in the configured directory: a header line with the format version
and the SHA-256 of the body, then the body: one line of JSON for the small state, with every numpy
array in the state replaced by `{"$array": i}`, then the arrays' raw bytes, each 8-byte aligned
(their dtype, shape and offset are in the JSON). The large state (the cost series and their
attribute sets) is arrays, so writing it is a copy of memory, not a text rendering of every series.
Version 1 (`checkpoint.json`, the whole state as JSON) is still read, so an upgrade continues every
series. The file is written to a temporary file, fsynced and renamed over the old one (then the
directory is fsynced), so a crash leaves either the old or the new checkpoint, never a mix. A lock
file keeps two processes off one directory. A checkpoint that is corrupt or was written for another
cluster, currency or format version is never reused: it is renamed aside
(`checkpoint.bin.rejected-<time>`), the reason is logged and counted, and the run starts afresh.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import numpy as np

from otelgpu.core.files import write_whole
from otelgpu.errors import ConfigError
from otelgpu.telemetry import CheckpointError, DurabilityTelemetry, SelfMetrics

log = logging.getLogger(__name__)

FORMAT = "otelgpu-checkpoint"
VERSION = 2
FILE = "checkpoint.bin"
V1_FILE = "checkpoint.json"  # version 1, read when there is no version 2 file yet
LOCK = ".lock"
ALIGN = 8
ARRAY_KINDS = "biuf"  # bool, integers, floats: nothing that needs pickling or has a layout of its own
PIECE_ROWS = 1 << 16  # what a `Pieces` array gives at a time: some hundreds of KiB


class Pieces:
    """A one-dimensional array that a checkpoint writes a piece at a time, never whole in memory:
    the store's sets' pair ids end to end (some 40 MiB at 100,000 GPUs), the store's live rows of a
    column. `pieces()` gives its values in order as arrays or bytes, each time it is called (the
    digest reads them, then the write). Read back it is an array like any other; `np.asarray`
    builds it whole. What it reads must not change before the checkpoint is written."""

    def __init__(self, dtype: Any, length: int, pieces: Callable[[], Iterator[bytes | np.ndarray]],
                 shape: Sequence[int] = ()) -> None:
        """`shape`: the array's, when not one-dimensional (`length` rows of that shape's rest)."""
        self.dtype = np.dtype(dtype)
        self.shape = tuple(map(int, shape)) if shape else (int(length),)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self.pieces = pieces

    def __len__(self) -> int:
        return self.shape[0]

    def __iter__(self) -> Iterator[Any]:
        return iter(np.asarray(self))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = np.frombuffer(b"".join(memoryview(p).cast("B") for p in self.pieces()), self.dtype).reshape(self.shape)
        return whole if dtype is None else whole.astype(dtype)

    @staticmethod
    def joined(parts: Sequence[bytes], dtype: Any) -> Pieces:
        """`parts` (bytes of `dtype`) end to end, joined some thousands at a time."""
        itemsize = np.dtype(dtype).itemsize
        step = max(1, PIECE_ROWS // 16)

        def pieces() -> Iterator[bytes]:
            for at in range(0, len(parts), step):
                yield b"".join(parts[at:at + step])
        return Pieces(dtype, sum(map(len, parts)) // itemsize, pieces)

    @staticmethod
    def gathered(column: np.ndarray, rows: np.ndarray) -> Pieces:
        """`column[rows]`, gathered PIECE_ROWS rows at a time."""
        def pieces() -> Iterator[np.ndarray]:
            for at in range(0, len(rows), PIECE_ROWS):
                yield np.ascontiguousarray(column[rows[at:at + PIECE_ROWS]])
        return Pieces(column.dtype, len(rows), pieces)

    @staticmethod
    def read(file: BinaryIO, offset: int, dtype: np.dtype, shape: Sequence[int]) -> Pieces:
        """The array of `dtype` and `shape` that `file` holds from `offset`, read PIECE_ROWS rows
        at a time (the file stays open while the Pieces is referred to)."""
        row = int(np.prod(shape[1:])) * dtype.itemsize
        total = int(shape[0]) * row

        def pieces() -> Iterator[bytes]:
            for at in range(0, total, PIECE_ROWS * row):
                piece = os.pread(file.fileno(), min(PIECE_ROWS * row, total - at), offset + at)
                if len(piece) != min(PIECE_ROWS * row, total - at):
                    raise OSError(f"a spilled array ended {at + len(piece)} bytes into its {total}")
                yield piece
        return Pieces(dtype, shape[0], pieces, shape)


def spilled(state: Mapping[str, Any], directory: Path) -> Mapping[str, Any]:
    """`state` with each of its arrays written to a file and read back from it a piece at a time
    (`Pieces`) when the checkpoint is written: state made ahead of its checkpoint (the facts of an
    interval computed ahead, some 24 MiB at 100,000 GPUs) waits in the page cache, which the
    kernel can write out and reclaim, instead of the process's memory. The file has no name (it is
    gone from the directory as it is made, so nothing is left behind by a crash) and its space is
    freed once nothing refers to its arrays. Raises OSError when the file cannot be written."""
    arrays: list[np.ndarray | Pieces] = []
    lifted = _lift(state, arrays)
    file = tempfile.TemporaryFile(dir=directory)
    try:
        read = []
        for a in arrays:
            if not a.shape:  # a number: kept as it is
                read.append(a)
                continue
            offset = file.tell()
            for piece in a.pieces() if isinstance(a, Pieces) else [a]:
                file.write(memoryview(piece).cast("B") if len(piece) else b"")
            read.append(Pieces.read(file, offset, a.dtype, a.shape))
        file.flush()
    except BaseException:
        file.close()
        raise
    return _lower(lifted, read)


class CheckpointRejected(Exception):
    """A checkpoint that must not be reused; `reason` is `corrupt` or `incompatible`."""

    def __init__(self, reason: CheckpointError, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Identity:
    """What a checkpoint must match to be continued."""

    cluster: str
    currency: str


def text_arrays(utf8: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """A table of strings (their UTF-8 bytes) as the checkpoint writes one: the bytes end to end
    and where each string ends."""
    return (np.frombuffer(b"".join(utf8), np.uint8),
            np.cumsum(np.fromiter(map(len, utf8), np.int64, len(utf8))))


def string_arrays(strings: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """`text_arrays` of these strings, with no bytes object per string when all are ASCII (as
    Kubernetes names, and most labels, are)."""
    joined = "".join(strings)
    if not joined.isascii():
        return text_arrays([text.encode("utf-8", "surrogatepass") for text in strings])
    return (np.frombuffer(joined.encode("ascii"), np.uint8),
            np.cumsum(np.fromiter(map(len, strings), np.int64, len(strings))))


def string_ids(texts: Iterable[str], count: int = -1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each of `texts` as the id of its string (uint32) in a table of every string once, in the
    order first met, and that table as `string_arrays` writes it. `count`: how many texts, if known."""
    ids: dict[str, int] = {}
    codes = np.fromiter((ids.setdefault(text, len(ids)) for text in texts), np.uint32, count)
    return (codes, *string_arrays(list(ids)))


def texts_of(blob: Any, ends: Any) -> list[str]:
    """The strings `text_arrays` wrote; ValueError when the arrays do not fit together."""
    blob, ends = np.asarray(blob), np.asarray(ends)
    if blob.dtype != np.uint8 or blob.ndim != 1 or ends.ndim != 1 or ends.dtype.kind not in "iu":
        raise ValueError("a string table is not a byte array and the ends of its strings")
    if len(ends) and (np.any(np.diff(ends, prepend=0) < 0) or int(ends[-1]) != len(blob)):
        raise ValueError("a string table's ends do not fit its bytes")
    raw = blob.tobytes()
    return [raw[a:b].decode("utf-8", "surrogatepass") for a, b in zip([0, *ends[:-1].tolist()], ends.tolist())]


def encode(identity: Identity, state: Mapping[str, Any], written_ns: int) -> bytes:
    return b"".join(encode_parts(identity, state, written_ns))


def encode_parts(identity: Identity, state: Mapping[str, Any], written_ns: int) -> Iterator[bytes | memoryview]:
    """The file's bytes in pieces (the arrays as views of their memory, not copies; `Pieces` a
    piece at a time)."""
    arrays: list[np.ndarray | Pieces] = []
    doc = _lift({"cluster": identity.cluster, "currency": identity.currency, "written_ns": written_ns, **state}, arrays)
    offset, layout = 0, []
    for a in arrays:
        if a.dtype.kind not in ARRAY_KINDS:
            raise ValueError(f"a checkpoint array of dtype {a.dtype} cannot be written")
        layout.append([a.dtype.str, list(a.shape), offset])
        offset += -(-a.nbytes // ALIGN) * ALIGN
    meta = json.dumps({"state": doc, "arrays": layout}, separators=(",", ":"), allow_nan=False).encode() + b"\n"
    meta += b" " * (-len(meta) % ALIGN)  # the arrays start aligned
    digest = hashlib.sha256()
    for piece in _body(meta, arrays):
        digest.update(piece)
    yield f"{FORMAT} v{VERSION} sha256={digest.hexdigest()}\n".encode()
    yield from _body(meta, arrays)


def _body(meta: bytes, arrays: list[np.ndarray | Pieces]) -> Iterator[bytes | memoryview]:
    yield meta
    for a in arrays:
        if isinstance(a, Pieces):
            written = 0
            for piece in a.pieces():
                view = memoryview(piece).cast("B") if len(piece) else b""
                written += len(view)
                yield view
            if written != a.nbytes:
                raise ValueError(f"a checkpoint array gave {written} bytes of the {a.nbytes} it was to")
        elif a.nbytes:
            yield memoryview(a).cast("B")
        yield b"\0" * (-a.nbytes % ALIGN)


# `_lift` and `_lower` are functions of the module, not closures: a closure that calls itself is a
# reference cycle, and what it closes over (every array of a checkpoint, 100 MiB and more at
# 100,000 GPUs) would then wait for the cyclic collector, which is off while an interval closes.


def _lift(value: Any, arrays: list[np.ndarray | Pieces]) -> Any:
    """`value` with each array appended to `arrays` and replaced by its place there."""
    if isinstance(value, np.ndarray):
        arrays.append(np.ascontiguousarray(value))
        return {"$array": len(arrays) - 1}
    if isinstance(value, Pieces):
        arrays.append(value)
        return {"$array": len(arrays) - 1}
    if isinstance(value, Mapping):  # arrays sit in mappings; lists are written as they are
        return {k: _lift(v, arrays) for k, v in value.items()}
    return value


def _lower(value: Any, arrays: list[np.ndarray]) -> Any:
    """Each {"$array": i} in `value` back to `arrays[i]`."""
    if isinstance(value, dict):
        if len(value) == 1 and "$array" in value:
            index = value["$array"]
            if not isinstance(index, int) or not 0 <= index < len(arrays):
                raise CheckpointRejected(CheckpointError.CORRUPT, f"reference to array {index!r}, not in the file")
            return arrays[index]
        return {k: _lower(v, arrays) for k, v in value.items()}
    return value


def decode(data: bytes, identity: Identity) -> dict[str, Any]:
    """The state in a checkpoint file's bytes (version 2 or 1); CheckpointRejected saying why it
    cannot be used. Arrays come back as read-only numpy arrays over `data`."""
    header, sep, body = data.partition(b"\n")
    parts = header.decode("ascii", "replace").split(" ")
    if not sep or len(parts) != 3 or parts[0] != FORMAT or not parts[2].startswith("sha256="):
        raise CheckpointRejected(CheckpointError.CORRUPT, "not an otelgpu checkpoint (bad header line)")
    if parts[1] not in (f"v{VERSION}", "v1"):
        raise CheckpointRejected(CheckpointError.INCOMPATIBLE, f"format {parts[1]} is not readable by this otelgpu (reads v1, v{VERSION})")
    if hashlib.sha256(body).hexdigest() != parts[2][len("sha256="):]:
        raise CheckpointRejected(CheckpointError.CORRUPT, "checksum mismatch: the file is truncated or altered")
    state = _body_v1(body) if parts[1] == "v1" else _body_v2(body)
    for key, expected in (("cluster", identity.cluster), ("currency", identity.currency)):
        if state.get(key) != expected:
            raise CheckpointRejected(CheckpointError.INCOMPATIBLE,
                                     f"written for {key} {state.get(key)!r}, this run is {key} {expected!r}")
    return state


def _body_v1(body: bytes) -> dict[str, Any]:
    try:
        state = json.loads(body)
    except ValueError as exc:
        raise CheckpointRejected(CheckpointError.CORRUPT, f"body is not valid JSON: {exc}") from None
    if not isinstance(state, dict):
        raise CheckpointRejected(CheckpointError.CORRUPT, "body is not a JSON object")
    return state


def _body_v2(body: bytes) -> dict[str, Any]:
    line, sep, _ = body.partition(b"\n")
    meta = _body_v1(line)
    start = -(-(len(line) + 1) // ALIGN) * ALIGN
    view = memoryview(body)
    try:
        arrays = []
        for dtype, shape, offset in meta["arrays"]:
            dt = np.dtype(str(dtype))
            count = int(np.prod([int(x) for x in shape], dtype=np.int64))
            first = start + int(offset)
            if dt.kind not in ARRAY_KINDS or count < 0 or offset < 0 or first + count * dt.itemsize > len(body):
                raise ValueError(f"array {dtype} {shape} at {offset} is not in the file")
            arrays.append(np.frombuffer(view, dt, count, first).reshape(shape))
        state = meta["state"]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointRejected(CheckpointError.CORRUPT, f"bad array directory: {exc}") from None
    if not sep or not isinstance(state, dict):
        raise CheckpointRejected(CheckpointError.CORRUPT, "body is not a JSON object")
    return _lower(state, arrays)


class Checkpoint:
    """One checkpoint directory, locked for this process while it runs."""

    def __init__(self, directory: str | Path, identity: Identity, metrics: SelfMetrics) -> None:
        self.directory = Path(directory)
        self.path = self.directory / FILE
        self.identity = identity
        self.telemetry = DurabilityTelemetry(metrics)
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
        if not self.path.exists() and (self.directory / V1_FILE).exists():
            self.path = self.directory / V1_FILE  # written by a version that wrote version 1
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._reject(CheckpointRejected(CheckpointError.CORRUPT, f"unreadable: {exc}"))
            return None
        try:
            return decode(data, self.identity)
        except CheckpointRejected as exc:
            self._reject(exc)
            return None

    def exists(self) -> bool:
        return self.path.exists() or (self.directory / V1_FILE).exists()

    def reject(self, reason: CheckpointError, message: str) -> None:
        """Set the current checkpoint aside (its content did not restore)."""
        self._reject(CheckpointRejected(reason, message))

    def _reject(self, exc: CheckpointRejected) -> None:
        aside = self.path.with_name(f"{self.path.name}.rejected-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
        try:
            os.replace(self.path, aside)
            where = f"moved to {aside}"
        except OSError as move_error:
            where = f"could not be moved aside ({move_error}); it will be overwritten"
        self.telemetry.checkpoint_failed(exc.reason)
        log.error("checkpoint %s not used (%s): %s; %s. Cost counters start afresh.", self.path, exc.reason, exc, where)

    def save(self, state: Mapping[str, Any]) -> bool:
        """Write atomically; False (logged, counted) when the write fails, the old file stays."""
        path = self.directory / FILE
        try:
            write_whole(path, encode_parts(self.identity, state, time.time_ns()))
            if self.path != path:  # the version 1 file it continued from is superseded
                self.path.unlink(missing_ok=True)
                self.path = path
        except (OSError, ValueError) as exc:
            self.telemetry.checkpoint_failed(CheckpointError.WRITE)
            log.error("checkpoint not written to %s: %s (the previous one stays)", path, exc)
            return False
        self.telemetry.checkpoints_written.inc()
        return True

    def spill(self, state: Mapping[str, Any]) -> Mapping[str, Any]:
        """`state`'s arrays in a file of this directory until the checkpoint writes them
        (`spilled`); `state` as it is when the file cannot be written (logged)."""
        try:
            return spilled(state, self.directory)
        except OSError as exc:
            log.warning("state made ahead of its checkpoint kept in memory: %s not writable: %s", self.directory, exc)
            return state

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = -1
