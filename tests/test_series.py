"""Series hygiene: detail levels trade dimensions for active series without changing any total,
series end when their holder is gone, timestamps only grow."""

from __future__ import annotations

import math

import pytest
from cluster import Cluster, Node, Pod, Unit
from support import feed, make_config, offline_pipeline

from otelgpu.errors import ConfigError
from otelgpu.exporter.store import CostStore

A100 = "NVIDIA A100-SXM4-40GB"


def cluster() -> Cluster:
    node = Node("gpu-1", "p4d.24xlarge", 96, 1152, units=[Unit(f"GPU-{i}", A100) for i in range(4)],
                capacity={"nvidia_com_gpu": 4})
    rs = {"pod-template-hash": "7d4b9c"}
    pods = [Pod("ml", f"serve-7d4b9c-{s}", "gpu-1", labels={"team": "nlp", **rs}, gpu=("nvidia_com_gpu", 1),
                holds=(f"GPU-{i}",), activity=a, owner=("ReplicaSet", "serve-7d4b9c")) for i, (s, a) in enumerate((("abcde", 0.2), ("fghij", 0.8)))]
    pods.append(Pod("ml", "train", "gpu-1", labels={"team": "vision"}, gpu=("nvidia_com_gpu", 1), holds=("GPU-2",),
                    activity=0.5, end_s=900))
    return Cluster([node], pods)


def run(**series):
    p = offline_pipeline(make_config(attribution__interval_seconds=300,
                                     attribution__cost_models=["request", "scad"],
                                     attribution__prices__gpu_hour_by_gpu_model={A100: 12.0},
                                     **{f"series__{k}": v for k, v in series.items()}))
    feed(p, *cluster().scrapes(60, 3600))
    p.close_due()
    return p


def test_detail_levels_keep_every_total() -> None:
    pod, workload, namespace = run(), run(detail="workload"), run(detail="namespace")
    for metric in ("allocated", "effective", "waste", "unused", "idle", "capacity", "held"):
        by = ("cost_model", "team", "resource")
        assert workload.store.totals(metric, by) == pytest.approx(pod.store.totals(metric, by))
        assert namespace.store.totals(metric, by) == pytest.approx(pod.store.totals(metric, by))
    live = {p: len(p.store.points()) for p in (pod, workload, namespace)}
    assert live[pod] > live[workload] >= live[namespace]
    assert {dict(pt.attrs).get("workload_name") for pt in workload.store.points()} >= {"serve"}
    for pt in workload.store.points():
        assert "pod" not in dict(pt.attrs)
    assert all("workload_name" not in dict(pt.attrs) for pt in namespace.store.points())
    # The two serve replicas' activity merges weighted by their cost: (0.2 + 0.8) / 2.
    (activity,) = [pt.value for pt in workload.store.points()
                   if pt.metric == "activity" and dict(pt.attrs).get("workload_name") == "serve"]
    assert activity == pytest.approx(0.5)


def test_dropping_more_attributes() -> None:
    p = run(drop_attributes=["node", "instance_type", "gpu_model"])
    assert all(not {"node", "instance_type", "gpu_model"} & set(dict(pt.attrs)) for pt in p.store.points())
    assert p.store.totals("allocated", ("team",)) == pytest.approx(run().store.totals("allocated", ("team",)))


def test_model_attributes_cannot_be_dropped() -> None:
    with pytest.raises(ConfigError, match="series.drop_attributes: cost_model cannot be dropped"):
        make_config(series__drop_attributes=["cost_model", "pod"])


def test_a_finished_pod_s_series_end_and_keep_their_total() -> None:
    p = run()
    assert p.store.series_ended > 0 and p.metrics.series_ended == p.store.series_ended
    assert all(dict(pt.attrs).get("pod") != "train" for pt in p.store.points())  # not exported any more
    # ...yet its cost stays in the run's totals (three intervals at $12/h under request).
    assert p.store.totals("allocated", ("pod",), {"cost_model": "request", "resource": "gpu"})[("train",)] == \
        pytest.approx(3 * 12.0 * 300 / 3600)


def test_timestamps_only_grow() -> None:
    store = CostStore()
    store.record(0, 10, {"allocated": {(("pod", "a"),): 1.0}}, {})
    with pytest.raises(ValueError, match="strictly increase"):
        store.record(0, 10, {"allocated": {(("pod", "a"),): 1.0}}, {})
    snapshot = store.record(10, 20, {}, {})
    assert [p.time_ns for p in snapshot] == [20] and not math.isnan(snapshot[0].value)


def test_a_queued_snapshot_keeps_its_attributes_when_the_store_reuses_their_slot() -> None:
    """A series ends, a new pod's series takes the freed attribute-set slot: a snapshot still
    waiting in an export queue reads the old series' attributes, not the new one's."""
    store = CostStore(end_after_intervals=1)
    old, new = (("pod", "old"), ("team", "a")), (("pod", "new"), ("team", "b"))
    held = store.record(0, 60, {"allocated": {old: 1.0}}, {})
    ended = store.record(60, 120, {}, {})
    store.record(120, 180, {"allocated": {new: 2.0}}, {})
    assert [(p.attrs, p.value) for p in held] == [(old, 1.0)]
    assert [(p.attrs, p.ended) for p in ended] == [(old, True)]
    assert [(p.attrs, p.value, p.start_ns) for p in store.points()] == [(new, 2.0, 120)]
