"""The real OpenTelemetry Collector in the tests: the binary collector-config/distribution pins
(built by tools/ensure-otelcol, cached outside the tree), `otelcol validate`, and a Collector
process run with a shipped config whose endpoints and credentials only are rewritten for loopback.

The AWS SDK inside `sigv4auth` is given static test credentials and told never to ask the EC2
instance metadata service: every process started here talks to loopback only."""

from __future__ import annotations

import copy
import functools
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Iterable, Optional

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from sidecar import free_port
from support import eventually

REPO = Path(__file__).resolve().parents[1]
ENSURE = REPO / "tools" / "ensure-otelcol"
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount/"
KUBELET_TOKEN = "test-service-account-token"  # what the stand-in service account presents to kubelets
# Static test credentials (AWS's documentation example pair) and no instance metadata lookups.
AWS_ENV = {"AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_SDK_LOAD_CONFIG": "false"}


@functools.lru_cache(maxsize=1)
def binary() -> str:
    """The pinned Collector; built on first use when `make test` has not built it already. A
    missing Go toolchain or a failed build fails the test with the build's own words."""
    run = subprocess.run([str(ENSURE)], capture_output=True, text=True, timeout=1800)
    if run.returncode:
        pytest.fail(f"tools/ensure-otelcol failed:\n{run.stderr[-6000:]}")
    return run.stdout.strip().splitlines()[-1]


