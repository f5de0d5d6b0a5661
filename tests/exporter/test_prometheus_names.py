"""The Prometheus names of the cost metrics after the Collector's prometheusremotewrite
translation (otlptranslator), applied to every metric otelgpu emits, and the same names on the
direct remote-write and scrape paths. The rules are those of the Collector (docs/pipeline.md):
dots become underscores, a known unit adds its suffix (`s` -> `_seconds`), `1` on a gauge adds
`_ratio`, a unit in braces adds nothing, an unknown unit passes through verbatim, and a monotonic
sum ends in `_total`."""

from __future__ import annotations

import re

import pytest

from otelgpu.exporter.prometheus import label_name
from otelgpu.exporter.store import cost_metrics

# The units otlptranslator names (a subset: those that matter for cost and time).
UNIT_SUFFIX = {"s": "seconds", "ms": "milliseconds", "By": "bytes", "%": "percent"}


def collector_name(name: str, unit: str, kind: str) -> str:
    """What the Collector's prometheusremotewrite exporter calls an OTLP metric."""
    out = re.sub(r"[^a-zA-Z0-9_:]", "_", name)
    if unit and not (unit.startswith("{") and unit.endswith("}")):
        if unit == "1":
            suffix = "ratio" if kind == "gauge" else ""
        else:
            suffix = UNIT_SUFFIX.get(unit, re.sub(r"[^a-zA-Z0-9_:]", "_", unit))
        if suffix and not out.endswith("_" + suffix):
            out += "_" + suffix
    if kind == "sum" and not out.endswith("_total"):
        out += "_total"
    return out


@pytest.mark.parametrize("currency", ["USD", "EUR"])
def test_every_metric_gets_the_documented_collector_name(currency: str) -> None:
    specs = cost_metrics(currency)
    assert len(specs) == 15
    for spec in specs.values():
        assert collector_name(spec.name, spec.unit, spec.kind) == spec.prometheus, spec.name


def test_the_rules_themselves() -> None:
    # The examples of docs/pipeline.md: a unit in braces adds nothing, an unknown unit passes
    # through verbatim, a known one adds its suffix.
    assert collector_name("gpu.cost", "{USD}", "sum") == "gpu_cost_total"
    assert collector_name("gpu.cost", "USD", "sum") == "gpu_cost_USD_total"
    assert collector_name("gpu.held", "s", "sum") == "gpu_held_seconds_total"
    assert collector_name("gpu.activity", "1", "gauge") == "gpu_activity_ratio"


def test_the_names_are_in_the_docs() -> None:
    from support import REPO

    doc = (REPO / "docs" / "metrics.md").read_text()
    for spec in cost_metrics().values():
        assert f"`{spec.name}`" in doc and f"`{spec.prometheus}`" in doc


def test_attribute_keys_become_the_collector_s_label_names() -> None:
    assert label_name("k8s.pod.name") == "k8s_pod_name"
    assert label_name("9lives") == "key_9lives"
    assert label_name("cost_model") == "cost_model"
