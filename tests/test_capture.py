"""Every interval's sums and gauges of the demo cluster, under each configuration variant, are
the ones recorded in tests/data/capture/demo.json, bit for bit (tests/capture.py). A change that
moves a figure on purpose records them again (`python tests/capture.py --write`) and says why."""

from __future__ import annotations

import json

import pytest
from capture import DATA, VARIANTS, demo, differences


@pytest.fixture(scope="module")
def recorded() -> dict[str, list[dict[str, str]]]:
    return json.loads((DATA / "demo.json").read_text())


def test_every_variant_is_recorded(recorded):
    assert set(recorded) == set(VARIANTS)
    # each variant changes the money somewhere: none of them is the demo again by mistake
    assert all(recorded[v] != recorded["demo"] for v in VARIANTS if v != "demo")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_interval_is_what_was_recorded(recorded, variant):
    assert differences(recorded[variant], demo(variant)) == []


@pytest.mark.parametrize("variant", ["demo", "hybrid-activity"])
def test_folding_every_batch_as_it_arrives_moves_no_figure(recorded, variant, monkeypatch):
    """The demo cluster is too small for its open intervals to fold before they close: folded
    from their first batch on (`attribution.fold_rows: 1`), whenever what they hold doubles
    (samples into steps, facts to each series' last), every interval is still the one recorded."""
    from otelgpu.enrich import window

    merges = []
    merge = window.Steps.merge
    monkeypatch.setattr(window.Steps, "merge", staticmethod(lambda parts: merges.append(len(parts)) or merge(parts)))
    assert differences(recorded[variant], demo(variant, {"attribution": {"fold_rows": 1}})) == []
    folds = sum(1 for parts in merges if parts > 1)  # a batch's own samples are one part
    assert folds > 2 * len(recorded[variant])  # folded as they filled, not only at each close
