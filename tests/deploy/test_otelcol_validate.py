"""Every Collector config otelgpu ships, checked by the real Collector: `otelcol validate` of the
pinned build (collector-config/distribution) on each file of collector-config/ in the combinations
the docs give, and on the configs every k8s overlay and component combination renders into the
Collector container, with that container's environment, --config order and feature gates. Only the
service account files the pod gets from Kubernetes are stand-ins (validate checks they exist)."""

from __future__ import annotations

from pathlib import Path

import otelcol
import pytest
import yaml
from manifests import COLLECTOR_CONFIG, K8S, combinations, overlays, pod, render

pytestmark = pytest.mark.slow

# What k8s/base/cluster.env and the pod spec set, for the files used alone.
ENV = {"CLUSTER_NAME": "gpu-test", "AMP_REGION": "us-east-1", "AMP_WORKSPACE_ID": "ws-00000000-0000-0000-0000-0",
       "NODE_NAME": "ip-10-0-12-34.ec2.internal", "DCGM_EXPORTER_NAMESPACE": "gpu-operator",
       "KUBE_STATE_METRICS_NAMESPACE": "kube-system"}
GATES = ("exporter.prometheusremotewritexporter.RetryOn429",)
FILE_SETS = [("gateway.yaml",), ("node.yaml",), ("gateway.yaml", "raw-gpu-to-amp.yaml"),
             ("node.yaml", "raw-gpu-to-amp.yaml"), ("node.yaml", "nvml.yaml"),
             ("node.yaml", "nvml.yaml", "raw-gpu-to-amp.yaml")]
PODS = combinations()
FLEET = [p for p in overlays() if "fleet" in p.parts and (p / "kustomization.yaml").exists()
         and p.parent.name == "clusters"]


def _validated(files: list[tuple[str, str]], env: dict[str, str], gates: tuple[str, ...], tmp_path: Path) -> None:
    account = otelcol.stand_in_service_account(tmp_path / "serviceaccount")
    paths = []
    for name, text in files:
        path = tmp_path / name
        path.write_text(otelcol.credentials_rewritten(text, account))
        paths.append(path)
    run = otelcol.validate(paths, env, gates)
    assert run.returncode == 0, f"otelcol validate {[n for n, _ in files]}:\n{run.stdout}{run.stderr}"
    # A component or setting the release deprecates is logged at validation too: none may be.
    assert "deprecated" not in (run.stdout + run.stderr).lower(), run.stdout + run.stderr


@pytest.mark.parametrize("names", FILE_SETS, ids=["+".join(n) for n in FILE_SETS])
def test_each_shipped_collector_config_is_valid_for_the_real_collector(names, tmp_path):
    _validated([(n, (COLLECTOR_CONFIG / n).read_text()) for n in names], ENV, GATES, tmp_path)


def _pod_configs(p) -> list[tuple[str, str]]:
    return [(Path(path).name, p.mounted("otel-collector", path)) for path in p.collector_configs()]


@pytest.mark.parametrize("mode,components", PODS, ids=["+".join((m, *c)) for m, c in PODS])
def test_the_collector_config_each_overlay_renders_is_valid(mode, components, tmp_path):
    p = pod(render(mode, components))
    _validated(_pod_configs(p), p.env("otel-collector"), tuple(p.feature_gates()), tmp_path)


@pytest.mark.parametrize("overlay", FLEET, ids=lambda p: p.name)
def test_each_fleet_clusters_collector_config_is_valid(overlay, tmp_path):
    p = pod(render(str(overlay.relative_to(K8S))))
    env = p.env("otel-collector")
    assert env["CLUSTER_NAME"] == overlay.name, env
    _validated(_pod_configs(p), env, tuple(p.feature_gates()), tmp_path)


def test_the_check_would_catch_a_setting_the_release_does_not_know(tmp_path):
    """The control: a misspelt key and an unknown environment variable are refused by validate."""
    doc = yaml.safe_load((COLLECTOR_CONFIG / "gateway.yaml").read_text())
    doc["exporters"]["otlp_grpc/otelgpu"]["sending_queue"]["queue_sise"] = 1000
    account = otelcol.stand_in_service_account(tmp_path / "serviceaccount")
    path = tmp_path / "gateway.yaml"
    path.write_text(otelcol.credentials_rewritten(yaml.safe_dump(doc), account))
    run = otelcol.validate([path], ENV, GATES)
    assert run.returncode != 0 and "queue_sise" in run.stderr, run.stderr
    unknown_gate = otelcol.validate([COLLECTOR_CONFIG / "raw-gpu-to-amp.yaml"], ENV, ("exporter.nosuchgate",))
    assert unknown_gate.returncode != 0 and "nosuchgate" in unknown_gate.stderr, unknown_gate.stderr
