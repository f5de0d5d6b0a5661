"""One bounded HTTP/1.1 server for the OTLP/HTTP receiver and /metrics, on tornado, driven from
synchronous code: TLS, mutual TLS, certificates rotated on disk and bearer tokens, with everything
a client can hold bounded.

tornado's event loop, on one background thread, does all the waiting (TLS handshakes, headers,
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
  `idle_timeout`. One deadline for all of it, not a timeout per recv: a byte a second does not
  extend it (tornado's `idle_connection_timeout`).
- Body deadline, `body_timeout_s`: the whole body must arrive within that long of its headers:
  `read_timeout` (tornado's `body_timeout`).
- Write deadline, `write_timeout_s`: an answer the client has not taken within that long closes
  the connection: `write_timeout`.
- Sizes: a body needs a Content-Length of at most `max_body_bytes` (411 or 413 from the headers,
  before any of it is read) or chunked transfer coding (tornado refuses it with 400 once its
  chunks pass `max_body_bytes`); a header block over `max_header_bytes` closes the connection.
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
connection stays open for the next request.

`stop(grace)` stops accepting, closes the connections waiting for a request, lets requests under
way be answered for up to `grace` seconds and then closes the rest. A handler still running then
cannot be interrupted: its worker thread (a daemon) finishes on its own and its answer is dropped.
The subclass of tornado's HTTPServer uses its documented delegate interface (`handle_stream`,
`start_request`, `on_close`) and reads `ssl_options` at each accept as tornado 6 does: hence the
pin to tornado < 7, and the rotation tests that would notice a change.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import logging
import queue
import ssl
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from tornado import gen, httputil, netutil
from tornado.http1connection import HTTP1Connection, HTTP1ServerConnection
from tornado.httpserver import HTTPServer
from tornado.iostream import IOStream, StreamClosedError

from otelgpu.errors import RetryableError
from otelgpu.receiver.memory import MemoryLimiter, Ticket
from otelgpu.tls import BearerTokens, ServerTLS

log = logging.getLogger(__name__)


class _ClientNoise(logging.Filter):
    """tornado logs each client's failed TLS handshake (warning), malformed request or body cut at
    its deadline (info): a line per client, which any scanner could turn into a flood. They go to
    this module's logger at debug instead; tornado's errors stay as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        log.debug("%s", record.getMessage())
        return False


logging.getLogger("tornado.general").addFilter(_ClientNoise())

RETRY_AFTER_S = 1  # a slot frees as soon as one request is answered or one deadline passes
SLOW_BODY_BYTES_PER_S = 64 * 1024  # a body slower than this may be cut to make room (any network sends faster)
IDLE, READING, BUSY = "idle", "reading", "busy"  # a connection's state (see BoundedServer.connections)
CLOSING = "closing"  # answered from its headers (a refusal), its body drained before the close
_LINGER_S, _QUIET_S, _LINGER_BYTES = 1.0, 0.2, 1 << 20  # the drain of a refused request's body


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


