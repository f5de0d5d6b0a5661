"""`otelgpu serve` end to end at 100, 1,000 and 10,000 GPUs, in real time.

For each size it starts `otelgpu serve` in its own process with the gateway's otelgpu.yaml
(k8s/gateway: request and scad models, 60 s intervals, 30 s lateness, checkpoint and write-ahead
log on; facts from kube-state-metrics, as no API server runs here), exporting over OTLP/gRPC as
that file says (uncompressed, as over the pod's loopback) to a real gRPC server in this process.
Every 30 s of data it sends what the shipped Collector sends on for the cluster: of
dcgm-exporter's default counters for every whole GPU, MIG instance and time-slicing replica,
kube-state-metrics, and the kubelet's cAdvisor every 60 s, the series otelgpu reads
(collector-config's filter/otelgpu; `--unfiltered`: every series, as a Collector without that
filter sends them), in requests of at most the Collector's batch size, uncompressed as the
shipped collector-config sends them over the pod's loopback (`--compression gzip`: compressed).
The requests of a scrape are built once and re-stamped for each scrape time, so building them
costs this process nothing per scrape; `--speed` sends scrapes that many times faster than real
time.

Measured from outside the sidecar:
- CPU: its user+system seconds per interval of data, and what that is in cores in real time;
  the points per CPU-second it sustains end to end (decode, join, attribution, export, checkpoint);
  CPU milliseconds per GPU per hour of data, as a ratio to the smallest size (flat = 1.0).
  Steady: from the scrape after the first close on (every label set met); settled, in runs of 8
  minutes or more: from the fifth interval's close on, once no cost series comes or goes.
- close to exported: for each interval, from the moment the scrape that closes it (its end plus
  the lateness) was received (its last request accepted: the interval cannot close before the
  data that moves the watermark is in) to the moment the last point stamped with its end reached
  the OTLP receiver here (which answers at once and reads the points on another thread). Median
  and worst over the second half of the run's intervals, as for the steady memory: the first
  ones create every series (and the first cAdvisor rates add more), which later ones only
  update. Also printed: the same from that scrape's first request, which adds taking it in.
- memory: VmRSS once ready; steady: the median of VmRSS sampled every 0.25 s over the second half
  of the run (the part of it not backed by a file, RssAnon, is printed too), and the median of
  VmRSS at the moments each scrape's last request was accepted, when the sidecar is busiest; and
  the kernel's high-water mark VmHWM (peak).
- inside: the sidecar's own `otelgpu_work_seconds_total` per interval computed: wall seconds of
  computing intervals ahead of their close (`attribution.compute_ahead`, on in the gateway's file:
  once every target has sent data past an interval's end, before the scrape that closes it; used
  or not), closing intervals, committing them (staging, checkpoint) and sending them; and how
  many intervals computed ahead were used at their close or computed again.
  `--no-compute-ahead` turns it off, for the figures of closing with all the work at the close.
- /metrics: the wall and CPU seconds of one scrape of the Prometheus endpoint after the run, as
  the gateway serves it (not part of the CPU above); with `--metrics-cost-series` it serves every
  cost series besides the sidecar's own metrics (`exporter.prometheus.cost_series: true`).
- start-up: seconds from exec to /readyz with an empty numba cache (cold, every kernel compiled)
  and with the cache that run left (warm).
- by step (`--rss-by-step DIR`): the sidecar runs under benchmarks/serve_by_step.py, which samples
  its RSS every 50 ms labelled by the step its pipeline is in (a batch, computing ahead, the
  close, staging the snapshot, the checkpoint's state, the commit) and whether an exporter is
  sending; printed: each step's highest RSS over the run's second half, so that a peak is told
  apart by what made it.

Churn (`--churn-nodes N`): every `--churn-minutes` of data (1 by default) the pods of the next N
nodes are replaced, a group of N nodes after another: new names in every series that names them
(dcgm-exporter's, kube-state-metrics', the kubelet's), so new facts, series and attribute sets
come and the old ones end, as in a cluster whose jobs finish and whose Deployments roll. The
requests are then packed a group of nodes at a time (each group's bytes renamed on their own),
which makes a few more of them: `--churn-minutes 0` packs them so and replaces nothing, the
baseline to compare with.

Per-node mode (`--node-pods`): a pod of k8s/node's otelgpu.yaml for each kind of node in the
fleet, side by side in real time for the same minutes, each fed its own node's scrapes; per-node
mode at each size is then the fleet's nodes, each kind at what its pod took, printed beside the
gateway: CPU and steady memory of all pods together, and per GPU.

Usage: python benchmarks/bench_scale.py [--gpus 100 1000 10000] [--minutes 5] [--speed 1] [--metrics-cost-series]
       [--no-compute-ahead] [--compression gzip|none] [--unfiltered] [--node-pods [--node-kernels compiled|interpreted]]
       [--sidecar-cpus 0] [--rss-by-step DIR] [--churn-nodes N [--churn-minutes 1]]
"""

from __future__ import annotations

import argparse
import math
import os
import queue
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Iterable, Iterator, Optional
from concurrent import futures
from pathlib import Path

