"""otelgpu inside a real pipeline, on this machine: the pinned OpenTelemetry Collector
(collector-config/distribution, built on first use) runs the shipped gateway config, discovers a
small GPU cluster through a local Kubernetes API and scrapes its exposition (the shared fixtures'
dcgm-exporter, kube-state-metrics, vLLM and kubelet text: a p5.48xlarge with MIG and a time-sliced
g5.2xlarge), sends it to `otelgpu serve`, takes the cost back and remote-writes it into a local
Prometheus. Every address is on loopback.

    make demo-collector                  # runs until Ctrl-C; open the Prometheus URL it prints
    .venv/bin/python tools/demo_collector.py --minutes 3

Only endpoints, credentials, the sending queue's directory and the scrape interval (1 s) differ
from the shipped configs; otelgpu closes 10-second intervals so the money moves while you watch.
Needs Go (to build the Collector, about five minutes the first time) and Prometheus (Debian's
`prometheus`)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from chain import NEW_POD, standalone  # noqa: E402
from promserver import PrometheusServer  # noqa: E402
from scrapecluster import Holder  # noqa: E402

TEAMS = 'sum by (team) (max_over_time(gpu_cost_allocated_total{cluster="e2e", cost_model="request"}[1h]))'
IDLE = 'sum(max_over_time(gpu_cost_idle_total{cluster="e2e", cost_model="request"}[1h]))'


def table(prom: PrometheusServer) -> str:
    rows = sorted(((m.get("team", ""), v) for m, v in prom.query(TEAMS)), key=lambda r: -r[1])
    idle = sum(v for _, v in prom.query(IDLE))
    lines = [f"  {team:<14} {value:>10.6f} USD" for team, value in rows] + [f"  {'(idle)':<14} {idle:>10.6f} USD"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=0, help="stop after this long (default: until Ctrl-C)")
    args = parser.parse_args()
    with standalone("otelgpu-demo-collector-") as chain:
        prom, cluster = chain.prometheus, chain.cluster
        print("starting otelgpu and the Collector (the Collector is built first if it is not yet) ...", flush=True)
        chain.start()
        print(f"Prometheus: {prom.url}/graph  (try: sum by (team, pod) (gpu_cost_allocated_total))\n"
              f"otelgpu /metrics: http://127.0.0.1:{chain.otelgpu.metrics_port}/metrics\n"
              f"logs: {chain.workdir}  (otelgpu.log, otelcol.log)\n", flush=True)
        started, moved = time.monotonic(), False
        try:
            while not args.minutes or time.monotonic() - started < args.minutes * 60:
                time.sleep(10)
                if not moved and time.monotonic() - started > 30:  # a pod starts on a free GPU
                    cluster.pod_started(NEW_POD, {"namespace": "team-b", "uid": "c0ffee00-1111-4222-8333-944455556666",
                                                  "team": "team-b", "job": "finetune-job-2"})
                    cluster.start_gpu_holding("3/", Holder("team-b", NEW_POD, "trainer"))
                    print(f"{NEW_POD} starts on GPU 3 of the p5.48xlarge", flush=True)
                    moved = True
                print(time.strftime("%H:%M:%S") + " allocated by team so far:\n" + table(prom) + "\n", flush=True)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
