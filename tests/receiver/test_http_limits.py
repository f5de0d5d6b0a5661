"""OTLP/HTTP connection limits against real sockets: idle floods, full servers, slow-loris clients
and idle keep-alive connections. Threads are counted by name, every wait is for a condition."""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time

import requests
from support import eventually

from otelgpu.receiver.http_server import HttpReceiver

from .helpers import VLLM

HEAD = (b"POST /v1/metrics HTTP/1.1\r\nHost: otelgpu\r\nContent-Type: application/x-protobuf\r\n"
        b"Content-Length: 1000\r\n")


def threads(receiver: HttpReceiver) -> int:
    prefix = f"otlp-http-conn-{receiver.port}-"
    return sum(t.name.startswith(prefix) for t in threading.enumerate())


def connect(receiver: HttpReceiver) -> socket.socket:
    # The timeout only keeps a broken test from hanging; no assertion depends on it.
    return socket.create_connection(("127.0.0.1", receiver.port), timeout=10)


def closed_by_server(sock: socket.socket) -> bool:
    """Read until the server closes; True when it did (EOF or reset), False on the safety timeout."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True  # nothing to read, and no EOF
    finally:
        sock.settimeout(10)


def trickle_until_closed(sock: socket.socket, byte: bytes) -> bool:
    """Send one byte every 50 ms until the server closes the connection (True), giving up after 20 s."""
    give_up = time.monotonic() + 20
    while time.monotonic() < give_up:
        try:
            sock.send(byte)
            readable, _, _ = select.select([sock], [], [], 0.05)
            if readable and not sock.recv(65536):
                return True
        except OSError:  # reset or broken pipe: the server closed it
            return True
    return False


def post(receiver: HttpReceiver, body: bytes) -> int:
    response = requests.post(f"http://127.0.0.1:{receiver.port}/v1/metrics", data=body,
                             headers={"Content-Type": "application/x-protobuf"}, timeout=10)
    return response.status_code


def refused(metrics, reason: str) -> int:
    return metrics.receiver_connections_refused[("http", reason)]


def test_idle_connections_beyond_the_limit_keep_threads_bounded(http_receiver, make_ingest, metrics, otel_request):
    receiver = http_receiver(make_ingest(), max_connections=4)
    socks, peak = [], 0
    for i in range(12):
        socks.append(connect(receiver))
        # Each newcomer beyond four closes the connection idle the longest: the first eight go.
        eventually(lambda: refused(metrics, "idle_evicted") == max(0, i - 3)
                   and receiver.connections() == {"idle": min(i + 1, 4)})
        peak = max(peak, threads(receiver))
    assert peak == 4 and threads(receiver) == 4
    assert all(closed_by_server(s) for s in socks[:8])
    assert all(still_open(s) for s in socks[8:])
    # a real sender still gets through: it takes the place of the oldest idle connection
    assert post(receiver, otel_request(VLLM).SerializeToString()) == 200
    assert refused(metrics, "idle_evicted") == 9 and refused(metrics, "connection_limit") == 0
    assert closed_by_server(socks[8]) and threads(receiver) <= 4
    for s in socks:
        s.close()
    eventually(lambda: threads(receiver) == 0)


def test_full_of_requests_under_way_a_newcomer_gets_503_with_retry_after(http_receiver, make_ingest, metrics,
                                                                         otel_request):
    receiver = http_receiver(make_ingest(), max_connections=2)
    slow = [connect(receiver) for _ in range(2)]
    for s in slow:
        s.sendall(HEAD + b"\r\n0123")  # a body begun and never finished: not idle, cannot be evicted
    eventually(lambda: receiver.connections() == {"reading": 2})
    newcomer = connect(receiver)
    answer = b""
    while chunk := newcomer.recv(65536):
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"\r\nRetry-After: 1\r\n" in head
    assert json.loads(body)["code"] == 14  # UNAVAILABLE, as a google.rpc.Status
    assert refused(metrics, "connection_limit") == 1 and threads(receiver) == 2
    for s in slow:  # the senders give up: their places free
        s.close()
    eventually(lambda: threads(receiver) == 0)
    assert post(receiver, otel_request(VLLM).SerializeToString()) == 200


def test_slow_loris_is_cut_at_the_read_deadline_while_others_are_served(http_receiver, make_ingest, metrics,
                                                                        otel_request):
    receiver = http_receiver(make_ingest(), read_timeout_seconds=0.5, max_connections=3)
    body = otel_request(VLLM).SerializeToString()
    in_headers, in_body = connect(receiver), connect(receiver)
    in_headers.sendall(HEAD + b"X-Slow: ")
    in_body.sendall(HEAD + b"\r\n")
    results: dict[str, bool] = {}
    trickles = [threading.Thread(target=lambda k=k, s=s, b=b: results.__setitem__(k, trickle_until_closed(s, b)))
                for k, s, b in (("headers", in_headers, b"a"), ("body", in_body, b"0"))]
    for t in trickles:
        t.start()
    eventually(lambda: receiver.connections().get("reading") == 2)
    assert post(receiver, body) == 200  # on the third place, while both trickle
    for t in trickles:
        t.join()
    # each recv got its byte in time: only the deadline for the whole request could end them
    assert results == {"headers": True, "body": True}
    assert refused(metrics, "read_timeout") == 2
    assert dict(metrics.requests) == {("http", "ok"): 1}  # the cut requests were never answered
    eventually(lambda: threads(receiver) == 0)


def test_idle_keep_alive_connection_is_closed(http_receiver, make_ingest, metrics, otel_request):
    receiver = http_receiver(make_ingest(), idle_timeout_seconds=0.5)
    silent = connect(receiver)  # a connection that never sends anything is idle from the start
    client = http.client.HTTPConnection("127.0.0.1", receiver.port, timeout=10)
    for _ in range(2):  # kept alive between requests that come in time
        client.request("POST", "/v1/metrics", otel_request(VLLM).SerializeToString(),
                       {"Content-Type": "application/x-protobuf"})
        response = client.getresponse()
        assert response.status == 200 and response.getheader("Connection") != "close"
        response.read()
    assert client.sock is not None and closed_by_server(client.sock)
    assert closed_by_server(silent)
    assert refused(metrics, "idle_timeout") == 2 and metrics.requests[("http", "ok")] == 2
    eventually(lambda: threads(receiver) == 0)
    client.close()


def test_shutdown_closes_idle_connections(http_receiver, make_ingest, metrics):
    receiver = http_receiver(make_ingest())  # idle timeout 60 s: only shutdown can close it this soon
    sock = connect(receiver)
    eventually(lambda: receiver.connections() == {"idle": 1})
    receiver.shutdown()
    assert closed_by_server(sock)
    eventually(lambda: threads(receiver) == 0)
