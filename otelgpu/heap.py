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

numba compiles (or loads from its cache) every kernel at start-up through LLVM, whose library
(libllvmlite.so) is then some 68 MiB of the resident size: pages of its code and read-only data
mapped from the file. Once every kernel is loaded, none of it runs again unless a kernel is
compiled anew. `page_out` hands those pages back: they are copies of the file, so nothing is
lost, and should LLVM run again they are mapped in again from it. `page_out_files` does the same,
once started, for what every other library mapped in to start (20 MiB of the 72 a per-node pod
held once ready, benchmarks/bench_ready.py); what the process runs comes back as it runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from contextlib import contextmanager
from typing import Callable, Iterator, Optional


def _libc_function(name: str, argtypes: list, restype: type) -> Optional[Callable[..., int]]:
    """The C library's function `name`, or None where there is none (another C library, no libc)."""
    path = ctypes.util.find_library("c")
    try:
        function = getattr(ctypes.CDLL(path, use_errno=True), name) if path else None
    except (OSError, AttributeError):
        return None
    if function is not None:
        function.argtypes, function.restype = argtypes, restype
    return function


_TRIM = _libc_function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)
_MALLOPT = _libc_function("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int)
_M_ARENA_MAX = -8  # malloc.h
ARENAS = 2
_MADVISE = _libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int)
_MADV_DONTNEED, _MADV_PAGEOUT = 4, 21  # linux/mman.h


_M_MMAP_THRESHOLD = -3  # malloc.h
MMAP_THRESHOLD = 2 << 20


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Blocks of `threshold` bytes and more mapped apart, and unmapped when freed (glibc's
    M_MMAP_THRESHOLD), unless the environment sets MALLOC_MMAP_THRESHOLD_ (glibc reads it itself).

    glibc's own threshold starts at 128 KiB and rises to the size of each mapped block freed, up
    to 32 MiB: after the first closes, an interval's arrays (some MiB each at 100,000 GPUs) come
    from the heaps, and the room they leave stays among the state that lives on. At 2 MiB they are
    mapped and unmapped, while requests, batches and Python's objects stay in the heaps (mapping
    each anew costs page faults: at 1 MiB the CPU an interval took rose by some 12 %; at 2 MiB, two
    runs at 100,000 GPUs took 0 and 4 % more). At 100,000 GPUs: peak RSS 1,313 MiB where 1,412,
    steady 1,075-1,082 where 1,138, 106-117 MiB freed and kept where 249 (docs/memory.md). Call
    before the threads start; False where it was not set."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or _MALLOPT is None:
        return False
    return _MALLOPT(_M_MMAP_THRESHOLD, threshold) == 1


def limit_arenas(arenas: int = ARENAS) -> bool:
    """At most `arenas` malloc heaps (glibc's M_ARENA_MAX; its default is 8 per core). Each thread
    that allocates while another holds a heap's lock gets a heap of its own, up to that number, and
    what a request's thread frees stays in its heap: with the receivers' worker threads decoding
    large requests at once, the heaps together held hundreds of MiB more than was in use (32
    concurrent 16 MiB Exports: some 490-675 MiB peak against 430-450 with two heaps). The
    interpreter's lock serialises most allocation anyway. Call before the threads start; False
    where the C library has no such setting."""
    return _MALLOPT is not None and _MALLOPT(_M_ARENA_MAX, arenas) == 1


class _MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2 (malloc.h, 2.33 and later)
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


_MALLINFO2 = _libc_function("mallinfo2", [], _MallInfo2)


def heap_bytes() -> Optional[tuple[int, int]]:
    """(in use, free) bytes of malloc's heaps, every arena and its large blocks: what the
    process's allocations hold, and what the allocator keeps of memory freed (in its heaps'
    bins, resident until reused or given back). None where the C library cannot say (before
    glibc 2.33, musl). numpy's arrays and Python's objects over 512 bytes come from malloc;
    Python's smaller objects live in the interpreter's own arenas, mapped apart from these heaps,
    as do LLVM's code, thread stacks and mapped files."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd, info.fordblks


def give_back() -> bool:
    """Return the free pages of every heap to the kernel; False where the C library cannot."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


def page_out(library: str) -> int:
    """Hand back the resident pages of the read-only mappings of the shared library whose file
    name contains `library`; returns the bytes of resident memory that went (from
    /proc/self/smaps; 0 where the system cannot: no such library, no /proc, no madvise).

    MADV_PAGEOUT reclaims the pages outright, but Linux does so for file pages only when the
    process owns the file or may write it (not so in the image: root owns the library, otelgpu
    runs as uid 10001). A read-only mapping none of whose pages was ever written (smaps shows no
    anonymous pages in it: its pages are the file's) is then simply unmapped (MADV_DONTNEED): the
    pages stay in the page cache, which the kernel drops under pressure, and are mapped again from
    the file if ever touched. A mapping with written pages (relocated data) keeps them."""
    return _hand_back(library, reclaim=True)


def page_out_files() -> int:
    """Unmap the resident pages of every read-only mapping of a file none of whose pages was ever
    written: the code and read-only data of the interpreter, its extension modules and their
    libraries, once the process has started. Returns the bytes of resident memory that went.

    Starting maps far more of them than running touches again: all of pydantic's validator core
    (the configuration is read once), OpenBLAS (numpy loads it; otelgpu multiplies no matrix),
    most of OpenSSL, numpy's and gRPC's code for what is never called. The pages stay in the page
    cache (only MADV_DONTNEED, so that no other process sharing the file loses them), and the ones
    the process runs again are mapped again from it, a minor fault each: what stays resident is
    what the process runs, not all it ever ran. A mapping with written pages (relocated data)
    keeps them; the kernel's own mappings (vdso) are left alone."""
    return _hand_back(None, reclaim=False)


def _hand_back(library: Optional[str], reclaim: bool) -> int:
    """Unmap the pages of the read-only mappings of `library` (None: of any file) that have no
    written page, after asking the kernel to reclaim them (`reclaim`: MADV_PAGEOUT) where it
    may; returns the bytes of resident memory that went."""
    if _MADVISE is None:
        return 0
    before = _mappings(library)
    for low, high, _, anonymous in before:
        if reclaim:
            _MADVISE(low, high - low, _MADV_PAGEOUT)
        if not anonymous:
            _MADVISE(low, high - low, _MADV_DONTNEED)
    return sum(r for _, _, r, _ in before) - sum(r for _, _, r, _ in _mappings(library))


def _mappings(library: Optional[str]) -> list[list[int]]:
    """[start, end, resident bytes, anonymous bytes] of each read-only mapping of the library (None:
    of any file)."""
    found: list[list[int]] = []
    try:
        with open("/proc/self/smaps") as file:
            lines = file.readlines()
    except OSError:
        return found
    current: Optional[list[int]] = None
    for line in lines:
        fields = line.split()
        if not fields[0].endswith(":"):  # a mapping's first line: range, permissions, offset, device, inode, path
            current = None
            if len(fields) >= 6 and fields[5].startswith("/") and "w" not in fields[1] and \
                    (library is None or library in fields[5].rsplit("/", 1)[-1]):
                current = [int(x, 16) for x in fields[0].split("-")] + [0, 0]
                found.append(current)
        elif current is not None and fields[0] in ("Rss:", "Anonymous:"):
            current[2 if fields[0] == "Rss:" else 3] = int(fields[1]) * 1024
    return found


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
