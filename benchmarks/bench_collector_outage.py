"""Long outages with the real Collector in the loop, on demand (they take as long as they say):
otelgpu `kill -9`ed and away for --otelgpu-outage seconds while the Collector queues its scrapes,
then the backlog replayed at the Collector's full queue speed; then Prometheus (AMP's stand-in)
away for --backend-outage seconds behind the Collector's remote-write exporter. The shipped
gateway configs (collector-config/gateway.yaml, k8s/gateway/otelgpu.yaml; endpoints, credentials,
the sending queue's directory, a 1 s scrape interval and 10 s intervals changed, as in
tests/chain.py) and the fixtures' cluster.

Prints whether PromQL's money equals the figures of an undisturbed run (tests/chain.py's
check_money), the points otelgpu took late, the Collector's drops, and otelgpu's and the
Collector's peak RSS against their pods' limits (k8s/gateway/deployment.yaml).

    .venv/bin/python benchmarks/bench_collector_outage.py                 # ten minutes each: ~25 min
    .venv/bin/python benchmarks/bench_collector_outage.py --otelgpu-outage 60 --backend-outage 60
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from chain import standalone  # noqa: E402
from test_collector_worst_day import memory_limit_bytes, peak_rss_bytes  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--otelgpu-outage", type=float, default=600, help="seconds otelgpu is away (default 600)")
    parser.add_argument("--backend-outage", type=float, default=600, help="seconds Prometheus is away (default 600)")
    args = parser.parse_args()
    x, y = args.otelgpu_outage, args.backend_outage
    with standalone("otelgpu-bench-outage-") as chain:
        prom = chain.prometheus
        peaks = {"otelgpu": [], "otelcol": []}

        def sample() -> None:
            peaks["otelgpu"].append(peak_rss_bytes(chain.otelgpu.proc.pid))
            peaks["otelcol"].append(peak_rss_bytes(chain.collector.proc.pid))

        def kill() -> None:
            sample()
            chain.otelgpu.kill()

        chain.start()
        started = time.monotonic()
        start_s, cut_s = chain.run([
            (27, f"kill -9 otelgpu for {x:g} s", kill),
            (27 + x, "otelgpu back", lambda: chain.otelgpu.start(timeout=300)),
            (40 + x, f"Prometheus away for {y:g} s", lambda: (sample(), prom.stop())),
            (40 + x + y, "Prometheus back", lambda: prom.start(prom.port)),
        ], after_s=60 + x + y)
        sample()
        ok, problem = True, ""
        try:
            chain.check_money(start_s, cut_s)
        except AssertionError as e:
            ok, problem = False, str(e).splitlines()[0]
        telemetry = chain.collector.telemetry()
        dropped = {n: v for (n, _), v in telemetry.items() if v and any(w in n for w in ("failed", "dropped"))}
        late = chain.otelgpu.metric("otelgpu_points_late_total")
        limits = {c: memory_limit_bytes(REPO / "k8s" / "gateway" / "deployment.yaml", c)
                  for c in ("otelgpu", "otel-collector")}
        print(f"otelgpu away {x:g} s, Prometheus away {y:g} s; run {time.monotonic() - started:.0f} s, "
              f"window {cut_s - start_s} s")
        print(f"money equals an undisturbed run's: {'yes' if ok else 'NO: ' + problem}")
        print(f"points late at otelgpu: {late:g}; Collector refusals, failures and drops: "
              f"{dropped or 'none'}")
        print(f"peak RSS otelgpu {max(peaks['otelgpu']) / 2**20:.0f} MiB of {limits['otelgpu'] / 2**20:.0f} MiB; "
              f"Collector {max(peaks['otelcol']) / 2**20:.0f} MiB of {limits['otel-collector'] / 2**20:.0f} MiB")
        return 0 if ok and not late else 1


if __name__ == "__main__":
    sys.exit(main())
