"""The data-path promises on the worst day, through a whole pipeline: a dcgm-exporter scrape that
fails (staleness markers, then silence), a relabel that arrives while the interval it follows
waits out its lateness, one target stamped minutes ahead, an interval whose computation fails on
one node, and gaps with no device data at all."""

from __future__ import annotations

import copy

import pytest
from cluster import Cluster, Node, Pod, Unit
from support import feed, make_config, offline_pipeline

from otelgpu.compute import IntervalCosts
from otelgpu.demo.otlp import request, scrape
from otelgpu.enrich.window import NS
from otelgpu.pipeline import Pipeline
from otelgpu.telemetry import by_label, total

A100 = "NVIDIA A100-SXM4-40GB"
PRICE = 12.0
INTERVAL = 60
PER_GPU = PRICE * INTERVAL / 3600


def cluster(team_of_train: str = "vision") -> Cluster:
    gpus = [Unit(f"GPU-a{i}", A100) for i in range(4)]
    other = [Unit(f"GPU-b{i}", A100) for i in range(2)]
    nodes = [Node("gpu-a", "p4d.24xlarge", 96, 1152, units=gpus, capacity={"nvidia_com_gpu": 4}),
             Node("gpu-b", "p4d.24xlarge", 96, 1152, units=other, capacity={"nvidia_com_gpu": 2})]
    pods = [Pod("ml", "train", "gpu-a", labels={"team": team_of_train}, gpu=("nvidia_com_gpu", 2),
                holds=("GPU-a0", "GPU-a1"), activity=0.7),
            Pod("ml", "serve", "gpu-a", labels={"team": "nlp"}, gpu=("nvidia_com_gpu", 1), holds=("GPU-a2",),
                activity=0.4),
            Pod("lab", "eval", "gpu-b", labels={"team": "research"}, gpu=("nvidia_com_gpu", 1), holds=("GPU-b0",),
                activity=0.9)]
    return Cluster(nodes, pods)


def pipeline(**overrides) -> Pipeline:
    return offline_pipeline(make_config(attribution__interval_seconds=INTERVAL, attribution__lateness_seconds=30,
                                        attribution__prices__gpu_hour_by_gpu_model={A100: PRICE}, **overrides))


def run(requests) -> Pipeline:
    p = pipeline()
    feed(p, *requests)
    p.close_due(flush=True)
    return p


def totals(p: Pipeline, metric: str = "allocated", by=("team", "pod", "node")) -> dict:
    return p.store.totals(metric, by, {"cost_model": "request"})


def without_dcgm_of(req, node: str, t: int, stale: bool):
    """`req` with `node`'s dcgm-exporter target failed at time `t`: as the prometheus receiver
    reports it, staleness markers on every series of the target the first time (`stale`), then
    nothing but `up` = 0."""
    out = copy.deepcopy(req)
    for rm in out.resource_metrics:
        attrs = {kv.key: kv.value.string_value for kv in rm.resource.attributes}
        if attrs.get("service.instance.id") != f"{node}:9400":
            continue
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for dp in m.gauge.data_points:
                    dp.flags, dp.time_unix_nano = 1, t
                    dp.ClearField("as_double")
                if not stale:
                    m.gauge.ClearField("data_points")
        up = rm.scope_metrics[0].metrics.add()
        up.name = "up"
        dp = up.gauge.data_points.add()
        dp.time_unix_nano, dp.as_double = t, 0.0
    return out


@pytest.mark.parametrize("how", ["stale then silent", "silent"])
def test_a_failed_dcgm_scrape_keeps_billing_the_pods_that_hold_the_gpus(how):
    c = cluster()
    clean = run(c.scrapes(30, 1800))
    reqs = []
    for k, req in enumerate(c.scrapes(30, 1800)):
        t = c.t0 + k * 30 * NS
        if k * 30 >= 630:  # the exporter fails 10.5 minutes in, for good
            first = k * 30 == 630 and how == "stale then silent"
            req = without_dcgm_of(req, "gpu-a", t, stale=first)
        reqs.append(req)
    broken = run(reqs)
    # Allocated cost is what pods hold: the same as if the exporter had never failed.
    assert totals(broken) == pytest.approx(totals(clean), rel=1e-12)
    assert totals(broken, "capacity", ("node",)) == pytest.approx(totals(clean, "capacity", ("node",)), rel=1e-12)
    # What was not measured is marked so: held from the failure on, activity unknown.
    # The staleness markers end the pods' measured time at 630 s; without them the scrape at
    # 600 s holds until its interval ends (660 s), as any step does.
    unmeasured = totals(broken, "unmeasured", ("pod",))
    dark_from = 630 if how == "stale then silent" else 660
    assert unmeasured[("train",)] == pytest.approx(2 * PER_GPU * (1800 - dark_from) / 60, rel=1e-9)
    assert unmeasured.get(("eval",), 0.0) == 0.0  # the other node's exporter kept working
    kinds = broken.store.totals("allocated", ("pod", "attribution"), {"cost_model": "request"})
    assert kinds[("train", "ksm_request")] == pytest.approx(unmeasured[("train",)], rel=1e-9)


def only_up(req, t: int):
    """`req` with every target's scrape failed at `t`: each sends `up` = 0 and nothing else."""
    out = copy.deepcopy(req)
    for rm in out.resource_metrics:
        del rm.scope_metrics[1:]
        rm.scope_metrics[0].ClearField("metrics")
        up = rm.scope_metrics[0].metrics.add()
        up.name = "up"
        dp = up.gauge.data_points.add()
        dp.time_unix_nano, dp.as_double = t, 0.0
    return out


