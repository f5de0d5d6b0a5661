"""Measure `otelgpu serve`'s memory and CPU as it runs in the shipped pods, against the
requests and limits those pods set.

It starts `otelgpu serve` as its own process with the otelgpu.yaml of k8s/gateway or k8s/node
(endpoints moved to free ports, facts from kube-state-metrics instead of the Kubernetes API,
the checkpoint in a temporary directory), exports to a real OTLP gRPC receiver here, and feeds
it scrapes the way the Collector would: dcgm-exporter's default counters for every GPU and MIG
instance, kube-state-metrics and cAdvisor, in requests of at most the Collector's batch size.
The scrapes go as fast as this process builds them (an hour of a 100-node cluster in about
four minutes), so intervals close far faster than in a cluster and the CPU figure is CPU seconds
per hour of data. `--churn-minutes` replaces every pod that often (new names and uids, as jobs
and rollouts do): what makes cost series end and interned label values accumulate.

Usage: python benchmarks/bench_footprint.py [--mode gateway|node] [--nodes 100] [--hours 1]
                                            [--churn-minutes 0] [--kernels compiled|interpreted]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid as uuidlib
from concurrent import futures
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import grpc
import yaml
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.metrics.v1.metrics_pb2 import ResourceMetrics

from otelgpu.demo import scenario, scrapes
from otelgpu.demo.otlp import request, send  # not demo.run: this process must not load numba's LLVM
from otelgpu.enrich.window import NS
from otelgpu.receiver.schema import READ_NAMES

ROOT = Path(__file__).resolve().parent.parent
SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"
EXPORT = f"/{SERVICE}/Export"  # for raw-bytes callables and handlers
EMPTY = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
SCRAPE_S = 30  # collector-config: dcgm-exporter and kube-state-metrics every 30 s, the kubelet every 60 s
BATCH_POINTS = 8192  # collector-config: batch send_batch_size
# dcgm-exporter's etc/default-counters.csv besides the three the demo sends (FB_USED, GPU_UTIL,
# PROF_GR_ENGINE_ACTIVE): what a default install exports per GPU or MIG instance. otelgpu decodes
# and ignores them, which is part of its cost.
DCGM_GAUGES = ("DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_DEV_MEMORY_TEMP", "DCGM_FI_DEV_GPU_TEMP",
               "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_MEM_COPY_UTIL", "DCGM_FI_DEV_ENC_UTIL",
               "DCGM_FI_DEV_DEC_UTIL", "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_RESERVED",
               "DCGM_FI_DEV_VGPU_LICENSE_STATUS", "DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
               "DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_PCIE_RX_BYTES")
DCGM_COUNTERS = ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
                 "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
                 "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS")


def fleet(n_nodes: int, generation: int) -> tuple[list[scenario.Node], dict[str, dict[str, str]]]:
    """n_nodes copies of the demo cluster's nodes, each with its own name, address, GPUs and pods;
    a new generation replaces every pod."""
    base, ns_labels = scenario.build()
    copies = range(math.ceil(n_nodes / len(base)))
    nodes = [_copy(n, i, k, generation) for i in copies for k, n in enumerate(base)]
    return nodes[:n_nodes], ns_labels


def _copy(n: scenario.Node, i: int, k: int, generation: int) -> scenario.Node:
    name = f"{n.name.split('.')[0]}-{i}.compute.internal"
    twins: dict[int, scenario.Pod] = {}

    def twin(p: scenario.Pod | None) -> scenario.Pod | None:  # a pod held by several devices stays one pod
        if p is not None and id(p) not in twins:
            twins[id(p)] = replace(p, name=f"{p.name}-{i}-g{generation}", uid="")
        return twins[id(p)] if p is not None else None

    devices = [replace(d, uuid="GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"{name}/{d.index}")),
                       holder=twin(d.holder)) for d in n.devices]
    return scenario.Node(name, f"10.{i // 250}.{i % 250}.{k + 10}", n.labels, n.capacity, devices,
                         [twin(p) for p in n.shared])


def dcgm(node: scenario.Node, time_ns: int, hour: float) -> ResourceMetrics:
    """The demo's dcgm-exporter scrape with the rest of the default counters, on the same series."""
    rm = scrapes.dcgm(node, time_ns, hour)
    metrics = rm.scope_metrics[0].metrics
    labels = [p.attributes for m in metrics if m.name == "DCGM_FI_DEV_FB_USED" for p in m.gauge.data_points]
    for name in DCGM_GAUGES + DCGM_COUNTERS:
        m = metrics.add(name=name)
        if name in DCGM_COUNTERS:
            m.sum.is_monotonic, m.sum.aggregation_temporality = True, 2
        points = m.sum.data_points if name in DCGM_COUNTERS else m.gauge.data_points
        for attrs in labels:
            points.add(time_unix_nano=time_ns, as_double=1.0).attributes.extend(attrs)
    return rm


