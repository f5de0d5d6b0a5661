"""What every FOCUS dataset otelgpu writes must satisfy, whatever the run behind it."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest


def assert_adds_up(rows: list[dict], origins: dict[tuple, float]) -> None:
    """Per origin (period, node): the charges' ratios add up to 1, every summable column to the
    origin's cost or quantity; each row's ratio is its cost over the origin's."""
    by: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        by[(r["ChargePeriodStart"], r["ResourceId"])].append(r)
    assert set(by) == set(origins)
    for key, charges in by.items():
        cost, quantity = origins[key]
        for column in ("BilledCost", "EffectiveCost", "ListCost", "ContractedCost"):
            assert sum(r[column] for r in charges) == pytest.approx(cost, rel=1e-12)
        assert sum(r["PricingQuantity"] for r in charges) == pytest.approx(quantity, rel=1e-12)
        ratios = [sum(e["AllocatedRatio"] for e in json.loads(r["AllocatedMethodDetails"])["Elements"]) for r in charges]
        assert sum(ratios) == pytest.approx(1.0, rel=1e-12)
        for r, ratio in zip(charges, ratios):
            assert ratio == pytest.approx(r["BilledCost"] / cost, rel=1e-12, abs=1e-15)
