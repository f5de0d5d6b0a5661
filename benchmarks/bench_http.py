"""The OTLP/HTTP receiver's cost per request, plaintext and over TLS (mutual TLS and a bearer
token), measured in one run.

The server runs in a process of its own: otelgpu's HttpReceiver and Ingest with the columnar
decoder, its queue drained by a thread that drops the batches (as bench_ingest.py does for gRPC).
Clients in this process POST Collector-shaped protobuf requests of about 100 KB over keep-alive
connections for `--seconds`, with 1 and with 4 clients. Printed per case: requests per second,
the server's CPU per request (from /proc), and TLS's ratio to plaintext. The certificates are
made here (the `cryptography` package of the test extra).

Usage: python benchmarks/bench_http.py [--seconds 8] [--clients 1 4]
"""

from __future__ import annotations

import argparse
import http.client
import os
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from bench_ingest import requests_of  # noqa: E402 - Collector-shaped requests of the benchmark fleet

SERVE = r"""
import json, sys, threading
from otelgpu.receiver.config import HttpReceiverConfig
from otelgpu.receiver.http_server import HttpReceiver
from otelgpu.receiver.ingest import Ingest
from otelgpu.receiver.interner import Interner
from otelgpu.receiver.limits import Limits, wanted_keys
from otelgpu.telemetry import SelfMetrics

metrics = SelfMetrics()
ingest = Ingest(Interner(), 64, 1.0, metrics, Limits(wanted=wanted_keys(())))

def drain():
    while True:
        if ingest.get(timeout=1) is not None:
            ingest.task_done()

threading.Thread(target=drain, daemon=True).start()
receiver = HttpReceiver(HttpReceiverConfig(**json.loads(sys.argv[1])), ingest, metrics, 64 << 20)
receiver.start()
print(receiver.port, flush=True)
sys.stdin.read()
receiver.shutdown()
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Server:
    def __init__(self, config: dict) -> None:
        import json

        self.proc = subprocess.Popen([sys.executable, "-c", SERVE, json.dumps(config)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def measure(server: Server, payloads: list[bytes], clients: int, seconds: float,
            context: ssl.SSLContext | None, token: str | None) -> tuple[float, float]:
    """(requests per second, server CPU milliseconds per request)."""
    headers = {"Content-Type": "application/x-protobuf", **({"Authorization": f"Bearer {token}"} if token else {})}
    counts: list[int] = []

    def client(first: int) -> None:
        conn = (http.client.HTTPSConnection("localhost", server.port, context=context, timeout=60) if context
                else http.client.HTTPConnection("127.0.0.1", server.port, timeout=60))
        i, end = first, time.monotonic() + seconds
        while time.monotonic() < end:
            conn.request("POST", "/v1/metrics", payloads[i % len(payloads)], headers)
            answer = conn.getresponse()
            answer.read()
            if answer.status != 200:
                raise RuntimeError(f"HTTP {answer.status}")
            i += 1
        counts.append(i - first)
        conn.close()

    threads = [threading.Thread(target=client, args=(k * 7,)) for k in range(clients)]
    cpu0, t0 = cpu_seconds(server.proc.pid), time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed, used, done = time.monotonic() - t0, cpu_seconds(server.proc.pid) - cpu0, sum(counts)
    return done / elapsed, used / done * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    from certs import Authority

    payloads = [p for p in requests_of(50, 4) if 90_000 <= len(p) <= 115_000]
    sizes = [len(p) for p in payloads]
    print(f"{len(payloads)} requests of {min(sizes) // 1000}-{max(sizes) // 1000} KB")
    with tempfile.TemporaryDirectory() as tmp:
        ca = Authority(Path(tmp))
        server, client = ca.issue("otelgpu", file="server"), ca.issue("bench", server=False, file="client")
        token = Path(tmp, "token")
        token.write_text("bench-token\n")
        context = ssl.create_default_context(cafile=str(ca.cert))
        context.load_cert_chain(client.cert, client.key)
        cases = {
            "plaintext": ({"endpoint": "127.0.0.1:0"}, None, None),
            "mTLS + token": ({"endpoint": "localhost:0", "auth": {"bearer_token_file": str(token)},
                              "tls": {"cert_file": str(server.cert), "key_file": str(server.key),
                                      "client_ca_file": str(ca.cert)}}, context, "bench-token"),
        }
        results: dict[tuple[str, int], tuple[float, float]] = {}
        for name, (config, ctx, tok) in cases.items():
            s = Server(config)
            try:
                measure(s, payloads, 1, 2.0, ctx, tok)  # warm: the decoder's kernels and label sets
                for n in args.clients:
                    results[(name, n)] = measure(s, payloads, n, args.seconds, ctx, tok)
            finally:
                s.stop()
    for (name, n), (rate, ms) in results.items():
        base_rate, base_ms = results[("plaintext", n)]
        ratio = "" if name == "plaintext" else f"   x{rate / base_rate:.2f} the rate, x{ms / base_ms:.2f} the CPU"
        print(f"{name:>13}, {n} client(s): {rate:7.0f} requests/s, server CPU {ms:.2f} ms/request{ratio}")


if __name__ == "__main__":
    main()
