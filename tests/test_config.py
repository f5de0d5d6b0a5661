"""Configuration: defaults, the documented example, and named invalid cases with their YAML paths."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support import REPO

from otelgpu.config import load_config, parse_config
from otelgpu.errors import ConfigError


def problems(doc) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_config(doc)
    return err.value.problems


def test_defaults():
    c = parse_config({})
    assert c.receiver.grpc.max_recv_msg_size_mib == 64
    assert c.attribution.cost_models == ("request",) and c.attribution.idle.policy == "keep" and c.attribution.interval_seconds == 60
    assert c.tags["team"].pod_labels == ("team",) and c.tags["team"].default == "unallocated"
    assert c.exporter.otlp is None


def test_example_config_loads_with_nothing_set(monkeypatch):
    monkeypatch.delenv("CLUSTER_NAME", raising=False)
    c = load_config(REPO / "examples" / "otelgpu.yaml")
    assert c.cluster.name == "dev"
    assert c.attribution.prices.gpu_hour_by_gpu_model["NVIDIA H100 80GB HBM3"] == 6.88
    assert c.exporter.otlp is None and c.exporter.prometheus.cost_series  # nothing external to reach
    monkeypatch.setenv("CLUSTER_NAME", "eks-prod-1")
    assert load_config(REPO / "examples" / "otelgpu.yaml").cluster.name == "eks-prod-1"


def test_production_example_names_missing_environment_variable(monkeypatch):
    monkeypatch.delenv("CLUSTER_NAME", raising=False)
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "examples" / "production.yaml")
    assert err.value.problems == ["cluster.name: environment variable CLUSTER_NAME is not set "
                                  "(set it, or give a default: ${env:CLUSTER_NAME:-value})"]
    monkeypatch.setenv("CLUSTER_NAME", "prod-eu-1")
    c = load_config(REPO / "examples" / "production.yaml")
    assert c.kubernetes.enabled and c.checkpoint.directory and c.exporter.otlp.target == ("127.0.0.1:4319", False)
    done = subprocess.run([sys.executable, "-m", "otelgpu", "check-config", str(REPO / "examples" / "production.yaml")],
                          capture_output=True, text=True, env={**os.environ, "CLUSTER_NAME": "prod-eu-1"})
    assert done.returncode == 0, done.stderr


def test_environment_references_take_a_default(monkeypatch):
    doc = {"cluster": {"name": "${env:OTELGPU_TEST_CLUSTER:-dev-1}"},
           "receiver": {"grpc": {"endpoint": "${env:OTELGPU_TEST_HOST:-127.0.0.1}:${env:OTELGPU_TEST_PORT:-4317}"}}}
    monkeypatch.delenv("OTELGPU_TEST_CLUSTER", raising=False)
    monkeypatch.delenv("OTELGPU_TEST_PORT", raising=False)
    monkeypatch.setenv("OTELGPU_TEST_HOST", "")  # set but empty: the default, as the Collector does
    c = parse_config(doc)
    assert (c.cluster.name, c.receiver.grpc.endpoint) == ("dev-1", "127.0.0.1:4317")
    monkeypatch.setenv("OTELGPU_TEST_CLUSTER", "prod-eu")
    monkeypatch.setenv("OTELGPU_TEST_PORT", "14317")
    c = parse_config(doc)
    assert (c.cluster.name, c.receiver.grpc.endpoint) == ("prod-eu", "127.0.0.1:14317")
    assert parse_config({"cluster": {"name": "${env:OTELGPU_TEST_UNSET:-a:-b}"}}).cluster.name == "a:-b"


@pytest.mark.parametrize(("endpoint", "parsed", "address", "loopback"), [
    ("127.0.0.1:4317", ("127.0.0.1", 4317), "127.0.0.1:4317", True),
    ("localhost:0", ("localhost", 0), "localhost:0", True),
    ("[::1]:4317", ("::1", 4317), "[::1]:4317", True),
    ("[::]:9464", ("::", 9464), "[::]:9464", False),
    (":4318", ("", 4318), "[::]:4318", False),
    ("0.0.0.0:4317", ("0.0.0.0", 4317), "0.0.0.0:4317", False),
    ("collector.monitoring.svc:4317", ("collector.monitoring.svc", 4317), "collector.monitoring.svc:4317", False),
])
def test_one_endpoint_parser_for_every_endpoint(endpoint, parsed, address, loopback):
    from otelgpu.core.settings import is_loopback, listen_address, split_endpoint

    assert split_endpoint(endpoint) == parsed and listen_address(endpoint) == address
    assert is_loopback(parsed[0]) is loopback
    for section in ({"receiver": {"grpc": {"endpoint": endpoint}}}, {"receiver": {"http": {"endpoint": endpoint}}},
                    {"exporter": {"prometheus": {"endpoint": endpoint}}}):
        parse_config(section)


@pytest.mark.parametrize("endpoint", ["::1:4317", "[::1]", "[]:4317", "host:99999", "host", "a b:1", "[1.2.3.4]:5"])
def test_malformed_endpoints_fail_check_config(endpoint):
    assert problems({"receiver": {"grpc": {"endpoint": endpoint}}})


@pytest.mark.parametrize("doc, expected", [
    ({"recever": {}}, "recever: unknown key"),
    ({"receiver": {"grpc": {"endpont": "x"}}}, "receiver.grpc.endpont: unknown key"),
    ({"receiver": {"grpc": {"endpoint": "4317"}}}, "receiver.grpc.endpoint: expected host:port, got '4317'"),
    ({"receiver": {"grpc": {"max_concurrent_requests": 2}}}, "receiver.grpc.max_concurrent_requests: Input should be greater than or equal to 10"),
    ({"attribution": {"cost_models": ["magic"]}},
     "attribution.cost_models[0]: Input should be 'request', 'scad', 'opencost' or 'hybrid'"),
    ({"attribution": {"cost_models": []}}, "attribution.cost_models: name at least one cost model"),
    ({"attribution": {"cost_models": ["scad", "scad"]}}, "attribution.cost_models: a cost model is listed twice"),
    ({"attribution": {"hybrid_alpha": 1.5}}, "attribution.hybrid_alpha: Input should be less than or equal to 1"),
    ({"attribution": {"idle": {"policy": "burn"}}}, "attribution.idle.policy: Input should be 'keep', 'share' or 'platform'"),
    ({"attribution": {"idle": {"platform_tags": {"squad": "x"}}}},
     "attribution.idle.platform_tags: unknown tag(s) squad"),
    ({"attribution": {"prices": {"capacity_types": {"spot": {"discount": 1.0}}}}},
     "attribution.prices.capacity_types.spot.discount: Input should be less than 1"),
    ({"attribution": {"prices": {"capacity_types": {"preemptible": {}}}}},
     "attribution.prices.capacity_types.preemptible: unknown key"),
    ({"attribution": {"mig_fraction_rule": "memory"}}, "attribution.mig_fraction_rule: Input should be 'compute' or 'max'"),
    ({"attribution": {"interval_seconds": 0}}, "attribution.interval_seconds: Input should be greater than or equal to 1"),
    ({"attribution": {"prices": {"gpu_hour_by_instance_type": {"p5.48xlarge": -1}}}},
     "attribution.prices.gpu_hour_by_instance_type: prices must be >= 0: p5.48xlarge"),
    ({"attribution": {"prices": {"instance_price_split": "half"}}},
     "attribution.prices.instance_price_split: Input should be 'scad', 'opencost' or 'gpu_only'"),
    ({"tags": {"squad": {}}}, "tags: unknown tag(s) squad; tags are team, project, environment, model, cost_center"),
    ({"tags": {"team": {"pod_label": ["team"]}}}, "tags.team.pod_label: unknown key"),
    ({"exporter": {"otlp": {"tls": {"insecure": True}}}}, "exporter.otlp.endpoint: Field required"),
    ([1, 2], "(top level): expected a mapping"),
    ({"attribution": {"idle": {"policy": "share", "share_scope": "cluster"}},
      "kubernetes": {"enabled": True, "scope": "node", "node_name": "ip-10-0-1-1"}},
     "(top level): attribution.idle.share_scope cluster needs the whole cluster, but kubernetes.scope node"),
    ({"series": {"drop_attributes": ["node"]},
      "kubernetes": {"enabled": True, "scope": "node", "node_name": "ip-10-0-1-1"}},
     "(top level): series.drop_attributes cannot drop node with kubernetes.scope node"),
])
def test_invalid_configs_name_the_path(doc, expected):
    assert any(p.startswith(expected) for p in problems(doc)), problems(doc)


def test_every_problem_is_reported_together():
    found = problems({"recever": {}, "attribution": {"interval_seconds": -5, "currency": 3}})
    assert len(found) == 3
    assert {p.split(":")[0] for p in found} == {"recever", "attribution.interval_seconds", "attribution.currency"}


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("receiver: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_check_config_command(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("cluster: {name: c1}\n")
    ok = subprocess.run([sys.executable, "-m", "otelgpu", "check-config", str(good)], capture_output=True, text=True)
    assert ok.returncode == 0 and "ok" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: {nme: c1}\n")
    res = subprocess.run([sys.executable, "-m", "otelgpu", "check-config", str(bad)], capture_output=True, text=True)
    assert res.returncode == 2 and "cluster.nme: unknown key" in res.stderr


def test_version_says_the_installed_release():
    from otelgpu import __version__

    done = subprocess.run([sys.executable, "-m", "otelgpu", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"otelgpu {__version__}"
