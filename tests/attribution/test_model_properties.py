"""Properties of every cost model on random clusters, through the whole pipeline:
each node's series add up to its cost; no CPU-only pod pays for GPUs; neither the order nor the
batching of the input changes a cent."""

from __future__ import annotations

import random

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from cluster import Cluster, Node, Pod, Unit
from otelgpu.telemetry import total
from support import feed, make_config, offline_pipeline

MODELS = ["request", "scad", "opencost", "hybrid"]
TYPES = ["p4d.24xlarge", "g5.12xlarge", "p5.48xlarge", "g6.xlarge", "x9.unknown"]


def random_cluster(rng: random.Random) -> Cluster:
    nodes, pods = [], []
    for n in range(rng.randint(1, 3)):
        gpus = rng.choice([1, 4, 8])
        shared = rng.random() < 0.3
        labels = {"nvidia.com/gpu.count": str(gpus)}
        if shared:
            labels.update({"nvidia.com/gpu.replicas": "4", "nvidia.com/gpu.sharing-strategy": "time-slicing"})
        cap = rng.choice([{}, {"karpenter.sh/capacity-type": "spot"}, {"eks.amazonaws.com/capacityType": "ON_DEMAND"}])
        node = Node(f"node-{n}", rng.choice(TYPES), cpu=rng.choice([8, 48, 96]), memory_gib=rng.choice([32, 384, 1152]),
                    labels={**labels, **cap}, units=[Unit(f"GPU-{n}-{g}") for g in range(gpus)])
        nodes.append(node)
        free = [u.uuid for u in node.units]
        for k in range(rng.randint(0, 6)):
            wants_gpu = free and rng.random() < 0.6
            holds: tuple[str, ...] = ()
            if wants_gpu:
                if shared:
                    holds = (rng.choice(free),)
                else:
                    holds = tuple(free.pop() for _ in range(min(len(free), rng.randint(1, 2))))
            start = rng.choice([0, 0, 600, 1500])
            pods.append(Pod(
                f"ns-{k % 3}", f"pod-{n}-{k}", node.name, {"team": f"t{k % 2}"} if rng.random() < 0.8 else {},
                cpu=rng.choice([0, 0.5, 4, 30]), memory_gib=rng.choice([0, 1, 16, 200]),
                gpu=("nvidia_com_gpu", len(holds)) if holds else None, holds=holds, activity=rng.random(),
                cpu_used=rng.choice([None, 0.2, 12.0, 60.0]), memory_used_gib=rng.choice([None, 2.0, 300.0]),
                start_s=start, end_s=rng.choice([3600, 3600, start + 900])))
    return Cluster(nodes, pods)


def pipeline(policy: str, scope: str = "node"):
    return offline_pipeline(make_config(
        attribution__interval_seconds=900, attribution__lateness_seconds=3600, attribution__cost_models=MODELS,
        attribution__idle__policy=policy, attribution__idle__share_scope=scope,
        attribution__prices__default_gpu_hour=3.0,
        attribution__prices__capacity_types={"spot": {"discount": 0.65}}))


def snapshot(store) -> dict:
    return {(p.metric, p.attrs): round(p.value, 9) for p in store.points() if p.metric != "tag_coverage"}


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("policy,scope", [("keep", "node"), ("share", "node"), ("share", "cluster"), ("platform", "node")])
def test_every_model_adds_up_and_never_bills_gpus_to_cpu_only_pods(seed: int, policy: str, scope: str) -> None:
    rng = random.Random(seed)
    c = random_cluster(rng)
    p = pipeline(policy, scope)
    feed(p, *c.scrapes(60, 3600))
    p.close_due(flush=True)
    store = p.store
    gpu_pods = {q.name for q in c.pods if q.holds}
    for model in MODELS:
        where = {"cost_model": model}
        cap = store.totals("capacity", ("node", "resource"), where)
        got: dict = {}
        for metric in ("allocated", "unused", "idle"):
            for k, v in store.totals(metric, ("node", "resource"), where).items():
                assert v >= -1e-12, (model, metric, k)
                got[k] = got.get(k, 0.0) + v
        if scope == "node":
            for k in cap:
                assert got.get(k, 0.0) == pytest.approx(cap[k], rel=1e-9, abs=1e-9), (model, k)
        for resource in {k[1] for k in cap}:
            total = sum(v for k, v in got.items() if k[1] == resource)
            assert total == pytest.approx(sum(v for k, v in cap.items() if k[1] == resource), rel=1e-9, abs=1e-9)
        # No pod that holds no GPU ever pays for one, under any model or idle policy.
        for metric in ("allocated", "unused"):
            billed = store.totals(metric, ("pod",), {**where, "resource": "gpu"})
            assert not {k[0] for k, v in billed.items() if v > 0} - gpu_pods - {""}, (model, metric)


@pytest.mark.parametrize("seed", range(8))
def test_order_and_batching_do_not_change_a_cent(seed: int) -> None:
    rng = random.Random(100 + seed)
    c = random_cluster(rng)
    requests = c.scrapes(60, 3600)
    straight = pipeline("share")
    feed(straight, *requests)
    straight.close_due(flush=True)

    # The same points regrouped: every scrape's targets in their own request, shuffled, some resent.
    parts = [ExportMetricsServiceRequest(resource_metrics=[rm]) for r in requests for rm in r.resource_metrics]
    rng.shuffle(parts)
    parts += rng.sample(parts, len(parts) // 10)
    merged = [ExportMetricsServiceRequest(resource_metrics=[rm for q in parts[i:i + 7] for rm in q.resource_metrics])
              for i in range(0, len(parts), 7)]
    shuffled = pipeline("share")
    feed(shuffled, *merged)
    shuffled.close_due(flush=True)
    assert total(shuffled.metrics.points_late) == 0
    a, b = snapshot(straight.store), snapshot(shuffled.store)
    assert a.keys() == b.keys()
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-9, abs=1e-9), k
