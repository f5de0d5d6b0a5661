"""What GPU sharing costs the interval join: the same cluster (N nodes of 8 A100, dcgm-exporter
without pod mapping) with each GPU held whole by one pod, or shared out by HAMi among `--grants`
pods (annotations, docs/cost-model.md section 11), or by a DRA claim reserved for that many pods.
Prints the join's seconds per interval for each, their ratio to the whole-GPU cluster, and that
each adds up (allocated + idle = capacity).

    python benchmarks/bench_sharing.py [--nodes 1250] [--grants 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from cluster import Cluster, Node, Pod, Unit  # noqa: E402
from support import feed, make_config  # noqa: E402

from otelgpu.enrich.join import Joiner  # noqa: E402
from otelgpu.enrich.model import ClaimFacts, DraDevice, SliceFacts
from otelgpu.pipeline import Pipeline  # noqa: E402

A100 = "NVIDIA A100-SXM4-40GB"
HAMI = "hami.io/vgpu-devices-allocated"
DRIVER = "gpu.nvidia.com"
INTERVALS = 3


def cluster(nodes: int, grants: int, how: str) -> Cluster:
    out_nodes, pods = [], []
    for n in range(nodes):
        name = f"n{n}"
        out_nodes.append(Node(name, "p4d.24xlarge", 96, 1152,
                              labels={"nvidia.com/gpu.count": "8", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"},
                              units=[Unit(f"GPU-{n}-{g}", A100, busy=0.5, memory_mib=40960) for g in range(8)],
                              capacity={"nvidia_com_gpu": 80 if how == "hami" else 8}))
        for g in range(8):
            if how == "whole":
                pods.append(Pod(f"ns{n % 40}", f"p-{n}-{g}", name, gpu=("nvidia_com_gpu", 1)))
                continue
            for k in range(grants):
                ann = {HAMI: f"GPU-{n}-{g},NVIDIA,8192,{100 // grants}:"} if how == "hami" else {}
                pods.append(Pod(f"ns{n % 40}", f"p-{n}-{g}-{k}", name, gpu=("nvidia_com_gpu", 1) if how == "hami" else None,
                                annotations=ann))
    return Cluster(out_nodes, pods)


def dra_facts(nodes: int, grants: int) -> tuple[dict, dict]:
    claims, slices = {}, {}
    for n in range(nodes):
        slices[f"n{n}-gpus"] = SliceFacts(f"n{n}", {(DRIVER, f"n{n}", f"gpu-{g}"): DraDevice(f"GPU-{n}-{g}")
                                                   for g in range(8)})
        for g in range(8):
            claims[(f"ns{n % 40}", f"claim-{n}-{g}")] = ClaimFacts(((DRIVER, f"n{n}", f"gpu-{g}"),),
                                                                   tuple(f"p-{n}-{g}-{k}" for k in range(grants)))
    return claims, slices


def run(c: Cluster, dra: tuple[dict, dict] | None) -> tuple[float, float]:
    """(join seconds per interval, |allocated + idle - capacity|)."""
    p = Pipeline(make_config(attribution__interval_seconds=60, attribution__lateness_seconds=0,
                             attribution__prices__gpu_hour_by_gpu_model={A100: 12.0}), serve_receivers=False)
    if dra is not None:  # the DRA objects as the Kubernetes API source would give them
        view = p.joiner.source.view
        p.joiner.source.view = lambda as_of=None: dataclasses.replace(view(as_of), claims=dra[0], slices=dra[1])
    spent = [0.0]
    join = Joiner.join

    def timed(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        began = time.perf_counter()
        try:
            return join(self, *a, **k)
        finally:
            spent[0] += time.perf_counter() - began

    Joiner.join = timed
    try:
        feed(p, *c.scrapes(60, 60 * INTERVALS))
        p.close_due(flush=True)
    finally:
        Joiner.join = join
    m = {"cost_model": "request"}
    gap = abs(sum(p.store.totals("allocated", (), m).values()) + sum(p.store.totals("idle", (), m).values())
              - sum(p.store.totals("capacity", (), m).values()))
    p.shutdown()
    return spent[0] / INTERVALS, gap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1250)
    ap.add_argument("--grants", type=int, default=4, help="pods sharing each GPU")
    args = ap.parse_args()
    print(f"{args.nodes} nodes x 8 A100 = {8 * args.nodes:,} GPUs; shared GPUs: {args.grants} pods each; "
          f"{INTERVALS} intervals of 60 s")
    base = None
    for how in ("whole", "hami", "dra"):
        c = cluster(args.nodes, args.grants, "whole" if how == "whole" else how)
        seconds, gap = run(c, dra_facts(args.nodes, args.grants) if how == "dra" else None)
        base = base or seconds
        print(f"{how:6s} {len(c.pods):>8,} pods  join {seconds:6.3f} s an interval  x{seconds / base:4.2f}  "
              f"|allocated + idle - capacity| {gap:.2e}")


if __name__ == "__main__":
    main()
