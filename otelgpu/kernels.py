"""Every numba kernel, compiled (or loaded from numba's cache) before the sidecar takes traffic and
by `otelgpu warm-up` when an image is built, so no request and no export waits for the JIT."""

from __future__ import annotations


def warm_up() -> dict[str, str]:
    """Per kernel, "cached", "compiled" or "interpreted" (see otelgpu.core.jit.how_loaded)."""
    from otelgpu.attribution import engine
    from otelgpu.enrich import facts
    from otelgpu.exporter import otlp, remote_write
    from otelgpu.receiver import columnar

    kernels = engine.warm_up()
    kernels["decode"] = columnar.warm_up()
    kernels["otlp"] = otlp.warm_up()
    kernels["remote_write"] = remote_write.warm_up()
    kernels["facts"] = facts.warm_up()
    return kernels
