"""Memory while pods come and go: does otelgpu forget what is gone?

A cluster of GPU nodes where every pod lives for one interval and is replaced by a new one with a
new name, uid, run label and owner (a batch platform's day, compressed): GPU pods holding every
GPU, CPU pods beside them, kube-state-metrics, dcgm-exporter and cAdvisor series, both cost
models. One pipeline in this process (no sockets: what is measured is the pipeline's state),
fed one scrape per interval. Prints, every tenth of the run, the process's VmRSS, the strings in
the label table, the pods kube-state-metrics facts hold, the live cost series and the tag values
admitted; then the growth of VmRSS from the end of the warm-up to the end, per thousand pods.

Usage: python benchmarks/bench_churn.py [--pods 100000] [--per-interval 500] [--warm-up 20000] [--nodes 4]
       [--no-compaction]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from cluster import T0, Cluster, Node, Pod, Unit  # noqa: E402
from support import make_config  # noqa: E402

import otelgpu.pipeline as pipeline_module  # noqa: E402
from otelgpu.enrich.window import NS  # noqa: E402
from otelgpu.pipeline import Pipeline  # noqa: E402
from otelgpu.telemetry import total

A100 = "NVIDIA A100-SXM4-40GB"
INTERVAL_S = 60


def rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) / 1024


def generation(nodes: list[Node], first: int, count: int, w: int) -> Cluster:
    """`count` new pods (numbered from `first`) for interval `w`: the first 8 per node hold its GPUs."""
    pods = []
    for j in range(count):
        n, serial = j % len(nodes), first + j
        node, g = nodes[n], j // len(nodes)
        gpu = g < len(node.units)
        pods.append(Pod(f"ns-{serial % 40}", f"job-{serial}-{(serial * 7919) % 99991:05d}", node.name,
                        labels={"team": f"team-{serial % 25}", "run": f"run-{serial}"}, cpu=1, memory_gib=2,
                        gpu=("nvidia_com_gpu", 1) if gpu else None, holds=(node.units[g].uuid,) if gpu else (),
                        activity=0.6, cpu_used=0.5, memory_used_gib=1.0, owner=("Job", f"job-{serial}")))
    return Cluster(nodes, pods, t0=T0 + w * INTERVAL_S * NS)


def report(p: Pipeline, pods: int, began: float) -> str:
    gc.collect()
    facts = len(p.facts.pods)
    values = sum(len(v) for v in p.tag_values.state()["uses"].values())
    return (f"pods {pods:8,d}  VmRSS {rss_mib():7.1f} MiB  strings {len(p.strings):7,d}  pod facts {facts:6,d}  "
            f"cost series {p.store.active_series():6,d}  tag values {values:5,d}  {time.monotonic() - began:5.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=100_000, help="distinct pods over the run, warm-up included")
    ap.add_argument("--per-interval", type=int, default=500, help="pods alive in each interval")
    ap.add_argument("--warm-up", type=int, default=20_000, help="pods before the baseline is taken")
    ap.add_argument("--nodes", type=int, default=4, help="GPU nodes, 8 A100 each")
    ap.add_argument("--no-compaction", action="store_true", help="never compact the label string table (to compare)")
    args = ap.parse_args()
    if args.no_compaction:
        pipeline_module.COMPACT_STRINGS_FROM = sys.maxsize
    nodes = [Node(f"gpu-{k}", "p4d.24xlarge", 96, 1152, units=[Unit(f"GPU-{k}-{i}", A100) for i in range(8)],
                  capacity={"nvidia_com_gpu": 8}) for k in range(args.nodes)]
    p = Pipeline(make_config(attribution__interval_seconds=INTERVAL_S, attribution__lateness_seconds=0,
                             attribution__cost_models=["request", "scad"],
                             attribution__prices__gpu_hour_by_gpu_model={A100: 4.0}), serve_receivers=False)
    intervals = args.pods // args.per_interval
    every = max(intervals // 10, 1)
    began, baseline = time.monotonic(), None
    peak = 0.0
    for w in range(intervals):
        p.ingest.consume(generation(nodes, w * args.per_interval, args.per_interval, w).scrape(0))
        p.process(p.ingest.get(timeout=0))
        p.ingest.task_done()
        seen = (w + 1) * args.per_interval
        if baseline is None and seen >= args.warm_up:
            baseline = (seen, rss_mib())
            print(report(p, seen, began), " <- baseline")
        elif w % every == 0 or w == intervals - 1:
            print(report(p, seen, began))
        if baseline is not None:
            peak = max(peak, rss_mib())
    end = rss_mib()
    seen0, rss0 = baseline or (0, end)
    print(f"VmRSS after the warm-up: {end - rss0:+.1f} MiB at the end, {peak - rss0:+.1f} MiB at the most, over "
          f"{args.pods - seen0:,d} more pods ({(end - rss0) * 1024 / max(args.pods - seen0, 1) * 1000:+.1f} KiB "
          f"per thousand pods at the end); interner compactions {total(p.metrics.interner_compactions)}")


if __name__ == "__main__":
    main()
