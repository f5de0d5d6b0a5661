"""Connection limits of the OTLP/HTTP receiver: how many connections hold a thread, how long a
request may take to arrive, and how long a keep-alive connection may wait for the next one.

The stdlib server gives every connection a thread blocked in recv() with a timeout per call, so a
client trickling a byte at a time, or one that connects and never sends, holds a thread (and its
partly read body) for as long as it likes. Here:
- at most `max_connections` connections are admitted, one thread each. When all are taken, the one
  idle the longest is closed to make room (reopening a keep-alive connection costs its client one
  handshake); when none is idle, the newcomer gets a canned 503 with Retry-After from the accepting
  thread, which never blocks on it, and no thread is started;
- a request must arrive whole (headers and body) within `read_timeout_s` of its first byte: one
  deadline for the request, not a timeout per recv; its answer gets as long again to be taken;
- a connection waiting for its next request is closed after `idle_timeout_s`.
So partly read bodies hold at most `max_connections` times the body limit, each for at most
`read_timeout_s`, however slow or numerous the clients. Each refusal and cut-off is counted in
`receiver_connections_refused{transport="http", reason}`.
"""

from __future__ import annotations

import io
import itertools
import socket
import threading
import time
from collections import Counter
from http.server import ThreadingHTTPServer
from typing import Any, NoReturn, Optional

import grpc
from google.protobuf import json_format
from google.rpc import status_pb2

from otelgpu.telemetry import SelfMetrics

RETRY_AFTER_S = 1  # a slot frees as soon as one request is answered or one deadline passes
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_BODY = json_format.MessageToJson(status_pb2.Status(code=_UNAVAILABLE, message="too many connections"),
                                  indent=None).encode()
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
           b"Retry-After: %d\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
           % (RETRY_AFTER_S, len(_BODY), _BODY))
_IDLE, _READING, _CLOSED = "idle", "reading", "closed"
_EVICTION_WAIT_S = 1.0  # the evicted connection's thread ends as soon as its recv returns


class Connection:
    """An admitted connection: its socket, and whether it waits for a request or reads one."""

    def __init__(self, sock: socket.socket, gate: "ConnectionGate") -> None:
        self.sock = sock
        self._gate = gate
        self._state = _IDLE  # guarded by the gate's lock, which evicts idle connections
        self._since = time.monotonic()
        self._deadline = 0.0

    def reader(self) -> io.BufferedReader:
        """The handler's rfile: reads through recv_into, under this connection's deadlines."""
        return io.BufferedReader(_Reader(self))

    def next_request(self) -> bool:
        """Wait for the next request from here on; False when the connection must close."""
        with self._gate.lock:
            if self._state == _CLOSED:
                return False
            self._state, self._since = _IDLE, time.monotonic()
            return True

    def request_started(self) -> bool:
        """A request's first bytes are here: its read deadline runs. False if the connection was closed."""
        with self._gate.lock:
            if self._state == _IDLE:
                self._state, self._deadline = _READING, time.monotonic() + self._gate.read_timeout_s
            return self._state == _READING

    def answering(self) -> None:
        """Bound the write of an answer to a client that does not read it."""
        self.sock.settimeout(self._gate.read_timeout_s)

    def recv_into(self, buf: memoryview) -> int:
        with self._gate.lock:
            state = self._state
            wait = self._gate.idle_timeout_s if state == _IDLE else self._deadline - time.monotonic()
        if state == _CLOSED:
            return 0
        reason = "idle_timeout" if state == _IDLE else "read_timeout"
        if wait <= 0:
            self._cut(reason)
        self.sock.settimeout(wait)
        try:
            n = self.sock.recv_into(buf)
        except TimeoutError:
            self._cut(reason)
        # Bytes that raced an eviction belong to a request nobody will answer: drop them with it.
        return n if not n or self.request_started() else 0

    def _cut(self, reason: str) -> NoReturn:
        with self._gate.lock:
            self._state = _CLOSED
        self._gate.count(reason)
        raise TimeoutError(reason)  # the stdlib handler closes the connection on TimeoutError

    def close_locked(self) -> None:
        """Close from another thread (the gate's lock held): the handler's recv returns at once."""
        self._state = _CLOSED
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # the client was gone already


