"""A GPU cluster a real Collector can scrape and discover: the shared fixtures' exposition text
(dcgm-exporter on a p5.48xlarge with MIG and on a time-sliced g5.2xlarge, kube-state-metrics,
vLLM) and the kubelet's cAdvisor, each served over HTTP (the kubelet over HTTPS with a bearer
token) on its own loopback address, and the pods and nodes behind them in a local Kubernetes API
(tests/kubeapi.py), so the shipped scrape configs' service discovery and relabelling run as they
are. Only loopback addresses are used: 127.x.y.z, one per pod and node.

What the cluster does over time is driven by the test: counters advance with the clock, a pod
ends, a pod starts on a free GPU, a scrape fails. dcgm-exporter, vLLM and cAdvisor samples carry
the time they were served as their timestamp (cAdvisor does so itself; for the other two it makes
every held second known to the test, which works the expected money out from what was served,
not from when the Collector happened to scrape), and every response is logged."""

from __future__ import annotations

import random
import re
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Optional

from kubeapi import FakeKubeApi
from otelcol import KUBELET_TOKEN
from support import fixtures_dir

NODE_A = "ip-10-20-3-41.us-west-2.compute.internal"  # p5.48xlarge, 8 H100, GPU 0 in MIG mode
NODE_B = "ip-10-20-7-12.us-west-2.compute.internal"  # g5.2xlarge, one A10G time-sliced 4 ways
# Each node's EC2 instance (its providerID: kube_node_info's provider_id, the Node's spec.providerID)
INSTANCES = {NODE_A: "i-0a7c3e91f5b2d4068", NODE_B: "i-05e9d2c7a1f3b8046"}
ZONES = {NODE_A: "us-west-2b", NODE_B: "us-west-2a"}
H100, A10G = "NVIDIA H100 80GB HBM3", "NVIDIA A10G"
SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$')
LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_labels(text: str) -> list[tuple[str, str]]:
    return LABEL.findall(text or "")


