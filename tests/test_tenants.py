"""A shared vLLM pod's cost, split among its tenants by tokens, through the pipeline, on the shared
fixtures: the vLLM pod of the H100 node (team-a) holds one whole GPU at $12/GPU-h, $0.20 a
60 s interval, and serves two tenants. Worked example (docs/cost-model.md section 8):

- interval 1 (scrape at 430 s): the counters' first points count nothing: $0.20 to "(no tokens)";
- interval 2 (scrape at 460 s): acme served 3,000 prompt + 1,000 generation tokens, globex 1,000 +
  0. With weights 1 and 1, acme weighs 4,000 of 5,000: $0.16, globex $0.04; acme's cost per million
  tokens is 0.16 / 4,000 * 1e6 = $40. With generation_weight 4, acme weighs 7,000 of 8,000.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from cluster import Cluster, Node, Pod, Unit
from support import feed, make_config, offline_pipeline, otlp_fixture

from otelgpu.attribution.config import TenantsConfig
from otelgpu.attribution.tenants import cost_per_million_tokens, split_by_tenant, token_sums
from otelgpu.enrich.usage import PROMPT, PodSamples, UsageTracker
from otelgpu.receiver.interner import Interner
from otelgpu.telemetry import total

H100 = "NVIDIA H100 80GB HBM3"
T1 = 1779350430 * 10**9
VLLM_POD = ("team-a", "vllm-llama3-8b-5c9d7b8f6d-k2x7q")
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
PER_GPU_INTERVAL = 12.0 * 60 / 3600


def vllm_scrape(t_ns: int, counters: dict):
    """The vLLM fixture's scrape at `t_ns`, its token counters one series per tenant (a `tenant`
    label) and engine: tenant or (tenant, engine) -> (prompt, generation); engine "0" by default."""
    req = otlp_fixture("otlp_vllm_scrape_text004_collector_v0.142.json")
    for m in req.resource_metrics[0].scope_metrics[0].metrics:
        which = m.WhichOneof("data")
        for p in getattr(m, which).data_points:
            p.time_unix_nano = t_ns
        if m.name not in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
            continue
        template = m.sum.data_points[0]
        points = []
        for key, (prompt, generation) in counters.items():
            tenant, engine = key if isinstance(key, tuple) else (key, "0")
            p = type(template)()
            p.CopyFrom(template)
            for kv in p.attributes:
                if kv.key == "engine":
                    kv.value.string_value = engine
            p.attributes.add(key="tenant").value.string_value = tenant
            p.as_double = prompt if m.name == "vllm:prompt_tokens_total" else generation
            points.append(p)
        del m.sum.data_points[:]
        m.sum.data_points.extend(points)
    return req


def run(**config):
    config.setdefault("attribution__cost_models", ["request", "scad"])
    p = offline_pipeline(make_config(attribution__prices__gpu_hour_by_gpu_model={H100: 12.0}, **config))
    feed(p, otlp_fixture("otlp_ksm_scrape_collector_v0.142.json"),
         otlp_fixture("otlp_dcgm_scrape1_collector_v0.142.json"),
         vllm_scrape(T1, {"acme": (1000, 100), "globex": (500, 50)}),
         otlp_fixture("otlp_dcgm_scrape2_stale_collector_v0.142.json"),
         vllm_scrape(T1 + 30 * 10**9, {"acme": (4000, 1100), "globex": (1500, 50)}))
    p.close_due(flush=True)
    return p


def tenants(p, model: str = "request") -> dict:
    return {k[0]: v for k, v in p.store.totals("tenant_cost", ("tenant",), {"cost_model": model}).items()}


def test_the_worked_example_through_the_pipeline():
    p = run()
    assert tenants(p) == pytest.approx({"(no tokens)": PER_GPU_INTERVAL, "acme": 0.8 * PER_GPU_INTERVAL,
                                        "globex": 0.2 * PER_GPU_INTERVAL}, rel=1e-12)
    tokens = p.store.totals("tenant_tokens", ("tenant", "token_kind", "served_model", "namespace", "pod"))
    assert tokens == {("acme", "prompt", LLAMA, *VLLM_POD): 3000.0, ("acme", "generation", LLAMA, *VLLM_POD): 1000.0,
                      ("globex", "prompt", LLAMA, *VLLM_POD): 1000.0, ("globex", "generation", LLAMA, *VLLM_POD): 0.0}
    per_mtok = {dict(pt.attrs)["tenant"]: pt.value for pt in p.store.points()
                if pt.metric == "tenant_cost_per_mtok" and dict(pt.attrs)["cost_model"] == "request"}
    assert per_mtok == pytest.approx({"acme": 40.0, "globex": 40.0})


@pytest.mark.parametrize("policy", ["keep", "share"])
def test_tenants_add_up_to_what_the_pod_is_charged_under_every_model_and_resource(policy):
    """What the pod is charged is allocated + unused (scad's unused cost, the `share` idle policy)."""
    p = run(attribution__idle__policy=policy)
    for model in ("request", "scad"):
        charged: dict = {}
        for metric in ("allocated", "unused"):
            for k, v in p.store.totals(metric, ("namespace", "pod", "resource"), {"cost_model": model}).items():
                charged[k] = charged.get(k, 0.0) + v
        split = p.store.totals("tenant_cost", ("namespace", "pod", "resource"), {"cost_model": model})
        assert split and split == pytest.approx({k: v for k, v in charged.items() if k[:2] == VLLM_POD}, rel=1e-12)
        if model == "scad" or policy == "share":  # the pod's unused share is in it
            pod_allocated = p.store.totals("allocated", ("namespace", "pod"), {"cost_model": model})[VLLM_POD]
            assert sum(split.values()) > pod_allocated * 1.01
    assert {k[2] for k in split} == {"gpu", "cpu", "memory"}  # scad charges the pod's CPU and memory too


def test_the_split_needs_no_pod_use_samples():
    p = run(attribution__cost_models=["request"])  # no scad: only the token counters are kept per pod
    assert tenants(p) == pytest.approx({"(no tokens)": PER_GPU_INTERVAL, "acme": 0.8 * PER_GPU_INTERVAL,
                                        "globex": 0.2 * PER_GPU_INTERVAL}, rel=1e-12)


@pytest.mark.parametrize("dropped", [["tenant"], ["served_model"], ["tenant", "served_model"]])
def test_series_that_drop_tenant_attributes_keep_every_cost(dropped):
    plain, p = run(), run(series__drop_attributes=dropped)
    assert p.store.totals("allocated", ("pod",)) == pytest.approx(plain.store.totals("allocated", ("pod",)), rel=1e-12)
    assert sum(p.store.totals("tenant_cost", ("cost_model",)).values()) == pytest.approx(
        sum(plain.store.totals("tenant_cost", ("cost_model",)).values()), rel=1e-12)
    assert not total(p.metrics.interval_errors)


def test_series_detail_reaches_the_token_series_too():
    p = run(series__detail="workload")
    assert p.store.totals("tenant_tokens", ("tenant",))[("acme",)] == 4000.0
    assert all("pod" not in dict(pt.attrs) for pt in p.store.points() if pt.metric in ("tenant_tokens", "tenant_cost"))


def test_generation_tokens_can_weigh_more():
    p = run(tenants__generation_weight=4.0)
    assert tenants(p)["acme"] == pytest.approx(7 / 8 * PER_GPU_INTERVAL, rel=1e-12)
    assert tenants(p)["globex"] == pytest.approx(1 / 8 * PER_GPU_INTERVAL, rel=1e-12)


def test_without_a_tenant_label_the_namespace_pays_and_turned_off_nothing_is_split():
    p = run(tenants__labels=["customer"])  # the series carry `tenant`, not `customer`
    assert tenants(p) == pytest.approx({"(no tokens)": PER_GPU_INTERVAL, "team-a": PER_GPU_INTERVAL}, rel=1e-12)
    off = run(tenants__enabled=False)
    assert not off.store.totals("tenant_cost", ("tenant",)) and not off.store.totals("tenant_tokens", ("tenant",))
    assert off.store.totals("allocated", ("pod",)) == p.store.totals("allocated", ("pod",))


def test_a_counter_reset_counts_from_zero_and_a_resend_counts_once():
    p = offline_pipeline(make_config(attribution__prices__gpu_hour_by_gpu_model={H100: 12.0}))
    first, again = vllm_scrape(T1, {"acme": (1000, 0)}), vllm_scrape(T1 + 30 * 10**9, {"acme": (300, 0)})
    feed(p, otlp_fixture("otlp_ksm_scrape_collector_v0.142.json"), otlp_fixture("otlp_dcgm_scrape1_collector_v0.142.json"),
         first, first, otlp_fixture("otlp_dcgm_scrape2_stale_collector_v0.142.json"), again, again)
    p.close_due(flush=True)
    # vLLM restarted between the scrapes: 300 tokens since, not -700, and the resends add nothing.
    assert p.store.totals("tenant_tokens", ("tenant", "token_kind"))[("acme", "prompt")] == 300.0


def fed(*vllm, gap_s: int = 30, **config):
    """The fixture cluster's two intervals with these vLLM scrapes, `gap_s` apart after the first."""
    p = offline_pipeline(make_config(attribution__prices__gpu_hour_by_gpu_model={H100: 12.0}, **config))
    feed(p, otlp_fixture("otlp_ksm_scrape_collector_v0.142.json"), otlp_fixture("otlp_dcgm_scrape1_collector_v0.142.json"))
    for k, counters in enumerate(vllm):
        feed(p, vllm_scrape(T1 + k * gap_s * 10**9, counters))
    feed(p, otlp_fixture("otlp_dcgm_scrape2_stale_collector_v0.142.json"))
    p.close_due(flush=True)
    return p


def test_a_series_cannot_claim_the_buckets_of_otelgpu():
    p = fed({"(no tokens)": (0.0, 0.0), "other": (0.0, 0.0)}, {"(no tokens)": (100.0, 0.0), "other": (50.0, 0.0)})
    assert p.store.totals("tenant_tokens", ("tenant", "token_kind"))[("team-a", "prompt")] == 150.0
    assert {k[0] for k in p.store.totals("tenant_tokens", ("tenant",))} == {"team-a"}


@pytest.mark.parametrize("order", [("0", "1"), ("1", "0")])
def test_the_engines_of_one_pod_are_series_of_their_own(order):
    """vLLM data-parallel: one series per engine; whatever their order, each is differenced alone."""
    first = {("acme", e): (1000.0 if e == "0" else 5.0, 0.0) for e in order}
    second = {("acme", e): (2000.0 if e == "0" else 55.0, 0.0) for e in reversed(order)}
    p = fed(first, second)
    assert p.store.totals("tenant_tokens", ("tenant", "token_kind"))[("acme", "prompt")] == 1000.0 + 50.0


def test_tokens_served_while_the_scrapes_were_away_for_hours_count_and_restarts_keep_them():
    """A counter series is forgotten after a day without points, not after the ten minutes a CPU
    rate may span: tokens served while the scrapes (or otelgpu) were away are counted; the
    checkpoint's token state comes back with its CPU rows."""
    strings = Interner()
    ns, pod, model, tenant, engine = (strings.code(x) for x in ("team-a", "vllm-0", LLAMA, "acme", "0"))

    def point(t_s: float, value: float) -> PodSamples:
        one = lambda x, dtype=np.int32: np.array([x], dtype)  # noqa: E731
        return PodSamples(one(PROMPT, np.int8), one(int(t_s * 1e9), np.int64), one(ns), one(pod), one(model),
                          one(tenant), one(value, float), one(0.0, float), one(engine))

    tracker = UsageTracker(strings)
    tracker.use_and_tokens(point(0, 1000.0), 0, 60 * 10**9)
    tracker.expire(4 * 3600 * 10**9)  # four hours on
    again = UsageTracker(strings)
    again.restore({"cpu": [["ml", "train", "main", "/kubepods/x", 5, 1.0]], "tokens": tracker.state()["tokens"]})
    _, tokens = again.use_and_tokens(point(4 * 3600, 500000.0), 4 * 3600 * 10**9 - 60 * 10**9, 4 * 3600 * 10**9)
    assert tokens == {("team-a", "vllm-0"): {(LLAMA, "acme"): [499000.0, 0.0]}}
    assert again.state()["cpu"] == [["ml", "train", "main", "/kubepods/x", 5, 1.0]]


# --- the split itself, on any input --------------------------------------------------------------------------

names = st.sampled_from(["a", "b", "c", "d", "e"])
counts = st.floats(min_value=0, max_value=1e9, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(served=st.dictionaries(st.tuples(names, names), st.lists(counts, min_size=2, max_size=2), max_size=8),
       costs=st.lists(st.floats(min_value=0, max_value=1e4, allow_nan=False), min_size=1, max_size=3),
       weights=st.tuples(st.sampled_from([0.0, 0.5, 1.0, 4.0]), st.sampled_from([1.0, 3.0])),
       cap=st.integers(min_value=1, max_value=6))
@example(served={("a", "a"): [0.0, 5e-324]}, costs=[1.5], weights=(0.0, 1.0), cap=1)  # a subnormal weight
def test_the_split_conserves_the_pod_and_never_goes_negative(served, costs, weights, cap):
    cfg = TenantsConfig(prompt_weight=weights[0], generation_weight=weights[1], max_tenants_per_pod=cap)
    allocated = {(("cost_model", "request"), ("namespace", "ns"), ("pod", "p"), ("resource", f"r{i}"),
                  ("unit_kind", "gpu")): c for i, c in enumerate(costs)}
    allocated[(("cost_model", "request"), ("namespace", "ns"), ("pod", "other"), ("resource", "r0"))] = 5.0
    tokens = {("ns", "p"): served}
    split = split_by_tenant(allocated, tokens, cfg)
    for i, c in enumerate(costs):  # per resource, the tenants add up to the pod's cost
        mine = [v for a, v in split.items() if dict(a)["resource"] == f"r{i}"]
        assert sum(mine) == pytest.approx(c, rel=1e-9, abs=1e-9) and min(mine) >= 0
    assert all(dict(a)["pod"] == "p" for a in split)  # a pod that served nothing is not split
    assert len({(dict(a).get("served_model"), dict(a)["tenant"]) for a in split}) <= cap + 1  # the cap, `(no tokens)`
    counted = token_sums(tokens, cfg)
    assert sum(counted.values()) == pytest.approx(sum(sum(v) for v in served.values()), rel=1e-9)
    for attrs, per in cost_per_million_tokens(split, counted, cfg).items():
        assert per >= 0 and dict(attrs)["tenant"] != cfg.without_tokens


def test_many_minted_tenants_and_models_fold_into_other():
    cfg = TenantsConfig(max_tenants_per_pod=3)
    rng = random.Random(7)
    served = {(f"m{i % 7}", f"t{i}"): [float(rng.randint(1, 100)), 0.0] for i in range(50)}
    served[("m0", "big")] = [1e6, 0.0]
    split = split_by_tenant({(("namespace", "ns"), ("pod", "p")): 1.0}, {("ns", "p"): served}, cfg)
    second = sorted(served, key=lambda k: -served[k][0])[1]
    assert {(dict(a)["served_model"], dict(a)["tenant"]) for a in split} == {("m0", "big"), second, ("other", "other")}
    assert sum(split.values()) == pytest.approx(1.0)
    assert len(token_sums({("ns", "p"): served}, cfg)) == 3 * 2  # three pairs, prompt and generation


def test_an_interval_without_a_token_scrape_has_no_tenant_series_and_every_other_one_adds_up():
    """A vLLM pod holds one H100 for 30 one-minute intervals; its own scrapes fail from 600 s to
    900 s. Those five intervals have no tenant series (the pod's allocated series has their cost);
    in every other one its tenants add up to what it is charged, and the tokens served while its
    scrapes were away are counted when they come back."""
    node = Node("gpu-1", "p5.4xlarge", 16, 256, units=[Unit("GPU-0", H100)], capacity={"nvidia_com_gpu": 1})
    vllm = Pod("team-a", "vllm-0", "gpu-1", {"team": "a"}, gpu=("nvidia_com_gpu", 1), holds=("GPU-0",),
               serves={"acme": (30.0, 10.0), "globex": (10.0, 0.0)})
    c = Cluster([node], [vllm])
    p = offline_pipeline(make_config(attribution__interval_seconds=60, attribution__lateness_seconds=0,
                                     attribution__prices__gpu_hour_by_gpu_model={H100: 12.0}))
    intervals: list = []
    p.on_interval.append(lambda i: intervals.append(
        (int((i.start_ns - c.t0) // 10**9), sum(p.store.totals("allocated", (), {"cost_model": "request"}).values()),
         sum(p.store.totals("tenant_cost", (), {"cost_model": "request"}).values()))))
    for k, req in enumerate(c.scrapes(60, 1860)):
        if 600 <= 60 * k < 900:
            for i in reversed(range(len(req.resource_metrics))):
                if any(kv.value.string_value == "vllm" for kv in req.resource_metrics[i].resource.attributes):
                    del req.resource_metrics[i]
        feed(p, req)
    p.close_due(flush=True)
    previous = (0.0, 0.0)
    for start_s, allocated, split in intervals:
        charged, tenants = allocated - previous[0], split - previous[1]
        previous = (allocated, split)
        assert charged == pytest.approx(PER_GPU_INTERVAL, rel=1e-12), start_s
        assert tenants == (0.0 if 600 <= start_s < 900 else pytest.approx(charged, rel=1e-12)), start_s
    assert len(intervals) == 31  # the last scrape, at 1800 s, opened the 31st
    tokens = p.store.totals("tenant_tokens", ("tenant", "token_kind"))
    assert tokens == {("acme", "prompt"): 30.0 * 1800, ("acme", "generation"): 10.0 * 1800,
                      ("globex", "prompt"): 10.0 * 1800, ("globex", "generation"): 0.0}
