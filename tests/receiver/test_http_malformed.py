"""Malformed and cut-short HTTP on the OTLP/HTTP receiver, over raw sockets: every request whose
request line arrived is answered (400, 408, 413, 431 or 501, as the Collector's own receiver, Go's
net/http, answers), a client that half-closes after its request still gets its answer, each
answer is counted once, and valid senders alongside lose nothing."""

from __future__ import annotations

import random
import socket
import threading

import pytest
import requests
from fuzzing import broken_http
from support import eventually

from otelgpu.receiver.http_server import HttpReceiver
from otelgpu.telemetry import by_label

from .helpers import VLLM, drain_points

PB = "application/x-protobuf"


def exchange(receiver: HttpReceiver, data: bytes, half_close: bool = True) -> bytes:
    """Send `data`, end our side of the stream (a half-close) and read all the server says until it closes."""
    with socket.create_connection(("127.0.0.1", receiver.port), timeout=30) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
        return out


def statuses(answer: bytes) -> list[int]:
    """The status of every answer in what the server sent (several where requests were pipelined)."""
    found, at = [], 0
    while (at := answer.find(b"HTTP/1.1 ", at)) >= 0:
        found.append(int(answer[at + 9:at + 12]))
        at += 12
    return found


def request_bytes(body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST /v1/metrics HTTP/1.1\r\nHost: otelgpu\r\nContent-Type: " + PB.encode() + b"\r\n"
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body)


def counted(metrics) -> int:
    """Requests the receiver counted as answered, whatever the outcome."""
    return sum(n for (transport, _), n in by_label(metrics.requests).items() if transport == "http")


def test_a_request_followed_by_a_half_close_is_answered_and_taken(http_receiver, make_ingest, metrics, otel_request):
    ingest = make_ingest()
    receiver = http_receiver(ingest)
    answer = exchange(receiver, request_bytes(otel_request(VLLM).SerializeToString()))
    assert statuses(answer) == [200]
    assert drain_points(ingest) == 2 and by_label(metrics.requests)[("http", "ok")] == 1


@pytest.mark.parametrize(("data", "status"), [
    (b"POST /v1/metrics HTTP/1.1\r\nHost: otelgpu\r\nContent-Type: application/x-", 400),  # headers cut short
    (b"POST /v1/metrics HTTP/1.1\r\nHost: otelgpu\r\nContent-Length: 100\r\n\r\nshort", 400),  # body cut short
    (b"POST /v1/metrics HTTP/1.1\r\nHost: otelgpu\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),  # bad chunk
    (b"POST /v1/metrics HTTP/1.1\r\nHost otelgpu\r\n\r\n", 400),  # a header without its colon
    (b"POST /v1/metrics HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!", 400),  # two lengths
    (b"NOT HTTP AT ALL\r\n\r\n", 400),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(32), 400),  # a TLS ClientHello to the plaintext port
    (b"POST /v1/metrics HTTP/1.1\r\nHost: otelgpu\r\nTransfer-Encoding: gzip\r\n\r\nxx", 501),
    (b"POST /v1/metrics HTTP/1.1\r\nHost: otelgpu\r\nX-Big: " + b"a" * (80 * 1024) + b"\r\n\r\n", 431),
    (b"POST /v1/metrics HTTP/1.1\r\nHost: otelgpu\r\nContent-Length: 99999999999\r\n\r\n", 413),
])
def test_malformed_http_is_answered_and_counted(http_receiver, make_ingest, metrics, otel_request, data, status):
    receiver = http_receiver(make_ingest())
    assert statuses(exchange(receiver, data)) == [status]
    assert by_label(metrics.requests)[("http", "invalid")] == 1
    response = requests.post(f"http://127.0.0.1:{receiver.port}/v1/metrics", data=otel_request(VLLM).SerializeToString(),
                             headers={"Content-Type": PB}, timeout=10)
    assert response.status_code == 200


def test_requests_begun_and_not_finished_by_their_deadlines_get_408(http_receiver, make_ingest, metrics):
    receiver = http_receiver(make_ingest(), idle_timeout_seconds=0.5, read_timeout_seconds=0.5)
    refused = metrics.receiver_connections_refused
    assert statuses(exchange(receiver, b"POST /v1/met", half_close=False)) == [408]
    assert statuses(exchange(receiver, request_bytes(b"x" * 1000)[:-10], half_close=False)) == [408]
    assert exchange(receiver, b"", half_close=False) == b""  # nothing begun: closed without a word
    assert by_label(refused)[("http", "idle_timeout")] == 2 and by_label(refused)[("http", "read_timeout")] == 1


def test_fuzzed_requests_are_all_answered_and_counted_while_valid_senders_lose_nothing(
        http_receiver, make_ingest, metrics, otel_request):
    ingest = make_ingest(queue_size=4096)
    receiver = http_receiver(ingest)
    valid = request_bytes(otel_request(VLLM).SerializeToString())
    rng = random.Random(20261128)
    answers: list[int] = []
    good: list[int] = []
    stop = threading.Event()

    def send_valid() -> None:
        with requests.Session() as session:
            while not stop.is_set():
                good.append(session.post(f"http://127.0.0.1:{receiver.port}/v1/metrics",
                                         data=otel_request(VLLM).SerializeToString(),
                                         headers={"Content-Type": PB}, timeout=30).status_code)

    sender = threading.Thread(target=send_valid)
    sender.start()
    try:
        for _ in range(400):
            data = broken_http(rng, valid)
            if not data:
                continue
            got = statuses(exchange(receiver, data))
            assert got, f"no answer to {data[:120]!r}"
            answers += got
    finally:
        stop.set()
        sender.join()
    assert good and set(good) == {200}
    # every answer counted once, whichever its outcome; the server said 400 on its own to many
    eventually(lambda: counted(metrics) == len(answers) + len(good))
    assert {400, 200} <= set(answers)
    assert drain_points(ingest) >= 2 * len(good)