def render_labels(labels: list[tuple[str, str]]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else ""


@dataclass
class Holder:
    namespace: str
    pod: str
    container: str


@dataclass
class Served:
    """One response: which target, when (ms, the samples' timestamp), whether it failed, what it showed."""
    target: str
    at_ms: int
    failed: bool
    holders: dict[str, Optional[str]] = field(default_factory=dict)  # device key -> "ns/pod"
    values: dict[str, float] = field(default_factory=dict)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def _loopback_block() -> str:
    """127.a.b: a /24 of loopback no other test is likely to use (pytest-xdist runs several at once)."""
    return f"127.{random.randint(100, 250)}.{random.randint(1, 250)}"


class Target:
    """One HTTP(S) server at ip:port answering `path` with `render(now_ms)`; any other path is 404."""

    def __init__(self, name: str, ip: str, port: int, path: str, render: Callable[[int], str],
                 tls: Optional[ssl.SSLContext] = None, token: Optional[str] = None) -> None:
        self.name, self.ip, self.port, self.path, self.render = name, ip, port, path, render
        self.fail_next = 0  # answer the next n scrapes 500
        self.lock = threading.Lock()
        target = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                if self.path.split("?")[0] != target.path:
                    return self._answer(404, b"not found\n")
                if token and self.headers.get("Authorization") != f"Bearer {token}":
                    return self._answer(401, b"Unauthorized\n")
                with target.lock:
                    if target.fail_next:
                        target.fail_next -= 1
                        body, code = None, 500
                    else:
                        body, code = target.render(int(time.time() * 1000)), 200
                if body is None:
                    target.on_failure(int(time.time() * 1000))
                    return self._answer(code, b"An error has occurred while serving metrics\n")
                self._answer(200, body.encode(), "text/plain; version=0.0.4; charset=utf-8")

            def _answer(self, code: int, body: bytes, ctype: str = "text/plain") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = _Server((ip, port), Handler)
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.on_failure: Callable[[int], None] = lambda ms: None
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True,
                         name=f"target:{name}").start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class GpuCluster:
    """The fixtures' two GPU nodes and their pods, served to a Collector, with the log of what was
    served. Every method that changes the cluster takes effect for the next response."""

    def __init__(self, workdir: Path, prompt_rate: float = 120.0, generation_rate: float = 40.0,
                 timestamps: bool = True) -> None:
        """`timestamps`: dcgm-exporter's and vLLM's samples carry the time they were served (False:
        none, as the real exporters send them; cAdvisor's always carry one)."""
        from certs import Authority

        self.workdir = workdir
        self.block = _loopback_block()
        self.log: list[Served] = []
        self.lock = threading.Lock()
        self.started_ms = int(time.time() * 1000)
        self.prompt_rate, self.generation_rate = prompt_rate, generation_rate
        self.timestamps = timestamps
        # Who holds each device of node A, as dcgm-exporter maps them ("gpu/GPU_I_ID" keys).
        self.holders_a: dict[str, Optional[Holder]] = {
            "0/11": Holder("testing", "ollama-76f687f4cd-xcvvp", "ollama"), "0/13": None,
            "1/": Holder("team-a", "vllm-llama3-8b-5c9d7b8f6d-k2x7q", "vllm"),
            "2/": Holder("team-b", "finetune-job-7xk2p", "trainer"),
            **{f"{i}/": None for i in range(3, 8)}}
        self.ksm_ended: set[str] = set()  # pods kube-state-metrics shows Succeeded
        self.ksm_started: dict[str, dict[str, str]] = {}  # pods added to kube-state-metrics: name -> facts
        self.dcgm_a = (fixtures_dir() / "dcgm" / "h100x8_mig_mixed_k8s_v4.prom").read_text()
        self.dcgm_b = (fixtures_dir() / "dcgm" / "a10g_timesliced_virtual_gpus_v4.8.prom").read_text()
        self.ksm_text = (fixtures_dir() / "ksm" / "gpu_cluster_wire_order_assembled.prom").read_text()
        self.vllm_text = (fixtures_dir() / "vllm" / "v1_text_0.0.4_prometheus_client_0.26.prom").read_text()

        ca = Authority(workdir / "kubelet-ca")
        self.ip = {name: f"{self.block}.{i}" for i, name in enumerate(
            ("dcgm-a", "dcgm-b", "ksm", "vllm", "kubelet-a", "kubelet-b"), start=11)}
        tls = {}
        for node in ("a", "b"):
            pair = ca.issue(f"kubelet-{node}", hosts=(self.ip[f"kubelet-{node}"],))
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(pair.cert), str(pair.key))
            tls[node] = ctx
        self.targets = {
            "dcgm-a": Target("dcgm-a", self.ip["dcgm-a"], 9400, "/metrics", self._dcgm_a),
            "dcgm-b": Target("dcgm-b", self.ip["dcgm-b"], 9400, "/metrics", self._dcgm_b),
            "ksm": Target("ksm", self.ip["ksm"], 8080, "/metrics", self._ksm),
            "vllm": Target("vllm", self.ip["vllm"], 8000, "/metrics", self._vllm),
            "kubelet-a": Target("kubelet-a", self.ip["kubelet-a"], 10250, "/metrics/cadvisor",
                                lambda ms: self._cadvisor(NODE_A, ms), tls["a"], KUBELET_TOKEN),
            "kubelet-b": Target("kubelet-b", self.ip["kubelet-b"], 10250, "/metrics/cadvisor",
                                lambda ms: self._cadvisor(NODE_B, ms), tls["b"], KUBELET_TOKEN)}
        for name, t in self.targets.items():
            t.on_failure = lambda ms, name=name: self._record(Served(name, ms, True))
        self.api = FakeKubeApi(token=None).start()
        self._objects()

    # -- the Kubernetes objects the Collector discovers and otelgpu watches ---------------------
    def _objects(self) -> None:
        api = self.api
        for ns, labels in {"gpu-operator": {}, "kube-system": {}, "testing": {"team": "platform", "cost-center": "cc-1001"},
                           "team-a": {"team": "team-a", "cost-center": "cc-2001"},
                           "team-b": {"team": "team-b", "cost-center": "cc-3001"},
                           "tenant-blue": {"team": "tenant-blue", "cost-center": "cc-4001"},
                           "tenant-green": {"team": "tenant-green"}}.items():
            api.apply({"kind": "Namespace", "apiVersion": "v1", "metadata": {"name": ns, "labels": labels}})
        # The nodes as kube-state-metrics' fixture shows them (the API source wins per object, so
        # both must tell the same story): GFD's labels, the capacity type, the device plugin's capacity.
        gfd = {"nvidia.com/gpu.count", "nvidia.com/gpu.product", "nvidia.com/gpu.replicas",
               "nvidia.com/gpu.sharing-strategy", "nvidia.com/mig.strategy", "nvidia.com/mig-1g.10gb.count"}
        nodes = {NODE_A: ("kubelet-a", {"node.kubernetes.io/instance-type": "p5.48xlarge",
                                        "eks.amazonaws.com/capacityType": "ON_DEMAND",
                                        "topology.kubernetes.io/zone": "us-west-2b",
                                        "nvidia.com/gpu.count": "8", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                                        "nvidia.com/gpu.replicas": "1", "nvidia.com/gpu.sharing-strategy": "none",
                                        "nvidia.com/mig-1g.10gb.count": "2", "nvidia.com/mig.strategy": "mixed"},
                          {"cpu": "192", "memory": "2063731785728", "nvidia.com/gpu": "7", "nvidia.com/mig-1g.10gb": "2"}),
                 NODE_B: ("kubelet-b", {"node.kubernetes.io/instance-type": "g5.2xlarge",
                                        "karpenter.sh/capacity-type": "spot",
                                        "topology.kubernetes.io/zone": "us-west-2a",
                                        "nvidia.com/gpu.count": "1", "nvidia.com/gpu.product": "NVIDIA-A10G-SHARED",
                                        "nvidia.com/gpu.replicas": "4", "nvidia.com/gpu.sharing-strategy": "time-slicing"},
                          {"cpu": "8", "memory": "33252212736", "nvidia.com/gpu": "4"})}
        assert all(gfd >= {k for k in labels if k.startswith("nvidia.com/")} for _, labels, _ in nodes.values())
        for name, (kubelet, labels, capacity) in nodes.items():
            api.apply({"kind": "Node", "apiVersion": "v1", "metadata": {"name": name, "labels": labels},
                       "spec": {"providerID": f"aws:///{ZONES[name]}/{INSTANCES[name]}"},
                       "status": {"capacity": capacity, "addresses": [{"type": "InternalIP", "address": self.ip[kubelet]},
                                                                      {"type": "Hostname", "address": name}],
                                  "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}}}})
        self._pod("gpu-operator", "nvidia-dcgm-exporter-a", NODE_A, self.ip["dcgm-a"], {"app": "nvidia-dcgm-exporter"},
                  ports=[9400])
        self._pod("gpu-operator", "nvidia-dcgm-exporter-b", NODE_B, self.ip["dcgm-b"], {"app": "nvidia-dcgm-exporter"},
                  ports=[9400])
        self._pod("kube-system", "kube-state-metrics-0", NODE_B, self.ip["ksm"],
                  {"app.kubernetes.io/name": "kube-state-metrics"}, ports=[8080, 8081])
        # The workload pods as kube-state-metrics' fixture shows them (otelgpu's API source wins per
        # object; in node mode it is the only one). The serving pod opts in to the token split.
        self._pod("team-a", "vllm-llama3-8b-5c9d7b8f6d-k2x7q", NODE_A, self.ip["vllm"],
                  {"app": "vllm", "app.kubernetes.io/name": "vllm", "team": "team-a"}, ports=[8000],
                  annotations={"otelgpu.io/tokens": "true"}, uid="3f6b2c1d-8e7a-4b5c-9d0e-1f2a3b4c5d6e",
                  requests={"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "1"}, container="vllm",
                  owner=("ReplicaSet", "vllm-llama3-8b-5c9d7b8f6d"))
        for i, (ns, name, node, labels, uid, requests, container, owner, phase) in enumerate(WORKLOADS):
            self._pod(ns, name, node, f"{self.block}.{40 + i}", labels, uid=uid, requests=requests,
                      container=container, owner=owner, phase=phase)

    def _pod(self, ns: str, name: str, node: str, ip: str, labels: dict[str, str], ports: list[int] = (),
             annotations: Optional[dict[str, str]] = None, uid: Optional[str] = None,
             requests: Optional[dict[str, str]] = None, container: str = "main",
             owner: Optional[tuple[str, str]] = None, phase: str = "Running") -> None:
        meta = {"name": name, "namespace": ns, "labels": labels, "annotations": annotations or {}}
        if uid:
            meta["uid"] = uid
        if owner:
            meta["ownerReferences"] = [{"apiVersion": "batch/v1" if owner[0] == "Job" else "apps/v1",
                                        "kind": owner[0], "name": owner[1],
                                        "uid": f"uid-{owner[1]}", "controller": True}]
        self.api.apply({"kind": "Pod", "apiVersion": "v1", "metadata": meta,
                        "spec": {"nodeName": node, "containers": [{
                            "name": container, "resources": {"requests": requests or {}},
                            "ports": [{"containerPort": p, "protocol": "TCP"} for p in ports]}]},
                        "status": {"phase": phase, "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": ip}})

    # -- what the test changes ------------------------------------------------------------------
    def end_gpu_holding(self, key: str) -> None:
        """The pod on device `key` of node A exits: dcgm-exporter shows the device without it."""
        with self.lock:
            self.holders_a[key] = None

    def start_gpu_holding(self, key: str, holder: Holder) -> None:
        with self.lock:
            self.holders_a[key] = holder

    def pod_ended(self, namespace: str, pod: str) -> None:
        """The pod Succeeded: kube-state-metrics and the Kubernetes API say so."""
        with self.lock:
            self.ksm_ended.add(pod)
        obj = self.api.get("Pod", pod, namespace)
        self.api.apply({**obj, "status": {**obj["status"], "phase": "Succeeded"}})

    def pod_started(self, pod: str, facts: dict[str, str]) -> None:
        """A new fine-tuning pod on node A, Running: namespace, uid, team and job (its owner)."""
        with self.lock:
            self.ksm_started[pod] = facts
        self._pod(facts["namespace"], pod, NODE_A, f"{self.block}.60", {"job-name": facts["job"], "team": facts["team"]},
                  uid=facts["uid"], requests={"cpu": "16", "memory": "128Gi", "nvidia.com/gpu": "1"},
                  container="trainer", owner=("Job", facts["job"]))

    def fail_next_scrape(self, target: str) -> None:
        with self.targets[target].lock:
            self.targets[target].fail_next += 1

    def served(self, target: str, failed: Optional[bool] = None) -> list[Served]:
        with self.lock:
            return [s for s in self.log if s.target == target and (failed is None or s.failed == failed)]

    def wait_served(self, target: str, after_ms: int, timeout: float = 60) -> Served:
        """The first response of `target` served after `after_ms`, waiting for it."""
        from support import eventually

        def first() -> Optional[Served]:
            return next((s for s in self.served(target) if s.at_ms > after_ms and not s.failed), None)

        return eventually(first, timeout, message=f"{target} was not scraped after {after_ms}")

    def close(self) -> None:
        for t in self.targets.values():
            t.close()
        self.api.stop()

    def _record(self, s: Served) -> None:
        with self.lock:
            self.log.append(s)

    # -- the exposition -------------------------------------------------------------------------
    def _stamp(self, ms: int) -> str:
        return f" {ms}" if self.timestamps else ""

    def _elapsed(self, ms: int) -> float:
        return (ms - self.started_ms) / 1000

    def _restamped(self, text: str, ms: int, sample: Callable[[str, str, float], str]) -> str:
        """`text` with each sample line's labels and value as `sample(name, labels, value)` gives
        them, stamped `ms` where this cluster stamps; comment lines as they are."""
        out = []
        for line in text.splitlines():
            m = SAMPLE.match(line)
            out.append(f"{m.group(1)}{sample(m.group(1), m.group(2) or '', float(m.group(3)))}{self._stamp(ms)}"
                       if m else line)
        return "\n".join(out) + "\n"

    def _dcgm_a(self, ms: int) -> str:
        """The fixture with each device's pod labels those of its holder now, energy counting on."""
        with self.lock:
            holders = dict(self.holders_a)

        def sample(name: str, text: str, value: float) -> str:
            labels = parse_labels(text)
            d = dict(labels)
            h = holders[f"{d['gpu']}/{d.get('GPU_I_ID', '')}"]
            keep = [(k, v) for k, v in labels if k not in ("container", "namespace", "pod")]
            if h is not None:
                keep += [("container", h.container), ("namespace", h.namespace), ("pod", h.pod)]
            if name == "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION":
                value += 700_000 * self._elapsed(ms)  # 700 W, in mJ
            if name == "DCGM_FI_PROF_GR_ENGINE_ACTIVE" and h is not None and value == 0:
                value = 0.5  # a pod that starts on an idle GPU uses it
            return f"{render_labels(keep)} {value:f}"

        body = self._restamped(self.dcgm_a, ms, sample)
        self._record(Served("dcgm-a", ms, False, {k: h and f"{h.namespace}/{h.pod}" for k, h in holders.items()}))
        return body

    def _dcgm_b(self, ms: int) -> str:
        def sample(name: str, labels: str, value: float) -> str:
            if name == "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION":
                value += 180_000 * self._elapsed(ms)
            return f"{{{labels}}} {value:f}"

        body = self._restamped(self.dcgm_b, ms, sample)
        self._record(Served("dcgm-b", ms, False))
        return body

    def _ksm(self, ms: int) -> str:
        """The fixture, with ended pods' phases Succeeded and started pods added; no timestamps, as
        kube-state-metrics sends none."""
        with self.lock:
            ended, started = set(self.ksm_ended), dict(self.ksm_started)
        out = []
        for line in self.ksm_text.splitlines():
            m = SAMPLE.match(line)
            if m and m.group(1) == "kube_pod_status_phase":
                d = dict(parse_labels(m.group(2)))
                if d["pod"] in ended:
                    line = f"{m.group(1)}{{{m.group(2)}}} {1 if d['phase'] == 'Succeeded' else 0}"
            out.append(line)
            if line.startswith("# TYPE "):
                family = line.split()[2]
                for pod, f in started.items():
                    out.extend(_ksm_started(family, pod, f))
        self._record(Served("ksm", ms, False))
        return "\n".join(_node_info() + out) + "\n"

    def _vllm(self, ms: int) -> str:
        elapsed = self._elapsed(ms)
        values = {"vllm:prompt_tokens_total": 1_840_512 + self.prompt_rate * elapsed,
                  "vllm:generation_tokens_total": 1_000_000 + self.generation_rate * elapsed}
        body = self._restamped(self.vllm_text, ms, lambda name, labels, value:
                               f"{{{labels}}} {values.get(name, value)!r}")
        self._record(Served("vllm", ms, False, values=values))
        return body

    def _cadvisor(self, node: str, ms: int) -> str:
        """The kubelet's /metrics/cadvisor for the node's running pods: per-container CPU and
        working set, the pod-level cgroup too, each sample with cAdvisor's own timestamp."""
        pods = [("testing", "ollama-76f687f4cd-xcvvp", "ollama", 1.5, 6e9),
                ("team-a", "vllm-llama3-8b-5c9d7b8f6d-k2x7q", "vllm", 9.0, 60e9),
                ("team-b", "finetune-job-7xk2p", "trainer", 12.0, 100e9)] if node == NODE_A else [
                ("tenant-blue", "chat-api-6f7d9c8b7-4xq2m", "server", 0.8, 5e9),
                ("tenant-green", "embedder-85b4d6f9c-wz8pl", "embed", 1.2, 3e9)]
        elapsed = self._elapsed(ms)
        cpu = ["# HELP container_cpu_usage_seconds_total [STABLE] Cumulative cpu time consumed by the container in core-seconds",
               "# TYPE container_cpu_usage_seconds_total counter"]
        mem = ["# HELP container_memory_working_set_bytes [STABLE] Current working set of the container in bytes",
               "# TYPE container_memory_working_set_bytes gauge"]
        for ns, pod, container, cores, working_set in pods:
            cg = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{abs(hash(pod)) % 10**8}.slice"
            base = f'container="{container}",id="{cg}/cri-containerd-{container}.scope",image="registry.local/{container}:1",' \
                   f'name="{container}",namespace="{ns}",pod="{pod}"'
            cpu.append(f"container_cpu_usage_seconds_total{{{base}}} {1000 + cores * elapsed:.6f} {ms}")
            cpu.append(f'container_cpu_usage_seconds_total{{container="",id="{cg}",image="",name="",namespace="{ns}",'
                       f'pod="{pod}"}} {1000 + (cores + 0.1) * elapsed:.6f} {ms}')
            mem.append(f"container_memory_working_set_bytes{{{base}}} {working_set:.0f} {ms}")
        self._record(Served("kubelet-a" if node == NODE_A else "kubelet-b", ms, False))
        return "\n".join(cpu + mem + ["# HELP machine_cpu_cores Number of logical CPU cores.",
                                      "# TYPE machine_cpu_cores gauge", "machine_cpu_cores 8"]) + "\n"


WORKLOADS = [  # namespace, pod, node, labels, uid, requests, container, owner, phase: as in the ksm fixture
    ("testing", "ollama-76f687f4cd-xcvvp", NODE_A, {"app": "ollama"}, "9c1f4a7e-2d3b-4e8f-a0b1-6c5d4e3f2a19",
     {"cpu": "2", "memory": "8Gi", "nvidia.com/mig-1g.10gb": "1"}, "ollama", ("ReplicaSet", "ollama-76f687f4cd"),
     "Running"),
    ("team-b", "finetune-job-7xk2p", NODE_A, {"job-name": "finetune-job", "team": "team-b"},
     "0d4e5f6a-7b8c-4d9e-8f0a-1b2c3d4e5f60", {"cpu": "16", "memory": "128Gi", "nvidia.com/gpu": "1"}, "trainer",
     ("Job", "finetune-job"), "Running"),
    ("team-b", "finetune-job-old-9z8y7", NODE_A, {"job-name": "finetune-job-old", "team": "team-b"},
     "7a8b9c0d-1e2f-4a3b-8c4d-5e6f7a8b9c0d", {"cpu": "16", "memory": "128Gi", "nvidia.com/gpu": "1"}, "trainer",
     ("Job", "finetune-job-old"), "Succeeded"),
    ("tenant-blue", "chat-api-6f7d9c8b7-4xq2m", NODE_B, {"app": "chat-api", "team": "tenant-blue"},
     "5f0c2f53-9a3e-4c1e-8f43-0d6f0d3b1a11", {"cpu": "1100m", "memory": "6272Mi", "nvidia.com/gpu": "1"}, "server",
     ("ReplicaSet", "chat-api-6f7d9c8b7"), "Running"),
    ("tenant-green", "embedder-85b4d6f9c-wz8pl", NODE_B, {"app": "embedder", "team": "tenant-green"},
     "a1d7e0c4-2b6f-4f0a-9c55-7e2b8d9f6c22", {"cpu": "1", "memory": "4Gi", "nvidia.com/gpu": "1"}, "embed",
     ("ReplicaSet", "embedder-85b4d6f9c"), "Running")]


def _node_info() -> list[str]:
    """kube_node_info of the two nodes, as kube-state-metrics writes it (its golden node test's labels)."""
    out = ["# HELP kube_node_info [STABLE] Information about a cluster node.", "# TYPE kube_node_info gauge"]
    for node, ip in ((NODE_A, "10.20.3.41"), (NODE_B, "10.20.7.12")):
        out.append(f'kube_node_info{{container_runtime_version="containerd://1.7.27",internal_ip="{ip}",'
                   f'kernel_version="6.1.141-155.222.amzn2023.x86_64",kubelet_version="v1.32.3-eks-473151a",'
                   f'kubeproxy_version="deprecated",node="{node}",os_image="Amazon Linux 2023.7.20250623",'
                   f'pod_cidr="",provider_id="aws:///{ZONES[node]}/{INSTANCES[node]}",'
                   f'system_uuid="ec2{INSTANCES[node][2:10]}-0000-0000-0000-000000000000"}} 1')
    return out


def _ksm_started(family: str, pod: str, f: dict[str, str]) -> list[str]:
    ident = f'namespace="{f["namespace"]}",pod="{pod}",uid="{f["uid"]}"'
    node = f'node="{NODE_A}"'
    if family == "kube_pod_info":
        return [f'kube_pod_info{{{ident},host_ip="10.20.3.41",pod_ip="10.20.40.77",{node},created_by_kind="Job",'
                f'created_by_name="{f["job"]}",priority_class="",host_network="false"}} 1']
    if family == "kube_pod_labels":
        return [f'kube_pod_labels{{{ident},label_job_name="{f["job"]}",label_team="{f["team"]}"}} 1']
    if family == "kube_pod_status_phase":
        return [f'kube_pod_status_phase{{{ident},phase="{p}"}} {int(p == "Running")}'
                for p in ("Pending", "Succeeded", "Failed", "Unknown", "Running")]
    if family == "kube_pod_container_resource_requests":
        req = f'{ident},container="trainer",{node}'
        return [f'kube_pod_container_resource_requests{{{req},resource="cpu",unit="core"}} 16',
                f'kube_pod_container_resource_requests{{{req},resource="memory",unit="byte"}} 1.37438953472e+11',
                f'kube_pod_container_resource_requests{{{req},resource="nvidia_com_gpu",unit="integer"}} 1']
    return []
