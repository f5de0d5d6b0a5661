"""Helpers shared by the receiver tests: where the fixtures live and how to spoil or grow a request."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from otelgpu.errors import RetryableError
from otelgpu.receiver.ingest import Ingest, Taken

REPO_ROOT = Path(__file__).resolve().parents[2]
DCGM1 = "otlp_dcgm_scrape1_collector_v0.142.json"
KSM = "otlp_ksm_scrape_collector_v0.142.json"
VLLM = "otlp_vllm_scrape_text004_collector_v0.142.json"


def otel_fixtures_dir() -> Path:
    """The shared OTLP fixtures (see tests/support.py for where they are looked for)."""
    from support import fixtures_dir

    return fixtures_dir() / "otel"


class Exploding:
    """A consumer with a bug: every request raises something outside the error taxonomy."""

    def __init__(self) -> None:
        self.calls = 0

    def consume(self, request: ExportMetricsServiceRequest) -> Taken:
        self.calls += 1
        raise KeyError("bug")


def spoil_dcgm(request: ExportMetricsServiceRequest) -> None:
    """Drop the UUID label of one DCGM point and push one GR_ENGINE_ACTIVE ratio to 87.0."""
    metrics = [m for rm in request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
    fb_used = next(m for m in metrics if m.name == "DCGM_FI_DEV_FB_USED")
    point = fb_used.gauge.data_points[0]
    keep = [kv for kv in point.attributes if kv.key != "UUID"]
    assert len(keep) < len(point.attributes)
    del point.attributes[:]
    point.attributes.extend(keep)
    active = next(m for m in metrics if m.name == "DCGM_FI_PROF_GR_ENGINE_ACTIVE")
    active.gauge.data_points[0].as_double = 87.0


def padded(request: ExportMetricsServiceRequest, size: int) -> ExportMetricsServiceRequest:
    """`request` grown to about `size` bytes by a metric otelgpu ignores."""
    out = ExportMetricsServiceRequest()
    out.CopyFrom(request)
    pad = out.resource_metrics[0].scope_metrics[0].metrics.add(name="padding")
    pad.description = "x" * (size - out.ByteSize())
    pad.gauge.data_points.add(time_unix_nano=1, as_double=1.0)
    return out


def drain_points(ingest: Ingest) -> int:
    total = 0
    while (batch := ingest.get(timeout=0)) is not None:
        total += len(batch)
    return total


@contextmanager
def refusals_counted() -> Iterator[Callable[[], int]]:
    """With the cyclic collector off, as the pipeline keeps it while it closes an interval (when
    receivers refuse most): a count of the refusals (RetryableError) alive beyond those alive at
    the start, to wait until none is. A refusal held in a reference cycle lives, with the request
    its frames hold, until the collector runs again."""

    def count() -> int:
        return sum(isinstance(o, RetryableError) for o in gc.get_objects())

    gc.collect()
    gc.disable()
    try:
        before = count()
        yield lambda: count() - before
    finally:
        gc.enable()
