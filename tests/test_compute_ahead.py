"""Computing an interval ahead of its close (Pipeline.compute_ahead) changes when the work is
done, never what it gives: whatever arrives between that computation and the close (a resent
scrape of the interval, late kube-state-metrics rows of an earlier one, a new price file), a
pipeline that computed ahead at every chance ends with the same cost series, the same self-metrics
and the same remembered state as one that never did."""

from __future__ import annotations

import copy
import os
import random
import threading
import time
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
from cluster import Cluster, Node, Pod, Unit
from kubeapi import FakeKubeApi
from support import eventually, feed, make_config, offline_pipeline

from otelgpu import compute
from otelgpu import pipeline as pipeline_module
from otelgpu.checkpoint import Checkpoint, Pieces
from otelgpu.enrich import factstate, join
from otelgpu.enrich.config import KubernetesConfig
from otelgpu.enrich.model import PodFacts
from otelgpu.enrich.window import NS
from otelgpu.pipeline import Pipeline
from otelgpu.telemetry import by_label, total

A100, H100 = "NVIDIA A100-SXM4-40GB", "NVIDIA H100 80GB HBM3"
INTERVAL_S, SCRAPE_S = 60, 15
BLIP_S = 300  # a pod only the scrape of this second shows, and that scrape arrives late


def cluster() -> Cluster:
    whole = Node("p4d-1", "p4d.24xlarge", 96, 1152, units=[Unit("GPU-0", A100), Unit("GPU-1", A100)],
                 capacity={"nvidia_com_gpu": 2})
    mig = Node("p5-1", "p5.48xlarge", 192, 2048, labels={"nvidia.com/gpu.count": "1"},
               units=[Unit("GPU-h", H100, "3g.40gb", "2"), Unit("GPU-h", H100, "2g.20gb", "3"),
                      Unit("GPU-h", H100, "1g.10gb", "9")])
    cpu = Node("m5-1", "m5.4xlarge", 16, 64)
    pods = [
        Pod("ml", "train", whole.name, {"team": "vision", "project": "p1"}, cpu=8, memory_gib=64,
            gpu=("nvidia_com_gpu", 1), holds=("GPU-0",), activity=0.7, cpu_used=6.0, memory_used_gib=40),
        Pod("ml", "serve", whole.name, {"team": "nlp"}, cpu=4, memory_gib=32, gpu=("nvidia_com_gpu", 1),
            holds=("GPU-1",), activity=0.2, cpu_used=1.0, start_s=200, end_s=700),
        Pod("search", "llm", mig.name, {"team": "search"}, cpu=2, memory_gib=16, gpu=("nvidia_com_mig_3g_40gb", 1),
            holds=("GPU-h/2",), activity=0.6, memory_used_gib=10),
        Pod("research", "nb", mig.name, {"team": "research-" + "x" * 70}, gpu=("nvidia_com_mig_2g_20gb", 1),
            holds=("GPU-h/3",), activity=0.1, end_s=500),
        Pod("research", "nb2", mig.name, {"team": "research-2"}, gpu=("nvidia_com_mig_1g_10gb", 1),
            activity=0.3, start_s=400),  # requests a unit DCGM shows nobody on: placed from its request
        Pod("web", "api", cpu.name, {"team": "web"}, cpu=2, memory_gib=4, cpu_used=1.5, memory_used_gib=3),
        Pod("batch", "blip", cpu.name, {"team": "batch"}, cpu=1, start_s=BLIP_S - 5, end_s=BLIP_S + 5),
    ]
    return Cluster([whole, mig, cpu], pods)


def pipeline(ahead: bool, prices: Optional[Path] = None, checkpoint: Optional[Path] = None) -> Pipeline:
    """`prices`: a price file (read at the first close, then at each close after it changed)."""
    priced = {"file": str(prices)} if prices else {"gpu_hour_by_gpu_model": {A100: 4.0}}
    return offline_pipeline(make_config(
        **({"checkpoint__directory": str(checkpoint)} if checkpoint else {}),
        attribution__interval_seconds=INTERVAL_S, attribution__lateness_seconds=30,
        attribution__cost_models=["request", "scad"], attribution__compute_ahead=ahead,
        attribution__prices=dict(priced, instance_hour_by_instance_type={"m5.4xlarge": 0.768}),
        attribution__scad__cpu_only_nodes=True,
        tag_values__max_distinct=3, tag_values__max_distinct_per_namespace=3))  # values get capped


