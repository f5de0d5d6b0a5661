"""The cost models on columns (`models`) against their readable reference (`models_reference`),
series by series, on the joins of random clusters that have every kind of unit and holder: whole
GPUs, MIG instances, time-sliced replicas, pods kube-state-metrics does not know, busy units
nobody holds, untagged pods, a node without device data and one whose exporter maps no pods."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster import Cluster, Node, Pod, Unit
from otelgpu.attribution.models import CostModels, Packed
from otelgpu.attribution.models_reference import CostModelsReference
from otelgpu.core.attrs import Extended, attrs_of
from otelgpu.telemetry import SelfMetrics, by_label
from support import feed, make_config, offline_pipeline

MODELS = ["request", "scad", "opencost", "hybrid"]
A100 = "NVIDIA A100-SXM4-40GB"
MIG = (("1g.5gb", "nvidia_com_mig_1g_5gb"), ("2g.10gb", "nvidia_com_mig_2g_10gb"), ("3g.20gb", "nvidia_com_mig_3g_20gb"))


def random_cluster(rng: random.Random) -> Cluster:
    nodes: list[Node] = []
    pods: list[Pod] = []
    count = 0

    def pod(node: Node, holds: tuple[str, ...] = (), gpu=None, **kw) -> None:  # noqa: ANN001
        nonlocal count
        count += 1
        start = rng.choice([0, 0, 600, 1500])
        labels = rng.choice([{"team": f"t{count % 3}", "project": "p"}, {"team": "t1"}, {}])
        pods.append(Pod(f"ns-{count % 4}", f"pod-{count}", node.name, labels, cpu=rng.choice([0, 0.5, 4]),
                        memory_gib=rng.choice([0, 1, 16]), gpu=gpu, holds=holds, activity=rng.random(),
                        cpu_used=rng.choice([None, 0.2, 6.0]), memory_used_gib=rng.choice([None, 2.0, 40.0]),
                        start_s=start, end_s=rng.choice([3600, start + 900]), **kw))

    whole = Node("whole", rng.choice(["p4d.24xlarge", "g5.12xlarge", "x9.unknown"]), cpu=96, memory_gib=1152,
                 labels={"nvidia.com/gpu.count": "4", "karpenter.sh/capacity-type": rng.choice(["spot", "on-demand"])},
                 units=[Unit(f"GPU-w{g}", busy=rng.choice([0.0, 0.4])) for g in range(4)])
    mig = Node("mig", "p4d.24xlarge", cpu=96, memory_gib=1152, labels={"nvidia.com/gpu.count": "1"},
               units=[Unit("GPU-m0", A100, profile, str(i)) for i, (profile, _) in enumerate(MIG)])
    shared = Node("shared", "g5.12xlarge", cpu=48, memory_gib=192,
                  labels={"nvidia.com/gpu.count": "2", "nvidia.com/gpu.replicas": "4",
                          "nvidia.com/gpu.sharing-strategy": "time-slicing"},
                  units=[Unit("GPU-s0"), Unit("GPU-s1")])
    blind = Node("blind", "g5.12xlarge", cpu=48, memory_gib=192, labels={"nvidia.com/gpu.count": "2"})
    unmapped = Node("unmapped", "g6.xlarge", cpu=8, memory_gib=32, labels={"nvidia.com/gpu.count": "2"},
                    units=[Unit("GPU-u0"), Unit("GPU-u1")])
    cpu_only = Node("cpu-only", "m5.xlarge", cpu=4, memory_gib=16)
    nodes += [whole, mig, shared, blind, unmapped, cpu_only]
    for u in whole.units[: rng.randint(1, 3)]:
        pod(whole, (u.uuid,), ("nvidia_com_gpu", 1), ksm=rng.random() < 0.7)
    for unit, (_, resource) in zip(mig.units, MIG):
        if rng.random() < 0.8:
            pod(mig, (f"{unit.uuid}/{unit.gi}",), (resource, 1))
    for _ in range(rng.randint(1, 5)):
        pod(shared, (rng.choice(["GPU-s0", "GPU-s1"]),), ("nvidia_com_gpu", 1))
    pod(blind, gpu=("nvidia_com_gpu", rng.randint(1, 3)))
    pod(unmapped, gpu=("nvidia_com_gpu", 1))
    for node in (whole, cpu_only):
        pod(node)  # CPU and memory only
    return Cluster(nodes, pods, {"ns-0": {"team": "from-namespace"}})


CONFIGS = [
    {},
    {"attribution__idle__policy": "share"},
    {"attribution__idle__policy": "share", "attribution__idle__share_scope": "cluster",
     "attribution__mig_fraction_rule": "max"},
    {"attribution__idle__policy": "platform", "attribution__hybrid_weight": "activity"},
    {"series__drop_attributes": ["pod", "workload_name"], "attribution__hybrid_weight": "activity"},
    {"series__detail": "namespace", "attribution__prices__instance_price_split": "opencost"},
]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("overrides", CONFIGS)
def test_columns_give_the_reference_series_in_the_same_order(seed: int, overrides: dict) -> None:
    config = make_config(attribution__interval_seconds=900, attribution__lateness_seconds=3600,
                         attribution__cost_models=MODELS, attribution__scad__cpu_only_nodes=True,
                         attribution__prices__instance_hour_by_instance_type={"m5.xlarge": 0.192},
                         **overrides)
    p = offline_pipeline(config)
    joins = []
    attribute = p.models.attribute

    def spy(j, dt, split=None):  # noqa: ANN001
        joins.append((j, dt))
        return attribute(j, dt, split)

    p.models.attribute = spy
    feed(p, *random_cluster(random.Random(seed)).scrapes(300, 3600))
    p.close_due(flush=True)
    assert len(joins) == 4
    defaults = {name: rule.default for name, rule in config.tags.items()}
    counted = SelfMetrics(), SelfMetrics()
    columns = CostModels(config.attribution, defaults, counted[0], config.series.dropped)
    reference = CostModelsReference(config.attribution, defaults, counted[1], config.series.dropped)
    seen: set[tuple[str, str]] = set()
    for j, dt in joins:
        (sums, gauges), (want_sums, want_gauges) = columns.attribute(j, dt), reference.attribute(j, dt)
        assert list(sums) == list(want_sums)
        for metric, series in want_sums.items():
            assert list(sums[metric].items()) == list(series.items()), metric  # exactly, and in order
        assert {m: dict(g) for m, g in gauges.items()} == want_gauges
        seen |= {kv for attrs in want_sums["held"] for kv in attrs if kv[0] in ("attribution", "unit_kind")}
    assert by_label(counted[0].scad_request_fallbacks) == by_label(counted[1].scad_request_fallbacks)
    # Every kind of holding was in the joins compared.
    assert {("attribution", a) for a in ("pod", "ksm_request")} | {("unit_kind", k) for k in ("gpu", "mig", "replica")} <= seen


def test_the_clusters_have_unknown_pods_and_busy_units_nobody_holds() -> None:
    kinds: set[str] = set()
    for seed in range(5):
        p = offline_pipeline(make_config(attribution__interval_seconds=900, attribution__lateness_seconds=3600))
        feed(p, *random_cluster(random.Random(seed)).scrapes(300, 3600))
        p.close_due(flush=True)
        kinds |= {k[0] for k in p.store.totals("held", ("attribution",))}
    assert {"pod", "pod_unknown", "ksm_request", "active_without_pod"} <= kinds


def test_the_models_name_their_series_by_parts_and_the_store_finds_them_so() -> None:
    """Every sum the models make names its series by parts (the join's set and the attributes a
    model adds) and builds no set, and the models keep nothing of an interval for the next. From
    the second interval on, the store looks up by value only sets it had not met (new pods'):
    every other series is found by its parts."""
    p = offline_pipeline(make_config(attribution__interval_seconds=900, attribution__lateness_seconds=3600,
                                     attribution__cost_models=["request", "scad"]))
    sets, store = p.store._sets, p.store
    find, add, record, attribute = sets.find_all, sets.add_all, store.record, p.models.attribute
    by_value: list[set] = []  # per record: the sets looked up by value
    new: list[set] = []  # per record: the sets the store had not met
    named: list[bool] = []
    narrow: list[bool] = []

    def counted_find(many):  # noqa: ANN001, ANN202
        by_value[-1].update(many)
        return find(many)

    def counted_add(many):  # noqa: ANN001, ANN202
        new[-1].update(attrs for attrs, at in zip(many, find(many).tolist()) if at < 0)
        return add(many)

    def counted_record(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        by_value.append(set())
        new.append(set())
        return record(*args, **kwargs)

    def spy(j, dt, split=None):  # noqa: ANN001, ANN202
        sums, gauges = attribute(j, dt, split)
        named.append(all(series.named() is not None for series in sums.values()))
        # what an interval computed ahead holds until its close: indices of the parts in 4 bytes or
        # fewer (the extras, a few, in one), and the activity gauges as columns
        narrow.append(all(s.named().base.itemsize <= 4 and s.named().extra.itemsize == 1 for s in sums.values()))
        narrow[-1] &= isinstance(gauges["activity"], Packed)
        return sums, gauges

    sets.find_all, sets.add_all, store.record, p.models.attribute = counted_find, counted_add, counted_record, spy
    feed(p, *random_cluster(random.Random(7)).scrapes(300, 3600))
    p.close_due(flush=True)
    assert len(named) == len(by_value) == 4 and all(named)
    assert narrow == [True] * 4
    assert by_value[0] and by_value[0] == new[0]
    assert all(looked <= added for looked, added in zip(by_value[1:], new[1:])), [len(s) for s in by_value]
    assert sum(map(len, by_value[1:])) < len(by_value[0])
    assert len(p.models._extras._kept) < 20  # the extras a model adds, not a set per series
    activity, bases = p.store._gauges["activity"].keys, p.store._sets._bases
    assert activity and all(bases.value(bases.find(a)) is a for a in activity)  # the store's objects: held once


EXTRAS = ((), (("cost_model", "request"),), (("team", "override"),), (("cost_model", "scad"), ("node", "")))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(1, 9)), min_size=1, max_size=20),
       st.sets(st.sampled_from(["pod", "team", "cost_model", "node"])))
def test_series_merged_by_their_parts_are_the_sets_merged(picks: list[tuple[int, int, int]], dropped: set[str]) -> None:
    """Series named by parts, without the dropped attributes, merge as the sets they name merge:
    by their projected parts where no base keeps a key its extra adds, else set by set (an extra
    that replaces the team, or removes the node, of its base)."""
    config = make_config(attribution__cost_models=["request"])
    models = CostModels(config.attribution, {name: rule.default for name, rule in config.tags.items()},
                        dropped=frozenset(dropped))
    bases = [attrs_of({"pod": f"p{k}", "team": f"t{k % 2}", "node": f"n{k % 3}"}) for k in range(6)]
    parts = list(dict.fromkeys((k, e) for k, e, _ in picks))  # distinct parts, first named first
    values = np.array([float(dict(((k, e), v) for k, e, v in picks)[p]) for p in parts])
    named = Extended(bases, EXTRAS, np.array([k for k, _ in parts]), np.array([e for _, e in parts]))
    want: dict = {}
    for attrs, value in zip(named, values.tolist()):
        projected = tuple(kv for kv in attrs if kv[0] not in dropped)
        want[projected] = want.get(projected, 0.0) + value
    got = models._merged(named, values)
    assert dict(got.items()) == want and len(got) == len(want)
    assert list(got) == list(want)  # first named first
