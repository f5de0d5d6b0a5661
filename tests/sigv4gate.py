"""A stand-in for AMP's front door: every remote-write request must carry a well-formed AWS
Signature Version 4 `Authorization` header for the `aps` service that verifies, by the independent
reference computation (tests/sigv4ref.py), over the exact bytes that arrived, with the test's
credentials. A verified request is forwarded to a real Prometheus and its answer relayed; one that
does not verify is answered 403, as AMP answers it, and counted."""

from __future__ import annotations

import re
import threading
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from sigv4ref import reference_sigv4

AUTH = re.compile(r"^AWS4-HMAC-SHA256 Credential=(?P<key>[^/]+)/(?P<date>\d{8})/(?P<region>[^/]+)/(?P<service>[^/]+)"
                  r"/aws4_request, SignedHeaders=(?P<signed>[a-z0-9;-]+), Signature=(?P<signature>[0-9a-f]{64})$")


class SigV4Gate:
    def __init__(self, target: str, key: str, secret: str, region: str, service: str = "aps") -> None:
        gate = self
        self.target = target
        self.verified = 0
        self.refused: list[str] = []  # why, per refused request
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                problem = gate.problem(dict(self.headers.items()), self.path, body, key, secret, region, service)
                with lock:
                    if problem:
                        gate.refused.append(problem)
                    else:
                        gate.verified += 1
                if problem:
                    return self._answer(403, b'{"message":"The request signature we calculated does not match"}')
                request = urllib.request.Request(gate.target, data=body, method="POST", headers={
                    k: v for k, v in self.headers.items() if k.lower() in ("content-type", "content-encoding",
                                                                         "x-prometheus-remote-write-version")})
                try:
                    with urllib.request.urlopen(request, timeout=30) as r:
                        self._answer(r.status, r.read())
                except urllib.error.HTTPError as e:
                    self._answer(e.code, e.read())
                except OSError:  # Prometheus away: a server error, which the exporter retries
                    self._answer(503, b"upstream unavailable")

            def _answer(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/workspaces/ws-e2e/api/v1/remote_write"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True, name="sigv4gate").start()

    @staticmethod
    def problem(headers: dict[str, str], path: str, body: bytes, key: str, secret: str, region: str,
                service: str) -> str:
        """Why the request's signature does not verify ("" when it does)."""
        auth, amz_date = headers.get("Authorization", ""), headers.get("X-Amz-Date", "")
        m = AUTH.match(auth)
        if not m:
            return f"malformed Authorization: {auth[:80]!r}"
        if (m["key"], m["region"], m["service"]) != (key, region, service):
            return f"credential scope {m['key']}/{m['region']}/{m['service']}"
        try:
            signed_at = datetime.strptime(amz_date, "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
        except ValueError:
            return f"X-Amz-Date {amz_date!r}"
        if m["date"] != amz_date[:8] or abs(datetime.now(timezone.utc) - signed_at) > timedelta(minutes=5):
            return f"signed at {amz_date}, not now"
        names = m["signed"].split(";")
        if "host" not in names:
            return "host not signed"
        lower = {k.lower(): v for k, v in headers.items()}
        if "x-amz-content-sha256" in lower:
            import hashlib
            if lower["x-amz-content-sha256"] != hashlib.sha256(body).hexdigest():
                return "x-amz-content-sha256 is not the body's"
        arrived = {n: lower[n] for n in names if n != "host" and n in lower}
        if len(arrived) != len(names) - 1:
            return f"signed headers missing: {sorted(set(names) - set(arrived) - {'host'})}"
        expected = reference_sigv4(arrived, lower["host"], path, body, key, secret, amz_date, region, service)
        return "" if auth == expected else "signature does not match the bytes that arrived"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
