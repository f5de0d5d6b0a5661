"""The label string table forgets what is gone: compacting it between batches keeps only what
queued batches and open intervals refer to, rewrites their codes, and changes no figure; a request
decoded across a compaction is decoded again, never queued with stale codes."""

from __future__ import annotations

import random

import numpy as np
from fuzz_traffic import PRICES, valid_cluster
from support import make_config

from otelgpu.enrich.window import NS
from otelgpu.pipeline import Pipeline
from otelgpu.receiver.interner import Interner
from otelgpu.telemetry import total

METRICS = ("allocated", "effective", "waste", "unmeasured", "unused", "idle", "capacity", "held")
BY = ("cost_model", "team", "pod", "node", "resource", "attribution")


def pipeline() -> Pipeline:
    return Pipeline(make_config(attribution__interval_seconds=300, attribution__lateness_seconds=60,
                                attribution__cost_models=["request", "scad"],
                                attribution__prices__gpu_hour_by_gpu_model=PRICES), serve_receivers=False,
                    keep_ended=True)


def run(compact_every: int) -> tuple[dict, Pipeline]:
    """An hour of the valid fuzz cluster, queued 3 requests ahead of processing (so compactions
    meet queued batches as well as open intervals), compacting after every `compact_every`
    batches (0: never)."""
    t0 = (1_700_000_000 * NS) // (3600 * NS) * 3600 * NS
    requests = valid_cluster(t0).scrapes(60, 3600)
    p = pipeline()
    done = 0
    for i, req in enumerate(requests + [None] * 3):
        if req is not None:
            p.ingest.consume(req)
        if i >= 3 or req is None:
            p.process(p.ingest.get(timeout=0))
            p.ingest.task_done()
            done += 1
            if compact_every and done % compact_every == 0:
                p.compact_strings()
    p.close_due(flush=True)
    totals = {m: p.store.totals(m, BY) for m in METRICS}
    return totals, p


def points_of(req):  # noqa: ANN001, ANN201 - an ExportMetricsServiceRequest
    for rm in req.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                yield from (m.gauge.data_points if m.HasField("gauge") else m.sum.data_points)


def test_compacting_after_every_batch_changes_no_figure():
    plain, p_plain = run(0)
    compacted, p = run(1)
    assert compacted == plain  # exactly: the same codes mean the same strings
    assert total(p.metrics.interner_compactions) == 60  # one per request processed
    assert len(p.strings) < len(p_plain.strings)  # keys and values only the closed intervals used


def test_compact_keeps_the_codes_in_use_and_renumbers_them():
    s = Interner()
    codes = np.array([s.code(x) for x in ("a", "b", "c", "d")])
    table = s.compact(np.array([codes[3], -1, codes[1], codes[3]]))
    assert s.strings() == ["b", "d"] and s.epoch == 1
    assert table[np.array([codes[1], codes[3], -1, codes[0]])].tolist() == [0, 1, -1, -1]
    assert s.find("a") == -1 and s.code("a") == 2  # interned afresh


def test_a_request_decoded_across_a_compaction_is_decoded_again():
    p = pipeline()
    t0 = (1_700_000_000 * NS) // (3600 * NS) * 3600 * NS
    first, second = valid_cluster(t0).scrapes(60, 120)
    p.ingest.consume(first)
    for k, dp in enumerate(points_of(second)):  # new label sets: the second request interns strings as it decodes
        dp.attributes.add(key="pod_uid", value=None).value.string_value = f"second-{k}"
    strings, real_code = p.strings, p.strings.code
    calls = []

    def code_compacting_midway(s: str) -> int:
        """As if the consumer compacted while a receiver thread was half-way through a request."""
        calls.append(s)
        if len(calls) == 5:
            p.compact_strings()
        return real_code(s)

    strings.code = code_compacting_midway
    try:
        p.ingest.consume(second)
    finally:
        del strings.code
    assert strings.epoch == 1 and len(calls) > 5
    batches = [p.ingest.get(timeout=0), p.ingest.get(timeout=0)]
    assert batches[1].epoch == 1  # decoded again after the compaction; batches[0] was queued, and rewritten
    decoded = [{(strings.string(int(k)), strings.string(int(v))) for k, v in zip(b.attr_key, b.attr_val)}
               for b in batches]
    assert ("pod", "train") in decoded[0] and ("pod", "train") in decoded[1]
    assert all(k and v for d in decoded for k, v in d)  # no code points at a string that was dropped


def test_the_sidecar_compacts_by_itself_as_pods_come_and_go(monkeypatch):
    import otelgpu.pipeline as pipeline_module

    monkeypatch.setattr(pipeline_module, "COMPACT_STRINGS_FROM", 2000)
    p = pipeline()
    t0 = (1_700_000_000 * NS) // (3600 * NS) * 3600 * NS
    rng = random.Random(7)
    for k, req in enumerate(valid_cluster(t0).scrapes(60, 3600)):
        for dp in points_of(req):  # every scrape names new pods: a run id label on each
            dp.attributes.add(key="pod_uid", value=None).value.string_value = f"{k}-{rng.random()}"
        p.ingest.consume(req)
        p.process(p.ingest.get(timeout=0))
        p.ingest.task_done()
    assert total(p.metrics.interner_compactions) >= 2
    assert len(p.strings) < 4 * 2000
