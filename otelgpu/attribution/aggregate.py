"""One interval's kernel output -> increments of the cost series, and the interval's gauges."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from otelgpu.attribution.engine import Attribution
from otelgpu.config import TAG_NAMES
from otelgpu.enrich.join import Joined
from otelgpu.exporter.store import Attrs


def interval_series(joined: Joined, att: Attribution) -> tuple[dict[str, dict[Attrs, float]], dict[str, dict[Attrs, float]]]:
    sums: dict[str, dict[Attrs, float]] = {m: defaultdict(float) for m in
                                           ("allocated", "effective", "waste", "unmeasured", "held", "idle", "capacity")}
    measured_alloc: dict[Attrs, float] = defaultdict(float)
    for i, attrs in enumerate(joined.row_attrs):
        sums["allocated"][attrs] += float(att.alloc[i])
        sums["effective"][attrs] += float(att.effective[i])
        sums["waste"][attrs] += float(att.waste[i])
        sums["unmeasured"][attrs] += float(att.unmeasured[i])
        sums["held"][attrs] += float(att.held_s[i])
        measured_alloc[attrs] += float(att.alloc[i] - att.unmeasured[i])
    for g, attrs in enumerate(joined.gpu_attrs):
        sums["idle"][attrs] += float(att.idle[g])
        sums["capacity"][attrs] += float(att.capacity[g])

    gauges: dict[str, dict[Attrs, float]] = {"activity": {}, "tag_coverage": {}}
    for attrs, m in measured_alloc.items():
        if m > 0:
            gauges["activity"][attrs] = sums["effective"][attrs] / m
    total = float(att.alloc.sum())
    if total > 0:
        found = np.array(joined.row_tags_found, dtype=bool).reshape(-1, len(TAG_NAMES))
        gauges["tag_coverage"][(("tag", "all"),)] = float(att.alloc[found.all(axis=1)].sum()) / total
        for j, name in enumerate(TAG_NAMES):
            gauges["tag_coverage"][(("tag", name),)] = float(att.alloc[found[:, j]].sum()) / total
    return {k: dict(v) for k, v in sums.items()}, gauges
