"""The worst day with the real Collector in the loop (tests/chain.py): while the cluster's pods
start, end and a scrape fails, otelgpu is killed with `kill -9`; while it is away the Collector's
`otlp_grpc/otelgpu` exporter queues the scrapes (a pod's end among them) and the Collector itself
is restarted (its start times reset, every target rescraped), its sending queue on disk
(`file_storage/otelgpu-queue`); otelgpu comes back from its checkpoint and takes the backlog;
Prometheus goes down behind the Collector's remote-write exporter and comes back. The money
PromQL reads back equals the figures of an undisturbed run, worked out from what the cluster
served, and otelgpu's peak memory stays within its pod's limit (k8s/gateway/deployment.yaml)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml
from chain import Chain
from support import eventually

if TYPE_CHECKING:
    from promserver import PrometheusServer

pytest_plugins = ["promserver", "chain"]  # the `prometheus` and `cluster` fixtures
pytestmark = pytest.mark.slow(seconds=140)  # real time: the cluster's timeline, 30 s of lateness
REPO = Path(__file__).resolve().parents[1]


def memory_limit_bytes(manifest: Path, container: str) -> int:
    """The container's memory limit in a Deployment or DaemonSet manifest (Mi or Gi); the Collector
    is a native sidecar (an init container that keeps running)."""
    doc = yaml.safe_load(manifest.read_text())
    spec = doc["spec"]["template"]["spec"]
    limit = next(c for c in spec.get("initContainers", []) + spec["containers"]
                 if c["name"] == container)["resources"]["limits"]["memory"]
    return int(limit[:-2]) * {"Mi": 2**20, "Gi": 2**30}[limit[-2:]]


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM), as the kernel counts it against a cgroup's limit."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def test_kill_9_collector_restart_and_backend_outage_lose_no_money(tmp_path, cluster,
                                                                    prometheus: PrometheusServer) -> None:
    # otelgpu waits for late data as shipped (30 s; the other chain tests 8 s). The restarted
    # Collector puts the batch it was retrying, up to 10 s older than otelgpu's kill, behind the
    # rest of its queue: it comes after what was scraped up to the restart, 9 s after the kill, and
    # the lateness must cover that (collector-config/gateway.yaml).
    chain = Chain(tmp_path, cluster, prometheus, lateness_s=30)
    peaks: list[int] = []
    queued_at_restart: list[float] = []

    def kill_otelgpu() -> None:
        peaks.append(peak_rss_bytes(chain.otelgpu.proc.pid))
        chain.otelgpu.kill()

    def restart_collector() -> None:
        # otelgpu is away and the queue holds what was scraped since, the pod's end among it: the
        # queue is on disk, and the restarted Collector sends it on.
        queued_at_restart.append(chain.collector.total("otelcol_exporter_queue_size", exporter="otlp_grpc/otelgpu"))
        assert chain.collector.stop() == 0, chain.collector.tail()
        chain.collector.start()

    disturbances = [  # the pod ends at 31 s and is Succeeded at 34 s while otelgpu is away
        (27, "kill -9 otelgpu", kill_otelgpu),
        (36, "the Collector restarted, its queue holding the pod's end", restart_collector),
        (42, "otelgpu restarted from its checkpoint", lambda: chain.otelgpu.start()),
        (55, "Prometheus down for longer than the remote-write exporter's default timeout", prometheus.stop),
        (73, "Prometheus back", lambda: prometheus.start(prometheus.port)),
    ]
    try:
        chain.start()
        start_s, cut_s = chain.run(disturbances, after_s=84)
        chain.check_money(start_s, cut_s)
        chain.check_signed()
        # The restarted Collector held the cost through the outage and dropped nothing.
        failed = {n: v for (n, ls), v in chain.collector.telemetry().items()
                  if v and any(w in n for w in ("refused", "failed", "dropped"))}
        assert not failed, failed
        assert "Dropping data" not in chain.collector.tail(10**7).split("Starting otelcol-otelgpu")[-1]
        # Nothing came late: the batch the restart put behind the rest of the queue came within the lateness.
        assert chain.otelgpu.metric("otelgpu_points_late_total") == 0
        # The stopped Collector left a backlog in its queue, and the restarted one took it up and sent it.
        loaded = chain.collector.queue_loaded()
        assert queued_at_restart[0] > 0 and loaded and loaded["itemsSize"] > 0, (queued_at_restart, loaded)
        assert chain.collector.total("otelcol_exporter_sent_metric_points_total",
                                     exporter="otlp_grpc/otelgpu") >= loaded["itemsSize"]
        retried = eventually(lambda: chain.otelgpu.metric("otelgpu_receiver_accepted_metric_points_total"), 10)
        assert retried >= loaded["itemsSize"]
        peaks.append(peak_rss_bytes(chain.otelgpu.proc.pid))
        limit = memory_limit_bytes(REPO / "k8s" / "gateway" / "deployment.yaml", "otelgpu")
        assert max(peaks) < limit, (peaks, limit)
        (tmp_path / "peak-rss.txt").write_text(f"{peaks} limit {limit}\n")
    finally:
        chain.close()
