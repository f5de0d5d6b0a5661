"""`otelgpu nvml` as a process against the real sidecar process: the stand-in NVML loaded by the
dynamic linker, the stand-in kubelet on its socket, kube-state-metrics facts sent as the Collector
sends them, and the cost read back from the sidecar's OTLP export. The money for a worked example
is what the same node gives with dcgm-exporter's series; the auto mode steps back while a
dcgm-exporter answers; a node without the NVIDIA library gets one clear line and a non-zero exit."""

from __future__ import annotations

import ctypes.util
import http.server
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from typing import Any

import pytest
from cluster import Cluster, Node, Pod
from otlpsink import MetricsSink, serve_sink
from sidecar import Sidecar
from support import REPO, CollectorSink, eventually, feed, make_config, offline_pipeline

from otelgpu.demo.otlp import request, scrape
from otelgpu.enrich.window import NS
from otelgpu.exporter.otlp import NO_RECORDED_VALUE
from otelgpu.nvml.agent import DcgmProbe

from .agentproc import AgentProcess
from .kubelet import pod
from .standin import Gpu

A100 = "NVIDIA A100-SXM4-40GB"
HELD, FREE = "GPU-3f6a1c2e-8b4d-4e5f-9a6b-7c8d9e0f1a2b", "GPU-7c1d2e3f-4a5b-4c6d-8e9f-0a1b2c3d4e5f"
NODE = "ip-10-20-5-17.us-west-2.compute.internal"
INTERVAL_S, PRICE = 2, 12.0
PER_INTERVAL = PRICE * INTERVAL_S / 3600  # one GPU for one interval
ATTRIBUTION = {"interval_seconds": INTERVAL_S, "lateness_seconds": 1, "prices": {"gpu_hour_by_gpu_model": {A100: PRICE}}}
METRICS = ("allocated", "effective", "waste", "unmeasured", "idle", "capacity")


def cluster(t0: int = 0) -> Cluster:
    """The node's kube-state-metrics facts: two GPUs, pod ml/train requesting one."""
    node = Node(NODE, "p4d.24xlarge", 96, 1152, labels={"nvidia.com/gpu.count": "2"}, capacity={"nvidia_com_gpu": 2})
    return Cluster([node], [Pod("ml", "train", NODE, {"team": "vision"}, gpu=("nvidia_com_gpu", 1))], t0=t0)


def gpus() -> list[Gpu]:
    """What NVML reports: the held GPU busy half the time, the other idle."""
    return [Gpu(HELD, A100, minor=0, pci="00000000:10:00.0", util=50, mem_used_mib=20480, procs=(4242,)),
            Gpu(FREE, A100, minor=1, pci="00000000:20:00.0", util=0)]


def dcgm_exporter(t_ns: int) -> Any:
    """The same node as dcgm-exporter with pod mapping reports it (Collector-shaped, fixture labels)."""
    base = {"DCGM_FI_DRIVER_VERSION": "575.51.03", "Hostname": NODE, "modelName": A100}
    held = {**base, "gpu": "0", "UUID": HELD, "device": "nvidia0", "pci_bus_id": "00000000:10:00.0",
            "container": "main", "namespace": "ml", "pod": "train"}
    free = {**base, "gpu": "1", "UUID": FREE, "device": "nvidia1", "pci_bus_id": "00000000:20:00.0"}
    return request(scrape("dcgm-exporter", "10.20.5.17:9400", NODE, t_ns, {
        "DCGM_FI_DEV_GPU_UTIL": [(held, 50.0), (free, 0.0)],
        "DCGM_FI_DEV_FB_USED": [(held, 20480.0), (free, 0.0)],
        "DCGM_FI_DEV_FB_FREE": [(held, 20480.0), (free, 40960.0)],
        "DCGM_FI_DEV_POWER_USAGE": [(held, 60.0), (free, 60.0)]}))


