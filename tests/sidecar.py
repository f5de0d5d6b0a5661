"""`otelgpu serve` as a subprocess, driven as a Collector and an operator would: OTLP/gRPC in,
/metrics read, SIGTERM or kill -9."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import grpc
import requests
import yaml
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from prometheus_client.parser import text_string_to_metric_families

from support import eventually, poll


_GIVEN: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on now, and one this process has not handed out before: the
    kernel may give a port it just freed again, and two endpoints of one test would then collide
    (a Collector's receiver and its health check on one port: "address already in use")."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


class Sidecar:
    """One `otelgpu serve` process. `config` is the configuration as a dict; the receiver and
    telemetry endpoints are set here to free loopback ports. The log goes to a file (an unread
    pipe would stall the process)."""

    def __init__(self, workdir: Path, config: dict[str, Any], name: str = "serve",
                 credentials: Optional[grpc.ChannelCredentials] = None, token: Optional[str] = None) -> None:
        """`credentials`, `token`: what export() presents (the config's receiver.grpc tls and auth
        are kept; only its endpoint is set here)."""
        self.credentials, self.token = credentials, token
        self._given = config
        self.config = workdir / f"{name}.yaml"
        self.log = workdir / f"{name}.log"
        self.proc: Optional[subprocess.Popen] = None
        self._listen_on(free_port(), free_port())

    def _listen_on(self, grpc_port: int, metrics_port: int) -> None:
        self.grpc_port, self.metrics_port = grpc_port, metrics_port
        config = self._given
        receiver = config.get("receiver", {})
        grpc_config = {**receiver.get("grpc", {}), "endpoint": f"127.0.0.1:{self.grpc_port}"}
        doc = {**config, "receiver": {**receiver, "grpc": grpc_config, "http": {"enabled": False}}}
        doc["exporter"] = {**config.get("exporter", {}), "prometheus": {"endpoint": f"127.0.0.1:{self.metrics_port}"}}
        self.config.write_text(yaml.safe_dump(doc))

    def start(self, timeout: float = 90) -> "Sidecar":
        """Start and wait for /readyz. A port found free and taken before the sidecar bound it (by
        another test's connection, say) makes the start fail on "cannot listen": it is then tried
        again on other ports, only at the first start (a restart keeps the ports a test knows)."""
        retries = 2 if self.proc is None else 0
        while True:
            began = self.log.stat().st_size if self.log.exists() else 0
            try:
                return self._start(timeout)
            except AssertionError:
                said = self.log.read_text()[began:]
                if not retries or ("cannot listen on" not in said and "Address already in use" not in said):
                    raise
                retries -= 1
                self._listen_on(free_port(), free_port())

    def _start(self, timeout: float) -> "Sidecar":
        with self.log.open("a") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "otelgpu", "serve", "--config", str(self.config)],
                                         stdout=out, stderr=subprocess.STDOUT)
        def ready() -> bool:
            assert self.proc.poll() is None, "sidecar exited:\n" + self.log.read_text()[-4000:]
            try:
                return requests.get(f"http://127.0.0.1:{self.metrics_port}/readyz", timeout=1).status_code == 200
            except requests.ConnectionError:
                return False

        eventually(ready, timeout, message=lambda: "sidecar not ready:\n" + self.log.read_text()[-4000:])
        return self

    def export(self, *reqs: ExportMetricsServiceRequest) -> None:
        channel = (grpc.secure_channel(f"localhost:{self.grpc_port}", self.credentials) if self.credentials
                   else grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}"))
        metadata = (("authorization", f"Bearer {self.token}"),) if self.token else ()
        with channel:
            stub = metrics_service_pb2_grpc.MetricsServiceStub(channel)
            for r in reqs:
                stub.Export(r, timeout=10, metadata=metadata)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a self-metric's samples on /metrics with these labels (0 when absent)."""
        return self.metrics(name, **labels)[name]

    def metrics(self, *names: str, **labels: str) -> dict[str, float]:
        """Per name, the sum of its samples with these labels, all from one scrape of /metrics."""
        text = requests.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        totals = dict.fromkeys(names, 0.0)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in totals and all(sample.labels.get(k) == v for k, v in labels.items()):
                    totals[sample.name] += sample.value
        return totals

    def wait_for(self, name: str, at_least: float, timeout: float = 30) -> float:
        return eventually(lambda: (value := self.metric(name)) >= at_least and (value,), timeout,
                          message=lambda: f"{name} < {at_least}:\n" + self.log.read_text()[-4000:])[0]

    def kill(self) -> None:
        """kill -9: no shutdown, no flush."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 60) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)  # every thread's stack into the log
            poll(lambda: "most recent call first" in self.log.read_text(errors="replace"))
            raise AssertionError("no exit after SIGTERM:\n" + self.log.read_text()[-6000:]) from None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
