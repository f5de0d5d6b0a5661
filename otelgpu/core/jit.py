"""The numba kernels' one decorator, how the process runs them, and how a kernel came to be loaded.

Every kernel is compiled once per process at most and cached on disk (`otelgpu warm-up` fills the
cache when an image is built), and releases the GIL while it runs, so the receivers' threads keep
taking requests. Small helpers the kernels call are inlined into them.

A process may instead run its kernels as the plain Python they are written in (`choose
("interpreted")`, the `kernels: interpreted` setting): numba and LLVM are then never imported,
some 40 MiB of resident memory once ready and 100 MiB at the peak (benchmarks/bench_ready.py,
bench_footprint.py) that a pod attributing one node's few dozen rows has no use for.
The figures are the same either way (tests/test_kernels_interpreted.py); the time is not."""

from __future__ import annotations

import sys
import warnings
from typing import Any, Callable, Optional

MODES = ("compiled", "interpreted")
_mode = {"chosen": "compiled", "fixed": False}  # fixed once the first kernel is defined


def choose(mode: str) -> None:
    """Run this process's kernels `mode`: before the first module with a kernel is imported, since
    a kernel is compiled or not as it is defined. Choosing the mode already in force is a no-op."""
    if mode not in MODES:
        raise ValueError(f"kernels must be one of {', '.join(MODES)}, not {mode!r}")
    if mode != _mode["chosen"] and _mode["fixed"]:
        raise RuntimeError(f"kernels are already {_mode['chosen']}: the mode is chosen before the first "
                           "kernel is defined, once per process")
    _mode["chosen"] = mode
    if mode == "interpreted":  # the kernels' unsigned arithmetic wraps by design, as it does compiled
        warnings.filterwarnings("ignore", r"overflow encountered in scalar (multiply|add|subtract|left_shift)",
                                RuntimeWarning, r"otelgpu\.")


def mode() -> str:
    """"compiled" or "interpreted": how this process runs its kernels."""
    return _mode["chosen"]


def kernel(fn: Optional[Callable[..., Any]] = None, *, inline: bool = False,
           interpreted: Optional[Callable[..., Any]] = None) -> Any:
    """`@kernel`, or `@kernel(inline=True)` for a helper that the kernels calling it inline.
    `interpreted`: what runs instead when the kernels are interpreted, for a helper whose loop
    costs Python far more than numpy's operations (or one call) doing the same; it must return
    the same values (its test holds the two together)."""
    _mode["fixed"] = True
    if _mode["chosen"] == "interpreted":
        if interpreted is not None:
            return interpreted if fn is not None else (lambda _: interpreted)
        return fn if fn is not None else _as_written
    from numba import njit

    jit = njit(cache=True, nogil=True, **({"inline": "always"} if inline else {}))
    return jit(fn) if fn is not None else jit


def _as_written(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn


def load_u64() -> Optional[Callable[..., Any]]:
    """For the compiled kernels: `load(buf, at)`, the eight bytes buf[at:at + 8] of a uint8 array as
    one little-endian uint64, read by one unaligned load. LLVM keeps a loop of eight byte loads,
    shifts and ors as written (some 24 instructions where one does), and the wire kernels read
    every attribute's bytes eight at a time. The caller keeps at + 8 within the array. None when
    the kernels are interpreted: numba is then never imported."""
    _mode["fixed"] = True
    if _mode["chosen"] == "interpreted":
        return None
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def load(typingctx: Any, buf: Any, at: Any) -> Any:  # noqa: ARG001 - numba's signature
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            array = context.make_array(signature.args[0])(context, builder, args[0])
            pointer = builder.bitcast(builder.gep(array.data, [args[1]]), ir.IntType(64).as_pointer())
            word = builder.load(pointer, align=1)
            return builder.bswap(word) if sys.byteorder == "big" else word

        return types.uint64(buf, at), codegen

    return load


def how_loaded(compiled: Any) -> str:
    """"cached", "compiled" or "interpreted": how a kernel that has run came to be."""
    stats = getattr(compiled, "stats", None)  # none when interpreted, or under NUMBA_DISABLE_JIT=1
    if stats is None:
        return "interpreted"
    return "cached" if sum(stats.cache_hits.values()) and not sum(stats.cache_misses.values()) else "compiled"
