"""Memory housekeeping around each interval's work: the cyclic garbage collector paused while
an interval closes, and freed heap memory handed back to the kernel afterwards.

Closing an interval at 10,000 GPUs allocates some hundreds of thousands of tuples, dicts and
lists that hold no reference cycles: reference counting frees them all. Left running, the cyclic
collector would still walk them some 390 times in its young generation and twice in full (about
0.22 s of CPU per interval, measured in-process); paused, it runs once when the close is over.

The same close builds and drops some hundreds of MiB of short-lived arrays, dicts and export
requests. glibc keeps what is freed inside its heaps for reuse and returns
memory to the kernel only from the top of a heap, so without help the resident size stays near
the high-water mark of the last close. `malloc_trim(0)` returns it and takes 5-20 ms: at 10,000
GPUs the sidecar's steady RSS went from 512-547 MiB to 464 MiB (benchmarks/bench_scale.py).
Other C libraries (musl) have no such call; there this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

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


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block (reference counting still frees), back on
    after it if it was on."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
