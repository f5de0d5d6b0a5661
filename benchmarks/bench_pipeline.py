"""Measure decode, join and kernel speed on a synthetic cluster of demo-shaped nodes, and each
attribution kernel's efficiency: the time of a plain read of its input arrays (one pass summing
every element, compiled the same way) as a share of the kernel's time on them.

Usage: python benchmarks/bench_pipeline.py [--nodes 50] [--scrapes 20] [--rows 1000000]
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np

from numba import njit

from otelgpu.attribution.engine import (UnitRows, attribute_request, hybrid_kernel, request_kernel, scad,
                                        scad_kernel, share_kernel, warm_up)
from otelgpu.attribution.engine_reference import attribute_request_reference, scad_reference
from otelgpu.demo import scenario, scrapes
from otelgpu.demo.otlp import request
from otelgpu.enrich.window import NS
from otelgpu.pipeline import Pipeline
from otelgpu.receiver.decode import decode_reference
from otelgpu.telemetry import total

COLLECTOR_BUDGET = 10_000 / 0.60  # points per second of a whole core, from the Collector's CI budget


def cluster(n_nodes: int):
    nodes, ns = scenario.build()
    out = []
    for i in range(n_nodes):
        for n in nodes:
            copy = scenario.Node(f"{n.name}-{i}", n.ip, n.labels, n.capacity, list(n.devices), list(n.shared))
            out.append(copy)
    return out, ns


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=50, help="copies of the 3-node demo cluster")
    ap.add_argument("--scrapes", type=int, default=20)
    ap.add_argument("--rows", type=int, default=1_000_000, help="holder rows for the kernel efficiency figures")
    args = ap.parse_args()
    nodes, ns = cluster(args.nodes)
    t0 = 1_779_350_400 * NS
    reqs = [request(scrapes.ksm(nodes, ns, t0 + k * 30 * NS), *(scrapes.dcgm(n, t0 + k * 30 * NS, 0.5) for n in nodes))
            for k in range(args.scrapes)]
    payload = sum(len(r.SerializeToString()) for r in reqs)

    p = Pipeline(_config(), serve_receivers=False)
    warm_up()
    start = time.process_time()
    batches = [decode_reference(r, p.strings, p.ingest.limits) for r in reqs]
    decode_s = time.process_time() - start
    points = sum(len(b) + b.ignored for b in batches)
    start = time.process_time()
    for b in batches:
        p.process(b)
    p.close_due(flush=True)
    join_s = time.process_time() - start

    rejected = sum(b.rejected_count for b in batches)
    print(f"cluster: {len(nodes)} nodes, {args.scrapes} scrapes, {points} points ({rejected} rejected), "
          f"{payload / 2**20:.1f} MiB of OTLP")
    print(f"decode: {points / decode_s:,.0f} points/s of CPU = {points / decode_s / COLLECTOR_BUDGET:.2f}x "
          f"the Collector's budget rate per core")
    print(f"facts + windows + join + kernel + store for {total(p.metrics.intervals_computed)} intervals: {join_s:.3f} s CPU")

    rng = np.random.default_rng(1)
    n_gpu, n_row = 8000, 40000
    rows = UnitRows(rng.uniform(0, 12, n_gpu), rng.integers(0, n_gpu, n_row), np.full(n_row, 1 / 7),
                    rng.uniform(0, 1, n_row), rng.uniform(0, 1, n_row), rng.uniform(0, 1, n_row))
    start = time.perf_counter()
    for _ in range(20):
        attribute_request(rows, 60.0)
    kernel = (time.perf_counter() - start) / 20
    start = time.perf_counter()
    attribute_request_reference(rows, 60.0)
    ref = time.perf_counter() - start
    print(f"kernel: {n_row} rows on {n_gpu} GPUs in {kernel * 1e3:.2f} ms; reference {ref * 1e3:.1f} ms; "
          f"ratio {ref / kernel:.0f}x")
    n_node, n_pod = 200, 2000  # the reference is O(pods x nodes): keep it to a size it finishes
    pod_node = rng.integers(0, n_node, n_pod)
    qty = rng.uniform(0, 8, (n_pod, 2))
    cap, rate = np.full((n_node, 2), (96.0, 1152.0)), np.full((n_node, 2), (0.1, 0.01))
    start = time.perf_counter()
    for _ in range(20):
        scad(pod_node, qty, cap, rate, 60.0)
    scad_s = (time.perf_counter() - start) / 20
    start = time.perf_counter()
    scad_reference(pod_node, qty, cap, rate, 60 / 3600)
    scad_ref = time.perf_counter() - start
    print(f"scad kernel: {n_pod} pods on {n_node} nodes in {scad_s * 1e3:.3f} ms; reference {scad_ref * 1e3:.0f} ms; "
          f"ratio {scad_ref / scad_s:.0f}x")
    efficiency(args.rows)
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


@njit(cache=True)
def _read(a: np.ndarray) -> float:
    total = 0.0
    for x in a.ravel():
        total += x
    return total


def _best(fn, repeat: int = 7) -> float:  # noqa: ANN001
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def efficiency(n_row: int) -> None:
    """Each kernel on arrays of `n_row` rows against one pass reading the same input arrays."""
    rng = np.random.default_rng(2)
    n_gpu, n_node = max(1, n_row // 10), max(1, n_row // 50)
    price, gpu = rng.uniform(0, 12, n_gpu), rng.integers(0, n_gpu, n_row)
    f, held, measured, activity = (rng.uniform(0, 1, n_row) for _ in range(4))
    outs = [np.zeros(n_row) for _ in range(5)] + [np.zeros(n_gpu), np.zeros(n_gpu)]
    node, weight, amount = rng.integers(0, n_node, n_row), rng.uniform(0, 1, n_row), rng.uniform(0, 5, n_node)
    is_measured = rng.uniform(0, 1, n_row) < 0.8
    qty = rng.uniform(0, 8, (n_row, 2))
    cap, rate = np.full((n_node, 2), (96.0, 1152.0)), np.full((n_node, 2), (0.1, 0.01))
    rows_out, nodes_out = [np.zeros(n_row) for _ in range(2)], np.zeros(n_node)
    pods_out, scad_idle = [np.zeros((n_row, 2)) for _ in range(2)], np.zeros((n_node, 2))
    cases = {  # outputs allocated once, as `outs`: the kernel's own time, not the allocator's
        "request": (lambda: request_kernel(price, 60.0, gpu, f, held, measured, activity, *outs),
                    (price, gpu, f, held, measured, activity)),
        "share": (lambda: share_kernel(node, weight, amount, rows_out[0], nodes_out), (node, weight, amount)),
        "hybrid": (lambda: hybrid_kernel(node, n_node, weight, f, is_measured, 0.5, rows_out[1]),
                   (node, weight, f, is_measured)),
        "scad": (lambda: scad_kernel(node, qty, cap, rate, 60 / 3600, *pods_out, scad_idle), (node, qty, cap, rate)),
    }
    print(f"kernel efficiency ({n_row:,} rows; a plain read of the inputs as a share of the kernel's time):")
    for name, (run, inputs) in cases.items():
        kernel_s = _best(run)
        read_s = _best(lambda: [_read(a) for a in inputs])
        print(f"  {name:8s} kernel {kernel_s * 1e3:7.2f} ms, plain read {read_s * 1e3:6.2f} ms: {read_s / kernel_s:4.0%}")


def _config():
    from otelgpu.config import parse_config

    return parse_config({"exporter": {"prometheus": {"enabled": False}},
                         "receiver": {"max_point_age_seconds": 0},  # the scrapes are stamped in the past
                         "attribution": {"interval_seconds": 60, "cost_models": ["request", "scad", "opencost", "hybrid"]}})


if __name__ == "__main__":
    main()
