"""A real in-process OTLP/gRPC MetricsService sink, and a small cost store to export."""

from __future__ import annotations

import gzip
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Iterator

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from otelgpu.exporter.store import CostStore

SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"


@dataclass
class Received:
    request: ExportMetricsServiceRequest
    gzipped: bool
    metadata: dict[str, str]


@dataclass
class MetricsSink:
    """Stores every ExportMetricsServiceRequest. Per-message decompression is switched off on the
    server, so the handler sees the bytes as sent and can tell whether the client used gzip."""

    endpoint: str = ""
    received: list[Received] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def export(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        gzipped = raw[:2] == b"\x1f\x8b"  # a protobuf request cannot start with 0x1f (wire type 7)
        request = ExportMetricsServiceRequest.FromString(gzip.decompress(raw) if gzipped else raw)
        with self._lock:
            self.received.append(Received(request, gzipped, dict(context.invocation_metadata())))
        return b""  # an empty ExportMetricsServiceResponse: full success


@pytest.fixture
def otlp_sink() -> Iterator[MetricsSink]:
    sink = MetricsSink()
    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Export": grpc.unary_unary_rpc_method_handler(sink.export)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[handler],
                         options=[("grpc.per_message_decompression", 0)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    sink.endpoint = f"127.0.0.1:{port}"
    yield sink
    server.stop(grace=None)


MIN = 60 * 10**9
T0 = 1_700_000_000 * 10**9
TEAM_A = (("namespace", "ml"), ("pod", "train-0"), ("team", "a"))
TEAM_A_COST = (("cost_model", "request"), *TEAM_A)
IDLE = (("cost_model", "request"), ("gpu_model", "H100"), ("node", "n1"))


class Intervals:
    """Feeds one-minute intervals into a store the way the attribution stage does."""

    T0, MIN = T0, MIN

    def __init__(self, store: CostStore) -> None:
        self.store = store

    def record(self, i: int, cost: float = 1.5) -> None:
        """Interval i: allocated/held for team a, idle on node n1, an activity gauge."""
        self.store.record(T0 + i * MIN, T0 + (i + 1) * MIN,
                          sums={"allocated": {TEAM_A_COST: cost}, "held": {TEAM_A: 60.0}, "idle": {IDLE: 0.25}},
                          gauges={"activity": {TEAM_A: 0.5 + 0.1 * i}})


@pytest.fixture
def store() -> CostStore:
    return CostStore()


@pytest.fixture
def intervals(store: CostStore) -> Intervals:
    # Fixtures rather than `from conftest import ...`: that import breaks under
    # --import-mode=importlib and when another test directory has a conftest of its own.
    return Intervals(store)
