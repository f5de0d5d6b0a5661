"""The numba kernels a configuration uses, compiled (or loaded from numba's cache) before the sidecar
takes traffic, and every kernel by `otelgpu warm-up` when an image is built, so no request and no
export waits for the JIT. A kernel the configuration never calls is neither compiled nor loaded:
each takes about a megabyte of LLVM's and numba's memory once loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from otelgpu.config import Config


def warm_up(config: Optional["Config"] = None) -> dict[str, str]:
    """Per kernel that `config` uses (every kernel without one): "cached", "compiled" or
    "interpreted" (see otelgpu.core.jit.how_loaded)."""
    from otelgpu.attribution import engine
    from otelgpu.enrich import facts, steps, timeline
    from otelgpu.receiver import columnar

    kernels = engine.warm_up(cost_kernels(config)) if config else engine.warm_up()
    kernels["decode"] = columnar.warm_up()
    kernels["facts"] = facts.warm_up()
    kernels["timeline"] = timeline.warm_up()
    kernels["steps"] = steps.warm_up()
    if config is None or config.checkpoint.directory:  # the write-ahead log's records
        from otelgpu.receiver import record

        kernels["wal"] = record.warm_up()
    if config is None or config.exporter.otlp:
        from otelgpu.exporter import otlp

        kernels["otlp"] = otlp.warm_up()
    if config is None or config.exporter.remote_write:
        from otelgpu.exporter import remote_write

        kernels["remote_write"] = remote_write.warm_up()
    return kernels


def cost_kernels(config: "Config") -> tuple[str, ...]:
    """The attribution kernels (otelgpu.attribution.engine.KERNELS) the configured cost models and
    idle policy call: `request` always (every model starts from what each holder was allocated);
    `scad` and its `share` of the unused capacity for SCAD; `share` for the idle policy `share`."""
    attribution = config.attribution
    used = {"request"}
    if "scad" in attribution.cost_models:
        used |= {"scad", "share"}
    if "hybrid" in attribution.cost_models:
        used.add("hybrid")
    if attribution.idle.policy == "share":
        used.add("share")
    return tuple(sorted(used))