def events(seed: int) -> list[tuple[str, float]]:
    """Scrapes in time order, with the troubles of a real day mixed in at random: a scrape of the
    interval still open resent (a Collector retrying) or arriving late with samples of its own (a
    straggler), one of an interval already closed resent or delivered only now (its facts are
    late, its samples dropped), a price file rewritten."""
    rng = random.Random(seed)
    out: list[tuple[str, float]] = []
    for k in range(1, 60):
        t = k * SCRAPE_S
        if t != BLIP_S:
            out.append(("scrape", t))
        if t == BLIP_S + 2 * INTERVAL_S:  # its interval closed: late, while the next one waits to close
            out.append(("scrape", BLIP_S))
        roll = rng.random()
        if roll < 0.15:
            out.append(("scrape", t - rng.choice((15, 30))))  # usually the open interval's own data
        elif roll < 0.25:
            out.append(("straggler", t - rng.choice((22.5, 37.5))))  # new samples, another activity
        elif roll < 0.35:
            out.append(("scrape", max(t - rng.choice((90, 120, 150)), 0)))
        elif roll < 0.42:
            out.append(("prices", float(k)))
    return out


def run(ahead: bool, seed: int, tmp: Path, checkpoint: bool = False) -> Pipeline:
    """`checkpoint`: with a checkpoint directory (a mark's facts wait in a file of it)."""
    prices = tmp / f"prices-{ahead}.yaml"
    prices.write_text("gpu_hour_by_gpu_model: {NVIDIA A100-SXM4-40GB: 4.0}\n")
    c, p = cluster(), pipeline(ahead, prices, tmp / f"checkpoint-{ahead}" if checkpoint else None)
    busy = cluster()
    for pod in busy.pods:
        pod.activity = 0.95
    for kind, x in events(seed):
        if kind in ("scrape", "straggler"):
            feed(p, (c if kind == "scrape" else busy).scrape(x))
        else:
            prices.write_text(f"gpu_hour_by_gpu_model: {{NVIDIA A100-SXM4-40GB: {4.0 + x / 10}}}\n")
            os.utime(prices, ns=(int(x) * 10**9, int(x) * 10**9))
        if ahead:
            p.compute_ahead()  # at every chance, as an idle worker would
    p.close_due(flush=True)
    return p


def rfc3339(t_ns: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_ns // NS))


def series(p: Pipeline) -> dict:
    return {(pt.metric, pt.attrs, pt.start_ns, pt.time_ns): pt.value for pt in p.store.points()}


def counted(p: Pipeline) -> dict:
    """Every self-metric sample but the time spent, the computations ahead and the process's."""
    skip = ("otelgpu_work_seconds", "otelgpu_intervals_ahead", "otelgpu_process_", "target")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in p.metrics.registry.collect() if not family.name.startswith(skip) for s in family.samples
            if s.value or family.type != "counter"}  # a held count dropped leaves its series at 0


@pytest.mark.parametrize("seed", range(6))
def test_computing_ahead_gives_what_computing_at_the_close_gives(tmp_path: Path, seed: int) -> None:
    """Odd seeds with a checkpoint directory: what puts the facts back waits in a file of it."""
    plain, ahead = run(False, seed, tmp_path, seed % 2 == 1), run(True, seed, tmp_path, seed % 2 == 1)
    assert (ahead.facts.spill is not None) == (seed % 2 == 1)
    a, b = series(plain), series(ahead)
    assert a.keys() == b.keys()
    assert all(a[k] == pytest.approx(b[k], rel=1e-12, abs=1e-12) for k in a)
    assert counted(plain) == counted(ahead)
    assert plain.tag_values.state() == ahead.tag_values.state()
    assert {k: sorted(map(str, v)) for k, v in plain.usage.state().items()} == \
        {k: sorted(map(str, v)) for k, v in ahead.usage.state().items()}
    devices = plain.devices.state(), ahead.devices.state()
    assert devices[0].keys() == devices[1].keys()
    assert all(np.array_equal(devices[0][k], devices[1][k]) for k in devices[0])
    for table in ("pods", "nodes", "namespaces", "owners"):  # the same facts, met in the same order
        assert list(getattr(plain.facts, table).items()) == list(getattr(ahead.facts, table).items())
    assert total(plain.metrics.intervals_computed) > 10 and by_label(plain.metrics.tag_values_capped)
    assert ("batch", "blip") in plain.facts.pods  # known from late facts alone
    used, redone = by_label(ahead.metrics.intervals_ahead)["used"], by_label(ahead.metrics.intervals_ahead)["redone"]
    assert used + redone == total(ahead.metrics.intervals_computed) - 1  # all but the last one, flushed
    assert used > 0 and redone > 0  # both ways were taken
    assert not by_label(plain.metrics.intervals_ahead)


