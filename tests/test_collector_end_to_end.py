"""The production chain with the real Collector in it (tests/chain.py): the pinned Collector build
runs the shipped gateway and node configs (collector-config/), discovers the fixtures' cluster
through a local Kubernetes API, scrapes its exposition (dcgm-exporter with MIG and time-slicing,
kube-state-metrics, vLLM, the kubelet's cAdvisor over HTTPS), sends it to the real `otelgpu serve`,
takes otelgpu's cost series back on its otlp/cost receiver and remote-writes them (signed by
sigv4auth) into a real Prometheus. PromQL totals by pod, team and node equal figures worked out
from what the cluster served; a pod starts, one ends and a scrape fails on the way.

What is rewritten in the shipped files for the test, and nothing else (otelcol.shipped_config):
endpoints (loopback ports, the Kubernetes API through a kubeconfig, Prometheus for AMP), the
service account files, the sending queue's directory (in the test's), and the scrape interval
(1 s instead of 30 s). otelgpu runs the mode's
otelgpu.yaml (k8s/<mode>/) with 10-second intervals and the test's prices (chain.otelgpu_config)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from chain import Chain

if TYPE_CHECKING:
    from promserver import PrometheusServer

pytest_plugins = ["promserver", "chain"]  # the `prometheus` and `cluster` fixtures
pytestmark = pytest.mark.slow(seconds=75)  # real time: the cluster's timeline


@pytest.mark.parametrize("mode", ["gateway", "node"])
def test_the_shipped_chain_through_a_real_collector(mode, tmp_path, cluster, prometheus: PrometheusServer) -> None:
    """Gateway: one Collector for the cluster, kube-state-metrics and the API. Per node: the
    Collector of node A scrapes only that node's targets, otelgpu watches only its pods (the API
    alone gives their facts)."""
    chain = Chain(tmp_path, cluster, prometheus, mode)
    try:
        chain.start()
        start_s, cut_s = chain.run()
        chain.check_money(start_s, cut_s)
        chain.check_nothing_lost()
        chain.check_signed()
    finally:
        chain.close()