def with_dcgm_exporter(intervals: int = 3) -> dict[str, float]:
    """Per metric, one interval's cost of the node fed dcgm-exporter's series (the pod's, for
    allocated, effective, waste and unmeasured), from the same sidecar configuration."""
    t0 = (time.time_ns() // (INTERVAL_S * NS) - 10 * intervals) * INTERVAL_S * NS
    c = cluster(t0)
    p = offline_pipeline(make_config(attribution=ATTRIBUTION))
    for k in range(intervals * INTERVAL_S * 2):
        feed(p, c.scrape(k / 2), dcgm_exporter(t0 + k * NS // 2))
    p.close_due(flush=True)
    out = {m: sum(v for key, v in p.store.totals(m, ("pod",)).items() if key in (("train",), ("",))) / intervals
           for m in METRICS}
    p.shutdown()
    return out


def increments(sink: CollectorSink, metric: str, where: dict[str, str]) -> dict[int, float]:
    """Interval end -> the increase of gpu.cost.<metric> (summed over the series matching `where`)
    since the interval before, over the series exported at both."""
    history: dict[frozenset, dict[int, float]] = defaultdict(dict)
    for req in list(sink.requests):
        for rm in req.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name != f"gpu.cost.{metric}":
                        continue
                    for p in m.sum.data_points:
                        if p.flags & NO_RECORDED_VALUE:  # a series that ended (start-up's first guesses)
                            continue
                        attrs = {kv.key: kv.value.string_value for kv in p.attributes}
                        if all(attrs.get(k) == v for k, v in where.items()):
                            history[frozenset(attrs.items())][p.time_unix_nano] = p.as_double
    out: dict[int, float] = defaultdict(float)
    for points in history.values():
        times = sorted(points)
        for before, t in zip(times, times[1:]):
            if t - before == INTERVAL_S * NS:
                out[t] += points[t] - points[before]
    return out


@pytest.fixture
def sink():
    s = CollectorSink()
    yield s
    s.stop()


@pytest.mark.slow
def test_the_agents_series_cost_a_node_as_dcgm_exporters_do(tmp_path, devices, stand_in_library, kubelet, sink):
    """One node, two A100s at $12 an hour: ml/train holds one at 50 % utilisation, the other is
    unheld. Per 2 s interval the pod is allocated $0.00667, half effective and half waste, the
    other GPU is idle, and allocated + idle is the capacity: as with dcgm-exporter's series."""
    devices.write(gpus())
    kubelet.set({"pod_resources": [pod("ml", "train", "main", "nvidia.com/gpu", HELD)]})
    expected = with_dcgm_exporter()
    assert expected["allocated"] == pytest.approx(PER_INTERVAL, rel=1e-12)
    assert expected["effective"] == expected["waste"] == pytest.approx(PER_INTERVAL / 2, rel=1e-12)
    assert expected["idle"] == pytest.approx(PER_INTERVAL, rel=1e-12) and expected["unmeasured"] == 0

    side = Sidecar(tmp_path, {"cluster": {"name": "nvml"}, "attribution": ATTRIBUTION,
                              "exporter": {"otlp": {"endpoint": sink.endpoint, "tls": {"insecure": True},
                                                    "timeout_seconds": 5}}}).start()
    agent = AgentProcess(tmp_path, stand_in_library, devices.path, f"--endpoint=127.0.0.1:{side.grpc_port}",
                         "--interval=0.5", "--mode=nvml", f"--pod-resources-socket={kubelet.socket}", node=NODE)
    facts, sent = cluster(), [0.0]

    def costs() -> dict[str, float] | None:
        """Keeps kube-state-metrics' facts coming (every half second, as a scrape would); the costs
        of the newest interval for which every cost series shows one increment, after the first."""
        agent.running()
        if time.monotonic() - sent[0] >= 0.5:
            side.export(facts.scrape(time.time_ns() / NS))
            sent[0] = time.monotonic()
        found = {m: increments(sink, m, {"pod": "train"} if m not in ("idle", "capacity") else {}) for m in METRICS}
        common = sorted(set.intersection(*(set(found[m]) for m in ("allocated", "effective", "waste", "idle"))))
        return {m: found[m].get(common[-1], 0.0) for m in METRICS} if len(common) >= 2 else None

    try:
        got = eventually(costs, 60, message=lambda: "no interval costed:\n" + agent.text()[-3000:] + side.log.read_text()[-3000:])
        assert got == pytest.approx(expected, rel=1e-9, abs=1e-15)
        assert got["allocated"] + got["idle"] == pytest.approx(got["capacity"], rel=1e-12)
        assert side.metric("otelgpu_points_rejected_total") == 0
        assert agent.stop() == 0
        assert "pod mapping: pods from the kubelet's pod-resources API" in agent.text()
    finally:
        agent.close()
        side.close()


class DcgmExporterStandIn:
    """A real HTTP server answering /metrics as dcgm-exporter would; counts the requests it answered."""

    def __init__(self, port: int = 0, body: bytes = b'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-3f6a1c2e"} 50\n') -> None:
        owner = self
        self.answered = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server hook
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                owner.answered += 1

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_probe_asks_for_a_dcgm_exporter_not_any_server():
    dcgm, other = DcgmExporterStandIn(), DcgmExporterStandIn(body=b"<html>a dashboard</html>")
    raw = socket.create_server(("127.0.0.1", 0))  # accepts, then closes without a word of HTTP
    threading.Thread(target=lambda: raw.accept()[0].close(), daemon=True).start()
    try:
        assert DcgmProbe(f"http://127.0.0.1:{dcgm.port}/metrics").answers()
        assert not DcgmProbe(f"http://127.0.0.1:{other.port}/metrics").answers()
        assert not DcgmProbe(f"http://127.0.0.1:{raw.getsockname()[1]}/metrics").answers()
    finally:
        dcgm.stop()
        other.stop()
        raw.close()
    assert not DcgmProbe(f"http://127.0.0.1:{dcgm.port}/metrics").answers()  # nobody listening


def exported(sink: MetricsSink) -> int:
    return len(sink.received)


@pytest.mark.slow
def test_auto_mode_exports_only_while_no_dcgm_exporter_answers(tmp_path, devices, stand_in_library, kubelet):
    devices.write(gpus())
    sink, dcgm = MetricsSink(), DcgmExporterStandIn()
    with serve_sink(sink):
        agent = AgentProcess(tmp_path, stand_in_library, devices.path, f"--endpoint={sink.endpoint}", "--interval=0.2",
                             "--mode=auto", f"--dcgm-url=http://127.0.0.1:{dcgm.port}/metrics",
                             f"--pod-resources-socket={kubelet.socket}")
        try:
            eventually(lambda: agent.running() and dcgm.answered >= 3, 30, message=agent.text)
            assert exported(sink) == 0  # three cycles decided with a dcgm-exporter answering: nothing sent
            assert "series paused while it does" in agent.text()
            dcgm.stop()
            eventually(lambda: agent.running() and exported(sink) >= 2, 30, message=agent.text)
            assert "no dcgm-exporter answers at" in agent.text()
            names = {m.name for m in sink.received[-1].request.resource_metrics[0].scope_metrics[0].metrics}
            assert "DCGM_FI_DEV_GPU_UTIL" in names
            # It answers again: the agent steps back. The export of the cycle before the first
            # answered probe has reached the sink by then (each cycle finishes its export first).
            dcgm = DcgmExporterStandIn(dcgm.port)
            eventually(lambda: agent.running() and dcgm.answered >= 1, 30, message=agent.text)
            sent = exported(sink)
            eventually(lambda: agent.running() and dcgm.answered >= 4, 30, message=agent.text)
            assert exported(sink) == sent
            log = agent.text()  # each switch logged once
            assert log.count("series paused while it does") == 2 and log.count(": exporting NVML's series") == 1
            assert agent.stop() == 0
        finally:
            agent.close()
            dcgm.stop()


def run_agent(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "otelgpu", "nvml", "--node", "gpu-1", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=60, env={"PATH": "/usr/bin:/bin", **env})


def test_a_missing_nvml_library_is_one_clear_line_and_a_non_zero_exit(tmp_path):
    run = run_agent("--nvml-library", str(tmp_path / "libnvidia-ml.so.1"), env={})
    assert run.returncode == 1
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith("otelgpu nvml: cannot load the NVIDIA Management Library") and "Traceback" not in run.stderr
    assert "driver installed" in line and "runtimeClassName" in line and "NVIDIA_DRIVER_CAPABILITIES" in line


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="this machine has an NVIDIA driver")
def test_without_a_driver_on_the_linkers_path_too(tmp_path):
    run = run_agent(env={"LD_LIBRARY_PATH": str(tmp_path)})
    assert run.returncode == 1 and "libnvidia-ml.so.1 (not found by the dynamic linker)" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_a_node_name_is_required():
    run = run_agent("--node", "", env={})
    assert run.returncode == 2 and "--node or NODE_NAME" in run.stderr


def test_endpoint_settings_follow_the_sidecars_exporter_rules():
    run = run_agent("--endpoint", "otelgpu-nvml.otelgpu.svc:4320", "--insecure", "--ca-file", "/etc/ca.crt", env={})
    assert run.returncode == 2 and "ca_file and cert_file need TLS, but the endpoint is plaintext" in run.stderr