def test_an_interval_is_computed_ahead_once_all_its_targets_are_past_its_end() -> None:
    c, p = cluster(), pipeline(True)
    built: list[int] = []
    p.on_interval.append(lambda interval: built.append(len(interval.samples)))
    feed(p, *(c.scrape(t) for t in (0, 15, 30, 45)))
    assert not p.compute_ahead()  # [0, 60) is still being scraped
    feed(p, c.scrape(60))
    assert p.compute_ahead() and not p.compute_ahead()  # once
    assert total(p.metrics.intervals_computed) == 0 and not p.store.points()  # nothing recorded before the close
    feed(p, c.scrape(75))
    assert total(p.metrics.intervals_computed) == 0
    feed(p, c.scrape(90))  # the watermark passes 60 + 30: [0, 60) closes with what was computed
    assert total(p.metrics.intervals_computed) == 1 and by_label(p.metrics.intervals_ahead) == {"used": 1}
    assert built == [0]  # it closed bare: its samples were not unpacked again
    second = (c.t0 + 60 * NS) // (INTERVAL_S * NS)  # [60, 120)
    assert p.windows.due_indices(flush=True) == [second] and total(p.metrics.intervals_computed) == 1  # asking closes nothing
    plain = pipeline(False)
    feed(plain, *(c.scrape(t) for t in (0, 15, 30, 45, 60, 75, 90)))
    assert series(p) == series(plain) and len(series(p)) > 20
    capacity = p.store.totals("capacity", (), {"cost_model": "request", "resource": "gpu"})[()]
    assert capacity > 2 * 4.0 / 60  # the two A100s for a minute, and the H100 at its catalog price


def test_the_facts_encoded_ahead_wait_in_a_file_and_are_the_checkpoint_of_the_close(tmp_path: Path) -> None:
    """Computed ahead with a checkpoint directory, an interval's facts wait for its close encoded
    in a file (arrays read from it a piece at a time, none held), and the close writes them: the
    facts of its checkpoint are those a pipeline that never computed ahead writes."""
    c = cluster()
    p, plain = pipeline(True, checkpoint=tmp_path / "ahead"), pipeline(False, checkpoint=tmp_path / "plain")
    feed(p, *(c.scrape(t) for t in (0, 15, 30, 45, 60)))
    assert p.compute_ahead()
    waiting = p.facts._encoded[1]
    leaves = [a for table in waiting.values() if isinstance(table, dict) for a in table.values()]
    assert leaves and not any(isinstance(a, np.ndarray) for a in leaves)
    assert all(isinstance(a, Pieces) for a in leaves)
    del waiting, leaves
    undo = p.facts.mark()  # as computing ahead marks them: encoded into a file, no copy of a pod
    held = [cell.cell_contents for cell in undo.__closure__]
    assert not any(isinstance(v, dict) and any(isinstance(x, PodFacts) for x in v.values()) for v in held)
    assert any(isinstance(v, dict) and isinstance(v["pods"]["key"], Pieces) for v in held)
    del undo, held
    feed(p, c.scrape(90))
    feed(plain, *(c.scrape(t) for t in (0, 15, 30, 45, 60, 90)))
    assert by_label(p.metrics.intervals_ahead) == {"used": 1} and p.facts._encoded is None
    facts = []
    for pipe in (p, plain):
        pipe.checkpoint.close()  # its lock: the file is read as the next start would
        facts.append(Checkpoint(pipe.checkpoint.directory, pipe.checkpoint.identity, pipe.metrics).load()["facts"])
    assert same_arrays(facts[0], facts[1]) and len(facts[0]["pods"]["key"]) > 3


