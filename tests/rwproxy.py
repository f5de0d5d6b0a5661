"""A remote-write proxy in front of a real Prometheus that forwards, fails or holds each request as
a test scripts it: the way to make a receiver fail part-way through a snapshot."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

FORWARD, FAIL, HOLD = "forward", "fail", "hold"


class RemoteWriteProxy:
    """`decide(n)` says what to do with the n-th request (1 = the first): FORWARD it to `target`,
    FAIL it with a 503, or HOLD it until `stop()`, then answer 503 without forwarding. `count`
    counts the requests, `held` those held."""

    def __init__(self, target: str, decide: Callable[[int], str]) -> None:
        proxy = self
        self.count = self.held = 0
        self.gate = threading.Event()
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with lock:
                    proxy.count += 1
                    action = decide(proxy.count)
                    proxy.held += action == HOLD
                status, answer = 503, f"scripted: {action}".encode()
                if action == FORWARD:
                    request = urllib.request.Request(target, data=body, headers=dict(self.headers.items()))
                    try:
                        with urllib.request.urlopen(request, timeout=10) as response:
                            status, answer = response.status, response.read()
                    except urllib.error.HTTPError as error:
                        status, answer = error.code, error.read()
                elif action == HOLD:
                    proxy.gate.wait(60)
                self.send_response(status)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api/v1/write"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def stop(self) -> None:
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()