import grpc
import yaml
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.metrics.v1.metrics_pb2 import ResourceMetrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_footprint as bf  # noqa: E402 - the fleet, its scrapes, /proc readers
import serve_by_step  # noqa: E402

from otelgpu.demo import scrapes  # noqa: E402
from otelgpu.enrich.window import NS  # noqa: E402

SCRAPE_S = bf.SCRAPE_S
INTERVAL_S, LATENESS_S = 60, 30  # k8s/gateway/otelgpu.yaml
# The first scrape of the steady part of a run: the first interval has closed, and every label set
# and series of the cluster has been met (the first scrapes learn them all, once per process).
STEADY_FROM = (INTERVAL_S + LATENESS_S) // SCRAPE_S + 1
# The first scrape once the store's series have settled too: scad's per-pod series come in the
# second and third intervals (memory use, then the CPU rate once a counter has two points) and the
# ones they replace end two intervals later; from the fifth interval's close on no set comes or
# goes (docs/memory.md). Runs of 8 minutes or more (`--minutes`) have such a part.
SETTLED_FROM = (5 * INTERVAL_S + LATENESS_S) // SCRAPE_S + 1
KINDS = 3  # kinds of node in the fleet (the demo cluster's: p4d with MIG, p5 time-sliced, g5), in turn
COMPRESSION = {"gzip": grpc.Compression.Gzip, "none": grpc.Compression.NoCompression}


def physical_gpus(node) -> int:  # noqa: ANN001 (scenario.Node)
    return len({d.index for d in node.devices})


