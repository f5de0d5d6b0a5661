"""The `request` cost model as a numba kernel: thin loops over arrays, no I/O, no objects.

Rows are (unit, holder) pairs: a whole GPU, MIG instance or replica set held by one pod for part
of the interval. Per row: allocated = P * f * share * dt / 3600, split into effective
(allocated * activity over the measured part), waste and unmeasured. Per physical GPU: capacity
= P * dt / 3600 and idle = capacity - allocated. If the rows of a GPU claim more than the whole
GPU (inconsistent input), they are scaled down together so a GPU is never sold twice.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def request_kernel(gpu_price_hour, dt_s, row_gpu, row_f, row_share, row_measured, row_activity,
                   alloc, effective, waste, unmeasured, held_s, capacity, idle):  # pragma: no cover - jitted
    n_gpu = gpu_price_hour.shape[0]
    n_row = row_gpu.shape[0]
    claimed = np.zeros(n_gpu)
    for i in range(n_row):
        claimed[row_gpu[i]] += row_f[i] * row_share[i]
    hours = dt_s / 3600.0
    for g in range(n_gpu):
        capacity[g] = gpu_price_hour[g] * hours
        idle[g] = capacity[g]
    for i in range(n_row):
        g = row_gpu[i]
        frac = row_f[i] * row_share[i]
        if claimed[g] > 1.0:
            frac = frac / claimed[g]
        held_s[i] = frac * dt_s
        a = gpu_price_hour[g] * frac * hours
        alloc[i] = a
        idle[g] -= a
        act = row_activity[i]
        if np.isnan(act):
            measured = 0.0
        else:
            measured = a * min(max(row_measured[i], 0.0), 1.0)
            act = min(max(act, 0.0), 1.0)
        if measured > 0.0:
            effective[i] = measured * act
            waste[i] = measured - effective[i]
        else:
            effective[i] = 0.0
            waste[i] = 0.0
        unmeasured[i] = a - measured
    for g in range(n_gpu):
        if idle[g] < 0.0:  # only rounding can get here; idle is never negative
            idle[g] = 0.0
