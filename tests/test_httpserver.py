"""otelgpu.httpserver.BoundedServer on real sockets, apart from the receiver and /metrics: the write
deadline, framing refusals from the headers, HEAD, handler failures, every-interface binds, a stop
that does not wait for a stuck handler, and malformed HTTP answered as Go's net/http answers it."""

from __future__ import annotations

import socket
import threading

import pytest
import requests
from support import eventually

from otelgpu.httpserver import BoundedServer, Limits, Request, Response

LIMITS = Limits(max_connections=8, header_timeout_s=30, body_timeout_s=30, write_timeout_s=30, max_body_bytes=1000,
                workers=2, queued=2)


class Served:
    """A BoundedServer on 127.0.0.1:0 with its refusals counted."""

    def __init__(self, handle, limits: Limits = LIMITS, host: str = "127.0.0.1", **options) -> None:
        self.refusals: list[str] = []
        self.server = BoundedServer("test-http", host, 0, handle, limits, refused=self.refusals.append, **options)
        self.server.start()
        self.url = f"http://127.0.0.1:{self.server.port}"

    def raw(self, data: bytes) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.server.port), timeout=10)
        sock.sendall(data)
        return sock


@pytest.fixture
def served():
    started: list[Served] = []

    def start(handle, limits: Limits = LIMITS, host: str = "127.0.0.1", **options) -> Served:
        started.append(Served(handle, limits, host, **options))
        return started[-1]

    yield start
    for s in started:
        s.server.stop(grace=0)


def answer_of(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def echo(request: Request) -> Response:
    return Response(200, request.body or b"empty", {"Content-Type": "text/plain"})


def test_an_answer_not_taken_is_cut_at_the_write_deadline(served):
    big = b"x" * (64 << 20)  # far more than the socket buffers hold
    # only "/" is big: a second client reading the big answer could not be sure to take it within the deadline
    s = served(lambda request: Response(200, big if request.path == "/" else b"small"),
               Limits(max_connections=4, header_timeout_s=30, body_timeout_s=30, write_timeout_s=0.3,
                      max_body_bytes=1000))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", s.server.port))
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # and never reads the answer
    eventually(lambda: s.refusals == ["write_timeout"], timeout=10)
    eventually(lambda: s.server.connections() == {})
    assert requests.get(s.url + "/small", timeout=10).text == "small"  # the worker was freed long before
    sock.close()


def test_bodies_need_a_content_length_or_chunks_within_the_limit(served):
    s = served(echo)
    assert requests.post(s.url, data=b"hello", timeout=10).text == "hello"
    chunked = s.raw(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                    b"5\r\nhello\r\n3\r\n, x\r\n0\r\n\r\n")
    answer = answer_of(chunked)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"\r\n\r\nhello, x")
    neither = s.raw(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    answer = answer_of(neither)  # answered, then closed: the body is not read as a next request
    assert answer.startswith(b"HTTP/1.1 501 ") and b"Connection: close" in answer
    # chunks beyond the limit: refused as they arrive, never buffered whole
    over = s.raw(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                 + b"".join(b"64\r\n" + b"z" * 100 + b"\r\n" for _ in range(11)) + b"0\r\n\r\n")
    assert answer_of(over).startswith(b"HTTP/1.1 413 ")
    # refused from the Content-Length alone: the client has not sent a byte of the body
    too_big = s.raw(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1001\r\n\r\n")
    assert answer_of(too_big).startswith(b"HTTP/1.1 413 ")
    assert requests.post(s.url, data=b"z" * 1000, timeout=10).status_code == 200  # exactly the limit


def test_head_gets_the_headers_only_and_the_connection_stays_open(served):
    s = served(echo)
    sock = s.raw(b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    answer = answer_of(sock)
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"Content-Length: 5" in head
    assert rest.startswith(b"HTTP/1.1 200 ") and rest.endswith(b"\r\n\r\nempty")  # no body after the HEAD


def test_a_failing_handler_is_a_500_and_the_server_keeps_serving(served):
    def handle(request: Request) -> Response:
        if request.path == "/bug":
            raise RuntimeError("bug")
        return echo(request)

    s = served(handle)
    assert requests.get(s.url + "/bug", timeout=10).status_code == 500
    assert requests.get(s.url + "/?q=1", timeout=10).text == "empty"


def test_every_interface_is_one_port_on_ipv4_and_ipv6(served):
    s = served(echo, host="")
    assert requests.get(f"http://127.0.0.1:{s.server.port}/", timeout=10).text == "empty"
    assert requests.get(f"http://[::1]:{s.server.port}/", timeout=10).text == "empty"


def test_stop_does_not_wait_past_its_grace_for_a_stuck_handler(served):
    release = threading.Event()
    entered = threading.Event()

    def stuck(request: Request) -> Response:
        entered.set()
        release.wait(30)
        return echo(request)

    s = served(stuck)
    sock = s.raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert entered.wait(10)
    s.server.stop(grace=0.1)  # returns although the handler still runs
    assert answer_of(sock) == b""  # closed unanswered
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", s.server.port), timeout=5)
    release.set()
    eventually(lambda: not [t for t in threading.enumerate() if t.name.startswith(f"test-http-{s.server.port}")])


def test_oversized_headers_are_answered_431(served):
    s = served(echo)
    for head in (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (70 * 1024) + b"\r\n\r\n",  # whole at once
                 b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (200 * 1024)):  # never ending
        answer = answer_of(s.raw(head))
        assert answer.startswith(b"HTTP/1.1 431 ") and b"Connection: close" in answer
    assert s.refusals == ["malformed", "malformed"]
    assert requests.get(s.url, timeout=10).status_code == 200


def test_clients_refused_from_their_headers_cannot_keep_a_real_sender_out(served, tmp_path):
    """Six clients without a token hold connections by announcing bodies they trickle; the
    connections being closed after their 401s are evicted first, so the sender with the token
    always gets a place."""
    from otelgpu.core.settings import ServerAuthConfig
    from otelgpu.tls import BearerTokens

    token = tmp_path / "token"
    token.write_text("good\n")
    s = served(echo, Limits(max_connections=4, header_timeout_s=30, body_timeout_s=30, write_timeout_s=30,
                            max_body_bytes=1000), tokens=BearerTokens(ServerAuthConfig(str(token)), "test"))
    hostile = [s.raw(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n") for _ in range(6)]
    eventually(lambda: s.server.connections().get("closing", 0) >= 3)
    for _ in range(5):
        ok = requests.post(s.url, data=b"hello", headers={"Authorization": "Bearer good"}, timeout=10)
        assert ok.status_code == 200 and ok.text == "hello"
    for sock in hostile:
        sock.close()


def test_a_content_length_of_other_digits_is_refused_not_a_crash(served, caplog):
    s = served(echo)
    sock = s.raw("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: ²\r\n\r\n".encode("latin-1"))
    assert answer_of(sock).startswith(b"HTTP/1.1 400 ")
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    assert requests.post(s.url, data=b"still here", timeout=10).text == "still here"
