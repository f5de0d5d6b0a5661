"""The numba kernels' one decorator, and how a kernel came to be loaded.

Every kernel is compiled once per process at most and cached on disk (`otelgpu warm-up` fills the
cache when an image is built), and releases the GIL while it runs, so the receivers' threads keep
taking requests. Small helpers the kernels call are inlined into them."""

from __future__ import annotations

from typing import Any, Callable, Optional

from numba import njit


def kernel(fn: Optional[Callable[..., Any]] = None, *, inline: bool = False) -> Any:
    """`@kernel`, or `@kernel(inline=True)` for a helper that the kernels calling it inline."""
    jit = njit(cache=True, nogil=True, **({"inline": "always"} if inline else {}))
    return jit(fn) if fn is not None else jit


def how_loaded(compiled: Any) -> str:
    """"cached", "compiled" or "interpreted": how a kernel that has run came to be."""
    stats = getattr(compiled, "stats", None)  # none under NUMBA_DISABLE_JIT=1 (coverage runs)
    if stats is None:
        return "interpreted"
    return "cached" if sum(stats.cache_hits.values()) and not sum(stats.cache_misses.values()) else "compiled"
