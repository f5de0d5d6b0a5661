"""Peak memory of `otelgpu serve` under the loads that threaten it, against its pod's limit.

It starts `otelgpu serve` with the otelgpu.yaml of k8s/gateway or k8s/node (as bench_footprint.py
does: free ports, facts from kube-state-metrics, the checkpoint in a temporary directory), with
the memory limiter's limits the pod's memory limit gives it by default (80 % hard, 60 % soft: in
the pod they come from the container's cgroup), and drives, one after the other, over OTLP/gRPC with
gzip as the Collector sends:

- saturation: `--clients` senders in a closed loop (each waits for its answer) for `--seconds`:
  the rate the sidecar takes;
- overload: three times that rate, open loop (a new Export every 1/rate s, whatever the answers,
  up to `--outstanding` in flight), for `--seconds`, then the recovery until the queue is empty;
- big requests: `--big` Exports of `--big-mib` MiB each (uncompressed) at once, three rounds;
- malformed flood: `--clients` senders mixing bit flips, truncations and garbage (tests/fuzzing.py's
  wire classes) with valid requests, one in two, for `--seconds`;
- over OTLP/HTTP (its receiver switched on for this; the shipped pods take gRPC only): the big
  requests again, POSTed at once, three rounds; then `--clients` senders mixing raw HTTP broken on
  the way (tests/fuzzing.py's `broken_http`: cut, bytes changed, lengths that lie; each followed by
  a half-close) with valid POSTs, one in two, for `--seconds`. `--no-http` leaves them out.

Each request is a Collector batch of the fleet's dcgm-exporter and kube-state-metrics scrapes, with
recent timestamps. The sidecar's VmRSS is sampled every 20 ms. Printed per phase: answers by kind,
peak VmRSS and the ratio to the pod's limit; then the UNAVAILABLE answers the senders got against
the refusals the sidecar counted (`otelgpu_requests_total{outcome="unavailable"}`, and by reason
`otelgpu_receiver_connections_refused_total`), and whether the sidecar is alive and answering.

Usage: python benchmarks/bench_overload.py [--mode gateway|node] [--nodes 100] [--seconds 20]
       [--limit-mib auto] [--no-limiter] [--no-http]
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent import futures
from pathlib import Path

import grpc
import yaml
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])

import bench_footprint as bf  # noqa: E402 - the fleet, its scrapes, the sink, /proc readers
from fuzzing import WIRE, broken_http  # noqa: E402

from otelgpu.demo import scrapes  # noqa: E402
from otelgpu.demo.otlp import request  # noqa: E402
from otelgpu.enrich.window import NS  # noqa: E402


RETRY_LATER = {"connection_limit", "concurrent_requests", "queue_full", "wal", "memory_limit", "bytes_in_flight"}


class Rss:
    """Samples a process's VmRSS every 20 ms on a thread; `peak()` since the last `reset()`."""

    def __init__(self, pid: int) -> None:
        self.pid, self._peak, self._stop = pid, 0, threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self._peak = max(self._peak, bf.proc_status(self.pid)["VmRSS"])
            except (OSError, KeyError):
                return

    def reset(self) -> None:
        self._peak = bf.proc_status(self.pid)["VmRSS"]

    def peak_mib(self) -> float:
        return self._peak / 1024

    def close(self) -> None:
        self._stop.set()


def payloads(nodes: list, ns_labels: dict, scrapes_n: int) -> list[bytes]:
    """Collector batches of `scrapes_n` successive scrapes ending now."""
    now = time.time_ns() // NS * NS
    out = []
    for k in range(scrapes_n):
        t = now - (scrapes_n - k) * bf.SCRAPE_S * NS
        targets = [scrapes.ksm(nodes, ns_labels, t)] + [bf.dcgm(n, t, 0.5) for n in nodes]
        out += [r.SerializeToString() for r in bf.batches(targets)]
    return out


def big_payload(nodes: list, ns_labels: dict, mib: float) -> bytes:
    """One request of about `mib` MiB: dcgm-exporter scrapes of the fleet, 1 s apart."""
    now = time.time_ns() // NS * NS
    targets, size, k = [], 0, 0
    while size < mib * 2**20:
        k += 1
        for n in nodes:
            rm = bf.dcgm(n, now - k * NS, 0.5)
            targets.append(rm)
            size += rm.ByteSize()
            if size >= mib * 2**20:
                break
    return request(*targets).SerializeToString()


