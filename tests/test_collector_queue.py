"""The Collector's sending queue on disk (collector-config/: `file_storage/otelgpu-queue`): the
pinned Collector runs the shipped gateway config while otelgpu is away, queues its scrapes, is
killed with `kill -9` and started again, and once otelgpu's receiver is up every point the queue
held arrives, once. A sink stands in for otelgpu's receiver, so the test counts each point that
arrives (tests/test_collector_worst_day.py runs the real otelgpu through a Collector restart).

What the batch processor held at the kill is lost: it sits in front of the queue, in memory (at
most its 5 s timeout of scrapes); a SIGTERM flushes it into the queue instead."""

from __future__ import annotations

import time

import otelcol
import pytest
from chain import ENV, GATES
from sidecar import free_port
from support import CollectorSink, eventually

pytest_plugins = ["chain"]  # the `cluster` fixture
pytestmark = pytest.mark.slow(seconds=25)  # real time: batches queued a batch timeout (5 s) apart
EXPORTER = "otlp_grpc/otelgpu"


def points_stamped_before(sink: CollectorSink, ns: int) -> int:
    """The data points the sink took that are stamped before `ns` (scraped or served then)."""
    count = 0
    with sink._lock:
        for req in sink.requests:
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        points = getattr(m, m.WhichOneof("data")).data_points
                        count += sum(p.time_unix_nano < ns for p in points)
    return count


def test_a_collector_killed_while_otelgpu_is_away_delivers_its_queue_after_the_restart(tmp_path, cluster) -> None:
    otelgpu_port, telemetry_port = free_port(), free_port()
    config = otelcol.shipped_config("gateway", tmp_path, cluster.api.url, f"127.0.0.1:{otelgpu_port}",
                                    f"127.0.0.1:{free_port()}", free_port(),
                                    f"http://127.0.0.1:{free_port()}/api/v1/write", telemetry_port)
    collector = otelcol.Collector(tmp_path, config, ENV, GATES, telemetry_port=telemetry_port)
    sink = None
    try:
        collector.start()
        # otelgpu is away: the exporter retries its oldest batch, and every batch after it waits in
        # the queue. Each adds its bytes to the queue's size: three sizes seen, three batches queued.
        sizes: set[float] = set()

        def batches_queued() -> bool:
            sizes.add(collector.total("otelcol_exporter_queue_size", exporter=EXPORTER))
            return len(sizes - {0.0}) >= 3

        eventually(batches_queued, 90, message=lambda: f"queue sizes {sorted(sizes)}\n{collector.tail(3000)}")
        killed_ns = time.time_ns()
        collector.kill()
        collector.start()
        loaded = collector.queue_loaded()
        assert loaded and loaded["itemsSize"] > 0, collector.tail(3000)
        assert loaded["writeIndex"] - loaded["readIndex"] + loaded["dispatchedItems"] >= 3, loaded
        # Nothing leaves while otelgpu is away: the restarted Collector holds at least what it loaded.
        assert collector.total("otelcol_exporter_queue_size", exporter=EXPORTER) >= loaded["bytesSize"]

        sink = CollectorSink(otelgpu_port)  # otelgpu's receiver is up
        # Everything stamped before the kill that arrives came from the queue (the restarted
        # Collector scrapes afresh): every point of it, each once.
        eventually(lambda: points_stamped_before(sink, killed_ns) >= loaded["itemsSize"], 60,
                   message=lambda: f"{points_stamped_before(sink, killed_ns)} of {loaded}\n{collector.tail(3000)}")
        eventually(lambda: collector.total("otelcol_exporter_queue_size", exporter=EXPORTER) == 0, 30)
        assert points_stamped_before(sink, killed_ns) == loaded["itemsSize"]
        lost = {n: v for (n, ls), v in collector.telemetry().items()
                if v and ("exporter", EXPORTER) in ls and any(w in n for w in ("failed", "dropped", "refused"))}
        assert not lost, lost
    finally:
        collector.close()
        if sink is not None:
            sink.stop()