def environment(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The Collector's environment: this process's without any AWS settings, test credentials, `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k not in ("HTTP_PROXY", "HTTPS_PROXY")}
    return {**env, **AWS_ENV, "NO_PROXY": "*", **(extra or {})}


def validate(configs: Iterable[Path], env: dict[str, str], gates: Iterable[str] = ()) -> subprocess.CompletedProcess:
    """`otelcol validate` on the configs merged in order, with the feature gates."""
    args = [binary(), "validate", *(f"--config={c}" for c in configs)]
    if gates:
        args.append("--feature-gates=" + ",".join(gates))
    return subprocess.run(args, capture_output=True, text=True, timeout=120, env=environment(env))


def stand_in_service_account(directory: Path) -> Path:
    """A service account token and CA file, standing in for what Kubernetes mounts in the pod."""
    from certs import Authority

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "token").write_text(KUBELET_TOKEN + "\n")
    ca = Authority(directory / "ca")
    (directory / "ca.crt").write_bytes(Path(ca.cert).read_bytes())
    return directory


def credentials_rewritten(text: str, service_account: Path) -> str:
    """The config with the pod's service account files at `service_account` instead."""
    return text.replace(SERVICE_ACCOUNT, str(service_account) + "/")


def shipped_config(mode: str, workdir: Path, api_url: str, otelgpu_endpoint: str, otelgpu_metrics: str,
                   cost_port: int, write_url: str, telemetry_port: int, scrape_interval: str = "1s") -> dict:
    """collector-config/<mode>.yaml with only what a test must change: endpoints (loopback ports,
    the Kubernetes API through a kubeconfig, `write_url` for AMP), the service account files, the
    sending queue's directory (the pod's volume: `workdir`/<extension>, kept across restarts of the
    Collector), and the scrape interval (seconds instead of 30 s, so minutes of traffic take seconds)."""
    account = stand_in_service_account(workdir / "serviceaccount")
    text = credentials_rewritten((REPO / "collector-config" / f"{mode}.yaml").read_text(), account)
    doc = yaml.safe_load(text)
    config = workdir / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": api_url}}],
        "users": [{"name": "test", "user": {"token": "test-token"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}]}))
    seconds = float(scrape_interval.rstrip("s"))
    for scrape in scrape_configs(doc):
        scrape["scrape_interval"], scrape["scrape_timeout"] = scrape_interval, f"{int(seconds * 900)}ms"
        for sd in scrape.get("kubernetes_sd_configs", []):
            sd["kubeconfig_file"] = str(config)
        for static in scrape.get("static_configs", []):
            static["targets"] = [{"127.0.0.1:9464": otelgpu_metrics, "127.0.0.1:8888": f"127.0.0.1:{telemetry_port}"}[t]
                                 for t in static["targets"]]
    for name, extension in doc["extensions"].items():
        if name.split("/")[0] == "file_storage":
            extension["directory"] = extension["compaction"]["directory"] = str(workdir / name.replace("/", "-"))
    doc["receivers"]["otlp/cost"]["protocols"]["grpc"]["endpoint"] = f"127.0.0.1:{cost_port}"
    doc["exporters"]["otlp_grpc/otelgpu"]["endpoint"] = otelgpu_endpoint
    doc["exporters"]["prometheus_remote_write/amp"]["endpoint"] = write_url
    return doc


def scrape_configs(config: dict) -> Iterable[dict]:
    for name, receiver in (config.get("receivers") or {}).items():
        if name.split("/")[0] == "prometheus":
            yield from receiver["config"]["scrape_configs"]


class Collector:
    """One Collector process on `config` (a dict, written to the work directory), its log in a file.

    `telemetry_port` serves the Collector's own metrics (service.telemetry), `health_port` the
    health_check extension; both are set here."""

    def __init__(self, workdir: Path, config: dict, env: dict[str, str], gates: Iterable[str] = (),
                 name: str = "otelcol", telemetry_port: int = 0) -> None:
        self.workdir, self.env, self.gates, self.name = workdir, env, tuple(gates), name
        self.health_port, self.telemetry_port = free_port(), telemetry_port or free_port()
        doc = copy.deepcopy(config)
        doc.setdefault("extensions", {})["health_check"] = {"endpoint": f"127.0.0.1:{self.health_port}"}
        service = doc.setdefault("service", {})
        if "health_check" not in service.setdefault("extensions", []):
            service["extensions"].append("health_check")
        service["telemetry"] = {
            "logs": {"level": "info"},
            "metrics": {"level": "detailed", "readers": [
                {"pull": {"exporter": {"prometheus": {"host": "127.0.0.1", "port": self.telemetry_port}}}}]}}
        self.config = workdir / f"{name}.yaml"
        self.config.write_text(yaml.safe_dump(doc, sort_keys=False))
        self.log = workdir / f"{name}.log"
        self.proc: Optional[subprocess.Popen] = None

    def start(self, timeout: float = 60) -> "Collector":
        args = [binary(), f"--config={self.config}"]
        if self.gates:
            args.append("--feature-gates=" + ",".join(self.gates))
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=environment(self.env))

        def healthy() -> bool:
            assert self.proc.poll() is None, f"the Collector exited ({self.proc.returncode}):\n{self.tail()}"
            try:
                return requests.get(f"http://127.0.0.1:{self.health_port}/", timeout=1).status_code == 200
            except requests.ConnectionError:
                return False

        eventually(healthy, timeout, message=lambda: "the Collector is not healthy:\n" + self.tail())
        return self

    def tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def telemetry(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The Collector's own metrics: (sample name, sorted labels) -> value."""
        text = requests.get(f"http://127.0.0.1:{self.telemetry_port}/metrics", timeout=5).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def total(self, name: str, **labels: str) -> float:
        """The sum of one telemetry series' samples with these labels (0 when it has none)."""
        return sum(v for (n, ls), v in self.telemetry().items()
                   if n == name and all(dict(ls).get(k) == want for k, want in labels.items()))

    def queue_loaded(self) -> Optional[dict]:
        """What the newest start found in the persistent sending queue, as its log says ("Loaded queue
        metadata": readIndex, writeIndex, itemsSize in points, bytesSize, dispatchedItems); None when
        it found none."""
        newest = self.log.read_text(errors="replace").split("Starting otelcol-otelgpu")[-1]
        for line in newest.splitlines():
            if "\tLoaded queue metadata\t" in line:
                return json.loads(line.rsplit("\t", 1)[1])
        return None

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM by PID: the Collector drains and stops."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"the Collector did not stop after SIGTERM:\n{self.tail()}") from None

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
