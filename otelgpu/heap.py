"""Hand freed heap memory back to the kernel after each interval's work.

Closing an interval at 10,000 GPUs builds and drops some hundreds of MiB of short-lived arrays,
dicts and export requests. glibc keeps what is freed inside its heaps for reuse and returns
memory to the kernel only from the top of a heap, so without help the resident size stays near
the high-water mark of the last close: measured in-process at 10,000 GPUs, about 400 MiB more
resident between closes than after `malloc_trim(0)`, which takes 5-20 ms. Other C libraries
(musl) have no such call; there this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Callable, Optional

log = logging.getLogger(__name__)


def _malloc_trim() -> Optional[Callable[[int], int]]:
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def give_back() -> bool:
    """Return the free pages of every heap to the kernel; False where the C library cannot."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
