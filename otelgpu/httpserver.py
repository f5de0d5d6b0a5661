"""One bounded HTTP/1.1 server for the OTLP/HTTP receiver and /metrics, on asyncio and h11 (the
sans-I/O HTTP/1.1 state machine), driven from synchronous code: TLS, mutual TLS, certificates
rotated on disk and bearer tokens, with everything a client can hold bounded, and every request
whose request line arrived answered, as the Collector's own receiver (Go's net/http) answers it.

asyncio's event loop, on one background thread, does all the waiting (TLS handshakes, headers,
bodies, answers being taken), so a slow or idle client costs a socket and a few KiB, never a
thread. The synchronous `handle` runs on a fixed pool of `workers` threads. The limits (`Limits`):

- Connections: at most `max_connections` open. A newcomer beyond it closes the connection that
  has waited longest for a request (idle keep-alive, TLS handshake or headers under way):
  `idle_evicted`; reopening one costs its client a handshake. With none waiting, it closes the
  connection whose body arrives slowest, if slower than SLOW_BODY_BYTES_PER_S (64 KiB/s) since its
  headers: `slow_evicted`, so that senders trickling bodies cannot keep valid ones out. When every
  connection has a request under way at a fair rate, or being handled, the newcomer is answered
  503 with Retry-After from the loop, no worker involved, and closed: `connection_limit` (at most
  `max_connections` such answers at a time; beyond, the newcomer is closed at once).
- Header deadline, `header_timeout_s`: a connection waiting for a request (idle keep-alive, its
  TLS handshake, the whole header block) is closed that long after it began waiting:
  `idle_timeout`; one whose request had begun to arrive is answered 408 first. One deadline for
  all of it, not a timeout per recv: a byte a second does not extend it.
- Body deadline, `body_timeout_s`: the whole body must arrive within that long of its headers,
  or 408 and the connection closed: `read_timeout`.
- Write deadline, `write_timeout_s`: an answer the client has not taken within that long closes
  the connection: `write_timeout`.
- Sizes: a body needs a Content-Length of at most `max_body_bytes` (411 or 413 from the headers,
  before any of it is read) or chunked transfer coding (413 once its chunks pass
  `max_body_bytes`); a header block over `max_header_bytes` is answered 431.
- Malformed HTTP (a request line, header or chunk h11 cannot parse, a body cut short by the
  client's end of stream, a transfer coding other than chunked) is answered 400 (431, 501 where
  h11 says so) and the connection closed: `malformed`. A client that ends its side of the
  connection after its request (a half-close) still gets its answer.
- Memory (`memory`, a receivers' MemoryLimiter): a request with a body reserves its Content-Length
  from its headers, a chunked one each chunk as it arrives, given back when its slot is; beyond
  the budget 503 with Retry-After (`memory_limit`, `bytes_in_flight`): from the headers, or for a
  chunked body once it ends, its chunks dropped unbuffered.
- Requests: at most `workers + queued` requests hold a slot, taken when their headers arrive and
  given back when the handler returns (or the connection ends before the body is whole), so at
  most that many bodies are buffered or handled at once. Beyond it, 503 with Retry-After before
  the body is read: `concurrent_requests`.
- Bearer tokens (`tokens`): a request for a path outside `open_paths` without a token the file
  holds is answered 401 from its headers: `unauthenticated`.
- TLS (`tls`): each accepted connection takes `tls.context()` of that moment, so certificate
  files rotated on disk serve new connections without a restart (a rotation that cannot be used
  is kept out by ServerTLS); mutual TLS when ServerTLS asks for client certificates.

Every refusal or cut is reported to `refused(reason)` with the reasons above. A request answered
from its headers (a refusal, or what `screen` answers) with a body following is answered, its body
read and dropped for up to a second (closing on unread bytes resets the connection, which can
destroy the answer before the client reads it), and the connection closed; without a body the
connection stays open for the next request. Every answer the server writes without its handler
(refusals, 408, malformed) closes the connection the same way.

`stop(grace)` stops accepting, closes the connections waiting for a request, lets requests under
way be answered for up to `grace` seconds and then closes the rest. A handler still running then
cannot be interrupted: its worker thread (a daemon) finishes on its own and its answer is dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import http.client
import logging
import queue
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Union

import h11

from otelgpu.errors import Refusal, RetryableError
from otelgpu.memory import MemoryLimiter, Ticket
from otelgpu.tls import BearerTokens, ServerTLS

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # a slot frees as soon as one request is answered or one deadline passes
SLOW_BODY_BYTES_PER_S = 64 * 1024  # a body slower than this may be cut to make room (any network sends faster)
IDLE, READING, BUSY = "idle", "reading", "busy"  # a connection's state (see BoundedServer.connections)
CLOSING = "closing"  # answered by the server itself, its client's bytes drained before the close
_LINGER_S, _QUIET_S, _LINGER_BYTES = 1.0, 0.2, 1 << 20  # that drain
_READ_BYTES = 64 * 1024  # one read from a socket
_BACKLOG = 128


@dataclass(frozen=True)
class Limits:
    """What one server allows; see the module's docstring for each."""

    max_connections: int
    header_timeout_s: float  # waiting for a request: idle keep-alive + TLS handshake + header block
    body_timeout_s: float  # the whole body, from the end of its headers
    write_timeout_s: float  # an answer taken by the client
    max_body_bytes: int
    workers: int = 4  # threads running `handle`
    queued: int = 0  # requests holding a slot beyond the running ones
    max_header_bytes: int = 64 * 1024


