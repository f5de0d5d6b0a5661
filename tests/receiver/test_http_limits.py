"""OTLP/HTTP connection limits against real sockets: idle floods, full servers, slow-loris clients in
the headers and in the body, idle keep-alive connections, shutdown, and the worker threads, which
stay few whatever the number of connections. Threads are counted by name, every wait is for a
condition."""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time

import requests
from support import eventually

from otelgpu.receiver.http_server import WORKERS, HttpReceiver
from otelgpu.telemetry import by_label

from .helpers import VLLM

HEAD = (b"POST /v1/metrics HTTP/1.1\r\nHost: otelgpu\r\nContent-Type: application/x-protobuf\r\n"
        b"Content-Length: 1000\r\n")


def threads(receiver: HttpReceiver) -> int:
    """The receiver's threads: its event loop and its workers."""
    prefix = f"otlp-http-{receiver.port}"
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
    return by_label(metrics.receiver_connections_refused)[("http", reason)]


class Gate:
    """A consumer that holds every request until opened: keeps the workers busy on demand."""

    def __init__(self, inner) -> None:
        self.inner, self.opened, self.entered = inner, threading.Event(), 0
        self._lock = threading.Lock()

    def consume(self, request):
        with self._lock:
            self.entered += 1
        self.opened.wait(30)
        return self.inner.consume(request)


def test_idle_connections_beyond_the_limit_are_evicted_oldest_first(http_receiver, make_ingest, metrics, otel_request):
    receiver = http_receiver(make_ingest(), max_connections=4)
    socks = []
    for i in range(12):
        socks.append(connect(receiver))
        # Each newcomer beyond four closes the connection idle the longest: the first eight go.
        eventually(lambda: refused(metrics, "idle_evicted") == max(0, i - 3)
                   and receiver.connections() == {"idle": min(i + 1, 4)})
    assert all(closed_by_server(s) for s in socks[:8])
    assert all(still_open(s) for s in socks[8:])
    # a real sender still gets through: it takes the place of the oldest idle connection
    assert post(receiver, otel_request(VLLM).SerializeToString()) == 200
    assert refused(metrics, "idle_evicted") == 9 and refused(metrics, "connection_limit") == 0
    assert closed_by_server(socks[8])
    assert threads(receiver) == 1 + WORKERS  # the loop and the workers, whatever the connections
    for s in socks:
        s.close()
    eventually(lambda: receiver.connections() == {})


def held(receiver: HttpReceiver, gate: "Gate", body: bytes, n: int) -> list[threading.Thread]:
    """`n` valid requests whose handlers the gate holds: their connections busy, not idle, not slow."""
    senders = [threading.Thread(target=post, args=(receiver, body)) for _ in range(n)]
    for t in senders:
        t.start()
    eventually(lambda: gate.entered == n and receiver.connections() == {"busy": n})
    return senders


def test_full_of_requests_under_way_a_newcomer_gets_503_with_retry_after(http_receiver, make_ingest, metrics,
                                                                         otel_request):
    body = otel_request(VLLM).SerializeToString()
    gate = Gate(make_ingest())
    receiver = http_receiver(gate, max_connections=2)
    senders = held(receiver, gate, body, 2)
    newcomer = connect(receiver)
    answer = b""
    while chunk := newcomer.recv(65536):
        answer += chunk
    head, _, reply = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"\r\nRetry-After: 1\r\n" in head
    assert b"\r\nContent-Type: application/json\r\n" in head
    assert json.loads(reply)["code"] == 14  # UNAVAILABLE, as a google.rpc.Status
    assert refused(metrics, "connection_limit") == 1
    assert by_label(metrics.requests)[("http", "unavailable")] == 1  # counted as every "retry later"
    gate.opened.set()  # the requests are answered: their places free once the answers are written
    for t in senders:
        t.join()
    eventually(lambda: "busy" not in receiver.connections())
    assert post(receiver, body) == 200


