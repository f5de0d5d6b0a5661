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

Usage: python benchmarks/bench_ingest.py [--points 1000 10000] [--seconds 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_footprint as bf  # noqa: E402 - the fleet and its scrapes

from otelgpu.demo import scrapes  # noqa: E402
from otelgpu.enrich.window import NS  # noqa: E402

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


def measure(kind: str, payloads: list[bytes], points_each: list[int], gzip: bool, seconds: float) -> float:
    """Server CPU microseconds per point."""
    port_file = f"/tmp/otelgpu-bench-ingest-{os.getpid()}-{kind}"
    child = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port-file", port_file],
                             stdin=subprocess.PIPE, text=True)
    try:
        while not (os.path.exists(port_file) and Path(port_file).read_text()):
            if child.poll() is not None:
                raise SystemExit(f"{kind} server exited")
            time.sleep(0.05)
        port = int(Path(port_file).read_text())
        compression = grpc.Compression.Gzip if gzip else grpc.Compression.NoCompression
        with grpc.insecure_channel(f"127.0.0.1:{port}", compression=compression,
                                   options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
            export = channel.unary_unary(bf.EXPORT, request_serializer=None, response_deserializer=None)
            for raw in payloads[:3]:  # warm: JIT caches loaded, label sets learnt once
                export(raw, timeout=60)
            for raw in payloads:  # every label set once, as after the first scrape of a cluster
                export(raw, timeout=60)
            start, sent, i = bf.cpu_seconds(child.pid), 0, 0
            began = time.monotonic()
            while time.monotonic() - began < seconds:
                export(payloads[i % len(payloads)], timeout=60)
                sent += points_each[i % len(payloads)]
                i += 1
            used = bf.cpu_seconds(child.pid) - start
        return used / sent * 1e6
    finally:
        child.stdin.close()
        child.wait(timeout=30)
        Path(port_file).unlink(missing_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--port-file", help=argparse.SUPPRESS)
    ap.add_argument("--points", type=int, nargs="+", default=[1000, 10000], help="points per request")
    ap.add_argument("--seconds", type=float, default=5.0, help="sending time per server and setting")
    ap.add_argument("--reference", action="store_true", help="also measure the reference decoder")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.port_file)
        return
    kinds = ["do-nothing", "otelgpu"] + (["reference"] if args.reference else [])
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


if __name__ == "__main__":
    main()
