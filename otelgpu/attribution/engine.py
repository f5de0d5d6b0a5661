"""Plain-Python wrapper around the kernels: validates inputs with clear errors, allocates outputs,
and compiles the kernels ahead of the first request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from otelgpu.attribution.kernel import hybrid_kernel, request_kernel, scad_kernel, share_kernel
from otelgpu.core.jit import how_loaded


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
    n_gpu, n_row = len(rows.gpu_price_hour), len(rows.row_gpu)
    for name in ("row_f", "row_share", "row_measured", "row_activity"):
        if len(getattr(rows, name)) != n_row:
            raise ValueError(f"{name} has {len(getattr(rows, name))} entries, row_gpu has {n_row}")
    prices = rows.gpu_price_hour
    if n_gpu and (not np.all(np.isfinite(prices)) or prices.min() < 0):
        raise ValueError("GPU prices must be finite and >= 0")
    if n_row and (rows.row_gpu.min() < 0 or rows.row_gpu.max() >= n_gpu):
        raise ValueError("row_gpu must index gpu_price_hour")
    for name in ("row_f", "row_share", "row_measured"):
        column = getattr(rows, name)
        if n_row and (not np.all(np.isfinite(column)) or column.min() < 0 or column.max() > 1 + 1e-9):
            raise ValueError(f"{name} must lie in [0, 1]")


def attribute_request(rows: UnitRows, dt_s: float) -> Attribution:
    if not (dt_s > 0 and np.isfinite(dt_s)):
        raise ValueError(f"interval length must be a positive number of seconds, got {dt_s}")
    validate(rows)
    n_row, n_gpu = len(rows.row_gpu), len(rows.gpu_price_hour)
    out = Attribution(*(np.zeros(n_row) for _ in range(5)), np.zeros(n_gpu), np.zeros(n_gpu))
    request_kernel(
        rows.gpu_price_hour.astype(np.float64), float(dt_s), rows.row_gpu.astype(np.int64),
        rows.row_f.astype(np.float64), rows.row_share.astype(np.float64),
        rows.row_measured.astype(np.float64), rows.row_activity.astype(np.float64),
        out.alloc, out.effective, out.waste, out.unmeasured, out.held_s, out.capacity, out.idle,
    )
    return out


def share(row_group: np.ndarray, row_weight: np.ndarray, group_amount: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each group's amount handed to its rows pro rata to weight: (per row, left per group)."""
    n_row = len(row_group)
    if n_row and (row_group.min() < 0 or row_group.max() >= len(group_amount)):
        raise ValueError("row_group must index group_amount")
    out, left = np.zeros(n_row), np.zeros(len(group_amount))
    share_kernel(row_group.astype(np.int64), row_weight.astype(np.float64), group_amount.astype(np.float64), out, left)
    return out, left


def hybrid(row_node: np.ndarray, n_node: int, alloc: np.ndarray, use: np.ndarray, measured: np.ndarray,
           alpha: float) -> np.ndarray:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"hybrid alpha must lie in [0, 1], got {alpha}")
    out = np.zeros(len(row_node))
    hybrid_kernel(row_node.astype(np.int64), int(n_node), alloc.astype(np.float64), use.astype(np.float64),
                  measured.astype(np.bool_), float(alpha), out)
    return out


@dataclass
class ScadSplit:
    split: np.ndarray  # [pod, resource]
    unused: np.ndarray  # [pod, resource]
    idle: np.ndarray  # [node, resource]: cost of a resource nobody on the node holds


def scad(pod_node: np.ndarray, alloc_qty: np.ndarray, capacity: np.ndarray, rate_hour: np.ndarray,
         dt_s: float) -> ScadSplit:
    n_pod, n_node = len(pod_node), len(capacity)
    n_res = capacity.shape[1] if capacity.ndim == 2 else 0
    if alloc_qty.shape != (n_pod, n_res) or rate_hour.shape != capacity.shape:
        raise ValueError(f"shapes disagree: alloc {alloc_qty.shape}, capacity {capacity.shape}, rates {rate_hour.shape}")
    for name, v in (("alloc_qty", alloc_qty), ("capacity", capacity), ("rate_hour", rate_hour)):
        if v.size and (not np.all(np.isfinite(v)) or v.min() < 0):
            raise ValueError(f"{name} must be finite and >= 0")
    if n_pod and (pod_node.min() < 0 or pod_node.max() >= n_node):
        raise ValueError("pod_node must index the nodes")
    out = ScadSplit(np.zeros((n_pod, n_res)), np.zeros((n_pod, n_res)), np.zeros((n_node, n_res)))
    scad_kernel(pod_node.astype(np.int64), np.ascontiguousarray(alloc_qty, dtype=np.float64),
                np.ascontiguousarray(capacity, dtype=np.float64), np.ascontiguousarray(rate_hour, dtype=np.float64),
                dt_s / 3600.0, out.split, out.unused, out.idle)
    return out


KERNELS = {"request": request_kernel, "share": share_kernel, "hybrid": hybrid_kernel, "scad": scad_kernel}


def warm_up(names: Iterable[str] = tuple(KERNELS)) -> dict[str, str]:
    """Compile (or load from numba's cache) the kernels `names` (of KERNELS) before the receivers
    take traffic. Returns, per kernel, "cached" (loaded from the cache), "compiled" (the JIT ran) or
    "interpreted" (otelgpu.core.jit's interpreted mode, or NUMBA_DISABLE_JIT)."""
    names = tuple(names)
    runs = {"request": lambda: attribute_request(UnitRows(np.array([1.0]), np.array([0]), np.array([0.5]),
                                                          np.array([1.0]), np.array([1.0]), np.array([0.5])), 60.0),
            "share": lambda: share(np.array([0]), np.array([1.0]), np.array([1.0])),
            "hybrid": lambda: hybrid(np.array([0]), 1, np.array([1.0]), np.array([0.5]), np.array([True]), 0.5),
            "scad": lambda: scad(np.array([0]), np.ones((1, 2)), np.ones((1, 2)), np.ones((1, 2)), 60.0)}
    for name in names:
        runs[name]()
    return {name: how_loaded(KERNELS[name]) for name in names}