def test_a_stop_closes_the_open_intervals_only_once_the_step_in_progress_has_ended(monkeypatch, caplog) -> None:
    """A stop that comes while the worker computes an interval ahead (tens of seconds at 100,000
    GPUs) waits for it, however long it takes, before it closes the open intervals: closing them
    beside it would change the state it is changing. The money is that of a pipeline that never
    computed ahead."""
    monkeypatch.setattr(pipeline_module, "WORKER_NOTICE_S", 0.05)
    computing, go_on, flushed_during = threading.Event(), threading.Event(), []
    real_ahead, real_close = Pipeline.compute_ahead, Pipeline.close_due

    def slow_ahead(self: Pipeline) -> bool:
        if self.windows.next_complete() is not None and not go_on.is_set():
            computing.set()
            go_on.wait(timeout=60)
        return real_ahead(self)

    def close_due(self: Pipeline, flush: bool = False) -> int:
        if flush:
            flushed_during.append(computing.is_set() and not go_on.is_set())
        return real_close(self, flush)

    monkeypatch.setattr(Pipeline, "compute_ahead", slow_ahead)
    monkeypatch.setattr(Pipeline, "close_due", close_due)
    c, p = cluster(), pipeline(True)
    p.start()
    for t in (0, 15, 30, 45, 60):
        p.ingest.consume(c.scrape(t))
    eventually(computing.is_set, timeout=30)
    stopping = threading.Thread(target=p.shutdown)
    stopping.start()
    eventually(lambda: "close once the step in progress ends" in caplog.text, timeout=30)
    assert flushed_during == []  # still waiting
    go_on.set()
    stopping.join(timeout=60)
    assert not stopping.is_alive() and flushed_during == [False]
    plain = pipeline(False)
    feed(plain, *(c.scrape(t) for t in (0, 15, 30, 45, 60)))
    plain.close_due(flush=True)
    assert series(p) == series(plain) and len(series(p)) > 20
    assert by_label(p.metrics.intervals_ahead) == {"used": 1}


def test_a_facts_mark_puts_back_what_later_updates_changed_in_place() -> None:
    c = cluster()
    p = pipeline(False)
    feed(p, c.scrape(0))
    before = {t: copy.deepcopy(getattr(p.facts, t)) for t in ("pods", "nodes", "namespaces", "owners")}
    undo = p.facts.mark()
    late = cluster()
    late.pods[0].labels["team"] = "audio"  # a label changed
    late.pods.append(Pod("ml", "new", "p4d-1", {"team": "x"}, cpu=1))  # a pod created
    late.nodes[0].capacity["nvidia_com_gpu"] = 1  # a capacity changed in place
    p.ingest.consume(late.scrape(30))
    p.facts.update(p.ingest.get(timeout=0))
    assert p.facts.pods != before["pods"] and p.facts.nodes != before["nodes"]
    undo()
    for table, was in before.items():
        assert list(getattr(p.facts, table).items()) == list(was.items())


def test_a_facts_mark_shares_the_maps_of_nodes_and_namespaces_that_stay() -> None:
    """Nodes' and namespaces' labels and capacities are replaced when they change, never changed
    in place, and only then: a mark's copies share them while they stay (at 100,000 GPUs some
    17,000 nodes' maps were held twice while an interval computed ahead waited for its close)."""
    c = cluster()
    c.namespace_labels = {"ml": {"cost-center": "cc-1"}, "web": {"team": "web"}}
    p = pipeline(False)
    p.ingest.consume(c.scrape(0))
    p.facts.update(p.ingest.get(timeout=0))
    nodes = {name: (n.labels, n.capacity, n.seen_ns) for name, n in p.facts.nodes.items()}
    namespaces = {name: n.labels for name, n in p.facts.namespaces.items()}
    assert any(labels for labels, _, _ in nodes.values()) and any(c for _, c, _ in nodes.values()) and namespaces
    p.facts.mark()
    p.ingest.consume(c.scrape(30))
    p.facts.update(p.ingest.get(timeout=0))
    assert all(n.seen_ns > nodes[name][2] for name, n in p.facts.nodes.items())  # every node reported again
    assert all(n.labels is nodes[name][0] and n.capacity is nodes[name][1] for name, n in p.facts.nodes.items())
    assert all(n.labels is namespaces[name] for name, n in p.facts.namespaces.items())


