"""Why a point was rejected: the metric it belongs to, a short stable code (the `metric` and
`reason` labels of otelgpu_points_rejected_total, so alerts and dashboards can rely on them) and
the sentence the sender is told (the request's partial_success error_message)."""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

# The codes, and what each says.
REASONS = {
    "no_timestamp": "a point without a timestamp",
    "from_the_future": "a timestamp ahead of the receive clock",
    "too_old": "a timestamp older than the age limit",
    "too_many_labels": "more labels than the limit",
    "bad_label": "a label value otelgpu cannot use (a MIG id or profile, a GPU count or replicas)",
    "missing_label": "a label its metric needs is missing",
    "mig_pair_incomplete": "only one of GPU_I_ID and GPU_I_PROFILE",
    "no_value": "a point without a value",
    "non_finite": "an infinite value",
    "out_of_range": "a value outside its metric's range",
    "bad_quantity": "a request or capacity outside its resource's range, or not whole where it must be",
    "wrong_type": "a metric that is not a gauge or a sum",
    "no_own_pod": "a series of its scrape target's own pod from a target that names none",
    "untrusted_dcgm": "dcgm series from a scrape target not in sources.dcgm",
    "untrusted_kube_state_metrics": "kube_state_metrics series from a scrape target not in sources.kube_state_metrics",
    "untrusted_cadvisor": "cadvisor series from a scrape target not in sources.cadvisor",
    "untrusted_vllm": "vllm series from a scrape target not in sources.vllm",
    "internal_error": "an error while processing a batch",
}


class Rejection(NamedTuple):
    metric: str  # the metric's name as otelgpu reads it; "" where not one metric's
    reason: str  # a code of REASONS
    text: str  # what the sender is told, the metric named


def rejection(metric: str, reason: str, what: str) -> Rejection:
    """`what`: the sentence without the metric's name, which leads it."""
    if reason not in REASONS:
        raise ValueError(f"unknown rejection reason {reason!r}")
    return Rejection(metric, reason, f"{metric} {what}" if metric else what)


def describe(rejected: Counter[Rejection]) -> str:
    """The partial_success error message: counts by reason, most frequent first."""
    return "; ".join(f"{n} {r.text}" for r, n in rejected.most_common())
