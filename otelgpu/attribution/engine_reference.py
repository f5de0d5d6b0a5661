"""The checked kernels of engine.py written the obvious way, one row at a time: their yardstick."""

from __future__ import annotations

import math

import numpy as np

from otelgpu.attribution.engine import Attribution, UnitRows


def attribute_request_reference(rows: UnitRows, dt_s: float) -> Attribution:
    hours = dt_s / 3600.0
    n_gpu = len(rows.gpu_price_hour)
    claimed = [0.0] * n_gpu
    for gpu, f, s in zip(rows.row_gpu, rows.row_f, rows.row_share):
        claimed[int(gpu)] += float(f) * float(s)
    capacity = [float(p) * hours for p in rows.gpu_price_hour]
    idle = list(capacity)
    alloc, eff, waste, unmeas, held = [], [], [], [], []
    for gpu, f, s, m, act in zip(rows.row_gpu, rows.row_f, rows.row_share, rows.row_measured, rows.row_activity):
        gpu = int(gpu)
        frac = float(f) * float(s) / max(claimed[gpu], 1.0)
        allocated = float(rows.gpu_price_hour[gpu]) * frac * hours
        measured = 0.0 if math.isnan(act) else allocated * min(max(float(m), 0.0), 1.0)
        effective = measured * min(max(float(act), 0.0), 1.0) if measured > 0 else 0.0
        alloc.append(allocated)
        eff.append(effective)
        waste.append(measured - effective)
        unmeas.append(allocated - measured)
        held.append(frac * dt_s)
        idle[gpu] -= allocated
    return Attribution(np.array(alloc), np.array(eff), np.array(waste), np.array(unmeas), np.array(held),
                       np.array(capacity), np.maximum(np.array(idle), 0.0))


def share_reference(row_group, row_weight, group_amount):
    """Each group's amount over its rows pro rata to weight; groups without weight keep it."""
    totals: dict[int, float] = {}
    for g, w in zip(row_group, row_weight):
        if w > 0:
            totals[int(g)] = totals.get(int(g), 0.0) + float(w)
    rows = [float(group_amount[int(g)]) * float(w) / totals[int(g)] if w > 0 else 0.0
            for g, w in zip(row_group, row_weight)]
    left = [0.0 if totals.get(g, 0.0) > 0 else float(a) for g, a in enumerate(group_amount)]
    return np.array(rows), np.array(left)


def hybrid_reference(row_node, alloc, use, measured, alpha):
    """docs/cost-model.md section 2.4, holder by holder."""
    out = []
    for i, n in enumerate(row_node):
        if not measured[i]:
            out.append(float(alloc[i]))
            continue
        peers = [j for j in range(len(row_node)) if row_node[j] == n and measured[j]]
        pool = sum(float(alloc[j]) for j in peers)
        used = sum(max(float(use[j]), 0.0) for j in peers)
        if used <= 0:
            out.append(float(alloc[i]))
        else:
            out.append(alpha * float(alloc[i]) + (1 - alpha) * pool * max(float(use[i]), 0.0) / used)
    return np.array(out)


def scad_reference(pod_node, alloc_qty, capacity, rate_hour, hours):
    """docs/cost-model.md section 2.2: split, unused and node idle per resource, pod by pod."""
    n_pod, n_res = alloc_qty.shape if len(alloc_qty) else (0, capacity.shape[1])
    split, unused = np.zeros((n_pod, n_res)), np.zeros((n_pod, n_res))
    idle = np.zeros(capacity.shape)
    for n in range(capacity.shape[0]):
        pods = [p for p in range(n_pod) if pod_node[p] == n]
        for x in range(n_res):
            holders = [p for p in pods if alloc_qty[p, x] > 0]
            total = sum(float(alloc_qty[p, x]) for p in holders)
            cap, rate = float(capacity[n, x]), float(rate_hour[n, x])
            if not holders:
                idle[n, x] = cap * rate * hours
                continue
            unused_cost = max(cap - total, 0.0) * rate * hours
            for p in holders:
                quantity = float(alloc_qty[p, x])
                split[p, x] = quantity / max(cap, total) * cap * rate * hours
                unused[p, x] = unused_cost * quantity / total
    return split, unused, idle