class _Reader(io.RawIOBase):
    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def readable(self) -> bool:
        return True

    def readinto(self, buf: memoryview) -> int:  # type: ignore[override]
        return self._conn.recv_into(buf)


class ConnectionGate:
    """Admits connections up to `max_connections`; see the module's docstring."""

    def __init__(self, max_connections: int, read_timeout_s: float, idle_timeout_s: float,
                 metrics: SelfMetrics, transport: str = "http") -> None:
        self.max_connections = max_connections
        self.read_timeout_s = read_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.lock = threading.Lock()
        self._freed = threading.Condition(self.lock)
        self._metrics = metrics
        self._transport = transport
        self._open: set[Connection] = set()
        self._closing = False

    def states(self) -> dict[str, int]:
        with self.lock:
            return dict(Counter(c._state for c in self._open))

    def count(self, reason: str) -> None:
        self._metrics.count("receiver_connections_refused", (self._transport, reason))

    def admit(self, sock: socket.socket) -> Optional[Connection]:
        """A Connection to serve on its own thread, or None: refuse it (see `refuse`)."""
        with self.lock:
            if self._closing:
                return None
            if len(self._open) >= self.max_connections and not self._evict_locked():
                self.count("connection_limit")
                return None
            conn = Connection(sock, self)
            self._open.add(conn)
            return conn

    def _evict_locked(self) -> bool:
        idle = [c for c in self._open if c._state == _IDLE]
        if not idle:
            return False
        min(idle, key=lambda c: c._since).close_locked()
        self.count("idle_evicted")
        # Wait for the evicted connection's thread to end, so threads never outnumber the limit.
        return self._freed.wait_for(lambda: len(self._open) < self.max_connections, _EVICTION_WAIT_S)

    def release(self, conn: Connection) -> None:
        with self.lock:
            self._open.discard(conn)
            self._freed.notify_all()

    def close(self) -> None:
        """Admit no more and close the idle connections; requests under way finish or time out."""
        with self.lock:
            self._closing = True
            for conn in self._open:
                if conn._state == _IDLE:
                    conn.close_locked()


def refuse(sock: socket.socket) -> None:
    """Answer 503 with Retry-After and close, without ever blocking the accepting thread."""
    try:
        sock.setblocking(False)
        sock.send(REFUSAL)  # a fresh connection's send buffer takes it whole
        sock.shutdown(socket.SHUT_WR)
        # Closing with unread bytes would reset the connection, and a reset can destroy the answer
        # before the client reads it: take what the client has sent so far.
        for _ in range(16):
            if not sock.recv(65536):
                break
    except OSError:
        pass  # nothing more to read now (BlockingIOError), or the client is gone
    sock.close()


class LimitedHTTPServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer that starts a thread only for connections `gate` admits, named
    `otlp-http-conn-<port>-<n>`. Its handler class takes the Connection as a fourth argument."""

    daemon_threads = True  # a stuck client must not keep the process alive at exit
    request_queue_size = 128  # connections waiting in the kernel cost no thread; refusing them is quick
    _names = itertools.count(1)

    def __init__(self, address: tuple[str, int], handler: Any, gate: ConnectionGate) -> None:
        self.gate = gate
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        # Runs on the accepting thread: a refusal is answered here, without a thread of its own.
        conn = self.gate.admit(request)
        if conn is None:
            return refuse(request)
        name = f"otlp-http-conn-{self.server_address[1]}-{next(self._names)}"
        threading.Thread(target=self._serve, args=(conn, client_address), name=name, daemon=True).start()

    def _serve(self, conn: Connection, client_address: Any) -> None:
        try:
            self.RequestHandlerClass(conn.sock, client_address, self, conn)  # type: ignore[call-arg]
        except Exception:
            self.handle_error(conn.sock, client_address)
        finally:
            self.shutdown_request(conn.sock)
            self.gate.release(conn)