class Headers:
    """A request's header fields, names case-insensitive: `headers.get("content-type")`. A field
    sent more than once is its values joined with ", " (RFC 9110 section 5.3)."""

    def __init__(self, fields: Iterable[tuple[Union[bytes, str], Union[bytes, str]]] = ()) -> None:
        self._values: dict[str, str] = {}
        for name, value in fields:
            key = (name.decode("latin-1") if isinstance(name, bytes) else name).lower()
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            self._values[key] = f"{self._values[key]}, {text}" if key in self._values else text

    def get(self, name: str, default: Any = None) -> Any:
        return self._values.get(name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._values

    def __getitem__(self, name: str) -> str:
        return self._values[name.lower()]


@dataclass
class Request:
    method: str
    path: str  # without the query
    headers: Headers
    body: bytes = b""
    peer: Any = None  # the client's address
    ticket: Optional[Ticket] = None  # the body's bytes reserved with the server's memory limiter


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Response]
Screen = Callable[[Request], Optional[Response]]
ErrorPage = Callable[[int, str, Optional[Request]], Response]


def plain_error(status: int, message: str, request: Optional[Request]) -> Response:
    """The default body of the server's own refusals: the message as text."""
    return Response(status, message.encode() + b"\n", {"Content-Type": "text/plain; charset=utf-8"})


