"""A node's cloud instance: the providerID that kube-state-metrics' kube_node_info carries (the
real golden exposition of its node tests) or the Kubernetes API's Node spec gives, turned into the
`instance_id` every cost series of the node carries, by which a bill's lines are matched."""

from __future__ import annotations

import pytest
from cluster import T0, Cluster, Node, Pod, Unit
from support import feed, make_config, offline_pipeline, prom_fixture_request

from otelgpu.core.catalog import instance_of
from otelgpu.enrich.kube.objects import node_facts
from otelgpu.enrich.nodes import node_info

A100 = "NVIDIA A100-SXM4-40GB"


def test_kube_state_metrics_golden_node_info_gives_the_provider_id():
    pipeline = offline_pipeline()
    feed(pipeline, prom_fixture_request("ksm/golden_node_gpu_capacity_node_test.txt", T0, "ksm-node",
                                        job="kube-state-metrics", instance="10.0.0.2:8080"))
    pipeline.close_due(flush=True)  # facts apply as the interval they arrived in closes
    node = pipeline.facts.nodes["127.0.0.1"]
    assert node.provider_id == "provider://i-randomidentifier"
    assert node_info(node).instance_id == "i-randomidentifier"
    assert node.capacity  # kube_node_status_capacity of the same scrape, kept beside it


def test_the_api_node_spec_gives_the_provider_id():
    obj = {"metadata": {"name": "n", "labels": {}}, "spec": {"providerID": "aws:///us-east-1a/i-0123456789abcdef0"},
           "status": {"capacity": {"cpu": "8"}}}
    assert node_info(node_facts(obj, 1)).instance_id == "i-0123456789abcdef0"
    assert node_info(node_facts({"metadata": {"name": "n"}}, 1)).instance_id == ""


@pytest.mark.parametrize("provider_id, instance", [
    ("aws:///us-west-2b/i-0a1b2c3d4e5f60718", "i-0a1b2c3d4e5f60718"),
    ("aws:///us-west-2b/fargate-ip-10-0-0-1", ""),  # Fargate: no EC2 instance of its own
    ("kind://docker/kind/kind-worker", ""),
    ("gce://project/us-central1-a/gke-node-1", ""),
    ("", ""),
])
def test_cost_series_carry_the_instance_id_and_keep_it_through_a_relabel(provider_id, instance):
    node = Node("gpu-1", "p4d.24xlarge", 96, 1152, units=[Unit("GPU-0", A100)], capacity={"nvidia_com_gpu": 1},
                provider_id=provider_id)
    pods = [Pod("ml", "train", "gpu-1", labels={"team": "vision"}, gpu=("nvidia_com_gpu", 1), holds=("GPU-0",))]
    cluster = Cluster([node], pods)
    pipeline = offline_pipeline(make_config(attribution__interval_seconds=300,
                                            attribution__prices__gpu_hour_by_gpu_model={A100: 12.0}))
    feed(pipeline, *cluster.scrapes(60, 900, ksm=True))
    node.labels["extra"] = "relabelled"  # a kube_node_labels change must not lose the provider id
    feed(pipeline, *cluster.scrapes(60, 1800 + 60, ksm=True, from_s=900))
    pipeline.close_due(flush=True)
    assert (instance_of(provider_id) or "") == instance
    totals = {metric: pipeline.store.totals(metric, ("node", "instance_id"), {"cost_model": "request"})
              for metric in ("capacity", "allocated")}
    assert set(totals["capacity"]) == set(totals["allocated"]) == {("gpu-1", instance)}
    assert totals["allocated"] == pytest.approx(totals["capacity"]) and sum(totals["capacity"].values()) > 0