@dataclass
class Request:
    method: str
    path: str  # without the query
    headers: httputil.HTTPHeaders  # case-insensitive: headers.get("content-type")
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
    message, request)` writes the body of the server's own refusals (401, 411, 413, 503, 500 when
    `handle` raises); `request` is None for a connection refused before any request.
    `refused(reason)` is told of every refusal and cut, by reason. `host` "" or None: every
    interface, IPv4 and IPv6."""

    def __init__(self, name: str, host: Optional[str], port: int, handle: Handler, limits: Limits, *,
                 screen: Optional[Screen] = None, error: ErrorPage = plain_error,
                 refused: Callable[[str], None] = lambda reason: None, tls: Optional[ServerTLS] = None,
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
        self._jobs: queue.SimpleQueue[Optional[_Exchange]] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._stopped = False

    # ---- the synchronous side ----------------------------------------------------------------

    def start(self) -> None:
        """Listen (an OSError if the address cannot be bound), then serve from a background thread."""
        sockets = netutil.bind_sockets(self.port, self.host, backlog=128)
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
        `busy` (its handler running or its answer being written), `closing` (answered from its
        headers, a refusal, and drained before the close; evicted before any idle one)."""
        return self._on_loop(lambda server: dict(Counter(conn.state for conn in server.open.values())), {})

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
        while (exchange := self._jobs.get()) is not None:
            assert exchange.request is not None
            try:
                response = self.handle(exchange.request)
            except Exception:  # the server keeps serving
                log.exception("%s: handler failed", self.name)
                response = self.error(500, "internal error", exchange.request)
            try:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(exchange.answered, response)
            except RuntimeError:
                pass  # the loop is closed: the server stopped before this handler returned

    # ---- the loop thread ---------------------------------------------------------------------

    def _run(self, sockets: list, started: concurrent.futures.Future) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)

        async def listen() -> None:
            lim = self.limits
            self._server = _Server(self, idle_connection_timeout=lim.header_timeout_s,
                                   body_timeout=lim.body_timeout_s, max_body_size=lim.max_body_bytes,
                                   max_header_size=lim.max_header_bytes, decompress_request=False)
            self._server.add_sockets(sockets)

        try:
            loop.run_until_complete(listen())
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
            pending = asyncio.all_tasks(loop)  # drains of refused requests, answers being written
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()


class _Conn:
    """An open connection: its state and since when (the loop's clock); `cut`: why the server
    closed it, once it did; `received`: the bytes of the body under way."""

    __slots__ = ("stream", "state", "since", "cut", "received")

    def __init__(self, stream: IOStream, now: float) -> None:
        self.stream, self.state, self.since, self.cut, self.received = stream, IDLE, now, "", 0


class _Server(HTTPServer):
    """tornado's HTTPServer, with the connection limit, TLS contexts taken at each accept, and
    requests handed to `_Exchange`s. All of it runs on the loop thread."""

    def initialize(self, owner: BoundedServer, **settings: Any) -> None:  # tornado's Configurable init
        self.owner = owner
        self.open: dict[IOStream, _Conn] = {}
        self.slots = 0  # requests holding a slot
        self.refusing = 0  # connections being answered 503 at the connection limit
        self.stopping = False
        self.drained = asyncio.Event()
        super().initialize(self, **settings)  # its own delegate: start_request below

    @property  # type: ignore[override]
    def ssl_options(self) -> Optional[ssl.SSLContext]:
        """Read by tornado at each accept: the context current then (ServerTLS reloads rotated files)."""
        return self.owner.tls.context() if self.owner.tls else None

    @ssl_options.setter
    def ssl_options(self, value: Any) -> None:
        pass  # tornado's constructor sets it; the context always comes from owner.tls

    @property
    def clock(self) -> float:
        return asyncio.get_running_loop().time()

    def handle_stream(self, stream: IOStream, address: Any) -> None:
        lim = self.owner.limits
        if self.stopping:
            stream.close()
            return
        if len(self.open) >= lim.max_connections:
            # A connection being closed after a refusal goes first: clients refused from their
            # headers (no token, too large) must not keep the ones that send well out.
            closing = [conn for conn in self.open.values() if conn.state == CLOSING]
            waiting = closing or [conn for conn in self.open.values() if conn.state == IDLE]
            slow = None if waiting else self.slowest_body()
            if waiting:
                self.cut(min(waiting, key=lambda conn: conn.since), "idle_evicted")
            elif slow is not None:
                self.cut(slow, "slow_evicted")
            else:
                self.owner.refused("connection_limit")
                if self.refusing < lim.max_connections:
                    self.refusing += 1
                    asyncio.ensure_future(self._refuse(stream))
                else:
                    stream.close()
                return
        self.open[stream] = _Conn(stream, self.clock)
        super().handle_stream(stream, address)

    async def _refuse(self, stream: IOStream) -> None:
        try:
            response = self.owner.error(503, "too many connections; retry later", None)
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
            # the handshake of a TLS connection happens in this write: bounded as for any connection
            await answer_and_close(stream, response, self.owner.limits.header_timeout_s)
        finally:
            self.refusing -= 1

    def slowest_body(self) -> Optional[_Conn]:
        """The connection whose body arrives slowest, if slower than SLOW_BODY_BYTES_PER_S since
        its headers: a sender trickling its body must not keep the ones that send well out."""
        now = self.clock
        rates = [(conn.received / max(now - conn.since, 1e-3), conn) for conn in self.open.values()
                 if conn.state == READING]
        rate, conn = min(rates, key=lambda rc: rc[0], default=(None, None))
        return conn if rate is not None and rate < SLOW_BODY_BYTES_PER_S else None

    def cut(self, conn: _Conn, reason: str) -> None:
        """Close `conn` from the server's side, reporting why (no report when `reason` is empty)."""
        conn.cut = reason or "stopping"
        self.open.pop(conn.stream, None)
        if reason:
            self.owner.refused(reason)
        conn.stream.close()

    def start_request(self, server_conn: object, request_conn: httputil.HTTPConnection) -> _Exchange:
        stream = server_conn.stream  # type: ignore[attr-defined]
        conn = self.open.get(stream) or _Conn(stream, self.clock)  # evicted before it began: reads fail
        conn.state, conn.since = IDLE, self.clock
        if self.stopping and conn.cut == "":
            self.cut(conn, "")
        return _Exchange(self, conn, request_conn)  # type: ignore[arg-type]

    def on_close(self, server_conn: object) -> None:
        super().on_close(server_conn)
        assert isinstance(server_conn, HTTP1ServerConnection)
        conn = self.open.pop(server_conn.stream, None)
        # tornado closed it at the header deadline (its clock started after `since`), unless the
        # client hung up first
        if conn is not None and conn.state == IDLE and self.clock >= conn.since + self.owner.limits.header_timeout_s:
            conn.cut = "idle_timeout"
            self.owner.refused("idle_timeout")
        if self.stopping and not self.open:
            self.drained.set()

    def screen(self, request: Request) -> Optional[Response]:
        """An answer from the headers alone, or None to read the body (a slot then taken)."""
        owner, lim = self.owner, self.owner.limits
        if self.stopping:
            return self.unavailable("stopping; retry later", request)
        if (owner.tokens is not None and request.path not in owner.open_paths
                and not owner.tokens.check(request.headers.get("Authorization"))):
            owner.refused("unauthenticated")
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
            owner.refused("concurrent_requests")
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
        self.stop()  # closes the listening sockets
        self.stopping = True
        for conn in list(self.open.values()):
            if conn.state == IDLE:
                self.cut(conn, "")
        if self.open:
            try:
                await asyncio.wait_for(self.drained.wait(), grace)
            except TimeoutError:
                pass
        for conn in list(self.open.values()):
            self.cut(conn, "")
        try:
            await asyncio.wait_for(self.close_all_connections(), 2)
        except TimeoutError:
            pass


class _Exchange(httputil.HTTPMessageDelegate):
    """One request on a connection: screened at its headers, its body gathered, handled on a
    worker, answered."""

    def __init__(self, server: _Server, conn: _Conn, request_conn: HTTP1Connection) -> None:
        self.server, self.conn, self.rc = server, conn, request_conn
        self.request: Optional[Request] = None
        self.chunks: list[bytes] = []
        self.early: Optional[Response] = None  # answered from the headers, no body: written at finish()
        self.over: Optional[RetryableError] = None  # a chunked body past the memory budget: dropped, answered 503
        self.slot = False
        self.dispatched = False

    def headers_received(self, start_line: Any, headers: httputil.HTTPHeaders) -> Optional[Any]:
        self.conn.state, self.conn.since, self.conn.received = READING, self.server.clock, 0
        self.request = Request(start_line.method, start_line.path.split("?", 1)[0], headers,
                               peer=getattr(self.rc.context, "address", None))
        answer = self.server.screen(self.request)
        if answer is None:
            self.slot = True
            self.server.slots += 1
            return None
        if not body_follows(headers):
            self.early = answer  # the connection stays open: nothing unread
            return None
        self.conn.state, self.conn.since = CLOSING, self.server.clock
        if self.request.method == "HEAD":
            answer.body = b""
        # tornado awaits this before it would read the body; the stream is closed by then
        return answer_and_close(self.conn.stream, answer, self.server.owner.limits.write_timeout_s)

    def data_received(self, chunk: bytes) -> None:
        self.conn.received += len(chunk)
        ticket = self.request.ticket if self.request is not None else None
        if ticket is not None and chunked(self.request.headers) and self.over is None:
            try:
                ticket.grow(len(chunk))
            except RetryableError as err:
                self.over = err
                self.server.owner.refused(err.reason)
                ticket.release()
                self.chunks = []
        if self.over is None:
            self.chunks.append(chunk)

    def finish(self) -> None:
        self.conn.state = BUSY
        if self.early is not None:
            self._write(self.early)
            return
        assert self.request is not None
        if self.over is not None:
            self._release()
            self._write(self.server.unavailable(str(self.over), self.request))
            return
        self.request.body = b"".join(self.chunks)
        self.chunks = []
        self.dispatched = True
        self.server.owner._jobs.put(self)

    def on_connection_close(self) -> None:
        conn, lim = self.conn, self.server.owner.limits
        # tornado closed it at the body deadline (its clock started after `since`), unless the
        # client hung up first
        if conn.state == READING and conn.cut == "" and self.server.clock >= conn.since + lim.body_timeout_s:
            conn.cut = "read_timeout"
            self.server.owner.refused("read_timeout")
        if not self.dispatched:
            self._release()

    def answered(self, response: Response) -> None:
        """On the loop, from the worker."""
        self._release()
        self._write(response)

    def _release(self) -> None:
        if self.slot:
            self.slot = False
            self.server.slots -= 1
        if self.request is not None and self.request.ticket is not None:
            self.request.ticket.release()

    def _write(self, response: Response) -> None:
        """Answer; a client that has not taken the answer by the write deadline is cut off."""
        stream = self.conn.stream
        if stream.closed():
            return
        assert self.request is not None
        headers = httputil.HTTPHeaders(response.headers)
        headers["Content-Length"] = str(len(response.body))
        if self.server.stopping:
            headers["Connection"] = "close"
        start = httputil.ResponseStartLine("HTTP/1.1", response.status, httputil.responses.get(response.status, "Unknown"))
        try:
            written = self.rc.write_headers(start, headers, b"" if self.request.method == "HEAD" else response.body)
            self.rc.finish()
        except (StreamClosedError, httputil.HTTPOutputError):
            return  # the client is gone
        conn, server = self.conn, self.server

        def expired() -> None:
            if not written.done():
                server.cut(conn, "write_timeout")

        deadline = stream.io_loop.call_later(server.owner.limits.write_timeout_s, expired)
        written.add_done_callback(lambda _: stream.io_loop.remove_timeout(deadline))


def content_length(value: Optional[str]) -> Optional[int]:
    """A Content-Length header's value when it is one (ASCII digits only: `str.isdigit` also
    takes "²", which int() refuses)."""
    return int(value) if value and value.isascii() and value.isdigit() else None


def chunked(headers: httputil.HTTPHeaders) -> bool:
    """A chunked body (tornado reads it, refusing one over max_body_bytes or with a Content-Length too)."""
    return headers.get("Transfer-Encoding", "").strip().lower() == "chunked"


def body_follows(headers: httputil.HTTPHeaders) -> bool:
    return "Transfer-Encoding" in headers or headers.get("Content-Length", "0") != "0"


def _raw(response: Response) -> bytes:
    lines = [f"HTTP/1.1 {response.status} {httputil.responses.get(response.status, 'Unknown')}"]
    lines += [f"{k}: {v}" for k, v in response.headers.items() if k.lower() not in ("content-length", "connection")]
    lines += [f"Content-Length: {len(response.body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + response.body


async def answer_and_close(stream: IOStream, response: Response, timeout_s: float) -> None:
    """Write `response` with `Connection: close` (within `timeout_s`), take what the client still
    sends (up to 1 MiB, for up to a second, until it has been quiet for 0.2 s) so that the close
    does not meet unread bytes and reset the connection, then close it."""
    try:
        await gen.with_timeout(datetime.timedelta(seconds=timeout_s), stream.write(_raw(response)),
                               quiet_exceptions=(StreamClosedError,))
        end, taken = stream.io_loop.time() + _LINGER_S, 0
        while taken < _LINGER_BYTES:
            wait = min(_QUIET_S, end - stream.io_loop.time())
            if wait <= 0:
                break
            taken += len(await gen.with_timeout(datetime.timedelta(seconds=wait),
                                                stream.read_bytes(65536, partial=True),
                                                quiet_exceptions=(StreamClosedError,)))
    except (TimeoutError, StreamClosedError):
        pass  # quiet long enough, or gone
    finally:
        stream.close()
