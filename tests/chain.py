"""The production chain with the real Collector in it, for tests: the fixtures' cluster
(tests/scrapecluster.py) discovered and scraped by the pinned Collector running a shipped config
(only endpoints, credentials, the queue's directory and the scrape interval rewritten:
otelcol.shipped_config), the real `otelgpu serve` between its two pipelines, a real Prometheus
behind its remote-write exporter.

`Chain.run(disturb)` plays the cluster's timeline (a pod starts, a scrape fails, a pod ends) with
the test's disturbances at chosen moments, and `Chain.check_money` compares what PromQL reads back
with the figures worked out from what the cluster served: the money of an undisturbed run.

dcgm-exporter's and vLLM's samples carry the time they were served here (as cAdvisor's do in
production), so every second a pod held a GPU is known to the test. The Collector sends no
staleness markers for timestamped series, so here a pod's end is its device's next sample and a
failed scrape leaves a gap; test_collector_shapes.py runs untimestamped exposition, where the
Collector's own markers end series, as with a real dcgm-exporter."""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import otelcol
import pytest
import requests
import yaml
from scrapecluster import A10G, H100, INSTANCES, NODE_A, NODE_B, GpuCluster, Holder
from sidecar import Sidecar, free_port
from sigv4gate import SigV4Gate
from support import eventually

if TYPE_CHECKING:
    from promserver import PrometheusServer

REPO = Path(__file__).resolve().parents[1]
DT = 10  # otelgpu's interval in these tests, seconds
PRICE = {H100: 12.0, A10G: 1.2}  # $ per GPU-hour
ENV = {"CLUSTER_NAME": "e2e", "AMP_REGION": "us-east-1", "AMP_WORKSPACE_ID": "ws-e2e",
       "DCGM_EXPORTER_NAMESPACE": "gpu-operator", "KUBE_STATE_METRICS_NAMESPACE": "kube-system"}
GATES = ("exporter.prometheusremotewritexporter.RetryOn429",)
FILTERED = "otelcol_processor_filter_datapoints_filtered_total"  # filter/otelgpu's drops (the `filter` label names it)
NEW_POD = "finetune-job-2-h7k4d"
VLLM = "vllm-llama3-8b-5c9d7b8f6d-k2x7q"
Disturbance = tuple[float, str, Callable[[], None]]  # (seconds after every target's first scrape, what, do it)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[GpuCluster]:
    """The fixtures' cluster, served on loopback for the test (`pytest_plugins = ["chain"]`)."""
    c = GpuCluster(tmp_path / "cluster")
    try:
        yield c
    finally:
        c.close()


def otelgpu_config(mode: str, workdir: Path, c: GpuCluster, cost_port: int, lateness_s: int = 8) -> dict:
    """k8s/<mode>/otelgpu.yaml with 10-second intervals waiting `lateness_s` for late data, the
    test's prices and loopback endpoints."""
    doc = yaml.safe_load((REPO / "k8s" / mode / "otelgpu.yaml").read_text())
    doc["cluster"]["name"] = ENV["CLUSTER_NAME"]
    doc["attribution"].update(interval_seconds=DT, lateness_seconds=lateness_s)
    doc["attribution"]["prices"] = {"gpu_hour_by_gpu_model": PRICE}
    doc["kubernetes"].update(auth="token", api_url=c.api.url, token="test-token")
    if mode == "node":
        doc["kubernetes"]["node_name"] = NODE_A
    doc["checkpoint"]["directory"] = str(workdir / "checkpoint")
    doc["exporter"]["otlp"]["endpoint"] = f"127.0.0.1:{cost_port}"
    return doc


