"""What k8s/README.md tells users to set matches what otelgpu reads: the kube-state-metrics label
allowlist covers the tags of the shipped configs and the node labels the code prices by, and the
sharding example is a Collector config both distributions can run, routing by a label every
routed series carries."""

from __future__ import annotations

import re

import pytest
import yaml
from manifests import MODES, REPO, collector_config, components, distributions, otelgpu_config, pod, render, render_text

from otelgpu.enrich.labels import NODE_LABEL_KEYS, POD_TEMPLATE_HASH, ksm_label_name

README = (REPO / "k8s" / "README.md").read_text()


def allowlist() -> dict[str, set[str]]:
    (line,) = re.findall(r"--metric-labels-allowlist=(\S+)", README)
    return {kind: set(keys.split(",")) for kind, keys in re.findall(r"(\w+)=\[([^\]]*)\]", line)}


@pytest.mark.parametrize("mode", MODES)
def test_the_allowlist_covers_every_key_the_shipped_configs_and_the_code_read(mode, tmp_path, monkeypatch):
    listed = allowlist()
    tags = otelgpu_config(pod(render(mode)), tmp_path, monkeypatch).tags
    assert {k for rule in tags.values() for k in rule.pod_labels} <= listed["pods"]
    assert {k for rule in tags.values() for k in rule.namespace_labels} <= listed["namespaces"]
    assert ksm_label_name("pod-template-hash") == POD_TEMPLATE_HASH and "pod-template-hash" in listed["pods"]
    assert set(NODE_LABEL_KEYS) <= listed["nodes"]


def test_the_sharding_example_runs_on_both_distributions_and_routes_by_node():
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", README, re.S) if "load_balancing" in b]
    config = yaml.safe_load(block)
    balancer = config["exporters"]["load_balancing"]
    assert balancer["routing_key"] == "attributes" and balancer["routing_attributes"] == ["node"]
    for dist in distributions():
        for kind, type_ in components(config):
            assert type_ in dist[kind], (dist["distribution"], type_)
    # every series the tier would route (dcgm-exporter and cAdvisor) gets a `node` label
    jobs = collector_config(pod(render("gateway")))["receivers"]["prometheus"]["config"]["scrape_configs"]
    for job in jobs:
        if job["job_name"] != "kube-state-metrics":
            assert any(r.get("target_label") == "node" for r in job["relabel_configs"]), job["job_name"]


def test_the_deploy_on_eks_overlay_renders_and_fills_everything_in(tmp_path):
    """README's "Deploy on EKS" overlay, with its placeholders filled and its remote base pointing
    at this checkout, renders: the image, the cluster's identity and the role land where they must."""
    text = (REPO / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "my-cluster/kustomization.yaml" in b]
    for placeholder, value in {"github.com/<you>/otelgpu//k8s/node?ref=<tag>": "../node", "<account>": "111122223333",
                               "<region>": "eu-west-1", "<role>": "otelgpu-amp"}.items():
        block = block.replace(placeholder, value)
    assert "<" not in block.replace("<...>", "")
    objects = render_text(block)
    p = pod(objects)
    assert p.container("otelgpu")["image"] == "111122223333.dkr.ecr.eu-west-1.amazonaws.com/otelgpu:0.1.0"
    assert p.env("otelgpu")["CLUSTER_NAME"] == "my-cluster"
    account = next(o for o in objects if o["kind"] == "ServiceAccount")
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == "arn:aws:iam::111122223333:role/otelgpu-amp"
