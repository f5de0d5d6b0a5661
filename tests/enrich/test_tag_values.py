"""Tag values are bounded per tag and per namespace, and given back when no pod uses them."""

from __future__ import annotations

import json

from otelgpu.config import TagValuesConfig
from otelgpu.enrich.labels import TagValues
from otelgpu.telemetry import SelfMetrics


def values(max_distinct: int = 8, per_namespace: int | None = None, release_after: int = 3) -> TagValues:
    return TagValues(TagValuesConfig(max_distinct=max_distinct, max_distinct_per_namespace=per_namespace),
                     SelfMetrics(), release_after=release_after)


def test_a_namespace_minting_values_fills_only_its_own_share():
    v = values(max_distinct=8)  # a namespace's share: a quarter, 2
    bomb = [v("team", f"bomb-{i}", "evil") for i in range(100)]
    assert bomb[:2] == ["bomb-0", "bomb-1"] and set(bomb[2:]) == {"other"}
    assert [v("team", t, ns) for t, ns in (("search", "web"), ("search", "infer"), ("research", "ml"))] == \
        ["search", "search", "research"]
    assert v.metrics.tag_values_capped == {("team", "distinct"): 98}


def test_the_tag_cap_still_holds_across_namespaces():
    v = values(max_distinct=4, per_namespace=4)
    got = [v("team", f"t{i}", f"ns{i}") for i in range(6)]
    assert got == ["t0", "t1", "t2", "t3", "other", "other"]
    assert v("team", "t0", "ns9") == "t0"  # a value already held costs no new place


def test_values_no_pod_uses_any_more_give_their_place_back():
    v = values(max_distinct=2, per_namespace=2, release_after=3)
    assert v("team", "a", "ml") == "a" and v("team", "b", "ml") == "b"
    assert v("team", "c", "ml") == "other"
    for _ in range(3):
        v.tick()
        v("team", "a", "ml")  # a is still in use, b is gone
    assert v("team", "c", "ml") == "other"
    v.tick()  # b unused for more than 3 intervals
    assert v("team", "c", "ml") == "c"
    assert v("team", "b", "ml") == "other"


def test_the_state_survives_a_restart_and_older_checkpoints_load():
    v = values(max_distinct=2, per_namespace=2)
    v("team", "a", "ml"), v("team", "b", "web")
    v.tick()
    restored = values(max_distinct=2, per_namespace=2)
    restored.restore(json.loads(json.dumps(v.state())))
    assert restored.generation == 1
    assert restored("team", "c", "ml") == "other" and restored("team", "a", "ml") == "a"
    old = values(max_distinct=2, per_namespace=2)
    old.restore({"team": ["a", "b"], "model": []})  # the format before namespaces
    assert old("team", "c", "ml") == "other" and old("team", "b", "ml") == "b"