class Chain:
    def __init__(self, workdir: Path, cluster: GpuCluster, prometheus: PrometheusServer, mode: str = "gateway",
                 lateness_s: int = 8) -> None:
        self.workdir, self.cluster, self.prometheus = workdir, cluster, prometheus
        self.cost_port, self.telemetry_port = free_port(), free_port()
        self.otelgpu = Sidecar(workdir, {}, name="otelgpu")
        doc = otelgpu_config(mode, workdir, cluster, self.cost_port, lateness_s)
        doc["receiver"]["grpc"]["endpoint"] = f"127.0.0.1:{self.otelgpu.grpc_port}"
        doc["exporter"]["prometheus"]["endpoint"] = f"127.0.0.1:{self.otelgpu.metrics_port}"
        self.otelgpu.config.write_text(yaml.safe_dump(doc))
        # AMP's front door: sigv4auth's signature checked over the bytes that arrive, then Prometheus.
        self.gate = SigV4Gate(prometheus.write_url, otelcol.AWS_ENV["AWS_ACCESS_KEY_ID"],
                              otelcol.AWS_ENV["AWS_SECRET_ACCESS_KEY"], ENV["AMP_REGION"])
        config = otelcol.shipped_config(mode, workdir, cluster.api.url, f"127.0.0.1:{self.otelgpu.grpc_port}",
                                        f"127.0.0.1:{self.otelgpu.metrics_port}", self.cost_port,
                                        self.gate.url, self.telemetry_port)
        self.mode = mode
        env = {**ENV, "NODE_NAME": NODE_A} if mode == "node" else ENV
        self.collector = otelcol.Collector(workdir, config, env, GATES, telemetry_port=self.telemetry_port)
        # Per node, the Collector scrapes only its node's dcgm-exporter, kubelet and vLLM pods.
        self.scraped = (["dcgm-a", "vllm", "kubelet-a"] if mode == "node" else list(cluster.targets))
        self.failing = "dcgm-a" if mode == "node" else "dcgm-b"  # the target one scrape of which fails

    def start(self) -> "Chain":
        self.otelgpu.start()
        self.collector.start()
        for target in self.scraped:  # each found by discovery and scraped
            self.cluster.wait_served(target, 0, timeout=60)
        return self

    def close(self) -> None:
        self.collector.close()
        self.otelgpu.close()
        self.gate.stop()

    def check_signed(self) -> None:
        """Every remote-write request carried a SigV4 signature that verified over its bytes."""
        assert self.gate.verified > 0 and not self.gate.refused, (self.gate.verified, self.gate.refused[:3])

    def run(self, disturbances: list[Disturbance] = (), after_s: float = 40) -> tuple[int, int]:
        """The cluster's timeline, with `disturbances` at their moments; returns the window
        (start, cut) of interval ends to check, once the cut is in Prometheus."""
        c = self.cluster
        first = {t: c.served(t)[0].at_ms for t in self.scraped}
        t0 = max(first.values())  # every target scraped once: the timeline counts from here
        events: list[Disturbance] = [
            # A new pod is scheduled on GPU 3: the API and kube-state-metrics show it first, then DCGM its process.
            (12, "new pod Running", lambda: c.pod_started(NEW_POD, {
                "namespace": "team-b", "uid": "c0ffee00-1111-4222-8333-944455556666", "team": "team-b",
                "job": "finetune-job-2"})),
            (15, "new pod on GPU 3", lambda: c.start_gpu_holding("3/", Holder("team-b", NEW_POD, "trainer"))),
            (22, f"a failed scrape of {self.failing}", lambda: c.fail_next_scrape(self.failing)),
            # The fine-tuning job ends: DCGM no longer shows it on GPU 2, then its phase is Succeeded.
            (31, "the fine-tuning pod leaves GPU 2", lambda: c.end_gpu_holding("2/")),
            (34, "the fine-tuning pod Succeeded", lambda: c.pod_ended("team-b", "finetune-job-7xk2p")),
            *disturbances]
        timeline = [f"first scrapes {first}"]
        for offset, what, action in sorted(events, key=lambda e: e[0]):
            wait_until_ms(t0 + int(offset * 1000))
            timeline.append(f"{int(time.time() * 1000)} +{offset}s {what}")
            action()
        last = max([e[0] for e in events] + [after_s])
        cut_s = (t0 // 1000 + int(last)) // DT * DT + DT  # an interval end after every event
        eventually(lambda: c.served(self.failing, failed=True), 30)  # the failed scrape happened
        # Wait until the interval ending at the cut is in Prometheus, through the whole chain.
        eventually(lambda: latest_s(self.prometheus, "gpu_cost_capacity_total") >= cut_s, timeout=180,
                   message=lambda: f"no cost at {cut_s} in Prometheus:\n{self.otelgpu.log.read_text()[-3000:]}"
                                   f"{self.collector.tail(3000)}")
        self.dump(cut_s)
        # The window: from the end of the first interval every source reported in (before it, a
        # node is priced from kube-state-metrics alone until its dcgm-exporter is first scraped) to
        # the cut.
        start_s = max(first.values()) // 1000 // DT * DT + DT
        served = [f"{s.at_ms} {s.target}{' failed' if s.failed else ''} {s.holders or ''}" for s in c.served("dcgm-a")]
        (self.workdir / "timeline.txt").write_text("\n".join(timeline + [f"window {start_s} to {cut_s}"] + served) + "\n")
        assert start_s * 1000 < t0 + 12_000, "the first event fell before the window"
        return start_s, cut_s

    def dump(self, cut_s: int) -> None:
        """What Prometheus, the Collector and otelgpu say at the cut, into the test's directory."""
        lines = [f"{labels.get('__name__')} {v!r} {labels}" for labels, v in self.prometheus.query(
            'last_over_time({__name__=~"gpu_.*|llm_.*", cluster="e2e"}[2h])', cut_s)]
        (self.workdir / "prometheus-at-cut.txt").write_text("\n".join(sorted(lines)) + "\n")
        for name, port in (("otelcol-telemetry", self.telemetry_port), ("otelgpu-metrics", self.otelgpu.metrics_port)):
            try:
                (self.workdir / f"{name}.txt").write_text(requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text)
            except requests.RequestException as e:
                (self.workdir / f"{name}.txt").write_text(repr(e))

    def check_money(self, start_s: int, cut_s: int) -> None:
        """PromQL totals over the window against the figures worked out from what was served."""
        prometheus, c = self.prometheus, self.cluster
        served_a = c.served("dcgm-a", failed=False)
        ended_ms = changed_ms(served_a, lambda s: s.holders["2/"] is None)
        new_ms = changed_ms(served_a, lambda s: s.holders["3/"] is not None)
        h100, span = PRICE[H100] / 3600, cut_s - start_s
        expected = {
            VLLM: h100 * span,
            "ollama-76f687f4cd-xcvvp": h100 / 7 * span,  # MIG 1g.10gb: 1 of 7 compute slices
            "finetune-job-7xk2p": h100 * (ended_ms / 1000 - start_s),
            NEW_POD: h100 * (cut_s - new_ms / 1000)}
        got = window(prometheus, "gpu_cost_allocated_total", "pod", start_s, cut_s)
        for pod, value in expected.items():
            assert got.get(pod) == pytest.approx(value, rel=1e-6), (
                f"{pod}: {got.get(pod)} != {value} (window {start_s}-{cut_s}, ended {ended_ms}, new {new_ms})\n"
                + series(prometheus, cut_s))
        # The g5's two time-sliced pods hold a quarter of the A10G each, through the failed scrape
        # (its gap is held by what the sample before it showed). Per node, only node A is seen.
        nodes = (NODE_A,) if self.mode == "node" else (NODE_A, NODE_B)
        for pod in ("chat-api-6f7d9c8b7-4xq2m", "embedder-85b4d6f9c-wz8pl"):
            if NODE_B in nodes:
                assert got[pod] == pytest.approx(PRICE[A10G] / 3600 / 4 * span, rel=1e-6), pod
            else:
                assert pod not in got, pod
        # Per node: allocated + idle = capacity, capacity = the GPUs' price over the window.
        allocated = window(prometheus, "gpu_cost_allocated_total", "node", start_s, cut_s)
        idle = window(prometheus, "gpu_cost_idle_total", "node", start_s, cut_s)
        capacity = window(prometheus, "gpu_cost_capacity_total", "node", start_s, cut_s)
        assert capacity[NODE_A] == pytest.approx(8 * h100 * span, rel=1e-6)
        if NODE_B in nodes:
            assert capacity[NODE_B] == pytest.approx(PRICE[A10G] / 3600 * span, rel=1e-6)
        assert set(capacity) == set(nodes), capacity
        # Each node's instance, from kube_node_info through the Collector, or the API's Node (node mode).
        instances = window(prometheus, "gpu_cost_capacity_total", "node, instance_id", start_s, cut_s, pair=True)
        assert set(instances) == {(node, INSTANCES[node]) for node in nodes}, instances
        for node in nodes:
            assert allocated[node] + idle[node] == pytest.approx(capacity[node], rel=1e-9), node
        # By team: the pods' tags from kube-state-metrics and the Kubernetes API.
        teams = window(prometheus, "gpu_cost_allocated_total", "team", start_s, cut_s)
        assert teams["team-b"] == pytest.approx(expected["finetune-job-7xk2p"] + expected[NEW_POD], rel=1e-6)
        assert teams["platform"] == pytest.approx(expected["ollama-76f687f4cd-xcvvp"], rel=1e-6)
        assert teams["team-a"] == pytest.approx(expected[VLLM], rel=1e-6)
        # Effective: the vLLM pod's GPU was 87.321 % active the whole time.
        effective = window(prometheus, "gpu_cost_effective_total", "pod", start_s, cut_s)
        assert effective[VLLM] == pytest.approx(0.873210 * expected[VLLM], rel=1e-6)
        # Tokens: an interval's are its last counter value less the one before it.
        served_vllm = c.served("vllm", failed=False)
        before = {edge: [s for s in served_vllm if s.at_ms < edge * 1000][-1] for edge in (start_s, cut_s)}
        tokens = {labels["token_kind"]: value for labels, value in prometheus.query(
            f'max_over_time(llm_tokens_total{{cluster="e2e"}}[2h] @ {cut_s}) - '
            f'(max_over_time(llm_tokens_total{{cluster="e2e"}}[2h] @ {start_s}) or vector(0))', cut_s)}
        for kind, name in (("prompt", "vllm:prompt_tokens_total"), ("generation", "vllm:generation_tokens_total")):
            assert tokens[kind] == pytest.approx(before[cut_s].values[name] - before[start_s].values[name], rel=1e-9)

    def check_nothing_lost(self) -> None:
        """No loop and nothing lost on the way: every point the prometheus receiver took went to
        otelgpu and was accepted there, but those filter/otelgpu dropped (the series otelgpu does
        not read: tests/test_collector_filter.py); nothing was refused, failed or dropped otherwise
        in the Collector. (For one Collector process: its counters start at zero when it starts.)"""
        def counts() -> tuple[dict, float, float, float, float]:
            telemetry = self.collector.telemetry()

            def total(name: str, label: tuple[str, str]) -> float:
                return sum(v for (n, ls), v in telemetry.items() if n == name and label in ls)

            scraped = total("otelcol_receiver_accepted_metric_points_total", ("receiver", "prometheus"))
            filtered = total(FILTERED, ("filter", "filter/otelgpu"))
            sent = total("otelcol_exporter_sent_metric_points_total", ("exporter", "otlp_grpc/otelgpu"))
            accepted = self.otelgpu.metric("otelgpu_receiver_accepted_metric_points_total")
            return telemetry, scraped, filtered, sent, accepted

        # Scrapes go on: read when no export is in flight (what was sent is what otelgpu took). What
        # was scraped and not yet sent waits in the batch processor (less than send_batch_size) or,
        # flushed, in the exporter's queue: at most one batch (send_batch_max_size) in all here.
        telemetry, scraped, filtered, sent, _ = eventually(lambda: (c := counts())[3] == c[4] and c, timeout=30)
        assert sent > 0 and filtered > 0 and 0 <= scraped - filtered - sent < 16384, (scraped, filtered, sent)
        assert self.otelgpu.metric("otelgpu_points_rejected_total") == 0
        lost = {n: v for (n, ls), v in telemetry.items() if v and any(w in n for w in ("refused", "failed", "dropped"))}
        assert not lost, lost
        # AMP gets the cost and both processes' own metrics, never the raw scrapes.
        names = {labels["__name__"] for labels, _ in self.prometheus.query('count by (__name__) ({__name__=~".+"})',
                                                                            time.time())}
        assert {"gpu_cost_allocated_total", "llm_tokens_total", "otelgpu_requests_total"} <= names, names
        # The Collector's counters reach the workspace with `_total` (docs/alerts.md names them so).
        assert "otelcol_exporter_sent_metric_points_total" in names, sorted(n for n in names if "otelcol" in n)
        raw = {n for n in names if n.startswith(("DCGM_", "kube_", "vllm", "container_"))}
        assert not raw, raw


def changed_ms(served: list, now: Callable) -> int:
    """When otelgpu sees a device change hands: at the first sample for which `now` holds, or at
    the interval boundary between it and the sample before it when they lie in different intervals
    (the state of an interval's first sample covers the interval from its start; cost-model.md)."""
    i = next(k for k, s in enumerate(served) if now(s))
    boundary = served[i].at_ms // (DT * 1000) * DT * 1000
    return boundary if i and served[i - 1].at_ms < boundary else served[i].at_ms


def window(prom: PrometheusServer, metric: str, label: str, start_s: float, end_s: float,
           model: str = "request", pair: bool = False) -> dict:
    """What the intervals from `start_s` to `end_s` added, by `label` (with `pair`, by the tuple of
    the labels `label` lists)."""
    before = by(prom, metric, label, start_s, model, pair)
    return {k: v - before.get(k, 0.0) for k, v in by(prom, metric, label, end_s, model, pair).items()}


def by(prom: PrometheusServer, metric: str, label: str, at_s: float, model: str = "request",
       pair: bool = False) -> dict:
    """Totals through `at_s` by `label`: each series' last value, ended series included (an ended
    series is stale at `at_s`, so an instant query alone would miss what it carried; the range
    reaches back past any run's start)."""
    out: dict = {}
    names = [name.strip() for name in label.split(",")]
    for labels, value in prom.query(
            f'sum by ({label}) (max_over_time({metric}{{cluster="e2e", cost_model="{model}"}}[2h]))', at_s):
        key = tuple(labels.get(name, "") for name in names) if pair else labels.get(label, "")
        out[key] = value
    return out


def series(prom: PrometheusServer, at_s: float) -> str:
    """Every allocated series at `at_s`, for a failure's message."""
    return "\n".join(f"{v:.6f} {labels.get('pod')} {labels.get('attribution')}" for labels, v in prom.query(
        'max_over_time(gpu_cost_allocated_total{cluster="e2e", cost_model="request"}[2h])', at_s))


def latest_s(prom: PrometheusServer, metric: str) -> float:
    """The newest sample time of `metric` in Prometheus (0 when it has none)."""
    return max((v for _, v in prom.query(f'max(timestamp({metric}{{cluster="e2e"}}))', time.time())), default=0.0)


def wait_until_ms(ms: int) -> None:
    """The cluster's own clock: it changes at chosen moments of real time (the scrapes go on)."""
    eventually(lambda: time.time() * 1000 >= ms, timeout=max(0.0, ms / 1000 - time.time()) + 60)


@contextlib.contextmanager
def standalone(prefix: str) -> Iterator[Chain]:
    """A gateway chain outside pytest (the benchmark, the demo): its own Prometheus, cluster and
    directory, all stopped and removed on leaving."""
    from promserver import PrometheusServer, prometheus_binary

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        work = Path(tmp)
        prom = PrometheusServer(prometheus_binary(), work)
        prom.start()
        cluster = GpuCluster(work / "cluster")
        chain = Chain(work, cluster, prom)
        try:
            yield chain
        finally:
            chain.close()
            cluster.close()
            prom.stop()
