"""kill -9 in the middle of a send: a child process stages snapshots in a persisted export queue,
releases some and is killed while a request is held by the receiver; a new Delivery on the same
directory recovers what was released and delivers it, to a real OTLP/gRPC server and, through
remote write, to a real Prometheus, which refuses any resent sample older than what it stored."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import grpc
import pytest
from otlpsink import MetricsSink, as_sent, received_rows, serve_sink
from rwproxy import FORWARD, HOLD, RemoteWriteProxy
from support import REPO, eventually

from otelgpu.exporter.config import DeliveryConfig, OtlpExporterConfig, RemoteWriteConfig
from otelgpu.exporter.delivery import Delivery
from otelgpu.exporter.otlp import OtlpSender
from otelgpu.exporter.remote_write import RemoteWriteSender
from otelgpu.exporter.store import CostStore, Point, cost_metrics
from otelgpu.telemetry import SelfMetrics, by_label

if TYPE_CHECKING:
    from promserver import PrometheusServer

pytest_plugins = ["promserver"]

MS = 1_000_000
MIN_MS = 60_000
GONE = (("namespace", "ml"), ("pod", "short-job"))

# The child: builds the sender named in the spec, stages every snapshot, releases through
# spec["release"], says so, and waits to be killed.
CHILD = r"""
import json, signal, sys
from otelgpu.exporter.config import DeliveryConfig, OtlpExporterConfig, RemoteWriteConfig
from otelgpu.exporter.delivery import Delivery
from otelgpu.exporter.otlp import OtlpSender
from otelgpu.exporter.store import Point, cost_metrics
from otelgpu.telemetry import SelfMetrics

spec = json.load(open(sys.argv[1]))
metrics = SelfMetrics()
if spec["kind"] == "otlp":
    from otelgpu.exporter.otlp import OtlpSender
    sender = OtlpSender(OtlpExporterConfig(endpoint=spec["target"]), cost_metrics(), metrics, "c1")
else:
    from otelgpu.exporter.remote_write import RemoteWriteSender
    config = RemoteWriteConfig(url=spec["target"], max_samples_per_request=2)
    sender = RemoteWriteSender(config, cost_metrics(), "c1", metrics)
delivery = Delivery(sender, DeliveryConfig(backoff_initial_seconds=0.05, backoff_max_seconds=0.2), metrics,
                    directory=spec["directory"], interval_s=60)
for end_ns, points in spec["snapshots"]:
    delivery.stage([Point(m, tuple(map(tuple, a)), s, t, v, e) for m, a, s, t, v, e in points], end_ns)