class BoundedServer:
    """`handle(request) -> Response` served on `host:port` within `limits`.

    `screen(request)`, called on the loop when a request's headers arrive (its body empty, not yet
    read), may answer it at once (a refusal, or something quick and non-blocking such as a health
    check); None reads the body and hands the request to `handle` on a worker. `error(status,
    message, request)` writes the body of the server's own answers (400, 401, 408, 411, 413, 431,
    501, 503, 500 when `handle` raises); `request` is None where no request could be read.
    `refused(reason)` is told of every refusal and cut, by reason. `host` "" or None: every
    interface, IPv4 and IPv6."""

    def __init__(self, name: str, host: Optional[str], port: int, handle: Handler, limits: Limits, *,
                 screen: Optional[Screen] = None, error: ErrorPage = plain_error,
                 refused: Callable[[Refusal], None] = lambda reason: None, tls: Optional[ServerTLS] = None,
                 tokens: Optional[BearerTokens] = None, open_paths: frozenset[str] = frozenset(),
                 memory: Optional[MemoryLimiter] = None) -> None:
        self.name = name
        self.memory = memory
        self.host = host or None
        self.port = port  # the bound port once started (port 0: any free one)
        self.handle = handle
        self.limits = limits
        self.screen = screen or (lambda request: None)
        self.error = error
        self.refused = refused
        self.tls = tls
        self.tokens = tokens
        self.open_paths = open_paths
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._server: Optional[_Server] = None
        self._jobs: queue.SimpleQueue[Optional[tuple[Request, asyncio.Future]]] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._stopped = False

    # ---- the synchronous side ----------------------------------------------------------------

    def start(self) -> None:
        """Listen (an OSError if the address cannot be bound), then serve from a background thread."""
        sockets = bind(self.host, self.port)
        self.port = sockets[0].getsockname()[1]
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(sockets, started), name=f"{self.name}-{self.port}",
                                        daemon=True)
        self._thread.start()
        started.result()  # what failed on the loop thread is raised here
        self._workers = [threading.Thread(target=self._work, name=f"{self.name}-{self.port}-worker-{i}", daemon=True)
                         for i in range(self.limits.workers)]
        for worker in self._workers:
            worker.start()

    def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, close the connections waiting for a request, let requests under way be
        answered for up to `grace` seconds, close the rest. Once only; before start() a no-op."""
        if self._stopped or self._loop is None or self._thread is None:
            self._stopped = True
            return
        self._stopped = True
        assert self._server is not None
        try:
            asyncio.run_coroutine_threadsafe(self._server.stop_serving(grace), self._loop).result(grace + 5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            for _ in self._workers:
                self._jobs.put(None)

    def connections(self) -> dict[str, int]:
        """Open connections by state: `idle` (waiting for a request: keep-alive, TLS handshake or
        headers under way; the ones eviction may close), `reading` (a request's body arriving),
        `busy` (its handler running or its answer being written), `closing` (answered by the
        server itself, a refusal, and drained before the close; evicted before any idle one)."""
        return self._on_loop(lambda server: dict(Counter(conn.state for conn in server.open)), {})

    def under_way(self) -> int:
        """Requests holding a slot: bodies being read, waiting for a worker or being handled
        (their senders may have left)."""
        return self._on_loop(lambda server: server.slots, 0)

    def _on_loop(self, look: Callable[[_Server], Any], stopped: Any) -> Any:
        """`look(server)` run on the loop thread, where the server's state lives; `stopped` if it is not running."""
        loop, server = self._loop, self._server
        if loop is None or server is None or not loop.is_running():
            return stopped

        async def run() -> Any:
            return look(server)

        try:
            return asyncio.run_coroutine_threadsafe(run(), loop).result(5)
        except (RuntimeError, concurrent.futures.TimeoutError):  # stopped meanwhile
            return stopped

    def _work(self) -> None:
        """A worker: runs `handle` for the requests the loop hands over, the answer back to the loop."""
        while (job := self._jobs.get()) is not None:
            request, answered = job
            try:
                response = self.handle(request)
            except Exception:  # the server keeps serving
                log.exception("%s: handler failed", self.name)
                response = self.error(500, "internal error", request)
            try:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(_settle, answered, response)
            except RuntimeError:
                pass  # the loop is closed: the server stopped before this handler returned

    # ---- the loop thread ---------------------------------------------------------------------

    def _run(self, sockets: list[socket.socket], started: concurrent.futures.Future) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            self._server = _Server(self)
            loop.run_until_complete(self._server.listen(sockets))
        except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller
            for sock in sockets:
                sock.close()
            loop.close()
            started.set_exception(exc)
            return
        self._loop = loop
        started.set_result(None)
        try:
            loop.run_forever()
        finally:
            pending = asyncio.all_tasks(loop)  # connections still open, answers being written
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()


def _settle(answered: asyncio.Future, response: Response) -> None:
    if not answered.done():  # its connection's task was cancelled at stop
        answered.set_result(response)


def bind(host: Optional[str], port: int) -> list[socket.socket]:
    """Listening sockets for `host` (None: every interface, IPv4 and IPv6, whichever the host has)
    on `port`; port 0 takes a free port, the same one on every address."""
    sockets: list[socket.socket] = []
    failed: Optional[OSError] = None
    try:
        for family, kind, proto, _, address in dict.fromkeys(socket.getaddrinfo(
                host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)):
            if port == 0 and sockets:
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            try:
                sock = socket.socket(family, kind, proto)
            except OSError as err:  # a family the kernel lacks (IPv6 switched off)
                failed = failed or err
                continue
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:  # the IPv4 socket takes IPv4 clients
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                sock.setblocking(False)
                sock.listen(_BACKLOG)
            except OSError as err:
                sock.close()
                if host is not None or err.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                    raise
                failed = failed or err
                continue
            sockets.append(sock)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    if not sockets:
        raise failed or OSError(errno.EADDRNOTAVAIL, f"no address to listen on for {host!r}")
    return sockets


class _Expired(Exception):
    """A deadline passed while waiting for the client."""


class _TooLarge(Exception):
    """A chunked body past max_body_bytes."""


class _Conn:
    """An open connection: its state and since when (the loop's clock); `cut`: why the server
    closed it, once it did; `received`: the bytes of the body under way."""

    __slots__ = ("reader", "writer", "state", "since", "cut", "received")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, now: float) -> None:
        self.reader, self.writer = reader, writer
        self.state, self.since, self.cut, self.received = IDLE, now, "", 0