def test_senders_trickling_bodies_make_room_for_a_valid_one(http_receiver, make_ingest, metrics, otel_request):
    """A body arriving slower than any network sends is cut when a newcomer needs its place, the
    slowest first."""
    receiver = http_receiver(make_ingest(), max_connections=4)
    slow = []
    for _ in range(4):
        slow.append(connect(receiver))
        slow[-1].sendall(HEAD + b"\r\n0123")  # a body begun and never finished
        eventually(lambda: receiver.connections() == {"reading": len(slow)})
    assert post(receiver, otel_request(VLLM).SerializeToString()) == 200
    assert refused(metrics, "slow_evicted") == 1 and refused(metrics, "connection_limit") == 0
    assert closed_by_server(slow[0])  # the same bytes for the longest time: the slowest
    assert all(still_open(s) for s in slow[1:])
    for s in slow:
        s.close()


def test_hundreds_of_idle_and_trickling_connections_do_not_keep_a_valid_sender_out(http_receiver, make_ingest,
                                                                                  metrics, otel_request):
    receiver = http_receiver(make_ingest())  # 32 connections at most
    body = otel_request(VLLM).SerializeToString()
    hostile = []
    for i in range(300):
        hostile.append(connect(receiver))
        if i % 2:
            hostile[-1].sendall(HEAD + b"\r\n0")  # a body begun, then nothing
    for _ in range(5):
        assert post(receiver, body) == 200
    assert refused(metrics, "connection_limit") == 0
    for s in hostile:
        s.close()


def test_a_sender_of_a_request_refused_for_a_full_server_reads_the_503(http_receiver, make_ingest, metrics,
                                                                       otel_request):
    """requests sends its whole body before reading: the refusal drains it, so the close does not
    reset the connection under the answer."""
    gate = Gate(make_ingest())
    receiver = http_receiver(gate, max_connections=1)
    senders = held(receiver, gate, otel_request(VLLM).SerializeToString(), 1)
    response = requests.post(f"http://127.0.0.1:{receiver.port}/v1/metrics", data=b"\0" * 200_000,
                             headers={"Content-Type": "application/x-protobuf"}, timeout=10)
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert response.json()["code"] == 14
    gate.opened.set()
    for t in senders:
        t.join()


def test_slow_loris_is_cut_at_the_header_and_body_deadlines_while_others_are_served(
        http_receiver, make_ingest, metrics, otel_request):
    receiver = http_receiver(make_ingest(), idle_timeout_seconds=0.5, read_timeout_seconds=0.5, max_connections=3)
    body = otel_request(VLLM).SerializeToString()
    in_headers, in_body = connect(receiver), connect(receiver)
    in_headers.sendall(HEAD + b"X-Slow: ")
    in_body.sendall(HEAD + b"\r\n")
    results: dict[str, bool] = {}
    trickles = [threading.Thread(target=lambda k=k, s=s, b=b: results.__setitem__(k, trickle_until_closed(s, b)))
                for k, s, b in (("headers", in_headers, b"a"), ("body", in_body, b"0"))]
    for t in trickles:
        t.start()
    assert post(receiver, body) == 200  # on the third place, while both trickle
    for t in trickles:
        t.join()
    # each recv got its byte in time: only a deadline for the whole header block or body could end them
    assert results == {"headers": True, "body": True}
    eventually(lambda: receiver.connections() == {})  # counted as the server lets go of them
    assert refused(metrics, "idle_timeout") == 1 and refused(metrics, "read_timeout") == 1
    assert dict(by_label(metrics.requests)) == {("http", "ok"): 1}  # the cut requests were never answered


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
    eventually(lambda: receiver.connections() == {})  # counted as the server lets go of them
    assert refused(metrics, "idle_timeout") == 2 and by_label(metrics.requests)[("http", "ok")] == 2
    client.close()