delivery.release(spec["release"])
print("released", flush=True)
signal.pause()  # until the test kills this process
"""


def _run_child(tmp_path: Path, kind: str, target: str, snapshots: list[tuple[int, list[Point]]],
               release: int) -> subprocess.Popen[str]:
    spec = {"kind": kind, "target": target, "directory": str(tmp_path / "queue"), "release": release,
            "snapshots": [[end, [[p.metric, p.attrs, p.start_ns, p.time_ns, p.value, p.ended] for p in points]]
                          for end, points in snapshots]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "spec.json")], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "released"
    return child


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for child in started:  # a failed test must not leave one behind
        if child.poll() is None:
            child.kill()
        child.wait(10)


def _kill(child: subprocess.Popen[str]) -> None:
    child.kill()  # SIGKILL: no handler, no close(), no flush
    assert child.wait(10) == -9


def _config() -> DeliveryConfig:
    return DeliveryConfig(backoff_initial_seconds=0.05, backoff_max_seconds=0.2)


# -- OTLP ----------------------------------------------------------------------------------------

@dataclass
class HoldingSink(MetricsSink):
    """Holds the calls that arrive before `gate` is set, then fails them (nothing stored)."""

    gate: threading.Event = field(default_factory=threading.Event)
    held: int = 0

    def export(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        if not self.gate.is_set():
            with self._lock:
                self.held += 1
            self.gate.wait(60)
            context.abort(grpc.StatusCode.UNAVAILABLE, "held until the sender was gone")
        return super().export(raw, context)


def test_otlp_kill_9_mid_send_delivers_the_released_snapshots_after_restart(tmp_path, children) -> None:
    store = CostStore()
    T0, MIN = 1_700_000_000 * 10**9, 60 * 10**9
    pod = (("namespace", "ml"), ("pod", "train-0"))
    snapshots = [(T0, store.record(T0 - MIN, T0, sums={"allocated": {pod: 1.0, GONE: 2.0}},
                                   gauges={"activity": {GONE: 0.5}}))]
    for i in range(1, 4):  # short-job ends while the Collector holds the first send
        snapshots.append((T0 + i * MIN, store.record(T0 + (i - 1) * MIN, T0 + i * MIN,
                                                     sums={"allocated": {pod: 1.0}}, gauges={})))
    assert [p.attrs for p in snapshots[2][1] if p.ended and p.metric == "allocated"] == [GONE]
    sink = HoldingSink()
    with serve_sink(sink):
        child = _run_child(tmp_path, "otlp", sink.endpoint, snapshots, release=snapshots[2][0])
        children.append(child)
        eventually(lambda: sink.held == 1, timeout=30)  # the first snapshot is in flight
        _kill(child)
        sink.gate.set()

        metrics = SelfMetrics()
        delivery = Delivery(_otlp_sender(sink.endpoint, store, metrics), _config(), metrics,
                            directory=tmp_path / "queue", interval_s=60)
        assert delivery.recover(snapshots[2][0]) == 3  # the fourth was never committed: deleted
        assert delivery.wait_idle(20)
        assert delivery.close() == 0
    assert received_rows(sink, store.specs) == [as_sent(points, store.specs) for _, points in snapshots[:3]]
    assert ("allocated", GONE, T0 - MIN, T0 + 2 * MIN, None) in received_rows(sink, store.specs)[2]
    assert [p.name for p in (tmp_path / "queue").iterdir()] == ["attrs.log"]


def _otlp_sender(endpoint: str, store: CostStore, metrics: SelfMetrics) -> OtlpSender:
    return OtlpSender(OtlpExporterConfig(endpoint=endpoint), store.specs, metrics, "c1")


# -- remote write into Prometheus ----------------------------------------------------------------

def test_remote_write_resumes_after_the_accepted_requests_of_a_killed_process(tmp_path, children,
                                                                               prometheus: PrometheusServer) -> None:
    end = prometheus.now_ms()
    a, b = (("k8s.pod.name", "a"),), (("k8s.pod.name", "b"),)
    times = [end - k * MIN_MS for k in (5, 4, 3, 2)]
    # A snapshot with several samples per series (as a merged one has), sent in requests of two,
    # in label order: [b's activity stale marker, a t1], [a t2, a t3], [a t4, b]. Two are accepted,
    # the third is held when the process is killed: resending the first would be refused as out
    # of order (a t1 is older than the a t3 stored).
    first = [Point("allocated", a, times[0] * MS, t * MS, float(i)) for i, t in enumerate(times)]
    first += [Point("allocated", b, times[0] * MS, times[-1] * MS, 9.0),
              Point("activity", b, times[-1] * MS, times[-1] * MS, math.nan, ended=True)]
    second = [Point("allocated", a, times[0] * MS, (end - MIN_MS) * MS, 4.0),
              Point("allocated", b, times[0] * MS, (end - MIN_MS) * MS, 10.0)]
    staged_only = [Point("allocated", a, times[0] * MS, end * MS, 5.0)]
    snapshots = [(times[-1] * MS, first), ((end - MIN_MS) * MS, second), (end * MS, staged_only)]

    proxy = RemoteWriteProxy(prometheus.write_url, lambda n: FORWARD if n <= 2 else HOLD)
    try:
        child = _run_child(tmp_path, "remote_write", proxy.url, snapshots, release=(end - MIN_MS) * MS)
        children.append(child)
        eventually(lambda: proxy.held == 1, timeout=30)  # two requests accepted, the third in flight
        _kill(child)
    finally:
        proxy.stop()
    queue = tmp_path / "queue"
    assert (queue / f"{times[-1] * MS:020d}.progress").exists()

    metrics = SelfMetrics()
    config = RemoteWriteConfig(url=prometheus.write_url, max_samples_per_request=2)
    delivery = Delivery(RemoteWriteSender(config, cost_metrics(), "c1", metrics), _config(), metrics, directory=queue,
                        interval_s=60)
    assert delivery.recover((end - MIN_MS) * MS) == 2
    assert delivery.wait_idle(20) and delivery.close() == 0
    assert by_label(metrics.exports)["remote_write"] == 2 and not by_label(metrics.export_failures)  # no out-of-order 400
    assert [p.name for p in queue.iterdir()] == ["attrs.log"]

    ((_, samples),) = prometheus.query_range('gpu_cost_allocated_total{k8s_pod_name="a"}',
                                             times[0] / 1000, (end - MIN_MS) / 1000, 60)
    assert samples == [(t / 1000, float(i)) for i, t in enumerate(times + [end - MIN_MS])]
    assert prometheus.query('gpu_cost_allocated_total{k8s_pod_name="b"}', (end - MIN_MS) / 1000)[0][1] == 10.0
    # The uncommitted third snapshot was deleted, not sent.
    assert prometheus.query('gpu_cost_allocated_total{k8s_pod_name="a"}', end / 1000)[0][1] == 4.0