def forwarded(rm: ResourceMetrics) -> ResourceMetrics:
    """The target as the shipped Collector sends it on to otelgpu: its metrics otelgpu does not
    read (most of dcgm-exporter's default counters) dropped by filter/otelgpu."""
    for scope in rm.scope_metrics:
        kept = [m for m in scope.metrics if m.name in READ_NAMES]
        del scope.metrics[:]
        scope.metrics.extend(kept)
    return rm


def points(rm: ResourceMetrics) -> int:
    return sum(len(m.gauge.data_points) + len(m.sum.data_points) for sm in rm.scope_metrics for m in sm.metrics)


def batches(targets: list[ResourceMetrics]) -> list[metrics_service_pb2.ExportMetricsServiceRequest]:
    """The scrapes in requests of about the Collector's batch size (a scrape is never split)."""
    out, current, size = [], [], 0
    for rm in targets:
        if current and size + points(rm) > BATCH_POINTS:
            out.append(request(*current))
            current, size = [], 0
        current.append(rm)
        size += points(rm)
    return out + ([request(*current)] if current else [])


class Sink(metrics_service_pb2_grpc.MetricsServiceServicer):
    """The Collector's otlp/cost receiver: takes everything, counts the points."""

    def __init__(self) -> None:
        self.points = 0
        self.lock = threading.Lock()

    def Export(self, req, context):  # noqa: ANN001 (the servicer's signature)
        n = sum(points(rm) for rm in req.resource_metrics)
        with self.lock:
            self.points += n
        return metrics_service_pb2.ExportMetricsServiceResponse()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (peak) and RssAnon (the resident memory not backed by a file) of a process, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)
                if k in ("VmRSS", "VmHWM", "RssAnon")}


