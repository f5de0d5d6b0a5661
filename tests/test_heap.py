"""Memory housekeeping (otelgpu/heap.py): freed heap memory goes back to the kernel (in a process
of its own, so its RSS is only what it allocates), and the cyclic collector is off while an
interval closes."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest
from cluster import Cluster, Node, Pod, Unit
from support import feed, make_config, offline_pipeline

from otelgpu.heap import collector_paused

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


MAPPED = textwrap.dedent("""
    import ctypes, ctypes.util, sys
    import numpy as np
    from otelgpu.heap import fix_mmap_threshold

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]
    mallinfo2 = ctypes.CDLL(ctypes.util.find_library("c")).mallinfo2
    mallinfo2.restype = MallInfo2

    fixed = fix_mmap_threshold() if sys.argv[1] == "fix" else None
    big = np.ones(16 << 20, np.uint8)  # mapped apart; freed, glibc's own threshold rises to its size
    del big
    array = np.ones(4 << 20, np.uint8)  # an interval's array at 100,000 GPUs
    print(fixed, mallinfo2().hblkhd)
""")


@pytest.mark.parametrize("how", ["fix", "default", "environment"])
def test_an_interval_s_arrays_are_mapped_apart_and_unmapped_when_freed(how):
    """With the threshold fixed, a 4 MiB array is mapped apart after a larger one was freed (glibc
    alone would take it from a heap, its threshold risen); an operator's MALLOC_MMAP_THRESHOLD_
    stands."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 << 20)} if how == "environment" else None
    out = subprocess.run([sys.executable, "-c", MAPPED, "fix" if how != "default" else "no"], capture_output=True,
                         text=True, timeout=120, check=True, env=env)
    fixed, mapped = out.stdout.split()
    assert fixed == {"fix": "True", "default": "None", "environment": "False"}[how]
    assert (int(mapped) >= 4 << 20) == (how == "fix"), out.stdout


def test_memory_freed_inside_the_heap_is_returned():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True)
    trimmed, before, after = out.stdout.split()
    assert trimmed == "True"  # glibc: the C library of this image and of CI
    assert float(before) - float(after) > 150, out.stdout  # most of the 192 MiB freed


PAGE_OUT_CHILD = textwrap.dedent("""
    import sys

    import numpy as np
    from otelgpu import heap
    from otelgpu.attribution.engine import scad
    from otelgpu.heap import page_out
    from otelgpu.kernels import warm_up

    if sys.argv[1] == "no-pageout":  # as where the kernel will not reclaim them: a file of root's, run as uid 10001
        heap._MADV_PAGEOUT = -1  # EINVAL, as an older kernel answers

    def llvm_resident_mib():
        # LLVM's resident pages in this process, whether another process (the test runner) maps them too
        mib, current = 0.0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                fields = line.split()
                if fields[0].endswith(":"):
                    mib += int(fields[1]) / 1024 if current and fields[0] == "Rss:" else 0
                else:
                    current = len(fields) > 5 and "libllvmlite" in fields[5]
        return mib

    warm_up()
    rng = np.random.default_rng(7)
    args = (rng.integers(0, 3, 50), rng.random((50, 3)), rng.random((3, 3)) * 40, rng.random((3, 3)), 60.0)
    expected = scad(*args)
    before = llvm_resident_mib()
    advised = page_out("libllvmlite")
    after = llvm_resident_mib()
    again = scad(*args)  # the kernels run on after LLVM's pages went
    same = all(np.array_equal(getattr(expected, k), getattr(again, k)) for k in ("split", "unused", "idle"))
    print(before, advised / 2**20, after, same, warm_up()["scad"])
""")


@pytest.mark.parametrize("how", ["pageout", "no-pageout"])
def test_llvms_pages_are_handed_back_once_the_kernels_are_loaded_and_the_kernels_still_run(how):
    out = subprocess.run([sys.executable, "-c", PAGE_OUT_CHILD, how], capture_output=True, text=True, timeout=300,
                         check=True)
    before, gone, after, same, how = out.stdout.split()
    assert float(before) > 5, out.stdout  # loading the kernels mapped LLVM in
    assert float(after) < float(before) / 4, out.stdout  # its pages went, reclaimed or unmapped
    assert float(gone) >= float(before) - float(after) - 1  # and page_out says so
    assert same == "True" and how != "interpreted"  # the compiled kernels still run, and agree


