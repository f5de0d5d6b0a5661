"""The `request` cost model as a numba kernel: thin loops over arrays, no I/O, no objects.

Rows are (unit, holder) pairs: a whole GPU, MIG instance or replica set held by one pod for part
of the interval. Per row: allocated = P * f * share * dt / 3600, split into effective
(allocated * activity over the measured part), waste and unmeasured. Per physical GPU: capacity
= P * dt / 3600 and idle = capacity - allocated. If the rows of a GPU claim more than the whole
GPU (inconsistent input), they are scaled down together so a GPU is never sold twice.
"""

from __future__ import annotations

import numpy as np

from otelgpu.core.jit import kernel


@kernel
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


@kernel
def share_kernel(row_group, row_weight, group_amount, out_row, out_left):  # pragma: no cover - jitted
    """Hand each group's amount to its rows pro rata to their weights. A group whose rows weigh
    nothing keeps its amount (`out_left`); weights below zero count as zero."""
    n_group = group_amount.shape[0]
    total = np.zeros(n_group)
    for i in range(row_group.shape[0]):
        if row_weight[i] > 0.0:
            total[row_group[i]] += row_weight[i]
    for g in range(n_group):
        out_left[g] = group_amount[g] if total[g] <= 0.0 else 0.0
    for i in range(row_group.shape[0]):
        g = row_group[i]
        if total[g] > 0.0 and row_weight[i] > 0.0:
            out_row[i] = group_amount[g] * (row_weight[i] / total[g])
        else:
            out_row[i] = 0.0


@kernel
def hybrid_kernel(row_node, n_node, alloc, use, measured, alpha, charge):  # pragma: no cover - jitted
    """charge = alpha * alloc + (1 - alpha) * pool * use / sum(use), per node, over the holders
    with an activity figure (`measured`); `pool` is their allocated total, so the node's charge
    equals its allocated cost. Unmeasured holders pay their allocated cost; a node where no
    measured holder used anything falls back to allocated."""
    pool = np.zeros(n_node)
    used = np.zeros(n_node)
    for i in range(row_node.shape[0]):
        if measured[i]:
            pool[row_node[i]] += alloc[i]
            used[row_node[i]] += max(use[i], 0.0)
    for i in range(row_node.shape[0]):
        n = row_node[i]
        if measured[i] and used[n] > 0.0:
            charge[i] = alpha * alloc[i] + (1.0 - alpha) * pool[n] * (max(use[i], 0.0) / used[n])
        else:
            charge[i] = alloc[i]


@kernel
def scad_kernel(pod_node, alloc_qty, capacity, rate_hour, hours, split, unused, idle):  # pragma: no cover - jitted
    """AWS Split Cost Allocation Data for one interval, resource by resource (columns).

    alloc_qty[p, x]: the pod's max(reserved, used) of resource x (time-weighted over the interval);
    capacity[n, x], rate_hour[n, x]: the node's capacity and hourly price per unit of x.
    Split ratio s = A / max(Cap, sum A) (oversubscription divides by what was allocated); split
    cost = s * Cap * rate * hours; the unused capacity's cost goes to the pods holding x pro rata
    to A, or stays on the node (`idle`) when nobody holds x there."""
    n_node, n_res = capacity.shape
    total = np.zeros((n_node, n_res))
    for p in range(pod_node.shape[0]):
        for x in range(n_res):
            if alloc_qty[p, x] > 0.0:
                total[pod_node[p], x] += alloc_qty[p, x]
    # Per node and resource, the cost per unit allocated of the split and of the unused capacity:
    # the pods' loop then multiplies (s * Cap * rate * hours = A * Cap * rate * hours / max(Cap, sum A)).
    # The two rates sit side by side, so a pod's lookup reads one cache line, not two.
    rates = np.zeros((n_node, n_res, 2))
    for n in range(n_node):
        for x in range(n_res):
            cap = capacity[n, x]
            cap_cost = cap * rate_hour[n, x] * hours
            if total[n, x] <= 0.0:
                idle[n, x] = cap_cost
                continue
            idle[n, x] = 0.0
            rates[n, x, 0] = cap_cost / max(cap, total[n, x])
            rates[n, x, 1] = max(cap - total[n, x], 0.0) * rate_hour[n, x] * hours / total[n, x]
    for p in range(pod_node.shape[0]):
        n = pod_node[p]
        for x in range(n_res):
            a = alloc_qty[p, x]
            if a <= 0.0:
                split[p, x] = 0.0
                unused[p, x] = 0.0
            else:
                split[p, x] = a * rates[n, x, 0]
                unused[p, x] = a * rates[n, x, 1]