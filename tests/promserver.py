"""A real Prometheus server for tests: the reference remote-write receiver, which AMP is compatible with.

`prometheus` (a function-scoped fixture) starts `prometheus` from PATH (else /usr/bin/prometheus,
Debian's package) on 127.0.0.1 with a free port, `--web.enable-remote-write-receiver`, a fresh
TSDB under tmp_path and a config with no scrape jobs, waits for `/-/ready`, and stops it after the
test. A missing binary fails the test, never skips it: install the Debian package `prometheus`
(CI's .ci/run does).

Timestamps must be near the present: the TSDB refuses samples older than its head's window (about
an hour behind its newest sample) and out-of-order samples, so a scenario should end at the current
time, `PrometheusServer.now_ms()`.

Use it with `pytest_plugins = ["promserver"]` in the test module (tests/ is on sys.path).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Iterator, Optional

import pytest
from sidecar import free_port
from support import poll

CONFIG = "global:\n  scrape_interval: 1m\n"  # no scrape jobs: remote write is the only input
READY_TIMEOUT_S = 20.0
Labels = dict[str, str]


def prometheus_binary() -> str:
    found = shutil.which("prometheus") or shutil.which("/usr/bin/prometheus")
    if not found:
        pytest.fail("the Prometheus server binary was not found on PATH or at /usr/bin/prometheus: install the "
                    "Debian package `prometheus` (apt-get install prometheus; CI's .ci/run installs it)")
    return found


class PrometheusServer:
    """One Prometheus process with its own TSDB under `workdir`."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = 0
        self._process: Optional[subprocess.Popen[bytes]] = None
        self._log = workdir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def write_url(self) -> str:
        return self.url + "/api/v1/write"

    @staticmethod
    def now_ms() -> int:
        """Where a scenario should end: the current time in ms, rounded down to the second (so
        queries with whole-second steps land on the samples)."""
        return int(time.time()) * 1000

    def start(self, port: int = 0) -> None:
        """Start (again: same data directory) on `port`, or on a free one."""
        config = self.workdir / "prometheus.yml"
        config.write_text(CONFIG)
        for _ in range(3):  # another process may take the free port between probe and bind
            self.port = port or free_port()
            with self._log.open("wb") as log:
                self._process = subprocess.Popen(
                    [self.binary, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'data'}",
                     f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-remote-write-receiver"],
                    stdout=log, stderr=subprocess.STDOUT)
            if self._wait_ready():
                return
            if self._process.poll() is None:
                break
        log_tail = self._log.read_text(errors="replace")[-2000:]
        self.stop()
        pytest.fail(f"Prometheus did not become ready within {READY_TIMEOUT_S} s; its log ends:\n{log_tail}")

    def _wait_ready(self) -> bool:
        def ready() -> Optional[bool]:
            if self._process is None or self._process.poll() is not None:
                return True  # exited: stop waiting (the caller sees it is not running)
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as response:
                    return response.status == 200
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                return False

        return bool(poll(ready, READY_TIMEOUT_S)) and self._process is not None and self._process.poll() is None

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)

    def _api(self, path: str, params: dict[str, str]) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str, at: Optional[float] = None) -> list[tuple[Labels, float]]:
        """An instant query (at `at`, seconds since the epoch; default now): (labels, value) per series."""
        params = {"query": promql}
        if at is not None:
            params["time"] = repr(at)
        data = self._api("query", params)
        assert data["resultType"] == "vector", data
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]

    def query_range(self, promql: str, start: float, end: float,
                    step: float) -> list[tuple[Labels, list[tuple[float, float]]]]:
        """A range query: (labels, [(time in seconds, value), ...]) per series."""
        data = self._api("query_range", {"query": promql, "start": repr(start), "end": repr(end),
                                         "step": repr(step)})
        return [(r["metric"], [(float(t), float(v)) for t, v in r["values"]]) for r in data["result"]]


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[PrometheusServer]:
    server = PrometheusServer(prometheus_binary(), tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
