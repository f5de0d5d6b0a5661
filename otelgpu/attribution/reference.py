"""The `request` model written the obvious way, one row at a time: the yardstick for the kernel."""

from __future__ import annotations

import math

import numpy as np

from otelgpu.attribution.engine import Attribution, UnitRows


def attribute_request_reference(rows: UnitRows, dt_s: float) -> Attribution:
    hours = dt_s / 3600.0
    n_gpu = len(rows.gpu_price_hour)
    claimed = [0.0] * n_gpu
    for g, f, s in zip(rows.row_gpu, rows.row_f, rows.row_share):
        claimed[int(g)] += float(f) * float(s)
    capacity = [float(p) * hours for p in rows.gpu_price_hour]
    idle = list(capacity)
    alloc, eff, waste, unmeas, held = [], [], [], [], []
    for g, f, s, m, act in zip(rows.row_gpu, rows.row_f, rows.row_share, rows.row_measured, rows.row_activity):
        g = int(g)
        frac = float(f) * float(s) / max(claimed[g], 1.0)
        a = float(rows.gpu_price_hour[g]) * frac * hours
        measured = 0.0 if math.isnan(act) else a * min(max(float(m), 0.0), 1.0)
        e = measured * min(max(float(act), 0.0), 1.0) if measured > 0 else 0.0
        alloc.append(a)
        eff.append(e)
        waste.append(measured - e)
        unmeas.append(a - measured)
        held.append(frac * dt_s)
        idle[g] -= a
    return Attribution(np.array(alloc), np.array(eff), np.array(waste), np.array(unmeas), np.array(held),
                       np.array(capacity), np.maximum(np.array(idle), 0.0))
