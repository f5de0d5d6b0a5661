"""The receivers' limits in the configuration and on /metrics: the example documents the defaults,
bad values are named with their YAML path, and the refusal counter is exposed."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client.exposition import generate_latest
from support import REPO

from otelgpu.config import load_config, parse_config
from otelgpu.errors import ConfigError
from otelgpu.exporter.prometheus import cost_registry
from otelgpu.exporter.store import CostStore
from otelgpu.receiver.config import GrpcReceiverConfig, HttpReceiverConfig
from otelgpu.telemetry import SelfMetrics


def test_example_config_documents_the_default_limits(monkeypatch):
    monkeypatch.setenv("CLUSTER_NAME", "c")
    receiver = load_config(REPO / "examples" / "otelgpu.yaml").receiver
    assert dataclasses.asdict(receiver.grpc) == dataclasses.asdict(GrpcReceiverConfig())
    assert dataclasses.asdict(receiver.http) == dataclasses.asdict(HttpReceiverConfig())
    assert (receiver.http.max_connections, receiver.http.read_timeout_seconds) == (32, 30.0)


def test_connection_lifetimes_can_be_turned_off():
    grpc = parse_config({"receiver": {"grpc": {"max_connection_idle_seconds": None,
                                               "max_connection_age_seconds": None}}}).receiver.grpc
    assert grpc.max_connection_idle_seconds is None and grpc.max_connection_age_seconds is None


@pytest.mark.parametrize(("doc", "expected"), [
    ({"http": {"max_connections": 0}}, "receiver.http.max_connections: Input should be greater than or equal to 1"),
    ({"http": {"read_timeout_seconds": 0}}, "receiver.http.read_timeout_seconds: Input should be greater than 0"),
    ({"http": {"idle_timeout": 5}}, "receiver.http.idle_timeout: unknown key"),
    ({"grpc": {"max_queued_requests": -1}},
     "receiver.grpc.max_queued_requests: Input should be greater than or equal to 0"),
    ({"grpc": {"max_connection_age_seconds": 0}},
     "receiver.grpc.max_connection_age_seconds: Input should be greater than 0"),
])
def test_bad_limits_are_named(doc, expected):
    with pytest.raises(ConfigError) as err:
        parse_config({"receiver": doc})
    assert err.value.problems == [expected]


def test_refusals_are_exposed_on_metrics():
    metrics = SelfMetrics()
    metrics.receiver_connections_refused.labels("http", "read_timeout").inc(2)
    metrics.receiver_connections_refused.labels("grpc", "concurrent_requests").inc()
    text = generate_latest(cost_registry(CostStore(), metrics, "c")).decode()
    assert 'otelgpu_receiver_connections_refused_total{reason="read_timeout",transport="http"} 2.0' in text
    assert 'otelgpu_receiver_connections_refused_total{reason="concurrent_requests",transport="grpc"} 1.0' in text
