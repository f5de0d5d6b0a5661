"""Server CPU per received point: otelgpu's OTLP/gRPC receiver against a do-nothing gRPC server
taking the same bytes.

Each server runs in a process of its own: `do-nothing` answers every Export with an empty response
without looking at the bytes; `otelgpu` is the sidecar's receiver (GrpcReceiver and Ingest, with
the columnar decoder), its queue drained by a thread that drops the batches; `reference` is the
same with the reference decoder (protobuf messages, a Python loop per point). The client sends the
same Collector-shaped requests (dcgm-exporter's default counters for whole, MIG and time-sliced
GPUs, kube-state-metrics) to each, with gzip on and off, and reads each server's CPU time from
/proc before and after. Printed: microseconds of server CPU per point, and the ratio to the
do-nothing server measured in the same run.

`--collector` puts the real Collector (tests/otelcol.py builds it) between the client and each
server, as the shipped gateway runs it: its `batch` processor and its `otlp_grpc/otelgpu` exporter
(the sending queue in memory), exporting with gzip and without. Printed: the Collector's and the
server's CPU per point, read once the Collector has sent on every point it took.

Usage: python benchmarks/bench_ingest.py [--points 1000 10000] [--seconds 5] [--reference] [--collector]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import grpc
import yaml
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "tests")]
import bench_footprint as bf  # noqa: E402 - the fleet and its scrapes
from support import eventually, poll  # noqa: E402

from otelgpu.demo import scrapes  # noqa: E402
from otelgpu.enrich.window import NS  # noqa: E402

TO_OTELGPU = "otlp_grpc/otelgpu"  # the shipped gateway's exporter to otelgpu (collector-config/gateway.yaml)


def serve(kind: str, port_file: str) -> None:
    """Child process: one server of `kind` until stdin closes."""
    from concurrent import futures

    if kind == "do-nothing":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                             options=[("grpc.max_receive_message_length", 64 << 20)])
        handler = grpc.unary_unary_rpc_method_handler(lambda raw, ctx: bf.EMPTY, request_deserializer=None,
                                                      response_serializer=None)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            bf.SERVICE, {"Export": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
    else:
        from otelgpu.receiver import columnar
        from otelgpu.receiver.config import GrpcReceiverConfig
        from otelgpu.receiver.grpc_server import GrpcReceiver
        from otelgpu.receiver.ingest import Ingest
        from otelgpu.receiver.interner import Interner
        from otelgpu.receiver.limits import Limits, wanted_keys
        from otelgpu.telemetry import SelfMetrics

        if kind == "reference":
            columnar.ColumnarDecoder.decode = lambda self, raw, now_ns=None: None  # type: ignore[method-assign]
        metrics = SelfMetrics()
        ingest = Ingest(Interner(), 64, 1.0, metrics, Limits(wanted=wanted_keys(())))

        def drain() -> None:
            while True:
                if ingest.get(timeout=1) is not None:
                    ingest.task_done()

        threading.Thread(target=drain, daemon=True).start()
        receiver = GrpcReceiver(GrpcReceiverConfig(endpoint="127.0.0.1:0", max_recv_msg_size_mib=64), ingest, metrics)
        receiver.start()
        port = receiver.port
    Path(port_file).write_text(str(port))
    sys.stdin.read()


def requests_of(points: int, scrape_times: int) -> list[bytes]:
    """Collector batches of about `points` points: successive scrapes of a 10,000-GPU fleet's
    dcgm-exporter and kube-state-metrics targets, cut to that size."""
    nodes, ns = bf.fleet(600, 0)
    now = time.time_ns() // NS * NS
    out: list[bytes] = []
    for k in range(scrape_times):
        t = now - (scrape_times - k) * 15 * NS
        targets = [scrapes.ksm(nodes[:200], ns, t)] + [bf.dcgm(n, t, 0.3) for n in nodes]
        batch: list = []
        size = 0
        for rm in targets:  # whole targets until the size, as the Collector's batch processor
            batch.append(rm)
            size += bf.points(rm)
            if size >= points:
                out.append(bf.request(*batch).SerializeToString())
                batch, size = [], 0
    return out


@contextlib.contextmanager
def server(kind: str) -> Iterator[tuple[subprocess.Popen, int]]:
    """A server of `kind` in a child process, and its port."""
    port_file = f"/tmp/otelgpu-bench-ingest-{os.getpid()}-{kind}"
    child = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port-file", port_file],
                             stdin=subprocess.PIPE, text=True)
    try:
        def written() -> str:
            if child.poll() is not None:
                raise SystemExit(f"{kind} server exited")
            return Path(port_file).read_text() if os.path.exists(port_file) else ""

        port = poll(written, 120)
        if not port:
            raise SystemExit(f"{kind} server gave no port in 120 s")
        yield child, int(port)
    finally:
        child.stdin.close()
        child.wait(timeout=30)
        Path(port_file).unlink(missing_ok=True)


@contextlib.contextmanager
def sending(port: int, gzip: bool) -> Iterator[Callable[[bytes], object]]:
    """An Export of raw request bytes to `port`, blocking until answered."""
    compression = grpc.Compression.Gzip if gzip else grpc.Compression.NoCompression
    with grpc.insecure_channel(f"127.0.0.1:{port}", compression=compression,
                               options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        export = channel.unary_unary(bf.EXPORT, request_serializer=None, response_deserializer=None)
        yield lambda raw: export(raw, timeout=60)


def warm(export: Callable[[bytes], object], payloads: list[bytes]) -> None:
    """JIT caches loaded, every label set learnt once, as after the first scrape of a cluster."""
    for raw in payloads[:3] + payloads:
        export(raw)


def send_for(export: Callable[[bytes], object], payloads: list[bytes], points_each: list[int], seconds: float) -> int:
    """The payloads in turn for `seconds`, each once answered; the points sent."""
    sent, i = 0, 0
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        export(payloads[i % len(payloads)])
        sent += points_each[i % len(payloads)]
        i += 1
    return sent


def measure(kind: str, payloads: list[bytes], points_each: list[int], gzip: bool, seconds: float) -> float:
    """Server CPU microseconds per point, the client sending to it directly."""
    with server(kind) as (child, port), sending(port, gzip) as export:
        warm(export, payloads)
        start = bf.cpu_seconds(child.pid)
        sent = send_for(export, payloads, points_each, seconds)
        return (bf.cpu_seconds(child.pid) - start) / sent * 1e6


def collector_config(port_in: int, port_out: int, compression: str) -> dict:
    """An otlp receiver for the client, the shipped gateway's batch processor and its exporter to
    otelgpu (`compression` set; its sending queue in memory rather than in a file)."""
    shipped = yaml.safe_load((REPO / "collector-config" / "gateway.yaml").read_text())
    exporter = {**shipped["exporters"][TO_OTELGPU], "endpoint": f"127.0.0.1:{port_out}", "compression": compression}
    exporter["sending_queue"] = {k: v for k, v in exporter["sending_queue"].items() if k != "storage"}
    return {"receivers": {"otlp": {"protocols": {"grpc": {"endpoint": f"127.0.0.1:{port_in}",
                                                          "max_recv_msg_size_mib": 64}}}},
            "processors": {"batch": shipped["processors"]["batch"]},
            "exporters": {TO_OTELGPU: exporter},
            "service": {"pipelines": {"metrics": {"receivers": ["otlp"], "processors": ["batch"],
                                                  "exporters": [TO_OTELGPU]}}}}


def measure_through_collector(kind: str, payloads: list[bytes], points_each: list[int], gzip: bool,
                              seconds: float) -> tuple[float, float]:
    """(the Collector's, the server's) CPU microseconds per point: the client sends to the real
    Collector uncompressed, which batches and exports to the server as the shipped gateway does,
    with gzip or without. The CPU is read once the Collector has sent on every point it took."""
    from otelcol import Collector, binary

    binary()  # built before anything is timed
    with server(kind) as (child, port), tempfile.TemporaryDirectory(prefix="otelgpu-bench-hop-") as work:
        port_in = bf.free_port()
        collector = Collector(Path(work), collector_config(port_in, port, "gzip" if gzip else "none"), {})
        try:
            collector.start()
            with sending(port_in, False) as export:
                warm(export, payloads)
                passed(collector)
                start = bf.cpu_seconds(collector.proc.pid), bf.cpu_seconds(child.pid)
                sent = send_for(export, payloads, points_each, seconds)
                passed(collector)
                used = bf.cpu_seconds(collector.proc.pid) - start[0], bf.cpu_seconds(child.pid) - start[1]
        finally:
            collector.close()
    return used[0] / sent * 1e6, used[1] / sent * 1e6


def passed(collector) -> None:  # noqa: ANN001 - tests/otelcol.Collector
    """Wait until the Collector has sent on every point its receiver accepted."""
    def through() -> bool:
        accepted = collector.total("otelcol_receiver_accepted_metric_points_total")
        return accepted > 0 and collector.total("otelcol_exporter_sent_metric_points_total") == accepted

    eventually(through, 120, message=lambda: "the Collector did not send on what it took:\n" + collector.tail())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--port-file", help=argparse.SUPPRESS)
    ap.add_argument("--points", type=int, nargs="+", default=[1000, 10000], help="points per request")
    ap.add_argument("--seconds", type=float, default=5.0, help="sending time per server and setting")
    ap.add_argument("--reference", action="store_true", help="also measure the reference decoder")
    ap.add_argument("--collector", action="store_true",
                    help="send through the real Collector (the shipped gateway's batch and exporter) instead")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.port_file)
        return
    kinds = ["do-nothing", "otelgpu"] + (["reference"] if args.reference else [])
    if args.collector:
        through_collector(kinds, args.points, args.seconds)
        return
    for size in args.points:
        payloads = requests_of(size, 4)
        counts = [sum(bf.points(rm) for rm in metrics_service_pb2.ExportMetricsServiceRequest.FromString(p)
                      .resource_metrics) for p in payloads]
        mean_points = sum(counts) / len(counts)
        mean_bytes = sum(map(len, payloads)) / len(payloads)
        for gzip in (False, True):
            got = {kind: measure(kind, payloads, counts, gzip, args.seconds) for kind in kinds}
            base = got["do-nothing"]
            print(f"{mean_points:,.0f}-point requests ({mean_bytes / 2**20:.2f} MiB), gzip {'on' if gzip else 'off'}: "
                  + ", ".join(f"{kind} {us:.2f} us/point ({us / base:.1f}x)" for kind, us in got.items()))


def through_collector(kinds: list[str], sizes: list[int], seconds: float) -> None:
    for size in sizes:
        payloads = requests_of(size, 4)
        counts = [sum(bf.points(rm) for rm in metrics_service_pb2.ExportMetricsServiceRequest.FromString(p)
                      .resource_metrics) for p in payloads]
        for gzip in (False, True):
            got = {kind: measure_through_collector(kind, payloads, counts, gzip, seconds) for kind in kinds}
            print(f"via the Collector, compression {'gzip' if gzip else 'none'}: " + ", ".join(
                f"to {kind}: Collector {col:.2f} us/point, {kind} {srv:.2f}" for kind, (col, srv) in got.items()),
                flush=True)


if __name__ == "__main__":
    main()
