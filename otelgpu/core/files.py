"""Files written whole or not at all: a reader (a restarted sidecar, a sidecar reloading its price
file) sees the old file or the new one, never part of one, even across a power loss."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable, Optional


def write_whole(path: str | Path, pieces: Iterable[bytes | memoryview],
                check: Optional[Callable[[Path], object]] = None) -> None:
    """Write `pieces` to `.NAME.tmp` beside `path`, fsync it, let `check` read it (whatever it
    raises leaves `path` as it was and no temporary file), rename it over `path` and fsync the
    folder, so that the rename itself survives a power loss. Raises OSError."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as file:
            for piece in pieces:
                file.write(piece)
            file.flush()
            os.fsync(file.fileno())
        if check is not None:
            check(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_directory(path.parent)


def sync_directory(directory: str | Path) -> None:
    """fsync a folder: the names created, renamed or removed in it survive a power loss."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
