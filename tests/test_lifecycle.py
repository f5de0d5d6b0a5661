"""One lifecycle for every component that runs (core/lifecycle.py), held to it by one test per
component: a shutdown before any start has nothing to stop and starts nothing; a second start
starts nothing more; `shutdown(deadline)` stops what it ran (its port refuses, its threads end)
and a second shutdown does nothing. Real servers, the real `kubernetes` client against a local API, a
real gRPC channel."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

import pytest
from kubeapi import FakeKubeApi
from prometheus_client import CollectorRegistry
from support import eventually

from otelgpu.core.lifecycle import Component
from otelgpu.enrich.config import KubernetesConfig, TagValuesConfig, default_tags
from otelgpu.enrich.kube.source import KubeSource
from otelgpu.enrich.labels import TagResolver, TagValues
from otelgpu.exporter.config import DeliveryConfig, OtlpExporterConfig, PrometheusConfig
from otelgpu.exporter.delivery import Delivery
from otelgpu.exporter.otlp import OtlpSender
from otelgpu.exporter.prometheus import TelemetryServer
from otelgpu.exporter.store import CostStore
from otelgpu.receiver.config import GrpcReceiverConfig, HttpReceiverConfig
from otelgpu.receiver.grpc_server import GrpcReceiver
from otelgpu.receiver.http_server import HttpReceiver
from otelgpu.receiver.ingest import Ingest
from otelgpu.receiver.interner import Interner
from otelgpu.telemetry import SelfMetrics


@dataclass
class Case:
    make: Callable[[], Component]
    running: Callable[[Component], bool]  # whether what it started still runs


def _listening(port: int | None) -> bool:
    if not port:
        return False
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _ingest() -> Ingest:
    return Ingest(Interner(), 16, 1.0, SelfMetrics())


def _dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _delivery() -> Delivery:
    """A delivery whose thread runs: a snapshot queued for a receiver that is not there."""
    store, metrics = CostStore(), SelfMetrics()
    sender = OtlpSender(OtlpExporterConfig(endpoint=_dead_endpoint(), timeout_seconds=2.0), store.specs, metrics, "c")
    delivery = Delivery(sender, DeliveryConfig(backoff_initial_seconds=60, backoff_max_seconds=60), metrics,
                        interval_s=60)
    return delivery


def _delivery_running(d: Component) -> bool:
    return d._thread.is_alive()  # type: ignore[attr-defined]


def _started_delivery(d: Delivery) -> None:
    store = CostStore()
    d.put(store.record(0, 60 * 10**9, {"allocated": {(("team", "a"),): 1.0}}, {}))


@pytest.fixture(scope="module")
def api():
    with FakeKubeApi(token="secret") as server:
        yield server


def _kube(api: FakeKubeApi) -> KubeSource:
    config = KubernetesConfig(enabled=True, auth="token", api_url=api.url, token="secret", watch_timeout_seconds=30,
                              backoff_initial_seconds=0.05, backoff_max_seconds=0.2)
    return KubeSource(config, TagResolver(default_tags(), TagValues(TagValuesConfig())), SelfMetrics())


def _kube_running(k: Component) -> bool:
    return any(t.is_alive() for t in k._threads)  # type: ignore[attr-defined]


CASES = {
    "grpc receiver": lambda api: Case(lambda: GrpcReceiver(GrpcReceiverConfig(endpoint="127.0.0.1:0"), _ingest(),
                                                           SelfMetrics()), lambda r: _listening(r.port)),
    "http receiver": lambda api: Case(lambda: HttpReceiver(HttpReceiverConfig(endpoint="127.0.0.1:0"), _ingest(),
                                                           SelfMetrics(), 2**20), lambda r: _listening(r.port)),
    "telemetry server": lambda api: Case(lambda: TelemetryServer(PrometheusConfig(endpoint="127.0.0.1:0"),
                                                                 CollectorRegistry(), lambda: True),
                                         lambda t: t._server is not None and _listening(t.port)),
    "kubernetes watches": lambda api: Case(lambda: _kube(api), _kube_running),
    "delivery": lambda api: Case(_delivery, _delivery_running),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_component_starts_once_and_shuts_down_by_its_deadline_once(name: str, api: FakeKubeApi) -> None:
    case = CASES[name](api)

    never = case.make()
    assert isinstance(never, Component)
    before = set(threading.enumerate())
    never.shutdown()  # nothing to stop
    never.shutdown()
    assert not case.running(never) and set(threading.enumerate()) <= before

    component = case.make()
    component.start()
    if isinstance(component, Delivery):
        _started_delivery(component)  # its thread starts with something to send
    eventually(lambda: case.running(component), 10)
    threads = set(threading.enumerate())
    component.start()
    assert set(threading.enumerate()) - threads == set(), "a second start started more"

    component.shutdown(time.monotonic() + 5)
    eventually(lambda: not case.running(component), 10)
    component.shutdown(time.monotonic() + 5)
    assert not case.running(component)
