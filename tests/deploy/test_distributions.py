"""Every Collector component a pod's configs use is compiled into the distribution its image
names (tests/deploy/data: each distribution's build manifest, with its source), under its
current type name, so the pinned images start without errors or deprecation warnings."""

from __future__ import annotations

import pytest
from manifests import collector_config, combinations, components, distributions, pod, render

DISTRIBUTIONS = distributions()
PODS = combinations()


def distribution(image: str) -> dict:
    found = [d for d in DISTRIBUTIONS if d["image"] == image]
    assert found, f"{image}: no distribution manifest in tests/deploy/data pins this image"
    return found[0]


@pytest.mark.parametrize("mode,components_", PODS, ids=["+".join((m, *c)) for m, c in PODS])
def test_every_component_is_in_the_distribution_of_the_image(mode, components_):
    p = pod(render(mode, components_))
    dist = distribution(p.container("otel-collector")["image"])
    config = collector_config(p)
    for kind, type_ in components(config):
        deprecated = dist.get("deprecated_aliases", {}).get(kind, {})
        assert type_ not in deprecated, f"{kind} {type_}: deprecated in {dist['distribution']}, use {deprecated[type_]}"
        assert type_ in dist[kind], f"{kind} {type_} is not in {dist['distribution']} {dist['version']}"


@pytest.mark.parametrize("mode,components_", PODS, ids=["+".join((m, *c)) for m, c in PODS])
def test_every_feature_gate_is_registered_in_the_distribution_of_the_image(mode, components_):
    """An unknown gate stops the Collector at start."""
    p = pod(render(mode, components_))
    dist = distribution(p.container("otel-collector")["image"])
    unknown = set(p.feature_gates()) - set(dist["feature_gates"])
    assert not unknown, f"{sorted(unknown)}: not registered in {dist['distribution']} {dist['version']}"


@pytest.mark.parametrize("mode,components_", PODS, ids=["+".join((m, *c)) for m, c in PODS])
def test_remote_write_retries_amps_429(mode, components_):
    """Without the gate the exporter drops a batch AMP refuses with 429 (over the ingestion quota)."""
    p = pod(render(mode, components_))
    exporters = {type_ for kind, type_ in components(collector_config(p)) if kind == "exporters"}
    assert "prometheus_remote_write" in exporters
    assert p.feature_gates().get("exporter.prometheusremotewritexporter.RetryOn429") is True


def test_both_distributions_are_rendered():
    images = {pod(render(mode, c)).container("otel-collector")["image"] for mode, c in PODS}
    assert images == {d["image"] for d in DISTRIBUTIONS}


def test_the_check_would_catch_a_component_adot_lacks():
    adot = next(d for d in DISTRIBUTIONS if d["distribution"] == "aws-otel-collector")
    contrib = next(d for d in DISTRIBUTIONS if d["distribution"] == "otelcol-contrib")
    assert "transform" in contrib["processors"] and "transform" not in adot["processors"]