def code_of(call: grpc.Future) -> str:
    try:
        response = metrics_service_pb2.ExportMetricsServiceResponse.FromString(call.result())
        return "partial" if response.HasField("partial_success") else "ok"
    except grpc.RpcError as err:
        return err.code().name


def closed_loop(port: int, bodies: list[bytes], clients: int, seconds: float) -> tuple[Counter, float]:
    """`clients` senders each waiting for its answer: answers by kind, and Exports taken per second."""
    answers: Counter[str] = Counter()
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def sender(i: int) -> None:
        k = i
        with channel(port) as ch:
            export = ch.unary_unary(bf.EXPORT, request_serializer=None, response_deserializer=None)
            while time.monotonic() < end:
                try:
                    export(bodies[k % len(bodies)], timeout=60)
                    kind = "ok"
                except grpc.RpcError as err:
                    kind = err.code().name
                    if kind == "UNAVAILABLE":
                        time.sleep(0.05)
                with lock:
                    answers[kind] += 1
                k += clients

    began = time.monotonic()
    with futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(sender, range(clients)))
    return answers, (answers["ok"] + answers["partial"]) / (time.monotonic() - began)


def channel(port: int) -> grpc.Channel:
    """The Collector's otlp_grpc exporter's: gzip; its own connection (no subchannel sharing)."""
    return grpc.insecure_channel(f"127.0.0.1:{port}", compression=grpc.Compression.Gzip,
                                 options=[("grpc.max_send_message_length", 64 << 20), ("grpc.use_local_subchannel_pool", 1)])


def open_loop(port: int, nodes: int, rate: float, seconds: float, outstanding: int) -> Counter:
    """In a process of its own: a new Export every 1/`rate` s whatever the answers, at most
    `outstanding` unanswered."""
    fleet = bf.fleet(nodes, 0)
    bodies = payloads(*fleet, 8)
    answers: Counter[str] = Counter()
    pending: list[grpc.Future] = []
    with channel(port) as ch:
        export = ch.unary_unary(bf.EXPORT, request_serializer=None, response_deserializer=None)
        began, sent = time.monotonic(), 0
        while time.monotonic() - began < seconds:
            due = int((time.monotonic() - began) * rate)
            while sent < due and len(pending) < outstanding:
                pending.append(export.future(bodies[sent % len(bodies)], timeout=120))
                sent += 1
            still = []
            for call in pending:
                if call.done():
                    answers[code_of(call)] += 1
                else:
                    still.append(call)
            pending = still
            time.sleep(0.005)
        for call in pending:
            answers[code_of(call)] += 1
    return answers


