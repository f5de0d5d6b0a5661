"""Freed heap memory goes back to the kernel when the pipeline asks (otelgpu/heap.py), in a
process of its own so the test's RSS is only what it allocates."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import os
    from otelgpu.heap import give_back

    def rss_mib():
        with open(f"/proc/{os.getpid()}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    blocks = [bytearray(48 * 1024) for _ in range(4096)]  # 192 MiB below the mmap threshold: heap
    for b in blocks:
        b[::4096] = b"x" * len(b[::4096])  # touch every page
    pinned = blocks[-1]  # the top of the heap stays in use: freeing the rest cannot shrink it by itself
    del blocks
    before = rss_mib()
    print(give_back(), before, rss_mib())
""")


def test_memory_freed_inside_the_heap_is_returned():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True)
    trimmed, before, after = out.stdout.split()
    assert trimmed == "True"  # glibc: the C library of this image and of CI
    assert float(before) - float(after) > 150, out.stdout  # most of the 192 MiB freed