def test_intervals_close_while_every_target_is_down():
    """Ten minutes in, every scrape fails: the Collector sends requests of `up` = 0 alone. They
    carry no point, yet they are the targets' clocks: the intervals of the outage close on time,
    costed from the facts last known, instead of waiting for the targets to come back."""
    c = cluster()
    p = pipeline()
    for k, req in enumerate(c.scrapes(30, 1200)):
        t = c.t0 + k * 30 * NS
        feed(p, req if k * 30 < 600 else only_up(req, t))
    # The last request is stamped 1170 s: every interval ending by 1140 s (1170 less the 30 s
    # lateness) has closed.
    assert p.windows.closed_through == (c.t0 // NS + 1140) // INTERVAL - 1
    assert total(p.metrics.intervals_computed) == 19 and not by_label(p.metrics.points_rejected)
    capacity = p.store.totals("capacity", ("node",), {"cost_model": "request"})
    assert sum(capacity.values()) == pytest.approx(19 * 6 * PER_GPU, rel=1e-12)  # 4 + 2 GPUs, all 19 minutes


def test_facts_apply_from_when_they_changed_not_to_an_interval_waiting_out_its_lateness():
    before, after = cluster("vision"), cluster("robotics")
    change_s = 65  # 5 s after interval [0, 60) ended, 25 s before it closes (lateness 30 s)
    reqs = [(before if t < change_s else after).scrape(t) for t in range(5, 300, 10)]
    p = run(reqs)
    train = p.store.totals("allocated", ("team",), {"cost_model": "request", "pod": "train"})
    assert train[("vision",)] == pytest.approx(2 * PER_GPU)  # [0, 60): the label then
    assert train[("robotics",)] == pytest.approx(2 * PER_GPU * 4)  # [60, 300): changed at 65 s


def test_one_target_stamped_minutes_ahead_does_not_make_everyone_late():
    c = cluster()
    clean = run(c.scrapes(30, 1200))

    def rogue(t_s: float) -> object:
        return scrape("dcgm-exporter", "10.9.9.9:9400", "rogue-node", c.t0 + int(t_s * NS),  # a trusted job, a bad clock
                      {"DCGM_FI_PROF_GR_ENGINE_ACTIVE": [({"UUID": "GPU-rogue", "Hostname": "rogue-node",
                                                            "modelName": A100}, 0.5)]})

    reqs = c.scrapes(30, 1200)
    reqs[4] = request(*reqs[4].resource_metrics, rogue(120 + 600))  # inside a valid request, 10 min ahead
    reqs.insert(10, request(rogue(300 + 840)))  # on its own, 14 min ahead
    p = pipeline()
    feed(p, *reqs)
    p.close_due(flush=True)
    assert total(p.metrics.points_late) == 0
    valid = {k: v for k, v in totals(p).items() if k[2] != "rogue-node"}
    assert valid == pytest.approx(totals(clean), rel=1e-12)


def test_an_interval_that_fails_on_one_node_keeps_every_other_node_exact(monkeypatch):
    c = cluster()
    clean = run(c.scrapes(30, 600))
    p = pipeline()
    join = p.joiner.join

    def failing_on_gpu_b(samples, start, end, use=None, **options):
        names = {p.strings.string(int(n)) for n in samples.node}
        if start >= c.t0 + 300 * NS and "gpu-b" in names and not options.get("without_pods"):
            raise ZeroDivisionError("a fault on gpu-b")
        return join(samples, start, end, use, **options)

    monkeypatch.setattr(p.joiner, "join", failing_on_gpu_b)  # fault injection: the code path itself is real
    feed(p, *c.scrapes(30, 600))
    p.close_due(flush=True)
    got, want = totals(p), totals(clean)
    for key, value in want.items():
        if key[2] == "gpu-a":
            assert got[key] == pytest.approx(value, rel=1e-12)
    assert got[("research", "eval", "gpu-b")] == pytest.approx(5 * PER_GPU)  # only before the fault
    # gpu-b's capacity from the fault on is booked, explicitly, as idle marked error="processing".
    marked = p.store.totals("idle", ("node", "error"), {"cost_model": "request"})
    assert marked[("gpu-b", "processing")] == pytest.approx(5 * 2 * PER_GPU, rel=1e-9)
    capacity = totals(p, "capacity", ("node",))
    assert capacity[("gpu-b",)] == pytest.approx(10 * 2 * PER_GPU, rel=1e-9)
    assert by_label(p.metrics.interval_errors)["whole"] == 5 and by_label(p.metrics.interval_errors)["node"] == 5
    assert isinstance(p.costs, IntervalCosts)


def test_intervals_with_no_data_close_and_a_long_stop_is_skipped_not_invented():
    c = cluster()
    p = pipeline()
    feed(p, *c.scrapes(30, 300))  # 5 minutes
    feed(p, *c.scrapes(30, 900, from_s=780))  # nothing at all from 5 to 13 minutes
    p.close_due(flush=True)
    # The 8 quiet minutes still cost the cluster's capacity (facts and devices remembered).
    capacity = sum(totals(p, "capacity", ()).values())
    assert capacity == pytest.approx(15 * 6 * PER_GPU, rel=1e-9)
    assert total(p.metrics.intervals_skipped) == 0
    q = pipeline()
    feed(q, *c.scrapes(30, 300))
    feed(q, *c.scrapes(30, 3600 * 3, from_s=3600 * 3 - 300))  # three hours later
    q.close_due(flush=True)
    assert total(q.metrics.intervals_skipped) > 100  # not invented from facts hours old
    assert sum(totals(q, "capacity", ()).values()) == pytest.approx((5 + 10 + 5) * 6 * PER_GPU, rel=1e-9)
