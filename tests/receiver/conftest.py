"""Real receivers on 127.0.0.1:0 feeding the real Ingest, and the shared OTLP fixtures as input."""

from __future__ import annotations

import time
from typing import Callable, Iterator, Optional

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from otelgpu.memory import MemoryLimiter
from otelgpu.receiver.config import GrpcReceiverConfig, HttpReceiverConfig
from otelgpu.receiver.grpc_server import GrpcReceiver
from otelgpu.receiver.http_server import HttpReceiver
from otelgpu.receiver.ingest import Consumer, Ingest
from otelgpu.receiver.interner import Interner
from otelgpu.telemetry import SelfMetrics

from .helpers import otel_fixtures_dir


@pytest.fixture
def otel_json() -> Callable[[str], str]:
    return lambda name: (otel_fixtures_dir() / name).read_text(encoding="utf-8")


@pytest.fixture
def otel_request(otel_json: Callable[[str], str]) -> Callable[[str], ExportMetricsServiceRequest]:
    def load(name: str) -> ExportMetricsServiceRequest:
        return json_format.Parse(otel_json(name), ExportMetricsServiceRequest(), ignore_unknown_fields=True)

    return load


@pytest.fixture
def metrics() -> SelfMetrics:
    return SelfMetrics()


@pytest.fixture
def make_ingest(metrics: SelfMetrics) -> Callable[..., Ingest]:
    def make(queue_size: int = 64, retry_after_s: float = 0.2, memory: Optional[MemoryLimiter] = None) -> Ingest:
        return Ingest(Interner(), queue_size, retry_after_s, metrics, memory=memory)

    return make


@pytest.fixture
def grpc_receiver(metrics: SelfMetrics) -> Iterator[Callable[..., GrpcReceiver]]:
    started: list[GrpcReceiver] = []

    def start(consumer: Consumer, memory: Optional[MemoryLimiter] = None, **config: object) -> GrpcReceiver:
        receiver = GrpcReceiver(GrpcReceiverConfig(endpoint="127.0.0.1:0", **config), consumer, metrics, memory)
        receiver.start()
        started.append(receiver)
        return receiver

    yield start
    for receiver in started:
        receiver.shutdown(time.monotonic())


@pytest.fixture
def http_receiver(metrics: SelfMetrics) -> Iterator[Callable[..., HttpReceiver]]:
    started: list[HttpReceiver] = []

    def start(consumer: Consumer, max_body_bytes: int = 64 * 1024 * 1024, memory: Optional[MemoryLimiter] = None,
              **config: object) -> HttpReceiver:
        receiver = HttpReceiver(HttpReceiverConfig(endpoint="127.0.0.1:0", **config), consumer, metrics, max_body_bytes,
                                memory)
        receiver.start()
        started.append(receiver)
        return receiver

    yield start
    for receiver in started:
        receiver.shutdown()
