"""Golden files for whole-pipeline output: every cost series the fixture scenarios produce, with
its value. Regenerate after an intended change with OTELGPU_UPDATE_GOLDEN=1 and review the diff."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support import feed, make_config, offline_pipeline, otlp_fixture, prom_fixture_request

TESTDATA = Path(__file__).parent / "testdata"
T = 1779350430 * 10**9

SCENARIOS = {
    "otlp_collector_v0142": lambda: [otlp_fixture("otlp_ksm_scrape_collector_v0.142.json"),
                                     otlp_fixture("otlp_dcgm_scrape1_collector_v0.142.json"),
                                     otlp_fixture("otlp_dcgm_scrape2_stale_collector_v0.142.json")],
    "h100_and_a10g_exposition": lambda: [
        otlp_fixture("otlp_ksm_scrape_collector_v0.142.json"),
        prom_fixture_request("dcgm/h100x8_mig_mixed_k8s_v4_pod_labels.prom", T, "n/a"),
        prom_fixture_request("dcgm/a10g_timesliced_virtual_gpus_v4.8.prom", T, "n/a", instance="10.20.7.12:9400"),
    ],
}


def series(pipeline) -> list[dict]:
    out = [{"metric": p.metric, "attrs": dict(p.attrs), "value": round(p.value, 9)} for p in pipeline.store.points()]
    return sorted(out, key=lambda s: (s["metric"], sorted(s["attrs"].items())))


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_golden(name):
    p = offline_pipeline(make_config(attribution__prices__gpu_hour_by_gpu_model={"NVIDIA H100 80GB HBM3": 12.0}))
    feed(p, *SCENARIOS[name]())
    p.close_due(flush=True)
    got = series(p)
    path = TESTDATA / f"{name}.golden.json"
    if os.environ.get("OTELGPU_UPDATE_GOLDEN"):
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert got == json.loads(path.read_text())