def overload(port: int, nodes: int, rate: float, seconds: float, outstanding: int, processes: int) -> Counter:
    """open_loop in `processes` processes, each a share of the rate: one Python sender cannot
    outpace the sidecar."""
    ctx = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(processes, mp_context=ctx) as pool:
        runs = [pool.submit(open_loop, port, nodes, rate / processes, seconds, outstanding // processes)
                for _ in range(processes)]
        return sum((r.result() for r in runs), Counter())


def at_once(port: int, body: bytes, n: int) -> Counter:
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        export = ch.unary_unary(bf.EXPORT, request_serializer=None, response_deserializer=None)
        calls = [export.future(body, timeout=300) for _ in range(n)]
        return Counter(code_of(c) for c in calls)


def flood(port: int, bodies: list[bytes], clients: int, seconds: float) -> Counter:
    """Malformed Exports (bit flips, truncations, garbage of valid bodies) mixed one in two with valid ones."""
    rng = random.Random(1)
    hostile = []
    for i in range(200):
        gen = list(WIRE.values())[i % len(WIRE)]
        hostile.append(gen(rng, time.time_ns(), metrics_service_pb2.ExportMetricsServiceRequest.FromString(
            bodies[i % len(bodies)])).raw)
    mixed = [b for pair in zip(hostile, bodies * (len(hostile) // len(bodies) + 1)) for b in pair]
    return closed_loop(port, mixed, clients, seconds)[0]


def post(port: int, body: bytes) -> str:
    """One OTLP/HTTP export on a connection of its own: its status, or the error that ended it."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/metrics", body, {"Content-Type": "application/x-protobuf"})
        response = conn.getresponse()
        response.read()
        return str(response.status)
    except OSError as err:
        return type(err).__name__
    finally:
        conn.close()


def http_at_once(port: int, body: bytes, n: int) -> Counter:
    with futures.ThreadPoolExecutor(n) as pool:
        return Counter(pool.map(lambda _: post(port, body), range(n)))


def raw_http(port: int, data: bytes) -> str:
    """Raw bytes, then a half-close: the status of the first answer, or how the connection ended."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            answer = sock.recv(12)
            while sock.recv(65536):
                pass
        return answer[9:12].decode() if answer.startswith(b"HTTP/1.1 ") else "no answer"
    except OSError as err:
        return type(err).__name__


def http_flood(port: int, bodies: list[bytes], clients: int, seconds: float) -> Counter:
    """Raw HTTP broken on the way mixed one in two with valid POSTs, from `clients` senders."""
    rng = random.Random(2)
    head = b"POST /v1/metrics HTTP/1.1\r\nHost: otelgpu\r\nContent-Type: application/x-protobuf\r\n"
    broken = [broken_http(rng, head + f"Content-Length: {len(b)}\r\n\r\n".encode() + b) or b"x"
              for b in bodies * (200 // len(bodies) + 1)][:200]
    answers: Counter = Counter()
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def sender(i: int) -> None:
        n = i
        while time.monotonic() < stop:
            got = "broken " + raw_http(port, broken[n % len(broken)]) if n % 2 else post(port, bodies[n % len(bodies)])
            with lock:
                answers[got] += 1
            n += clients
    threads = [threading.Thread(target=sender, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def drained(metrics_port: int, limit_s: float = 600) -> float:
    """Seconds until the sidecar's queue is empty and its interval count stands still."""
    began, last, steady = time.monotonic(), None, 0
    while steady < 5 and time.monotonic() - began < limit_s:
        m = bf.scrape_metrics(metrics_port)
        state = (m.get("otelgpu_intervals_computed_total"), m.get("otelgpu_queue_depth", 0))
        steady = steady + 1 if state == last and not state[1] else 0
        last = state
        time.sleep(0.2)
    return time.monotonic() - began


def refusals_counted(metrics_port: int) -> tuple[float, dict[str, float]]:
    """The "retry later" answers the sidecar counted, in all and by reason."""
    m = bf.scrape_metrics(metrics_port)
    by_reason = {k.split('reason="')[1].split('"')[0]: v for k, v in m.items()
                 if k.startswith("otelgpu_receiver_connections_refused_total")
                 and k.split('reason="')[1].split('"')[0] in RETRY_LATER}
    return sum(v for k, v in m.items() if k.startswith('otelgpu_requests_total{outcome="unavailable"')), by_reason


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("gateway", "node"), default="gateway")
    ap.add_argument("--nodes", type=int, default=100, help="GPU nodes of the fleet the requests describe")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each timed phase")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--outstanding", type=int, default=600, help="most Exports in flight in the overload")
    ap.add_argument("--processes", type=int, default=3, help="sending processes in the overload")
    ap.add_argument("--big", type=int, default=32, help="concurrent big Exports")
    ap.add_argument("--big-mib", type=float, default=16.0)
    ap.add_argument("--limit-mib", default="auto", help="the container memory the limiter takes its defaults from "
                    "(80 %% hard, 60 %% soft); auto: the pod's limit")
    ap.add_argument("--no-limiter", action="store_true", help="run without the memory limiter, to compare")
    ap.add_argument("--no-http", action="store_true", help="leave out the OTLP/HTTP phases")
    args = ap.parse_args()
    limit_mib = bf.mib(bf.pod_resources(args.mode)["memory_limit"])

    sink = bf.Sink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(sink, server)
    sink_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    grpc_port, metrics_port, http_port = bf.free_port(), bf.free_port(), bf.free_port()
    with tempfile.TemporaryDirectory() as tmp:
        path = bf.sidecar_config(args.mode, Path(tmp), grpc_port, sink_port, metrics_port)
        config = yaml.safe_load(path.read_text())
        config["receiver"]["http"] = {"enabled": not args.no_http, "endpoint": f"127.0.0.1:{http_port}"}
        pod = limit_mib if args.limit_mib == "auto" else float(args.limit_mib)
        # what the defaults give inside the pod, from its cgroup: 80 % hard, 20 % spike
        limiter = {"enabled": False} if args.no_limiter else {"limit_mib": int(pod * 0.8), "spike_limit_mib": int(pod * 0.2)}
        config["receiver"]["memory_limiter"] = limiter
        path.write_text(yaml.safe_dump(config))
        log = Path(tmp) / "log"
        with log.open("w") as stderr, bf.serving(path, server, stderr) as child:
            run(args, child, grpc_port, http_port, metrics_port, limit_mib, log)


def run(args: argparse.Namespace, child: subprocess.Popen, grpc_port: int, http_port: int, metrics_port: int,
        limit_mib: float, log: Path) -> None:
    bf.wait_ready(child, metrics_port, lambda: log.read_text()[-3000:])
    nodes, ns_labels = bf.fleet(args.nodes if args.mode == "gateway" else 1, 0)
    bodies = payloads(nodes, ns_labels, 8)
    big = big_payload(nodes, ns_labels, args.big_mib)
    rss = Rss(child.pid)
    print(f"{args.mode} mode, pod limit {limit_mib:.0f} MiB, memory limiter "
          f"{'off' if args.no_limiter else 'at ' + str(args.limit_mib)}; {len(bodies)} request bodies of "
          f"{sum(map(len, bodies)) / len(bodies) / 1024:.0f} KiB on average; once ready: "
          f"{bf.proc_status(child.pid)['VmRSS'] / 1024:.0f} MiB")
    unavailable = 0

    def phase(name: str, answers: Counter, extra: str = "") -> None:
        nonlocal unavailable
        unavailable += answers["UNAVAILABLE"] + answers["503"] + answers["broken 503"]
        alive = child.poll() is None
        print(f"{name:<16} peak {rss.peak_mib():6.0f} MiB = {rss.peak_mib() / limit_mib:.2f} of the limit; "
              f"answers: {', '.join(f'{k} {v}' for k, v in answers.most_common())}{extra}"
              + ("" if alive else f"; EXITED {child.returncode}"))
        if not alive:
            raise SystemExit(log.read_text()[-3000:])

    rss.reset()
    answers, rate = closed_loop(grpc_port, bodies, args.clients, args.seconds)
    phase("saturation", answers, f"; {rate:.1f} Exports/s taken")
    drained(metrics_port)
    rss.reset()
    answers = overload(grpc_port, len(nodes), 3 * rate, args.seconds, args.outstanding, args.processes)
    recovery = drained(metrics_port)
    phase("3x overload", answers, f"; recovered {recovery:.1f} s after")
    transports = [("", grpc_port, at_once, flood, "malformed flood")]
    if not args.no_http:
        transports.append(("HTTP ", http_port, http_at_once, http_flood, "HTTP malformed"))
    for prefix, port, all_at_once, hostile, hostile_name in transports:
        rss.reset()
        answers = Counter()
        for _ in range(3):
            answers += all_at_once(port, big, args.big)
        drained(metrics_port)
        phase(f"{prefix}{args.big} x {len(big) / 2**20:.0f} MiB", answers)
        rss.reset()
        answers = hostile(port, bodies, args.clients, args.seconds)
        drained(metrics_port)
        phase(hostile_name, answers)
    counted, by_reason = refusals_counted(metrics_port)
    with channel(grpc_port) as ch:
        answering = ch.unary_unary(bf.EXPORT, request_serializer=None, response_deserializer=None)(b"", timeout=30)
    status = bf.proc_status(child.pid)
    print(f"refusals: {unavailable} UNAVAILABLE or 503 answers, {counted:.0f} counted by the sidecar ("
          + ", ".join(f"{k} {v:.0f}" for k, v in sorted(by_reason.items())) + ")")
    print(f"VmHWM {status['VmHWM'] / 1024:.0f} MiB = {status['VmHWM'] / 1024 / limit_mib:.2f} of the limit; "
          f"VmRSS at end {status['VmRSS'] / 1024:.0f} MiB; alive and answering: {answering == b''}")
    rss.close()


if __name__ == "__main__":
    main()
