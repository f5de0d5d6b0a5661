"""Plain-Python wrapper around the kernels: validates inputs with clear errors, allocates outputs,
and compiles the kernels ahead of the first request."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from otelgpu.attribution.kernel import request_kernel


@dataclass
class UnitRows:
    """Kernel input. One entry per physical GPU in `gpu_price_hour`; one per (unit, holder) in row_*."""

    gpu_price_hour: np.ndarray  # float64 [n_gpu]
    row_gpu: np.ndarray  # int64 [n_row], index into gpu_price_hour
    row_f: np.ndarray  # float64, unit fraction of one GPU held (0..1)
    row_share: np.ndarray  # float64, share of the interval held (0..1)
    row_measured: np.ndarray  # float64, share of the held time with an activity figure (0..1)
    row_activity: np.ndarray  # float64, activity of the unit over the measured time (0..1), NaN if none


@dataclass
class Attribution:
    alloc: np.ndarray
    effective: np.ndarray
    waste: np.ndarray
    unmeasured: np.ndarray
    held_s: np.ndarray  # GPU-seconds held (fraction of a GPU times seconds)
    capacity: np.ndarray  # per GPU
    idle: np.ndarray  # per GPU


def validate(rows: UnitRows) -> None:
    n_gpu, n = len(rows.gpu_price_hour), len(rows.row_gpu)
    for name in ("row_f", "row_share", "row_measured", "row_activity"):
        if len(getattr(rows, name)) != n:
            raise ValueError(f"{name} has {len(getattr(rows, name))} entries, row_gpu has {n}")
    p = rows.gpu_price_hour
    if n_gpu and (not np.all(np.isfinite(p)) or p.min() < 0):
        raise ValueError("GPU prices must be finite and >= 0")
    if n and (rows.row_gpu.min() < 0 or rows.row_gpu.max() >= n_gpu):
        raise ValueError("row_gpu must index gpu_price_hour")
    for name in ("row_f", "row_share", "row_measured"):
        v = getattr(rows, name)
        if n and (not np.all(np.isfinite(v)) or v.min() < 0 or v.max() > 1 + 1e-9):
            raise ValueError(f"{name} must lie in [0, 1]")


def attribute_request(rows: UnitRows, dt_s: float) -> Attribution:
    if not (dt_s > 0 and np.isfinite(dt_s)):
        raise ValueError(f"interval length must be a positive number of seconds, got {dt_s}")
    validate(rows)
    n, n_gpu = len(rows.row_gpu), len(rows.gpu_price_hour)
    out = Attribution(*(np.zeros(n) for _ in range(5)), np.zeros(n_gpu), np.zeros(n_gpu))
    request_kernel(
        rows.gpu_price_hour.astype(np.float64), float(dt_s), rows.row_gpu.astype(np.int64),
        rows.row_f.astype(np.float64), rows.row_share.astype(np.float64),
        rows.row_measured.astype(np.float64), rows.row_activity.astype(np.float64),
        out.alloc, out.effective, out.waste, out.unmeasured, out.held_s, out.capacity, out.idle,
    )
    return out


def warm_up() -> None:
    """Compile (or load from cache) every kernel before the receivers take traffic."""
    rows = UnitRows(np.array([1.0]), np.array([0]), np.array([0.5]), np.array([1.0]),
                    np.array([1.0]), np.array([0.5]))
    attribute_request(rows, 60.0)
