"""Hostile OTLP input against a running `otelgpu serve`, mixed into a valid cluster's traffic.

The valid cluster of tests/fuzz_traffic.py reports every 30 s, hour after hour; every mutation
class of tests/fuzzing.py (absurd quantities, non-finite values, empty names, timestamps decades
away, swapped types, huge labels, cardinality bombs, skewed clocks, bit flips, truncations,
garbage) is mixed into each hour three times, before, between and inside the valid requests.
Everything goes over one gRPC channel as raw bytes, as fast as the sidecar answers (UNAVAILABLE
is retried). Prints the answers by kind, the points rejected by reason (top 10), requests per
second, the sidecar's VmRSS and VmHWM at start and end, and whether it is still alive and
answering, then stops it with SIGTERM and reports how it exited.

Usage: python benchmarks/bench_fuzz.py [--requests 3000] [--seed 1]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Iterator

import grpc
import requests
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
# The sidecar (a child process) runs this checkout's otelgpu too, whatever is installed.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])

from fuzz_traffic import PRICES, Send, plan, valid_cluster  # noqa: E402
from fuzzing import STRUCTURED, WIRE  # noqa: E402
from sidecar import Sidecar  # noqa: E402

from otelgpu.enrich.window import NS  # noqa: E402

HOUR = 3600 * NS
EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
CONFIG = {
    "attribution": {"interval_seconds": 300, "lateness_seconds": 60, "cost_models": ["request", "scad"],
                    "prices": {"gpu_hour_by_gpu_model": PRICES}},
    "tag_values": {"max_distinct": 50},
}


def traffic(rng: random.Random, n: int) -> Iterator[Send]:
    """`n` sends: hour after hour of the valid cluster scraped every 30 s, every class mixed into
    each hour three times. The last hour ends before the current one (no valid point is in the
    future), and the first begins as late as it can (up to about 3,000 sends none is a day old)."""
    now = time.time_ns() // HOUR * HOUR
    classes = {**STRUCTURED, **WIRE}
    per_hour = len(plan(random.Random(0), valid_cluster(now).scrapes(30, 3600), classes, 3))
    hours = -(-n // per_hour)
    sent = 0
    for h in range(hours):
        for s in plan(rng, valid_cluster(now - (hours + 1 - h) * HOUR).scrapes(30, 3600), classes, 3):
            yield s
            sent += 1
            if sent == n:
                return


def memory(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        return {k: v.strip() for k, _, v in (line.partition(":") for line in f) if k in ("VmRSS", "VmHWM")}


def rejected_by_reason(url: str) -> Counter[str]:
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(requests.get(url, timeout=10).text):
        for s in family.samples:
            if s.name == "otelgpu_points_rejected_total":
                out[s.labels["reason"]] += int(s.value)
    return out


def send_all(export, wires: list[bytes]) -> Counter[str]:  # noqa: ANN001 - a grpc callable
    answers: Counter[str] = Counter()
    for data in wires:
        while True:
            try:
                response = export(data, timeout=60)
                answers["partial_success" if response.HasField("partial_success") else "ok"] += 1
            except grpc.RpcError as err:
                answers[err.code().name] += 1
                if err.code() == grpc.StatusCode.UNAVAILABLE:  # queue full: the same request again
                    time.sleep(0.05)
                    continue
            break
    return answers


def settle(sidecar: Sidecar, quiet_s: float = 3.0, limit_s: float = 300.0) -> float:
    """Seconds until the counters the sidecar's worker moves (intervals computed, points late,
    points rejected, which include batches it failed on) have stood still for `quiet_s`: its
    queue has drained."""
    names = ("otelgpu_intervals_computed_total", "otelgpu_points_late_total", "otelgpu_points_rejected_total")
    began = time.monotonic()
    last, since = -1.0, time.monotonic()
    while time.monotonic() - began < limit_s:
        value = sum(sidecar.metric(name) for name in names)
        if value != last:
            last, since = value, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.2)
    return time.monotonic() - began - quiet_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000, help="Export calls to make, valid and hostile")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sidecar = Sidecar(Path(tmp), CONFIG, name="fuzz").start()
        try:
            report(sidecar, args)
        finally:
            sidecar.close()


def report(sidecar: Sidecar, args: argparse.Namespace) -> None:
    pid = sidecar.proc.pid
    at_start = memory(pid)  # ready, before any traffic
    metrics_url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
    with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel:
        export = channel.unary_unary(EXPORT, request_serializer=None,
                                     response_deserializer=ExportMetricsServiceResponse.FromString)
        wires = [s.wire() for s in traffic(random.Random(args.seed), args.requests)]  # built before the clock starts
        began = time.monotonic()
        answers = send_all(export, wires)
        elapsed = time.monotonic() - began
        drained = settle(sidecar)
        alive = sidecar.proc.poll() is None
        answering = alive and export(b"", timeout=10) == ExportMetricsServiceResponse()
    at_end = memory(pid) if alive else {}
    reasons = rejected_by_reason(metrics_url) if alive else Counter()
    intervals = sidecar.metric("otelgpu_intervals_computed_total") if alive else float("nan")
    stopping = time.monotonic()
    code = sidecar.stop() if alive else sidecar.proc.returncode
    stopped = time.monotonic() - stopping
    errors = sum("ERROR" in line for line in sidecar.log.read_text(errors="replace").splitlines())

    sent = sum(answers.values()) - answers["UNAVAILABLE"]
    print(f"requests sent: {sent} (seed {args.seed}) in {elapsed:.1f} s: {sent / elapsed:.0f} requests/s; "
          f"queue drained {max(drained, 0):.1f} s later")
    print("answers: " + ", ".join(f"{k} {v}" for k, v in answers.most_common()))
    print(f"points rejected: {sum(reasons.values())}, by reason (top 10):")
    for reason, n in reasons.most_common(10):
        print(f"  {n:8d}  {reason}")
    print(f"intervals computed: {intervals:.0f}; ERROR lines in the sidecar's log: {errors}")
    print(f"memory at start: VmRSS {at_start['VmRSS']}, VmHWM {at_start['VmHWM']}")
    print(f"memory at end:   VmRSS {at_end.get('VmRSS', '-')}, VmHWM {at_end.get('VmHWM', '-')}")
    print(f"alive at end: {alive}; answering: {answering}; exit status after SIGTERM: {code} ({stopped:.1f} s)")


if __name__ == "__main__":
    main()