FILES_CHILD = textwrap.dedent("""
    import grpc
    import numpy as np
    from otelgpu.config import parse_config
    from otelgpu.heap import _mappings, page_out_files

    def resident_mib():  # the read-only mappings of files: (clean, with written pages)
        maps = _mappings(None)
        return (sum(r for _, _, r, a in maps if not a) / 2**20, sum(r for _, _, r, a in maps if a) / 2**20)

    config = parse_config({"cluster": {"name": "c"}})  # pydantic's validators, run once
    before, written = resident_mib()
    gone = page_out_files()
    after, written_after = resident_mib()
    # everything runs on: numpy's code, pydantic's validators, gRPC's core
    total = float(np.arange(10**5, dtype=np.float64).sum())
    again = parse_config({"cluster": {"name": "c"}}) == config
    grpc.insecure_channel("127.0.0.1:1").close()
    print(before, written, gone / 2**20, after, written_after, total, again)
""")


def test_the_libraries_pages_are_handed_back_once_started_and_everything_runs_on():
    out = subprocess.run([sys.executable, "-c", FILES_CHILD], capture_output=True, text=True, timeout=300,
                         check=True)
    before, written, gone, after, written_after, total, again = out.stdout.split()
    assert float(before) > 10, out.stdout  # numpy, pydantic, gRPC and the interpreter mapped in
    assert float(after) < float(before) / 4, out.stdout  # their clean pages went
    assert float(gone) >= float(before) - float(after) - 1, out.stdout  # and page_out_files says so
    assert float(written_after) == float(written), out.stdout  # relocated data stays: it is not the file's
    assert float(total) == 4999950000.0 and again == "True"  # numpy, pydantic and gRPC run on


def test_the_cyclic_collector_is_paused_while_an_interval_closes_and_resumes_after():
    a100 = "NVIDIA A100-SXM4-40GB"
    node = Node("gpu-1", "p4d.24xlarge", 96, 1152, units=[Unit("GPU-0", a100)], capacity={"nvidia_com_gpu": 1})
    c = Cluster([node], [Pod("ml", "train", "gpu-1", labels={"team": "vision"}, gpu=("nvidia_com_gpu", 1),
                             holds=("GPU-0",))])
    p = offline_pipeline(make_config(attribution__interval_seconds=300, attribution__lateness_seconds=30,
                                     attribution__prices__gpu_hour_by_gpu_model={a100: 12.0}))
    during: list[bool] = []
    p.on_interval.append(lambda interval: during.append(gc.isenabled()))
    assert gc.isenabled()
    feed(p, *c.scrapes(60, 1200))
    assert during and not any(during)  # every close ran with the collector off
    assert gc.isenabled()  # and it is back on between closes

    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # one that was off stays off
    finally:
        gc.enable()
    try:
        with collector_paused():
            raise RuntimeError("a failed close")
    except RuntimeError:
        pass
    assert gc.isenabled()


HEAP_CHILD = textwrap.dedent("""
    from otelgpu.heap import heap_bytes

    base_used, _ = heap_bytes()
    blocks = [bytearray(48 * 1024) for _ in range(2048)]  # 96 MiB below the mmap threshold: in the heap
    pinned = bytearray(48 * 1024)  # above them: the heap cannot shrink by itself once they are freed
    used, _ = heap_bytes()
    del blocks
    after_used, after_free = heap_bytes()
    print(used - base_used, used - after_used, after_free)
""")


def test_the_heap_in_use_and_freed_is_measured():
    """otelgpu_process_heap_bytes: allocations count as in use, and once freed as free (kept by
    the allocator, under an allocation still in use)."""
    out = subprocess.run([sys.executable, "-c", HEAP_CHILD], capture_output=True, text=True, timeout=120,
                         check=True)
    grew, fell, kept = map(int, out.stdout.split())
    mib = 1 << 20
    assert grew >= 96 * mib and fell >= 96 * mib, out.stdout
    assert kept >= 96 * mib, out.stdout  # freed inside the heap: kept, not returned


def test_the_heap_gauge_is_served():
    from prometheus_client import generate_latest

    from otelgpu.telemetry import SelfMetrics

    text = generate_latest(SelfMetrics().registry).decode()
    served = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("otelgpu_process_heap_bytes{")}
    assert set(served) == {'otelgpu_process_heap_bytes{state="in_use"}', 'otelgpu_process_heap_bytes{state="free"}'}
    assert served['otelgpu_process_heap_bytes{state="in_use"}'] > 0

