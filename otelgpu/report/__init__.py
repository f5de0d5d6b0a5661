"""`otelgpu report`: showback of a period from the cost series in Prometheus or AMP (showback.py),
written as CSV (here) or as a self-contained HTML page (html.py)."""

from __future__ import annotations

import csv
import math
from datetime import datetime, timezone
from typing import TextIO

from otelgpu.report.showback import Showback

FIGURES = ("charged", "allocated", "unused", "effective", "waste", "unmeasured", "gpu_hours", "cost_per_gpu_hour")


def parse_time(text: str) -> float:
    """ISO 8601 (`2026-11-01`, `2026-11-01T06:00:00Z`, with an offset) as seconds since the epoch;
    a time without a zone is UTC."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError as exc:
        raise ValueError(f"expected an ISO 8601 date or time, got {text!r}") from exc
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


def write_csv(showback: Showback, out: TextIO) -> None:
    """One row per group, largest charge first, then `(idle)` and `(total)` (the capacity, what the
    rows and the idle add up to). Money in the currency of the series; shares of the capacity."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*(showback.by or ("group",)), *FIGURES, "share_of_capacity"])
    blank = [""] * max(len(showback.by) - 1, 0)
    for r in showback.rows:
        values = [r.charged, r.allocated, r.unused, r.effective, r.waste, r.unmeasured, r.gpu_hours, r.cost_per_gpu_hour]
        writer.writerow([*(r.key or ("everything",)), *map(_number, values),
                    _number(r.charged / showback.capacity if showback.capacity else math.nan)])
    idle = [showback.idle, 0, showback.idle, 0, 0, 0, 0, math.nan]
    writer.writerow(["(idle)", *blank, *map(_number, idle), _number(showback.idle_share)])
    overall = showback.total
    total = [showback.capacity, overall.allocated, overall.unused, overall.effective, overall.waste,
             overall.unmeasured, overall.gpu_hours, math.nan]
    writer.writerow(["(total)", *blank, *map(_number, total), _number(1.0 if showback.capacity else math.nan)])


def _number(value: float) -> str:
    return "" if math.isnan(value) else f"{value:.6f}"