def same_arrays(a, b) -> bool:  # noqa: ANN001 - nested dicts and lists of arrays and numbers
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_arrays(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


def test_facts_encoded_ahead_serve_the_next_checkpoint_only_while_the_facts_stay_as_they_were() -> None:
    c = cluster()
    p = pipeline(False)
    facts = p.facts
    p.ingest.consume(c.scrape(0))
    facts.update(p.ingest.get(timeout=0))
    assert facts.pods

    def fresh() -> dict:
        return factstate.encode(facts.pods, facts.nodes, facts.namespaces, facts.owners)

    facts.encode_ahead()
    assert same_arrays(facts.state(), fresh())
    late = cluster()
    late.pods[0].labels["team"] = "audio"
    p.ingest.consume(late.scrape(30))
    ahead = (facts.encode_ahead(), facts._encoded)[1]
    undo = facts.mark()
    facts.update(p.ingest.get(timeout=0))  # a label changed in place after the encoding
    assert not same_arrays(ahead[1], fresh()) and same_arrays(facts.state(), fresh())
    facts.encode_ahead()
    undo()  # put back after the encoding
    assert same_arrays(facts.state(), fresh()) and same_arrays(fresh(), ahead[1])
    facts.encode_ahead()
    assert facts.pods
    facts.expire(c.t0 + 10**6 * NS)  # everything forgotten after the encoding
    assert same_arrays(facts.state(), fresh()) and not facts.pods


def test_a_mark_reads_the_facts_where_they_were_last_spilled_only_while_they_stay_as_they_were(tmp_path: Path) -> None:
    """With a checkpoint directory, a mark after `encode_ahead` puts back the facts from the file
    that encoded them (nothing encoded again); once the facts changed, it encodes them anew."""
    c = cluster()
    p = pipeline(False, checkpoint=tmp_path)
    facts, spills = p.facts, []
    facts.spill = lambda state: spills.append(state) or p.checkpoint.spill(state)
    p.ingest.consume(c.scrape(0))
    facts.update(p.ingest.get(timeout=0))

    def now() -> dict:
        return factstate.encode(facts.pods, facts.nodes, facts.namespaces, facts.owners)

    later = cluster()
    later.pods[0].labels["team"] = "audio"
    p.ingest.consume(later.scrape(30))
    facts.encode_ahead()
    first = now()
    undo = facts.mark()
    assert len(spills) == 1  # the mark read the file encode_ahead wrote
    facts.update(p.ingest.get(timeout=0))  # a label changes
    assert not same_arrays(now(), first)
    undo()
    assert same_arrays(now(), first)

    p.ingest.consume(later.scrape(60))
    facts.update(p.ingest.get(timeout=0))
    changed = now()
    assert not same_arrays(changed, first)
    undo = facts.mark()  # the facts moved since they were spilled: encoded anew
    assert len(spills) == 2
    p.ingest.consume(c.scrape(90))
    facts.update(p.ingest.get(timeout=0))
    undo()
    assert same_arrays(now(), changed)


def test_kubernetes_api_facts_of_the_interval_that_change_before_its_close_make_it_computed_again() -> None:
    """A pod created before the interval's end but seen by the watch only after it was computed
    ahead (watch lag): the facts as of its end changed, so the close computes it again."""
    c = cluster()
    late_pod = Pod("ml", "late", "p4d-1", {"team": "late"}, cpu=4, memory_gib=8)
    runs = []
    for ahead in (False, True):
        with FakeKubeApi(token="t") as api:
            for obj in c.namespace_objects() + c.node_objects() + [c.pod_object(p) for p in c.pods]:
                obj["metadata"]["creationTimestamp"] = rfc3339(c.t0 - 3600 * NS)  # long before the data
                api.apply(obj)
            config = make_config(attribution__interval_seconds=INTERVAL_S, attribution__lateness_seconds=30,
                                 attribution__cost_models=["request", "scad"], attribution__compute_ahead=ahead,
                                 attribution__prices__gpu_hour_by_gpu_model={A100: 4.0})
            p = offline_pipeline(replace(config, kubernetes=KubernetesConfig(
                enabled=True, auth="token", api_url=api.url, token="t", backoff_initial_seconds=0.05,
                backoff_max_seconds=0.2)))
            p.kube.facts.clock = lambda p=p: p.windows.watermark_ns / NS  # changes observed at data time
            p.start_sources()
            try:
                for t in range(0, 300, SCRAPE_S):
                    feed(p, c.scrape(t))
                    if ahead:
                        p.compute_ahead()
                    if t == 135:  # [60, 120) was computed ahead at 120; it closes at 150
                        obj = c.pod_object(late_pod)
                        obj["metadata"]["creationTimestamp"] = rfc3339(c.t0 + 100 * NS)
                        api.apply(obj)
                        eventually(lambda p=p: ("ml", "late") in p.kube.view().pods)
                p.close_due(flush=True)
                runs.append((series(p), dict(by_label(p.metrics.intervals_ahead))))
            finally:
                p.shutdown()
    (plain, _), (ahead_series, outcomes) = runs
    assert plain == ahead_series
    assert outcomes.get("redone") == 1 and outcomes.get("used", 0) >= 2
    assert any(dict(attrs).get("pod") == "late" for _, attrs, _, _ in plain)  # scad bills its CPU and memory


def test_packed_series_read_as_the_dict_they_were() -> None:
    from otelgpu.compute import Costs, Packed

    series = {(("pod", "a"),): 1.5, (("pod", "b"),): 0.1 + 0.2, (): 0.0}
    packed = Packed(series)
    assert dict(packed.items()) == series and packed == series and len(packed) == 3
    assert packed[(("pod", "b"),)] == series[(("pod", "b"),)] and list(packed) == list(series)
    costs = Costs({"allocated": series}, {"activity": {(("pod", "a"),): 0.5}}, 2, 1).packed()
    assert costs.sums["allocated"] == series and costs.gauges["activity"] == {(("pod", "a"),): 0.5}
    assert (costs.unpriced_gpus, costs.gpus_without_device_data) == (2, 1)


def test_an_earlier_interval_that_opens_after_the_first_was_computed_ahead_closes_on_the_state_before_it() -> None:
    """Before anything has closed, data of an earlier interval can still open it (a slow target's
    backlog): it closes first, so what computing the later one ahead changed is put back first."""
    runs = []
    for ahead in (False, True):
        c, p = cluster(), pipeline(ahead)
        for t in (60, 75, 90, 105, 120, 30, 45, 135, 150, 165, 180, 195, 210):
            feed(p, c.scrape(t))
            if ahead:
                p.compute_ahead()
        p.close_due(flush=True)
        runs.append(p)
    plain, ahead_run = runs
    assert series(plain) == series(ahead_run) and total(plain.metrics.intervals_computed) == 4
    assert counted(plain) == counted(ahead_run)
    for table in ("pods", "nodes", "namespaces", "owners"):
        assert list(getattr(plain.facts, table).items()) == list(getattr(ahead_run.facts, table).items())
    assert by_label(ahead_run.metrics.intervals_ahead)["redone"] == 1  # [60, 120), computed before [0, 60) opened


def test_the_join_holds_the_cost_stores_sets_rather_than_copies_of_its_own() -> None:
    """An interval's join builds every holding's attribute set anew; a set equal to one the store
    names its series by is held as the store's object (one copy, not two, while an interval
    computed ahead waits for its close), any other set as the join's own. The holdings are the
    same as a join's that keeps its own copies."""
    c, p = cluster(), pipeline(True)
    feed(p, *(c.scrape(t) for t in range(0, 180, SCRAPE_S)))
    assert total(p.metrics.intervals_computed) >= 1
    interval = p.windows.peek(p.windows.due_indices(flush=True)[0])  # the oldest open: it closes next
    samples = interval.steps.unpack(memory=False)
    held = p.joiner.join(samples, interval.start_ns, interval.end_ns)
    p.joiner.kept = None
    own = p.joiner.join(samples, interval.start_ns, interval.end_ns)
    assert own.sets == held.sets and np.array_equal(own.row_set, held.row_set)
    in_store = [i for i, s in enumerate(own.sets) if p.store.kept(s) is not s]  # an equal set is the store's
    assert len(in_store) > 5 and len(in_store) < len(own.sets)  # a set no series of the store is named by stays
    assert all(held.sets[i] is p.store.kept(own.sets[i]) for i in in_store)
    assert all(p.store.kept(s) is s for s in held.sets)


def test_the_join_lets_the_intervals_samples_go_once_it_has_read_what_dcgm_reported(monkeypatch) -> None:
    """The interval's samples (the close's largest arrays) are held by nothing once the join has
    read what DCGM reported: not the computation that unpacked them, not the join, not what it
    reported. The same costs as ever (the other tests here), computed ahead or at the close."""
    c, p = cluster(), pipeline(True)
    made: list[weakref.ref] = []
    alive_after_reported: list[bool] = []
    unpack, row_sets = compute.IntervalCosts._samples, join._row_sets

    def samples(self, *args):  # noqa: ANN001, ANN202 - a spy: keeps a weak reference, nothing else
        out = unpack(self, *args)
        made.append(weakref.ref(out))
        return out

    def rows_then(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the join's next step after the report
        alive_after_reported.append(made[-1]() is not None)
        return row_sets(*args, **kwargs)

    monkeypatch.setattr(compute.IntervalCosts, "_samples", samples)
    monkeypatch.setattr(join, "_row_sets", rows_then)
    feed(p, *(c.scrape(t) for t in range(0, 300, SCRAPE_S)))
    p.close_due(flush=True)
    assert total(p.metrics.intervals_computed) >= 4 and len(alive_after_reported) >= 4
    assert not any(alive_after_reported)


def test_costs_computed_ahead_are_let_go_once_their_interval_is_recorded(monkeypatch) -> None:
    """An interval computed ahead closes bare: its costs (at 100,000 GPUs 2 million series and the
    store's plan for them) are held by nothing once the store has recorded them, not through the
    snapshot's staging and the checkpoint that follow."""
    c, p = cluster(), pipeline(True)
    made: list[weakref.ref] = []
    alive_at_stage: list[bool] = []
    ahead, add = Pipeline.compute_ahead, p.committer.add

    def computing(self) -> bool:  # a spy: keeps a weak reference to what it computed, nothing else
        done = ahead(self)
        if done:
            made.append(weakref.ref(self._ahead.costs))
        return done

    def staging(end_ns: int, snapshot) -> None:  # noqa: ANN001 - what follows the record
        alive_at_stage.append(bool(made) and made[-1]() is not None)
        add(end_ns, snapshot)

    monkeypatch.setattr(Pipeline, "compute_ahead", computing)
    monkeypatch.setattr(p.committer, "add", staging)
    for t in range(0, 300, SCRAPE_S):
        feed(p, c.scrape(t))
        p.compute_ahead()
    assert by_label(p.metrics.intervals_ahead).get("used", 0) >= 3 and len(alive_at_stage) >= 3
    assert not any(alive_at_stage)


def test_intervals_closed_at_once_are_each_let_go_before_its_snapshot_is_staged(monkeypatch) -> None:
    """A stop closes the interval waiting for its lateness and the one begun, computed at their
    close: each one's samples, pod samples and facts are held by nothing once its costs are
    recorded, not through its snapshot's staging, the next one's computation and the checkpoint."""
    c, p = cluster(), pipeline(False)
    intervals: list[weakref.ref] = []
    alive_at_stage: list[list[bool]] = []
    due, add = p.windows.due, p.committer.add

    def closing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - a spy: weak references to what closes
        closed = due(*args, **kwargs)
        intervals.extend(weakref.ref(interval.steps) for interval in closed)
        return closed

    def staging(end_ns: int, snapshot) -> None:  # noqa: ANN001
        alive_at_stage.append([ref() is not None for ref in intervals])
        add(end_ns, snapshot)

    for t in range(0, 200, SCRAPE_S):
        feed(p, c.scrape(t))
    monkeypatch.setattr(p.windows, "due", closing)
    monkeypatch.setattr(p.committer, "add", staging)
    assert p.close_due(flush=True) == 2 and len(intervals) == 2
    assert alive_at_stage == [[False, True], [False, False]]  # the second still to be computed at the first's
