"""Tag values are bounded per tag and per namespace, and given back when no pod uses them."""

from __future__ import annotations

import json

from cluster import Cluster, Node, Pod, Unit
from otelgpu.enrich.config import TagValuesConfig
from otelgpu.enrich.labels import TagValues
from otelgpu.telemetry import SelfMetrics, by_label
from support import feed, make_config, offline_pipeline


def values(max_distinct: int = 8, per_namespace: int | None = None, release_after: int = 3,
           metrics: SelfMetrics | None = None) -> TagValues:
    return TagValues(TagValuesConfig(max_distinct=max_distinct, max_distinct_per_namespace=per_namespace),
                     metrics or SelfMetrics(), release_after=release_after)


def test_a_namespace_minting_values_fills_only_its_own_share():
    metrics = SelfMetrics()
    v = values(max_distinct=8, metrics=metrics)  # a namespace's share: a quarter, 2
    bomb = [v("team", f"bomb-{i}", "evil") for i in range(100)]
    assert bomb[:2] == ["bomb-0", "bomb-1"] and set(bomb[2:]) == {"other"}
    assert [v("team", t, ns) for t, ns in (("search", "web"), ("search", "infer"), ("research", "ml"))] == \
        ["search", "search", "research"]
    assert by_label(metrics.tag_values_capped) == {("team", "distinct"): 98}


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
        v.expire()
        v("team", "a", "ml")  # a is still in use, b is gone
    assert v("team", "c", "ml") == "other"
    v.expire()  # b unused for more than 3 intervals
    assert v("team", "c", "ml") == "c"
    assert v("team", "b", "ml") == "other"


def test_the_state_survives_a_restart_and_older_checkpoints_load():
    v = values(max_distinct=2, per_namespace=2)
    v("team", "a", "ml"), v("team", "b", "web")
    v.expire()
    restored = values(max_distinct=2, per_namespace=2)
    restored.restore(json.loads(json.dumps(v.state())))
    assert restored.generation == 1
    assert restored("team", "c", "ml") == "other" and restored("team", "a", "ml") == "a"
    old = values(max_distinct=2, per_namespace=2)
    old.restore({"team": ["a", "b"], "model": []})  # the format before namespaces
    assert old("team", "c", "ml") == "other" and old("team", "b", "ml") == "b"


def test_under_the_cap_the_holders_of_the_first_units_keep_their_values_whatever_their_names() -> None:
    """The join admits holders' tag values in the order their units come (DCGM's, GPU by GPU),
    not in the order their names were first seen: pod "aa", named first by kube-state-metrics,
    holds the second GPU."""
    node = Node("n1", "p4d.24xlarge", cpu=96, memory_gib=1152, labels={"nvidia.com/gpu.count": "2"},
                units=[Unit("GPU-0"), Unit("GPU-1")])
    pods = [Pod("ns", "aa", "n1", {"team": "team-a"}, gpu=("nvidia_com_gpu", 1), holds=("GPU-1",)),
            Pod("ns", "zz", "n1", {"team": "team-z"}, gpu=("nvidia_com_gpu", 1), holds=("GPU-0",))]
    p = offline_pipeline(make_config(attribution__interval_seconds=900, attribution__lateness_seconds=3600,
                                     tag_values__max_distinct=1))
    feed(p, *Cluster([node], pods).scrapes(300, 1800))
    p.close_due(flush=True)
    teams = {pod: team for pod, team in p.store.totals("allocated", ("pod", "team"), {"cost_model": "request"})}
    assert teams == {"zz": "team-z", "aa": "other"}
