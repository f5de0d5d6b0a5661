"""Resident memory of `otelgpu serve` once ready, per configuration: what a pod costs before its
first scrape, and what of it each configuration loads.

Each configuration starts `otelgpu serve` in its own process (the shipped otelgpu.yaml of k8s/node
and k8s/gateway as bench_footprint.py runs them: free ports, facts from kube-state-metrics, the
checkpoint in a temporary directory; k8s/node with compiled kernels; examples/otelgpu.yaml), waits
for /readyz and reads /proc: VmRSS, what of it is anonymous and what is mapped from files, the
kernels as its log names them, and whether LLVM (numba's compiler) is mapped. numba's cache is the
one this user already has (run twice, or `otelgpu warm-up`, for the cached figure).

Usage: python benchmarks/bench_ready.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_footprint as bf  # noqa: E402
import bench_scale as bs  # noqa: E402


def configurations(tmp: Path, sink_port: int) -> dict[str, tuple[Path, int]]:
    """name: (otelgpu.yaml, its /metrics port)."""
    out = {}
    for name, mode, kernels in (("k8s/node (kernels: interpreted)", "node", None),
                                ("k8s/node, kernels: compiled", "node", "compiled"),
                                ("k8s/gateway (kernels: compiled)", "gateway", None)):
        metrics_port = bf.free_port()
        directory = Path(tempfile.mkdtemp(dir=tmp))
        out[name] = (bf.sidecar_config(mode, directory, bf.free_port(), sink_port, metrics_port, kernels), metrics_port)
    example = yaml.safe_load((bf.ROOT / "examples" / "otelgpu.yaml").read_text())
    metrics_port = bf.free_port()
    example["receiver"]["grpc"]["endpoint"] = f"127.0.0.1:{bf.free_port()}"
    example["receiver"]["http"]["endpoint"] = f"127.0.0.1:{bf.free_port()}"
    example["exporter"]["prometheus"]["endpoint"] = f"127.0.0.1:{metrics_port}"
    path = tmp / "example.yaml"
    path.write_text(yaml.safe_dump(example))
    out["examples/otelgpu.yaml"] = (path, metrics_port)
    return out


def ready(config: Path, metrics_port: int, env: dict[str, str]) -> dict:
    child, ready_s = bs.start(config, env, metrics_port)
    try:
        status = bf.proc_status(child.pid)
        maps = Path(f"/proc/{child.pid}/maps").read_text()
    finally:
        bs.stop(child)
    kernels = next((line.split("kernels ready: ", 1)[1] for line in child.stderr.read().splitlines()
                    if "kernels ready: " in line), "?")
    return {"ready_s": ready_s, "rss": status["VmRSS"] / 1024, "anon": status["RssAnon"] / 1024,
            "llvm": "libllvmlite" in maps, "kernels": kernels}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3, help="starts per configuration (the median is printed)")
    args = ap.parse_args()
    env = {**os.environ, "CLUSTER_NAME": "bench", "NODE_NAME": bf.fleet(1, 0)[0][0].name,
           "MALLOC_ARENA_MAX": "2"}  # as the image sets it (Dockerfile)
    sink = bs.Receiver()
    with tempfile.TemporaryDirectory() as name:
        print("configuration | ready after | RSS ready | anonymous | from files | LLVM mapped | kernels")
        for label, (config, metrics_port) in configurations(Path(name), sink.port).items():
            runs = [ready(config, metrics_port, env) for _ in range(args.runs)]
            rss, anon = statistics.median(r["rss"] for r in runs), statistics.median(r["anon"] for r in runs)
            print(f"{label} | {statistics.median(r['ready_s'] for r in runs):.1f} s | {rss:.0f} MiB | {anon:.0f} MiB | "
                  f"{rss - anon:.0f} MiB | {'yes' if runs[-1]['llvm'] else 'no'} | {runs[-1]['kernels']}")
    sink.server.stop(0)


if __name__ == "__main__":
    main()