def nodes_for(gpus: int) -> int:
    """The fewest fleet nodes holding at least `gpus` physical GPUs."""
    nodes, _ = bf.fleet(max(3, gpus // 4), 0)
    total = 0
    for i, n in enumerate(nodes):
        total += physical_gpus(n)
        if total >= gpus:
            return i + 1
    raise AssertionError("fleet too small")


class Scrapes:
    """One scrape of the fleet as request bytes, re-stamped for any time. Built a slice of nodes
    at a time, each request serialized as soon as it is full (at 100,000 GPUs the messages of a
    whole scrape would not fit in this machine's memory); a target larger than the Collector's
    batch size (kube-state-metrics) is split across requests, as the batch processor splits it."""

    SLICE = 500  # nodes whose scrapes are built at once

    def __init__(self, nodes: list, ns_labels: dict[str, dict[str, str]], churn_nodes: int = 0,
                 unfiltered: bool = False) -> None:
        """`churn_nodes`: the scrapes in groups of that many nodes, each group's requests its own,
        so that `churn` replaces one group's pods in their bytes. `unfiltered`: every series of
        the scrapes, as a Collector without collector-config's filter/otelgpu sends them (by
        default only what that filter forwards: the series otelgpu reads)."""
        self.gpus = sum(physical_gpus(n) for n in nodes)
        self.units = sum(len(n.devices) for n in nodes)
        self.nodes = len(nodes)
        self.stamp = (time.time_ns() // NS - 10 * 86400) * NS  # a time no other field of a request holds
        size = churn_nodes or self.SLICE
        slices = [nodes[lo:lo + size] for lo in range(0, len(nodes), size)]

        sent = (lambda target: target) if unfiltered else bf.forwarded

        def every(k: int, part: list) -> Iterator[ResourceMetrics]:  # made as the requests take them
            yield sent(self._ksm(part, ns_labels, first=k == 0))
            yield from (sent(bf.dcgm(n, self.stamp, 0.3)) for n in part)

        def kubelet(part: list) -> Iterator[ResourceMetrics]:
            return (sent(scrapes.cadvisor(n, self.stamp, 3600)) for n in part)

        # Each group's (requests every scrape, the kubelet's every other): one group of the whole
        # fleet unless it churns, its targets packed into requests across the slices
        self.groups = ([(encoded(every(k, part)), encoded(kubelet(part))) for k, part in enumerate(slices)]
                       if churn_nodes else
                       [(encoded(t for k, part in enumerate(slices) for t in every(k, part)),
                         encoded(t for part in slices for t in kubelet(part)))])
        groups = slices if churn_nodes else [nodes]
        self.group_pods = [len({p.name for n in part for p in [d.holder for d in n.devices] + n.shared if p})
                           for part in groups]
        self._churned = 0  # groups churn in turn: group k has been churned churned // groups times
        self._old = struct.pack("<Q", self.stamp)

    @property
    def every(self) -> list[tuple[bytes, int]]:
        """The requests of every scrape (the kubelet's, every other scrape, not among them)."""
        return [request for every, _ in self.groups for request in every]

    def churn(self) -> int:
        """Replace the pods of the next group of nodes, in turn: each gets a new name (the
        generation in its name, `-gN`, moved on: the same width, so the bytes stay a valid
        request), as when a Deployment rolls or a job's pods are done and new ones take their
        GPUs. Returns how many pods were replaced."""
        at, generation = self._churned % len(self.groups), self._churned // len(self.groups)
        old, new = f"-g{generation % 10}".encode(), f"-g{(generation + 1) % 10}".encode()
        self.groups[at] = tuple([(raw.replace(old, new), n) for raw, n in requests]  # type: ignore[assignment]
                                for requests in self.groups[at])
        self._churned += 1
        return self.group_pods[at]

    def _ksm(self, nodes: list, ns_labels: dict[str, dict[str, str]], first: bool) -> ResourceMetrics:
        """kube-state-metrics' series of these nodes; the namespaces' and its own `up` with the first."""
        target = scrapes.ksm(nodes, ns_labels if first else {}, self.stamp)
        if not first:
            for scope in target.scope_metrics:
                kept = [m for m in scope.metrics if m.name != "up"]
                del scope.metrics[:]
                scope.metrics.extend(kept)
        return target

    def at(self, time_ns: int, with_kubelet: bool) -> Iterator[tuple[bytes, int]]:
        """The scrape's requests stamped `time_ns`, each made as it is taken."""
        new = struct.pack("<Q", time_ns)
        kubelet = [request for _, requests in self.groups for request in requests] if with_kubelet else []
        return ((raw.replace(self._old, new), n) for raw, n in self.every + kubelet)


def encoded(targets: Iterable[ResourceMetrics]) -> list[tuple[bytes, int]]:
    """The targets' points in requests of at most the batch size, serialized as each fills:
    (bytes, points) each."""
    out: list[tuple[bytes, int]] = []
    current, size = metrics_service_pb2.ExportMetricsServiceRequest(), 0
    for target in targets:
        for piece in pieces(target, bf.BATCH_POINTS):
            n_point = bf.points(piece)
            if size and size + n_point > bf.BATCH_POINTS:
                out.append((current.SerializeToString(), size))
                current, size = metrics_service_pb2.ExportMetricsServiceRequest(), 0
            current.resource_metrics.append(piece)
            size += n_point
    return out + ([(current.SerializeToString(), size)] if size else [])


def pieces(target: ResourceMetrics, limit: int) -> Iterator[ResourceMetrics]:
    """The target whole if it has at most `limit` points, else its points in pieces of `limit`,
    each with the target's resource and scope and its metrics' names and kinds."""
    if bf.points(target) <= limit:
        yield target
        return
    piece, room = None, 0
    for scope in target.scope_metrics:
        for metric in scope.metrics:
            kind = metric.WhichOneof("data")
            points = getattr(metric, kind).data_points
            at = 0
            while at < len(points):
                if piece is None or room == 0:
                    if piece is not None:
                        yield piece
                    piece, room = ResourceMetrics(resource=target.resource), limit
                    piece.scope_metrics.add(scope=scope.scope)
                part = points[at:at + room]
                into = piece.scope_metrics[-1].metrics.add(name=metric.name, description=metric.description,
                                                           unit=metric.unit)
                getattr(into, kind).MergeFrom(type(getattr(metric, kind))(data_points=part))
                if kind == "sum":
                    into.sum.is_monotonic = metric.sum.is_monotonic
                    into.sum.aggregation_temporality = metric.sum.aggregation_temporality
                at, room = at + len(part), room - len(part)
    if piece is not None:
        yield piece


class Sampler:
    """VmRSS and RssAnon of a process every `every_s` seconds until stopped, in MiB."""

    def __init__(self, pid: int, every_s: float = 0.25) -> None:
        self.samples: list[tuple[float, float, float]] = []  # (monotonic time, VmRSS, RssAnon)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(pid, every_s), daemon=True)
        self._thread.start()

    def _run(self, pid: int, every_s: float) -> None:
        while not self._stop.wait(every_s):
            status = bf.proc_status(pid)
            self.samples.append((time.monotonic(), status["VmRSS"] / 1024, status.get("RssAnon", 0) / 1024))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def steady(self, since: float) -> tuple[float, float]:
        """Median VmRSS and RssAnon of the samples taken from `since` on."""
        later = [s for s in self.samples if s[0] >= since] or self.samples or [(0.0, 0.0, 0.0)]
        return statistics.median(s[1] for s in later), statistics.median(s[2] for s in later)

    def highest(self, since: float = -math.inf) -> tuple[float, float]:
        """(VmRSS, when) of the highest sample taken from `since` on."""
        later = [s for s in self.samples if s[0] >= since] or [(0.0, 0.0, 0.0)]
        top = max(later, key=lambda s: s[1])
        return top[1], top[0]


class Receiver:
    """The Collector's otlp/cost receiver: for every interval end, when its last point arrived. It
    answers at once, as the Collector's receiver does once a request is in its queue; the points
    are read on another thread, so the sidecar's send never waits on this process's Python."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.last_arrival: dict[int, float] = {}
        self.points = 0
        self.latest = 0.0  # when the newest request arrived
        self._pending = 0  # requests received, not read yet
        self._arrived: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                                  options=[("grpc.max_receive_message_length", 256 << 20)])
        handler = grpc.unary_unary_rpc_method_handler(self._export, request_deserializer=None,
                                                      response_serializer=None)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(bf.SERVICE, {"Export": handler}),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def _export(self, raw: bytes, context) -> bytes:  # noqa: ANN001
        with self.lock:
            self._pending += 1
            self.latest = time.monotonic()
        self._arrived.put((time.monotonic(), raw))
        return bf.EMPTY

    def drain(self) -> None:
        """Wait until every request received so far is read."""
        while True:
            with self.lock:
                if not self._pending:
                    return
            time.sleep(0.05)

    def _read(self) -> None:
        while True:
            arrived, raw = self._arrived.get()
            req = metrics_service_pb2.ExportMetricsServiceRequest.FromString(raw)
            ends, n = set(), 0
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        points = m.sum.data_points if m.HasField("sum") else m.gauge.data_points
                        n += len(points)
                        ends.update(p.time_unix_nano for p in points)
            with self.lock:
                self._pending -= 1
                self.points += n
                for end in ends:
                    self.last_arrival[end] = max(arrived, self.last_arrival.get(end, 0.0))

    def quiet_for(self, seconds: float, timeout: float = 300) -> None:
        """Wait until no request has arrived for `seconds`: the snapshot being sent is all in."""
        deadline = time.monotonic() + timeout
        while time.monotonic() - self.latest < seconds and time.monotonic() < deadline:
            time.sleep(0.1)


SIDECAR_CPUS: set[int] = set()  # --sidecar-cpus: the CPUs `otelgpu serve` runs on (empty: any)


def start(config: Path, env: dict[str, str], metrics_port: int,
          by_step: Optional[Path] = None) -> tuple[subprocess.Popen, float]:
    """`otelgpu serve` and the seconds it took to answer /readyz; with `by_step`, its RSS sampled
    by step into that file (serve_by_step.py)."""
    began = time.monotonic()
    run = [str(bf.ROOT / "benchmarks" / "serve_by_step.py"), str(by_step)] if by_step else ["-m", "otelgpu"]
    child = subprocess.Popen([sys.executable, *run, "serve", "--config", str(config)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if SIDECAR_CPUS:  # the interpreter is still starting: every thread it starts inherits this
        os.sched_setaffinity(child.pid, SIDECAR_CPUS)
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/readyz", timeout=1)
            return child, time.monotonic() - began
        except OSError:
            if child.poll() is not None or time.monotonic() - began > 300:
                raise SystemExit(f"otelgpu serve did not become ready:\n{child.stderr.read()}") from None
            time.sleep(0.05)


def stop(child: subprocess.Popen) -> None:
    child.send_signal(signal.SIGTERM)
    try:
        child.wait(timeout=120)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def export(channel_export, raw: bytes) -> int:  # noqa: ANN001
    """Send one request as the Collector does (retrying while told to); the retries it took."""
    for attempt in range(60):
        try:
            channel_export(raw, timeout=60)
            return attempt
        except grpc.RpcError as err:
            if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                raise
            time.sleep(min(0.05 * 2 ** attempt, 1.0))
    raise RuntimeError("the sidecar stayed unavailable")


def run_size(gpus: int, args: argparse.Namespace, tmp: Path, env: dict[str, str]) -> dict:
    load = Scrapes(*bf.fleet(nodes_for(gpus), 0), churn_nodes=args.churn_nodes, unfiltered=args.unfiltered)
    churn_every = round(args.churn_minutes * 60 / SCRAPE_S) if args.churn_nodes else 0  # scrapes between churns
    sink = Receiver()
    grpc_port, metrics_port = bf.free_port(), bf.free_port()
    work = Path(tempfile.mkdtemp(dir=tmp))
    config = bf.sidecar_config("gateway", work, grpc_port, sink.port, metrics_port)
    if args.metrics_cost_series or args.no_compute_ahead:
        doc = yaml.safe_load(config.read_text())
        doc["exporter"]["prometheus"]["cost_series"] = args.metrics_cost_series
        doc["attribution"]["compute_ahead"] = not args.no_compute_ahead
        config.write_text(yaml.safe_dump(doc))
    by_step = Path(args.rss_by_step) / f"rss-{gpus}.log" if args.rss_by_step else None
    if by_step:
        by_step.parent.mkdir(parents=True, exist_ok=True)
    child, ready_s = start(config, env, metrics_port, by_step)
    n_scrapes = int(args.minutes * 60 / SCRAPE_S)
    # Data ending now or before: the gateway config refuses points ahead of the clock or a day old.
    t0 = (time.time_ns() // NS - int(args.minutes * 60 / args.speed * (args.speed - 1)) - 3 * INTERVAL_S) \
        // INTERVAL_S * INTERVAL_S * NS
    try:
        rss_ready = bf.proc_status(child.pid)["VmRSS"] / 1024
        cpu0, wall0 = bf.cpu_seconds(child.pid), time.monotonic()
        accepted: dict[int, float] = {}  # scrape time -> when its first request was accepted
        received: dict[int, float] = {}  # scrape time -> when its last request was accepted
        rss, sent, retries, replaced = [], 0, 0, 0
        cpu_steady0 = cpu_settled0 = float("nan")  # runs too short to have a steady part
        sampler = Sampler(child.pid)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}", compression=COMPRESSION[args.compression],
                                   options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
            call = channel.unary_unary(bf.EXPORT, request_serializer=None, response_deserializer=None)
            for k in range(n_scrapes):
                due = wall0 + k * SCRAPE_S / args.speed
                time.sleep(max(0.0, due - time.monotonic()))
                if k == STEADY_FROM:
                    cpu_steady0 = bf.cpu_seconds(child.pid)
                if k == SETTLED_FROM:
                    cpu_settled0 = bf.cpu_seconds(child.pid)
                t = t0 + (k + 1) * SCRAPE_S * NS
                if churn_every and k and k % churn_every == 0:
                    replaced += load.churn()
                for i, (raw, n) in enumerate(load.at(t, with_kubelet=k % 2 == 1)):
                    retries += export(call, raw)
                    sent += n
                    if i == 0:
                        accepted[t] = time.monotonic()
                received[t] = time.monotonic()
                rss.append(bf.proc_status(child.pid)["VmRSS"] / 1024)
            sampler.stop()
            half = wall0 + n_scrapes * SCRAPE_S / args.speed / 2
            steady, steady_anon = sampler.steady(since=half)
            highest = sampler.highest()
            highest = (highest[0], (highest[1] - wall0) * args.speed, sampler.highest(since=half)[0])
            mappings = bf.resident_by_mapping(child.pid)  # at the last scrape's end
            closes = [end for end in range(t0 + INTERVAL_S * NS, t + 1, INTERVAL_S * NS)
                      if end + LATENESS_S * NS <= t]  # intervals the data closes (the rest close at shutdown)
            for end in closes:  # wait for each to be delivered
                deadline = time.monotonic() + 120
                while end not in sink.last_arrival and time.monotonic() < deadline:
                    time.sleep(0.05)
            sink.quiet_for(3.0)  # the newest interval's snapshot sent whole (its first request is what arrived)
            sink.drain()
        cpu = bf.cpu_seconds(child.pid) - cpu0
        steady_s = (n_scrapes - STEADY_FROM) * SCRAPE_S  # its closes: as many as its intervals of data
        cpu_steady = (bf.cpu_seconds(child.pid) - cpu_steady0) / steady_s * INTERVAL_S if steady_s > 0 else float("nan")
        settled_s = (n_scrapes - SETTLED_FROM) * SCRAPE_S
        cpu_settled = ((bf.cpu_seconds(child.pid) - cpu_settled0) / settled_s * INTERVAL_S if settled_s > 0
                       else float("nan"))
        status = bf.proc_status(child.pid)
        latency, after_first = [], []
        for end in closes:
            trigger = min((s for s in accepted if s >= end + LATENESS_S * NS), default=None)
            if trigger is not None and end in sink.last_arrival:
                latency.append(sink.last_arrival[end] - received[trigger])
                after_first.append(sink.last_arrival[end] - accepted[trigger])
        cpu_before, began = bf.cpu_seconds(child.pid), time.monotonic()
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=300).read().decode()
        scrape = (time.monotonic() - began, bf.cpu_seconds(child.pid) - cpu_before, len(text))
        metrics = {}
        for line in text.splitlines():
            if line.startswith("otelgpu_"):
                name, _, value = line.rpartition(" ")
                metrics[name] = float(value)
    finally:
        stopping = time.monotonic()
        stop(child)
        sink.server.stop(0)
    data_s = n_scrapes * SCRAPE_S
    by_step_data = serve_by_step.summary(str(by_step), wall0 + data_s / args.speed / 2, stopping) if by_step else {}
    by_step_stop = serve_by_step.summary(str(by_step), stopping) if by_step else {}
    return {
        "gpus": load.gpus, "nodes": load.nodes, "units": load.units, "ready_s": ready_s,
        "points_per_scrape": sum(n for _, n in load.every), "sent": sent, "retries": retries,
        "pods": sum(load.group_pods), "replaced": replaced, "requests_per_scrape": len(load.every),
        "cost_points": sink.points, "intervals": len(closes), "delivered": len(latency),
        "cpu_s": cpu, "data_s": data_s, "cores": cpu / data_s, "cpu_per_interval": cpu / data_s * INTERVAL_S,
        "cpu_per_interval_steady": cpu_steady, "cpu_per_interval_settled": cpu_settled,
        "points_per_cpu_s": sent / cpu if cpu else float("inf"),
        "cpu_ms_per_gpu_hour": cpu / load.gpus / (data_s / 3600) * 1000,
        "latency": latency, "after_first": after_first, "rss_ready": rss_ready,
        "rss_steady": steady, "rss_steady_anon": steady_anon, "rss_highest": highest,
        "rss_at_scrape": statistics.median(rss[len(rss) // 2:]) if rss else 0.0, "rss_peak": status["VmHWM"] / 1024,
        "rss_by_step": by_step_data, "rss_at_stop": max(by_step_stop.values(), default=0.0),
        "mappings": {kind: kib / 1024 for kind, kib in mappings.items()}, "metrics": metrics,
        "rejected": sum(v for k, v in metrics.items() if k.startswith("otelgpu_points_rejected_total")),
        "late": metrics.get("otelgpu_points_late_total", 0.0),
        "scrape": scrape,
        "work": {name.split('"')[1]: value / max(1.0, metrics.get("otelgpu_intervals_computed_total", 0.0))
                 for name, value in metrics.items() if name.startswith("otelgpu_work_seconds_total{")},
        "ahead": {name.split('"')[1]: int(value) for name, value in metrics.items()
                  if name.startswith("otelgpu_intervals_ahead_total{")},
    }


def run_node_pods(args: argparse.Namespace, tmp: Path, env: dict[str, str]) -> list[dict]:
    """Per-node mode: one pod (k8s/node's otelgpu.yaml, facts from kube-state-metrics as no API
    server runs here) for each kind of node in the fleet, side by side, each fed its own node's
    scrapes in real time for the run's minutes. Per pod: its node's kind, GPUs and units, CPU
    cores, and ready, steady and peak RSS."""
    nodes, ns_labels = bf.fleet(KINDS, 0)  # one node of each kind: the fleet repeats them in this order
    pods = []
    for node in nodes:
        sink, grpc_port, metrics_port = Receiver(), bf.free_port(), bf.free_port()
        config = bf.sidecar_config("node", Path(tempfile.mkdtemp(dir=tmp)), grpc_port, sink.port, metrics_port,
                                   args.node_kernels)
        child, _ = start(config, {**env, "NODE_NAME": node.name}, metrics_port)
        pods.append({"load": Scrapes([node], ns_labels, unfiltered=args.unfiltered), "sink": sink, "child": child,
                     "node": node,
                     "channel": grpc.insecure_channel(f"127.0.0.1:{grpc_port}"),
                     "ready": bf.proc_status(child.pid)["VmRSS"] / 1024, "cpu0": bf.cpu_seconds(child.pid),
                     "sampler": Sampler(child.pid)})
    n_scrapes = int(args.minutes * 60 / SCRAPE_S)
    t0 = (time.time_ns() // NS - 3 * INTERVAL_S) // INTERVAL_S * INTERVAL_S * NS
    wall0 = time.monotonic()
    try:
        for k in range(n_scrapes):
            time.sleep(max(0.0, wall0 + k * SCRAPE_S / args.speed - time.monotonic()))
            for pod in pods:
                call = pod["channel"].unary_unary(bf.EXPORT, request_serializer=None, response_deserializer=None)
                for raw, _ in pod["load"].at(t0 + (k + 1) * SCRAPE_S * NS, with_kubelet=k % 2 == 1):
                    export(call, raw)
        time.sleep(max(0.0, wall0 + n_scrapes * SCRAPE_S / args.speed - time.monotonic()))
    finally:
        out = []
        for pod in pods:
            child = pod["child"]
            pod["sampler"].stop()
            steady, _ = pod["sampler"].steady(since=wall0 + n_scrapes * SCRAPE_S / args.speed / 2)
            cpu = bf.cpu_seconds(child.pid) - pod["cpu0"]
            out.append({"kind": pod["node"].labels.get("node.kubernetes.io/instance-type", "?"),
                        "gpus": pod["load"].gpus, "units": pod["load"].units, "cores": cpu / (n_scrapes * SCRAPE_S),
                        "rss_ready": pod["ready"], "rss_steady": steady,
                        "rss_peak": bf.proc_status(child.pid)["VmHWM"] / 1024})
            pod["channel"].close()
            stop(child)
            pod["sink"].server.stop(0)
    return out


def print_node_mode(pods: list[dict], sizes: list[dict]) -> None:
    """Each node pod's figures, and per-node mode at each gateway size: the fleet's nodes, each
    kind as its pod measured, beside the one gateway measured."""
    print("per-node pods, in real time beside each other (CPU cores, RSS ready / steady / peak):")
    for pod in pods:
        print(f"  {pod['kind']}: {pod['gpus']} GPUs, {pod['units']} units: {pod['cores'] * 1000:.1f} millicores, "
              f"{pod['rss_ready']:.0f} / {pod['rss_steady']:.0f} / {pod['rss_peak']:.0f} MiB")
    print("GPUs | mode | pods | CPU cores, all pods | steady RSS, all pods | per GPU: millicores, steady MiB")
    for size in sizes:
        count = [len(range(kind, size["nodes"], KINDS)) for kind in range(KINDS)]
        node_cores = sum(n * pod["cores"] for n, pod in zip(count, pods))
        node_rss = sum(n * pod["rss_steady"] for n, pod in zip(count, pods))
        for mode, n_pods, cores, rss in (("gateway", 1, size["cores"], size["rss_steady"]),
                                         ("per-node", size["nodes"], node_cores, node_rss)):
            print(f"{size['gpus']:,} | {mode} | {n_pods:,} | {cores:.2f} | {rss / 1024:,.1f} GiB | "
                  f"{cores * 1000 / size['gpus']:.3f} mc, {rss / size['gpus']:.2f} MiB")


def start_up(tmp: Path, env: dict[str, str]) -> tuple[float, float]:
    """Seconds to /readyz with an empty numba cache, then with the cache it left."""
    cache = tmp / "numba-cache"
    cache.mkdir()
    env = {**env, "NUMBA_CACHE_DIR": str(cache)}
    times = []
    for _ in range(2):
        sink = Receiver()
        grpc_port, metrics_port = bf.free_port(), bf.free_port()
        config = bf.sidecar_config("gateway", Path(tempfile.mkdtemp(dir=tmp)), grpc_port, sink.port, metrics_port)
        child, ready_s = start(config, env, metrics_port)
        stop(child)
        sink.server.stop(0)
        times.append(ready_s)
    return times[0], times[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, nargs="+", default=[100, 1000, 10000], help="cluster sizes (physical GPUs)")
    ap.add_argument("--minutes", type=float, default=5.0, help="minutes of cluster data per size")
    ap.add_argument("--speed", type=float, default=1.0, help="send scrapes this many times faster than real time")
    ap.add_argument("--metrics-cost-series", action="store_true",
                    help="serve the cost series on /metrics too (the gateway config does not)")
    ap.add_argument("--no-compute-ahead", action="store_true",
                    help="attribution.compute_ahead off: every interval computed when it closes")
    ap.add_argument("--compression", choices=sorted(COMPRESSION), default="none",
                    help="the requests' compression (none, as the shipped collector-config sends over the pod's "
                         "loopback; gzip, as a Collector's otlp exporter does by default)")
    ap.add_argument("--unfiltered", action="store_true",
                    help="send every series of the scrapes (all of dcgm-exporter's default counters), as a "
                         "Collector without collector-config's filter/otelgpu does; by default only the series "
                         "otelgpu reads, as the shipped Collector forwards them")
    ap.add_argument("--node-pods", action="store_true",
                    help="also run a per-node pod (k8s/node) for each kind of node, and print per-node mode's "
                         "CPU and memory at each size beside the gateway's")
    ap.add_argument("--node-kernels", choices=("compiled", "interpreted"),
                    help="with --node-pods: run the pods' kernels so instead of as k8s/node's otelgpu.yaml says")
    ap.add_argument("--churn-nodes", type=int, default=0, metavar="N",
                    help="replace the pods of N nodes every --churn-minutes of data, a group of N nodes after "
                         "another (new pod names: new series, facts and attribute sets), as a cluster whose "
                         "jobs and rollouts come and go; default 0, the same pods throughout. The requests "
                         "are then packed a group at a time")
    ap.add_argument("--churn-minutes", type=float, default=1.0,
                    help="with --churn-nodes: minutes of data between replacements (a multiple of the 30 s "
                         "scrape); 0 replaces none, the requests packed as for churn: its baseline")
    ap.add_argument("--rss-by-step", metavar="DIR",
                    help="sample the sidecar's RSS every 50 ms by the step its pipeline is in (serve_by_step.py), "
                         "logs in DIR, and print each step's highest from the run's second half")
    ap.add_argument("--sidecar-cpus", type=int, nargs="+", default=[],
                    help="run the sidecar on these CPUs and the load and the receiving end on the others, as a "
                         "pod with its own cores would be (default: all share every CPU)")
    args = ap.parse_args()
    if args.sidecar_cpus:  # before any thread starts: the threads of this process inherit it
        others = os.sched_getaffinity(0) - set(args.sidecar_cpus)
        if not others:
            raise SystemExit("--sidecar-cpus must leave a CPU to the load")
        SIDECAR_CPUS.update(args.sidecar_cpus)
        os.sched_setaffinity(0, others)
    env = {**os.environ, "CLUSTER_NAME": "bench", "NODE_NAME": bf.fleet(1, 0)[0][0].name,
           "MALLOC_ARENA_MAX": "2"}  # as the image sets it (Dockerfile)
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        cold, warm = start_up(tmp, env)
        print(f"start-up to /readyz: cold (empty numba cache) {cold:.1f} s, warm {warm:.1f} s ({cold / warm:.1f}x)")
        print(f"{args.minutes:g} min of data per size at {args.speed:g}x real time; scrapes every {SCRAPE_S} s, "
              f"{INTERVAL_S} s intervals, request and scad models, checkpoint on; the sidecar on "
              + (f"CPUs {sorted(SIDECAR_CPUS)}, the load on the others" if SIDECAR_CPUS else "every CPU, beside the load"))
        rows = [run_size(g, args, tmp, env) for g in args.gpus]
        node_pods = run_node_pods(args, tmp, env) if args.node_pods else []
    base = rows[0]["cpu_ms_per_gpu_hour"]
    head = ("GPUs", "nodes", "units", "pts/scrape", "cost pts/intv", "CPU s/intv", "cores", "pts/CPU-s",
            "ms/GPU-h", "flat", "close->exp p50", "max", "RSS ready", "steady", "peak")
    print(" | ".join(head))
    for r in rows:
        lat = r["latency"][len(r["latency"]) // 2:] or [float("nan")]
        per_interval = r["cost_points"] / max(1, r["delivered"])
        print(" | ".join([f"{r['gpus']:,}", f"{r['nodes']:,}", f"{r['units']:,}", f"{r['points_per_scrape']:,}",
                          f"{per_interval:,.0f}", f"{r['cpu_per_interval']:.2f}", f"{r['cores']:.3f}",
                          f"{r['points_per_cpu_s']:,.0f}", f"{r['cpu_ms_per_gpu_hour']:.1f}",
                          f"{r['cpu_ms_per_gpu_hour'] / base:.2f}", f"{statistics.median(lat):.2f} s",
                          f"{max(lat):.2f} s", f"{r['rss_ready']:.0f} MiB", f"{r['rss_steady']:.0f} MiB",
                          f"{r['rss_peak']:.0f} MiB"]))
        what = "every cost series and the self-metrics" if args.metrics_cost_series else "the self-metrics"
        print(f"  {r['gpus']:,} GPUs: one scrape of /metrics ({what}, "
              f"{r['scrape'][2] / 2**20:.1f} MiB of text) took {r['scrape'][0]:.1f} s and {r['scrape'][1]:.1f} CPU-s")
        print(f"  {r['gpus']:,} GPUs: steady RSS {r['rss_steady']:.0f} MiB, of which {r['rss_steady_anon']:.0f} MiB "
              f"not backed by a file; {r['rss_at_scrape']:.0f} MiB at the moments a scrape was in (median)")
        top, when, later = r["rss_highest"]
        print(f"  {r['gpus']:,} GPUs: highest RSS sampled {top:.0f} MiB, {when:.0f} s into the data; from the second "
              f"half of the run on (every label set and series met), {later:.0f} MiB")
        if r["rss_by_step"]:
            print(f"  {r['gpus']:,} GPUs: highest RSS in the second half by the step the pipeline was in: "
                  + ", ".join(f"{step} {mib:.0f} MiB" for step, mib in
                              sorted(r["rss_by_step"].items(), key=lambda item: -item[1]))
                  + f"; while it shut down (closing the open intervals at once) {r['rss_at_stop']:.0f} MiB")
        print(f"  {r['gpus']:,} GPUs: resident at the last scrape's end, by mapping: "
              + ", ".join(f"{kind} {mib:.0f} MiB" for kind, mib in r["mappings"].items()))
        heap = {state: r["metrics"].get(f'otelgpu_process_heap_bytes{{state="{state}"}}', float("nan")) / 2**20
                for state in ("in_use", "free")}
        print(f"  {r['gpus']:,} GPUs: malloc's heaps after the run: {heap['in_use']:.0f} MiB in use, "
              f"{heap['free']:.0f} MiB freed and kept")
        print(f"  {r['gpus']:,} GPUs: per GPU, {(r['rss_steady'] - r['rss_ready']) * 1024 / r['gpus']:.1f} KiB of steady "
              f"RSS above ready and {r['cpu_per_interval'] * 1000 / r['gpus']:.2f} CPU-ms an interval")
        print(f"  {r['gpus']:,} GPUs: steady, from the scrape at {STEADY_FROM * SCRAPE_S + SCRAPE_S} s of data on (every "
              f"label set and series already met): {r['cpu_per_interval_steady']:.2f} CPU-s an interval, "
              f"{r['cpu_per_interval_steady'] / INTERVAL_S:.3f} cores")
        if r["cpu_per_interval_settled"] == r["cpu_per_interval_settled"]:  # not NaN: the run was long enough
            print(f"  {r['gpus']:,} GPUs: settled, from the scrape at {SETTLED_FROM * SCRAPE_S + SCRAPE_S} s of data on "
                  f"(no series comes or goes): {r['cpu_per_interval_settled']:.2f} CPU-s an interval, "
                  f"{r['cpu_per_interval_settled'] / INTERVAL_S:.3f} cores")
        first = r["after_first"][len(r["after_first"]) // 2:] or [float("nan")]
        print(f"  {r['gpus']:,} GPUs: from the first request of the scrape that closes an interval instead: "
              f"{statistics.median(first):.2f} s median, {max(first):.2f} s worst")
        print(f"  {r['gpus']:,} GPUs: wall seconds per interval inside the sidecar: "
              + ", ".join(f"{step} {seconds:.2f}" for step, seconds in sorted(r["work"].items()))
              + "; intervals computed ahead: " + (", ".join(f"{n} {o}" for o, n in sorted(r["ahead"].items()))
                                                  or "none"))
        if args.churn_nodes:
            minutes = r["data_s"] / 60
            print(f"  {r['gpus']:,} GPUs: churn: {r['replaced']:,} pods replaced over {minutes:g} min of data, "
                  f"{r['replaced'] / minutes / r['pods']:.1%} of the fleet's {r['pods']:,} pods a minute "
                  f"(those of {args.churn_nodes} nodes every {args.churn_minutes:g} min; requests packed "
                  f"{args.churn_nodes} nodes at a time, {r['requests_per_scrape']} a scrape)")
        if r["retries"] or r["rejected"] or r["late"] or r["delivered"] < r["intervals"]:
            print(f"  {r['gpus']:,} GPUs: {r['retries']} requests retried (sidecar busy), {r['rejected']:.0f} points "
                  f"rejected, {r['late']:.0f} late, {r['delivered']}/{r['intervals']} intervals delivered")
    big = rows[-1]
    per_core = big["gpus"] / big["cores"] * 0.5
    print(f"at {big['gpus']:,} GPUs: {big['cores']:.3f} cores in real time, so half a core keeps up with about "
          f"{per_core:,.0f} GPUs at this rate")
    if node_pods:
        print_node_mode(node_pods, rows)


if __name__ == "__main__":
    main()