class _Server:
    """The connections of one BoundedServer, each served by a task of its own; all of it on the
    loop thread."""

    def __init__(self, owner: BoundedServer) -> None:
        self.owner = owner
        self.open: set[_Conn] = set()
        self.slots = 0  # requests holding a slot
        self.refusing = 0  # connections being answered 503 at the connection limit
        self.stopping = False
        self.drained = asyncio.Event()
        self.listeners: list[asyncio.AbstractServer] = []

    async def listen(self, sockets: list[socket.socket]) -> None:
        for sock in sockets:
            self.listeners.append(await asyncio.start_server(self.serve, sock=sock, limit=_READ_BYTES,
                                                             backlog=_BACKLOG))

    @property
    def clock(self) -> float:
        return asyncio.get_running_loop().time()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection, from its accept to its close."""
        lim = self.owner.limits
        writer.transport.set_write_buffer_limits(high=0)  # drain() returns once the kernel took it all
        conn = _Conn(reader, writer, self.clock)
        if self.stopping:
            writer.transport.abort()
            return
        if len(self.open) >= lim.max_connections and not self.make_room():
            self.owner.refused(Refusal.CONNECTION_LIMIT)
            if self.refusing >= lim.max_connections:
                writer.transport.abort()
                return
            self.refusing += 1
            try:
                await self.refuse(conn)
            finally:
                self.refusing -= 1
            return
        self.open.add(conn)
        try:
            await self.converse(conn)
        except (OSError, asyncio.IncompleteReadError):
            pass  # the client reset the connection, or its TLS failed
        except asyncio.CancelledError:
            pass  # the loop stopping; ended quietly (on 3.11 asyncio logs a connection task cancelled)
        finally:
            self.let_go(conn)
            if conn.cut:
                writer.transport.abort()
            else:
                writer.close()

    def let_go(self, conn: _Conn) -> None:
        """`conn` no longer counts among the open connections."""
        self.open.discard(conn)
        if self.stopping and not self.open:
            self.drained.set()

    def make_room(self) -> bool:
        """Close one connection for a newcomer at the connection limit; False where none may go.
        A connection being closed after a refusal goes first (clients refused from their headers,
        no token or too large, must not keep the ones that send well out), then the one waiting
        longest for a request, then the slowest body under SLOW_BODY_BYTES_PER_S."""
        closing = [conn for conn in self.open if conn.state == CLOSING]
        waiting = closing or [conn for conn in self.open if conn.state == IDLE]
        if waiting:
            self.cut(min(waiting, key=lambda conn: conn.since), Refusal.IDLE_EVICTED)
            return True
        slow = self.slowest_body()
        if slow is not None:
            self.cut(slow, Refusal.SLOW_EVICTED)
            return True
        return False

    async def refuse(self, conn: _Conn) -> None:
        """A newcomer at the connection limit: 503 with Retry-After (its TLS handshake first)."""
        response = self.unavailable("too many connections; retry later", None)
        try:
            async with asyncio.timeout_at(conn.since + self.owner.limits.header_timeout_s):
                await self.handshake(conn)
        except (TimeoutError, OSError):
            conn.writer.transport.abort()
            return
        await answer_and_close(conn, response, self.owner.limits.write_timeout_s)

    def slowest_body(self) -> Optional[_Conn]:
        """The connection whose body arrives slowest, if slower than SLOW_BODY_BYTES_PER_S since
        its headers: a sender trickling its body must not keep the ones that send well out."""
        now = self.clock
        rates = [(conn.received / max(now - conn.since, 1e-3), conn) for conn in self.open if conn.state == READING]
        rate, conn = min(rates, key=lambda rc: rc[0], default=(None, None))
        return conn if rate is not None and rate < SLOW_BODY_BYTES_PER_S else None

    def cut(self, conn: _Conn, reason: Optional[Refusal]) -> None:
        """Close `conn` from the server's side, reporting why (no report when `reason` is empty)."""
        conn.cut = reason or "stopping"
        self.let_go(conn)
        if reason:
            self.owner.refused(reason)
        conn.writer.transport.abort()  # its task sees the end of the stream and returns

    async def handshake(self, conn: _Conn) -> None:
        """TLS, with the context of this moment (certificate files rotated on disk)."""
        if self.owner.tls is not None:
            # the header deadline around it ends it first; asyncio's own timeout only backs it up
            await conn.writer.start_tls(self.owner.tls.context(),
                                        ssl_handshake_timeout=2 * self.owner.limits.header_timeout_s + 1)

    async def converse(self, conn: _Conn) -> None:
        """Requests, one after another while the connection is kept alive."""
        lim = self.owner.limits
        try:
            async with asyncio.timeout_at(conn.since + lim.header_timeout_s):
                await self.handshake(conn)
        except TimeoutError:
            self.owner.refused(Refusal.IDLE_TIMEOUT)
            return
        parser = h11.Connection(h11.SERVER, max_incomplete_event_size=lim.max_header_bytes)
        while not conn.cut and not self.stopping:
            try:
                event = await self.next_event(conn, parser, conn.since + lim.header_timeout_s)
            except _Expired:
                self.owner.refused(Refusal.IDLE_TIMEOUT)
                if parser.trailing_data[0]:  # a request had begun to arrive
                    await self.close_with(conn, 408, "request headers not received in time", None)
                return
            except h11.RemoteProtocolError as err:
                await self.malformed(conn, err, None)
                return
            if not isinstance(event, h11.Request):
                return  # the client closed the connection
            if head_bytes(event) > lim.max_header_bytes:  # h11 bounds only a head still arriving
                self.owner.refused(Refusal.MALFORMED)
                await self.close_with(conn, 431, f"request header block exceeds {lim.max_header_bytes} bytes", None)
                return
            if not await self.exchange(conn, parser, event):
                return
            if parser.our_state is not h11.DONE or parser.their_state is not h11.DONE:
                return  # Connection: close, either side
            parser.start_next_cycle()
            conn.state, conn.since = IDLE, self.clock

    async def next_event(self, conn: _Conn, parser: h11.Connection, deadline: float) -> Any:
        """h11's next event, reading from the client as it needs, by `deadline` (the loop's clock)."""
        while (event := parser.next_event()) is h11.NEED_DATA:
            if conn.cut:
                return h11.ConnectionClosed()
            try:
                async with asyncio.timeout_at(deadline):
                    data = await conn.reader.read(_READ_BYTES)
            except TimeoutError:
                raise _Expired from None
            parser.receive_data(data)  # b"": the client's end of the stream
        return event

    async def exchange(self, conn: _Conn, parser: h11.Connection, head: h11.Request) -> bool:
        """One request: screened at its headers, its body gathered, handled on a worker, answered.
        False when the connection is to be closed."""
        lim = self.owner.limits
        conn.state, conn.since, conn.received = READING, self.clock, 0
        target = head.target.decode("latin-1")
        request = Request(head.method.decode("latin-1"), target.split("?", 1)[0], Headers(head.headers),
                          peer=conn.writer.get_extra_info("peername"))
        answer = self.screen(request)
        if answer is not None and body_follows(request.headers):
            if request.method == "HEAD":
                answer.body = b""
            # "retry later": its sender will send the body again, so it is read (and dropped) to
            # its end, and the sender reads the answer whether or not it reads while it sends
            length = content_length(request.headers.get("Content-Length"))
            body = min(length, lim.max_body_bytes) if length is not None else lim.max_body_bytes
            drain = max(body - len(parser.trailing_data[0]), 0) if answer.status == 503 else 0  # h11 has the rest
            await self.close_with_response(conn, answer, drain)
            return False
        slot = answer is None
        if slot:
            self.slots += 1
            if parser.client_is_waiting_for_100_continue:
                conn.writer.write(parser.send(h11.InformationalResponse(status_code=100, headers=[])))
        try:
            try:
                over = await self.read_body(conn, parser, request)
            except _Expired:
                self.owner.refused(Refusal.READ_TIMEOUT)
                await self.close_with(conn, 408, f"request body not received within {lim.body_timeout_s:g} s", request)
                return False
            except _TooLarge:
                await self.close_with(conn, 413, f"body exceeds {lim.max_body_bytes} bytes", request)
                return False
            except h11.RemoteProtocolError as err:
                await self.malformed(conn, err, request)
                return False
            if conn.cut:
                return False
            conn.state = BUSY
            if over is not None:
                answer = self.unavailable(str(over), request)
            elif answer is None:
                answer = await self.handled(conn, parser, request)
        finally:
            if slot:
                self.slots -= 1
            if request.ticket is not None:
                request.ticket.release()
        return await self.respond(conn, parser, request, answer)

    async def handled(self, conn: _Conn, parser: h11.Connection, request: Request) -> Response:
        """`handle(request)` on a worker. Meanwhile what the client pipelines is kept for the next
        request, and the end of its stream lets the connection go from the open ones: a client
        gone holds no connection place, and one that only half-closed still gets the answer."""
        answered: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        self.owner._jobs.put((request, answered))
        watch = asyncio.ensure_future(self.watch(conn, parser))
        try:
            return await answered
        finally:
            watch.cancel()
            await asyncio.wait([watch])  # its read ended before the next one begins

    async def watch(self, conn: _Conn, parser: h11.Connection) -> None:
        while len(parser.trailing_data[0]) <= self.owner.limits.max_header_bytes:  # then it waits its turn
            data = await conn.reader.read(_READ_BYTES)
            parser.receive_data(data)
            if not data:
                self.let_go(conn)
                return

    async def read_body(self, conn: _Conn, parser: h11.Connection, request: Request) -> Optional[RetryableError]:
        """The request's body into `request.body`, by the body deadline. A chunked body reserves
        its chunks as they arrive: past the memory budget the rest is read and dropped, and the
        refusal returned."""
        lim = self.owner.limits
        deadline = conn.since + lim.body_timeout_s
        is_chunked, ticket = chunked(request.headers), request.ticket
        chunks: list[bytes] = []
        over: Optional[RetryableError] = None
        while isinstance(event := await self.next_event(conn, parser, deadline), h11.Data):
            conn.received += len(event.data)
            if is_chunked and conn.received > lim.max_body_bytes:
                raise _TooLarge
            if ticket is not None and is_chunked and over is None:
                try:
                    ticket.grow(len(event.data))
                except RetryableError as err:
                    over = err
                    self.owner.refused(err.reason)
                    ticket.release()
                    chunks = []
            if over is None:
                chunks.append(event.data)
        if isinstance(event, h11.ConnectionClosed):  # cut by the server meanwhile
            return over
        request.body = b"".join(chunks)
        return over

    async def respond(self, conn: _Conn, parser: h11.Connection, request: Request, response: Response) -> bool:
        """Write the answer; a client that has not taken it by the write deadline is cut off.
        False when the connection is gone."""
        writer = conn.writer
        if conn.cut or writer.transport.is_closing():
            return False
        conn.state = BUSY
        headers = [(k, v) for k, v in response.headers.items() if k.lower() not in ("content-length", "connection")]
        headers.append(("Content-Length", str(len(response.body))))
        if self.stopping:
            headers.append(("Connection", "close"))
        try:
            writer.write(parser.send(h11.Response(status_code=response.status, headers=headers,
                                                  reason=http.client.responses.get(response.status, "Unknown"))))
            if request.method != "HEAD" and response.body:
                writer.writelines(parser.send_with_data_passthrough(h11.Data(data=response.body)) or [])
            writer.write(parser.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # a handler's answer h11 cannot frame (a header it refuses)
            log.exception("%s: answer to %s %s cannot be sent", self.owner.name, request.method, request.path)
            await self.close_with(conn, 500, "internal error", request)
            return False
        try:
            async with asyncio.timeout(self.owner.limits.write_timeout_s):
                await writer.drain()
        except TimeoutError:
            self.cut(conn, Refusal.WRITE_TIMEOUT)
            return False
        return not conn.cut

    async def malformed(self, conn: _Conn, err: h11.RemoteProtocolError, request: Optional[Request]) -> None:
        """HTTP h11 cannot read: answered as Go's net/http answers (400, or 431, 501 as h11 says)."""
        if conn.cut:
            return
        self.owner.refused(Refusal.MALFORMED)
        await self.close_with(conn, err.error_status_hint, str(err), request)

    async def close_with(self, conn: _Conn, status: int, message: str, request: Optional[Request]) -> None:
        await self.close_with_response(conn, self.owner.error(status, message, request))

    async def close_with_response(self, conn: _Conn, response: Response, drain: int = 0) -> None:
        """Answer and close; `drain`: the bytes of the request's body to read and drop first, by
        the body deadline (else what the client still sends is taken as answer_and_close says)."""
        conn.state, conn.since = CLOSING, self.clock
        lim = self.owner.limits
        await answer_and_close(conn, response, lim.write_timeout_s, drain, lim.body_timeout_s)

    def screen(self, request: Request) -> Optional[Response]:
        """An answer from the headers alone, or None to read the body (a slot then taken)."""
        owner, lim = self.owner, self.owner.limits
        if self.stopping:
            return self.unavailable("stopping; retry later", request)
        if (owner.tokens is not None and request.path not in owner.open_paths
                and not owner.tokens.check(request.headers.get("Authorization"))):
            owner.refused(Refusal.UNAUTHENTICATED)
            response = owner.error(401, "a bearer token this server accepts is required (Authorization: Bearer <token>)",
                                   request)
            response.headers["WWW-Authenticate"] = 'Bearer realm="otelgpu"'
            return response
        response = owner.screen(request)
        if response is not None:
            return response
        if body_follows(request.headers) and not chunked(request.headers):
            length = content_length(request.headers.get("Content-Length"))
            if length is None:
                return owner.error(411, "Content-Length required", request)
            if length > lim.max_body_bytes:
                return owner.error(413, f"body exceeds {lim.max_body_bytes} bytes", request)
        if self.slots >= lim.workers + lim.queued:
            owner.refused(Refusal.CONCURRENT_REQUESTS)
            return self.unavailable(f"more than {lim.workers + lim.queued} requests under way; retry later", request)
        if owner.memory is not None:
            try:  # a chunked body reserves as it arrives
                request.ticket = owner.memory.admit(content_length(request.headers.get("Content-Length")) or 0)
            except RetryableError as err:
                owner.refused(err.reason)
                return self.unavailable(str(err), request)
        return None

    def unavailable(self, message: str, request: Optional[Request]) -> Response:
        response = self.owner.error(503, message, request)
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    async def stop_serving(self, grace: float) -> None:
        for listener in self.listeners:
            listener.close()
        self.stopping = True
        for conn in list(self.open):
            if conn.state == IDLE:
                self.cut(conn, None)
        if self.open:
            try:
                await asyncio.wait_for(self.drained.wait(), grace)
            except TimeoutError:
                pass
        for conn in list(self.open):
            self.cut(conn, None)


def content_length(value: Optional[str]) -> Optional[int]:
    """A Content-Length header's value when it is one (ASCII digits only: `str.isdigit` also
    takes "²", which int() refuses)."""
    return int(value) if value and value.isascii() and value.isdigit() else None


def chunked(headers: Headers) -> bool:
    """A chunked body (h11 refuses any other transfer coding)."""
    return headers.get("Transfer-Encoding", "").strip().lower() == "chunked"


def body_follows(headers: Headers) -> bool:
    return "Transfer-Encoding" in headers or headers.get("Content-Length", "0") != "0"


def head_bytes(head: h11.Request) -> int:
    """The size of a request's line and header fields as sent, within a few bytes a line."""
    return len(head.method) + len(head.target) + 12 + sum(len(name) + len(value) + 4
                                                           for name, value in head.headers.raw_items())


def _raw(response: Response) -> bytes:
    lines = [f"HTTP/1.1 {response.status} {http.client.responses.get(response.status, 'Unknown')}"]
    lines += [f"{k}: {v}" for k, v in response.headers.items() if k.lower() not in ("content-length", "connection")]
    lines += [f"Content-Length: {len(response.body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + response.body


async def answer_and_close(conn: _Conn, response: Response, timeout_s: float, drain: int = 0,
                           drain_s: float = 0.0) -> None:
    """Write `response` with `Connection: close` (within `timeout_s`), take what the client still
    sends so that the close does not meet unread bytes and reset the connection, then close it:
    `drain` bytes within `drain_s` where given (a body the client will send whole), until it has
    been quiet for a second (one that read the answer before sending its body sends none), else up
    to 1 MiB, for up to a second, until it has been quiet for 0.2 s. What is taken is dropped."""
    loop = asyncio.get_running_loop()
    try:
        conn.writer.write(_raw(response))
        async with asyncio.timeout(timeout_s):
            await conn.writer.drain()
        if drain:
            end, limit, quiet = loop.time() + drain_s, drain, _LINGER_S
        else:
            end, limit, quiet = loop.time() + _LINGER_S, _LINGER_BYTES, _QUIET_S
        taken = 0
        while taken < limit and not conn.cut:
            async with asyncio.timeout(min(quiet, end - loop.time())):
                data = await conn.reader.read(_READ_BYTES)
            if not data:
                break
            taken += len(data)
    except (TimeoutError, OSError):
        pass  # quiet long enough, or gone
    finally:
        conn.writer.close()