def test_shutdown_closes_idle_connections_and_answers_requests_under_way(http_receiver, make_ingest, metrics,
                                                                         otel_request):
    gate = Gate(make_ingest())
    receiver = http_receiver(gate)  # idle timeout 60 s: only shutdown can close it this soon
    sock = connect(receiver)
    eventually(lambda: receiver.connections() == {"idle": 1})
    codes: list[int] = []
    sender = threading.Thread(target=lambda: codes.append(post(receiver, otel_request(VLLM).SerializeToString())))
    sender.start()
    eventually(lambda: gate.entered == 1)
    stopping = threading.Thread(target=receiver.shutdown)
    stopping.start()
    assert closed_by_server(sock)  # at once, while the request under way is still held
    gate.opened.set()
    sender.join()
    stopping.join()
    assert codes == [200]
    assert refused(metrics, "idle_timeout") == 0
    eventually(lambda: threads(receiver) == 0)
    try:
        connect(receiver).close()
        raise AssertionError("still accepting after shutdown")
    except ConnectionRefusedError:
        pass


def test_workers_stay_few_and_requests_beyond_the_queue_get_503(http_receiver, make_ingest, metrics, otel_request):
    """Twelve senders at once on four workers: all wait on open connections, none gets a thread of
    its own. Requests whose senders left still hold their place until handled: beyond the workers
    and the queue (one waiting request per connection) a newcomer gets 503 with Retry-After."""
    gate = Gate(make_ingest())
    receiver = http_receiver(gate, max_connections=12)
    body = otel_request(VLLM).SerializeToString()
    codes: list[int] = []
    senders = [threading.Thread(target=lambda: codes.append(post(receiver, body))) for _ in range(12)]
    for s in senders:
        s.start()
    eventually(lambda: gate.entered == WORKERS and receiver.connections() == {"busy": 12})
    assert threads(receiver) == 1 + WORKERS
    gate.opened.set()
    for s in senders:
        s.join()
    assert codes == [200] * 12

    gate.opened.clear()
    gate.entered = 0
    limit = WORKERS + 12  # the workers, and one waiting request per allowed connection
    for n in range(limit):  # each sender leaves; its request stays, held by a worker or queued
        with connect(receiver) as s:
            s.sendall(HEAD.replace(b"1000", str(len(body)).encode()) + b"\r\n" + body)
            eventually(lambda: receiver.connections().get("busy") == 1)
        eventually(lambda: receiver.connections() == {})
    assert gate.entered == WORKERS and threads(receiver) == 1 + WORKERS
    response = requests.post(f"http://127.0.0.1:{receiver.port}/v1/metrics", data=body,
                             headers={"Content-Type": "application/x-protobuf"}, timeout=10)
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert response.headers["Content-Type"] == "application/x-protobuf"  # the sender's own format
    assert refused(metrics, "concurrent_requests") == 1
    gate.opened.set()
    eventually(lambda: receiver._server.under_way() == 0)  # places free as the held requests are handled
    assert gate.entered == limit and post(receiver, body) == 200


def test_a_sender_that_writes_its_whole_body_before_reading_gets_the_503(http_receiver, make_ingest, metrics,
                                                                          otel_request):
    """Refused from its headers, "retry later": the body is read and dropped to its end, so a
    client that reads nothing until it has sent everything (Python's http.client) gets the 503
    instead of a connection reset by the close."""
    gate = Gate(make_ingest())
    receiver = http_receiver(gate, max_connections=2)
    body = otel_request(VLLM).SerializeToString()
    held = WORKERS + 2  # the workers, and one waiting request per allowed connection
    for _ in range(held):
        with connect(receiver) as s:
            s.sendall(HEAD.replace(b"1000", str(len(body)).encode()) + b"\r\n" + body)
            eventually(lambda: receiver.connections().get("busy") == 1)
        eventually(lambda: receiver.connections() == {})
    big = b"\x00" * (8 << 20)  # far more than the socket buffers and the 1 MiB taken after other refusals
    for _ in range(3):
        client = http.client.HTTPConnection("127.0.0.1", receiver.port, timeout=30)
        client.request("POST", "/v1/metrics", big, {"Content-Type": "application/x-protobuf"})  # all of it, then read
        response = client.getresponse()
        assert response.status == 503 and response.getheader("Retry-After") == "1"
        client.close()
    assert refused(metrics, "concurrent_requests") == 3
    gate.opened.set()
    eventually(lambda: receiver._server.under_way() == 0)
    assert gate.entered == held and post(receiver, body) == 200
