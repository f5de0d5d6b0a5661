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