def resident_by_mapping(pid: int) -> dict[str, int]:
    """A process's resident memory in KiB by kind of mapping (/proc/PID/smaps): "heap" (malloc's
    main heap, [heap]), "anonymous" (anonymous mappings: malloc's other arenas and its large
    blocks, numpy's large arrays, LLVM's code and data, thread stacks), "files" (pages of
    mapped files: the interpreter, libraries, their data) and "other" (stacks, vdso)."""
    out = {"heap": 0, "anonymous": 0, "files": 0, "other": 0}
    kind = "other"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if not head[0].endswith(":"):  # a mapping's first line: range, perms, offset, dev, inode[, path]
                path = head[5] if len(head) > 5 else ""
                kind = ("heap" if path == "[heap]" else "anonymous" if not path
                        else "files" if path.startswith("/") else "other")
            elif head[0] == "Rss:":
                out[kind] += int(head[1])
    return out


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def scrape_metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(otelgpu_\w+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def pod_resources(mode: str) -> dict[str, str]:
    workload = ROOT / "k8s" / mode / ("deployment.yaml" if mode == "gateway" else "daemonset.yaml")
    spec = yaml.safe_load(workload.read_text())["spec"]["template"]["spec"]
    c = next(c for c in spec["containers"] if c["name"] == "otelgpu")
    return {"cpu_request": c["resources"]["requests"]["cpu"], "memory_request": c["resources"]["requests"]["memory"],
            "memory_limit": c["resources"]["limits"]["memory"]}


def mib(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


def cores(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def sidecar_config(mode: str, tmp: Path, grpc_port: int, sink_port: int, metrics_port: int,
                   kernels: Optional[str] = None) -> Path:
    """k8s/<mode>'s otelgpu.yaml on these ports, facts from kube-state-metrics, the checkpoint in
    `tmp`; `kernels` instead of the file's setting when given."""
    config = yaml.safe_load((ROOT / "k8s" / mode / "otelgpu.yaml").read_text())
    if kernels:
        config["kernels"] = kernels
    config["receiver"]["grpc"]["endpoint"] = f"127.0.0.1:{grpc_port}"
    config["exporter"]["otlp"]["endpoint"] = f"127.0.0.1:{sink_port}"
    config["exporter"]["prometheus"]["endpoint"] = f"127.0.0.1:{metrics_port}"
    config["kubernetes"] = {"enabled": False}  # facts from kube-state-metrics: no API server here
    config["checkpoint"]["directory"] = str(tmp / "checkpoint")
    path = tmp / "otelgpu.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("gateway", "node"), default="gateway")
    ap.add_argument("--nodes", type=int, help="GPU nodes (gateway: default 100; node: always 1, the p4d)")
    ap.add_argument("--hours", type=float, default=1.0, help="hours of cluster data to send")
    ap.add_argument("--churn-minutes", type=float, default=0, help="replace every pod this often (0: never)")
    ap.add_argument("--kernels", choices=("compiled", "interpreted"),
                    help="run the kernels so instead of as the mode's otelgpu.yaml says")
    args = ap.parse_args()
    n_nodes = 1 if args.mode == "node" else (args.nodes or 100)
    limits = pod_resources(args.mode)

    sink = Sink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(sink, server)
    sink_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    grpc_port, metrics_port = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = sidecar_config(args.mode, Path(tmp), grpc_port, sink_port, metrics_port, args.kernels)
        with serving(config, server, stderr=subprocess.PIPE) as child:
            run(args, n_nodes, limits, child, grpc_port, metrics_port, sink)


@contextmanager
def serving(config: Path, sink_server: grpc.Server, stderr: Any) -> Iterator[subprocess.Popen]:
    """`otelgpu serve --config config` as a child process (the fleet's cluster and node names),
    stopped with SIGTERM (killed if it takes over 60 s) on the way out, the sink's server with it."""
    env = {**os.environ, "CLUSTER_NAME": "bench", "NODE_NAME": fleet(1, 0)[0][0].name}
    child = subprocess.Popen([sys.executable, "-m", "otelgpu", "serve", "--config", str(config)], env=env,
                             stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    try:
        yield child
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
        sink_server.stop(0)


def wait_ready(child: subprocess.Popen, metrics_port: int, log_tail: Callable[[], str], limit_s: float = 120) -> None:
    """Until `otelgpu serve` answers /readyz; SystemExit with `log_tail()` if it exits or takes too long."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/readyz", timeout=1)
            return
        except OSError:
            if child.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"otelgpu serve did not become ready:\n{log_tail()}") from None
            time.sleep(0.2)


def run(args: argparse.Namespace, n_nodes: int, limits: dict[str, str], child: subprocess.Popen, grpc_port: int,
        metrics_port: int, sink: Sink) -> None:
    wait_ready(child, metrics_port, lambda: child.stderr.read())
    started = proc_status(child.pid)["VmRSS"] / 1024
    cpu_start = cpu_seconds(child.pid)
    n_scrapes = int(args.hours * 3600 / SCRAPE_S)
    # The data ends about now: the shipped configs refuse points more than a day old or ahead of the clock.
    t0 = (time.time_ns() // NS - n_scrapes * SCRAPE_S + 60) // 60 * 60 * NS
    sent_points = sent_bytes = 0
    nodes, ns_labels, generation = *fleet(n_nodes, 0), 0
    wall = time.monotonic()
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}", compression=grpc.Compression.Gzip,
                               options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = metrics_service_pb2_grpc.MetricsServiceStub(channel)
        for k in range(n_scrapes):
            elapsed = SCRAPE_S * k + SCRAPE_S
            if args.churn_minutes and elapsed // (args.churn_minutes * 60) != generation:
                generation = int(elapsed // (args.churn_minutes * 60))
                nodes, ns_labels = fleet(n_nodes, generation)
            t = t0 + elapsed * NS
            hour = (elapsed % 3600) / 3600
            targets = [scrapes.ksm(nodes, ns_labels, t)] + [dcgm(n, t, hour) for n in nodes]
            if k % 2:  # the kubelet every 60 s
                targets += [scrapes.cadvisor(n, t, elapsed) for n in nodes]
            for req in batches(targets):
                sent_points += sum(points(rm) for rm in req.resource_metrics)
                sent_bytes += req.ByteSize()
                send(stub, req)
    send_s = time.monotonic() - wall

    # done when every interval the data closes is computed and delivered
    last, steady = None, 0
    while steady < 10:
        m = scrape_metrics(metrics_port)
        state = (m.get("otelgpu_intervals_computed_total"), m.get('otelgpu_exports_total{exporter="otlp"}'),
                 m.get('otelgpu_exporter_queue_size{exporter="otlp"}'))
        steady = steady + 1 if state == last and state[2] == 0 else 0
        last = state
        time.sleep(0.3)
    done_s = time.monotonic() - wall - 3.0  # less the stability wait
    cpu = cpu_seconds(child.pid) - cpu_start
    status = proc_status(child.pid)
    peak_mib = status["VmHWM"] / 1024  # the kernel's high-water mark of the resident set
    data_s = n_scrapes * SCRAPE_S
    gpus = sum(len(n.devices) for n in nodes)
    pods = sum(len(scrapes.node_pods(n)) for n in nodes)

    print(f"{args.mode} mode: {n_nodes} GPU nodes, {gpus} GPUs and MIG instances, {pods} GPU pods"
          + (f", every pod replaced every {args.churn_minutes:g} min ({generation + 1} generations)"
             if args.churn_minutes else ""))
    print(f"sent: {args.hours:g} h of data, {n_scrapes} scrapes, {sent_points:,} points, "
          f"{sent_bytes / 2**20:.1f} MiB of OTLP before gzip, in {send_s:.1f} s")
    print(f"otelgpu: {m.get('otelgpu_intervals_computed_total', 0):.0f} intervals computed, "
          f"{m.get('otelgpu_series_active', 0):,.0f} cost series live, "
          f"{m.get('otelgpu_series_ended_total', 0):,.0f} ended; {sink.points:,} points delivered over OTLP; "
          f"{m.get('otelgpu_checkpoints_written_total', 0):.0f} checkpoints; "
          f"{sum(v for k, v in m.items() if k.startswith('otelgpu_points_rejected_total')):.0f} points rejected")
    for k, v in sorted(m.items()):
        if k.startswith("otelgpu_points_rejected_total"):
            print(f"  rejected {v:.0f}: {k}")
    print(f"memory: {started:.0f} MiB once ready, peak {peak_mib:.0f} MiB, {status['VmRSS'] / 1024:.0f} MiB after; "
          f"peak / limit ({limits['memory_limit']}) = {peak_mib / mib(limits['memory_limit']):.2f}, "
          f"peak / request ({limits['memory_request']}) = {peak_mib / mib(limits['memory_request']):.2f}")
    need = cpu / data_s
    print(f"cpu: {cpu:.1f} s for {data_s / 3600:g} h of data ({done_s:.1f} s wall) = {need * 1000:.1f} millicores "
          f"in real time; / request ({limits['cpu_request']}) = {need / cores(limits['cpu_request']):.2f}")


if __name__ == "__main__":
    main()
