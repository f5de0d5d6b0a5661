"""Run the demo: start the sidecar, replay an hour of the demo cluster, print who paid for what."""

from __future__ import annotations

import socket
import sys
import time
from dataclasses import replace
from importlib import resources
from typing import Iterator, TextIO

import grpc
import yaml
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from otelgpu.config import Config, parse_config
from otelgpu.demo import scenario, scrapes
from otelgpu.demo.otlp import request, send
from otelgpu.enrich.window import NS
from otelgpu.exporter.config import PrometheusConfig
from otelgpu.pipeline import Pipeline
from otelgpu.telemetry import by_label, total

SCRAPE_S = 60


def demo_config(metrics_port: int | None = None) -> Config:
    config = parse_config(yaml.safe_load(resources.files("otelgpu.demo").joinpath("config.yaml").read_text()))
    port = metrics_port if metrics_port is not None else (9464 if _free(9464) else 0)
    return replace(config, exporter=replace(config.exporter, prometheus=PrometheusConfig(endpoint=f"127.0.0.1:{port}")))


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def scrape_requests(start_ns: int, seconds: int,
                    kube_state_metrics: bool = True) -> Iterator[ExportMetricsServiceRequest]:
    """The demo cluster scraped every minute from start_ns for `seconds`, one request per scrape
    (without kube-state-metrics when the sidecar takes pod facts from the Kubernetes API)."""
    nodes, ns_labels = scenario.build()
    for k in range(seconds // SCRAPE_S):
        time_ns = start_ns + (30 + SCRAPE_S * k) * NS
        hour = ((time_ns - start_ns) / NS % 3600) / 3600
        ksm = [scrapes.ksm(nodes, ns_labels, time_ns)] if kube_state_metrics else []
        elapsed = (time_ns - start_ns) / NS
        yield request(*ksm, *(scrapes.dcgm(n, time_ns, hour) for n in nodes),
                      *(scrapes.cadvisor(n, time_ns, elapsed) for n in nodes),
                      *(rm for n in nodes for rm in scrapes.vllm(n, time_ns, elapsed)))


def replay(pipeline: Pipeline, start_ns: int, seconds: int, kube_state_metrics: bool = True) -> None:
    """`scrape_requests` sent to the sidecar through a real gRPC client."""
    with grpc.insecure_channel(f"127.0.0.1:{pipeline.grpc.port}", compression=grpc.Compression.Gzip) as channel:
        stub = metrics_service_pb2_grpc.MetricsServiceStub(channel)
        for req in scrape_requests(start_ns, seconds, kube_state_metrics):
            send(stub, req)


def report(pipeline: Pipeline, out: TextIO) -> None:
    store, cur = pipeline.store, pipeline.config.attribution.currency
    request = {"cost_model": "request"}
    by = {m: store.totals(m, ("team",), request) for m in ("allocated", "effective", "waste", "unmeasured")}
    teams = sorted(by["allocated"], key=lambda k: -by["allocated"][k])
    out.write(f"\nrequest model, GPU cost by team ({cur})\n")
    out.write(f"{'team':<16}{'allocated':>12}{'effective':>12}{'waste':>12}{'unmeasured':>12}\n")
    for team in teams:
        out.write(f"{team[0]:<16}" + "".join(f"{by[m].get(team, 0.0):>12.6f}" for m in by) + "\n")
    allocated = sum(by["allocated"].values())
    idle = sum(store.totals("idle", (), request).values())
    capacity = sum(store.totals("capacity", (), request).values())
    out.write(f"{'(idle)':<16}{idle:>12.6f}\n")
    out.write(f"{'cluster total':<16}{allocated + idle:>12.6f}   = GPU capacity cost {capacity:.6f}\n")
    coverage = {dict(p.attrs)["tag"]: p.value for p in store.points()
                if p.metric == "tag_coverage" and "namespace" not in dict(p.attrs)}  # the cluster's figure
    if coverage:
        out.write(f"tag coverage (last interval): all five tags {coverage.get('all', 0):.0%}; " +
                  ", ".join(f"{k} {v:.0%}" for k, v in coverage.items() if k != "all") + "\n")
    compare_models(pipeline, out)
    tenants(pipeline, out)


def tenants(pipeline: Pipeline, out: TextIO) -> None:
    """The serving pods' charge split among their tenants by tokens (request model)."""
    store, cur = pipeline.store, pipeline.config.attribution.currency
    request = {"cost_model": "request"}
    cost = store.totals("tenant_cost", ("namespace", "pod", "tenant", "served_model"), request)
    if not cost:
        return
    tokens = store.totals("tenant_tokens", ("namespace", "pod", "tenant", "served_model"))
    out.write(f"\nserving pods' charge by tenant, request model ({cur}; weights prompt "
              f"{pipeline.config.tenants.prompt_weight:g}, generation {pipeline.config.tenants.generation_weight:g})\n")
    out.write(f"{'pod / tenant':<32}{'model':<36}{'cost':>10}{'Mtokens':>10}{'per Mtok':>10}\n")
    for pod in sorted({k[:2] for k in cost}):
        mine = {k[2:]: v for k, v in cost.items() if k[:2] == pod}
        charged = sum(v for m in ("allocated", "unused") for k, v in
                      store.totals(m, ("namespace", "pod"), request).items() if k == pod)
        out.write(f"{'/'.join(pod):<32}{'':<36}{sum(mine.values()):>10.6f}   = its charge {charged:.6f}\n")
        for (tenant, model), v in sorted(mine.items(), key=lambda kv: -kv[1]):
            mtok = tokens.get((*pod, tenant, model), 0.0) / 1e6
            per = f"{v / mtok:>10.4f}" if mtok else f"{'':>10}"
            out.write(f"  {tenant:<30}{model:<36}{v:>10.6f}{mtok:>10.3f}{per}\n")


def compare_models(pipeline: Pipeline, out: TextIO) -> None:
    """Each team's charge (allocated + unused) under every configured model, side by side."""
    models = pipeline.config.attribution.cost_models
    if len(models) < 2:
        return
    store = pipeline.store
    charge: dict[tuple[str, str], float] = {}
    for metric in ("allocated", "unused"):
        for (team, model), v in store.totals(metric, ("team", "cost_model")).items():
            charge[(team, model)] = charge.get((team, model), 0.0) + v
    teams = sorted({t for t, _ in charge}, key=lambda t: (-round(charge.get((t, models[0]), 0.0), 9), t))
    out.write("\ncharge by team and cost model: allocated + unused (scad: GPU, vCPU and memory of GPU nodes)\n")
    out.write(f"{'team':<16}" + "".join(f"{m:>12}" for m in models) + "\n")
    for team in teams:
        out.write(f"{team or '(idle)':<16}" + "".join(f"{charge.get((team, m), 0.0):>12.6f}" for m in models) + "\n")
    idle = {m: sum(store.totals("idle", (), {"cost_model": m}).values()) for m in models}
    capacity = {m: sum(store.totals("capacity", (), {"cost_model": m}).values()) for m in models}
    out.write(f"{'(idle)':<16}" + "".join(f"{idle[m]:>12.6f}" for m in models) + "\n")
    out.write(f"{'capacity':<16}" + "".join(f"{capacity[m]:>12.6f}" for m in models) + "\n")


def progress(pipeline: Pipeline, end_ns: int) -> str:
    """The keep-running line: each cost model's totals so far (models are never added together)."""
    store = pipeline.store
    charged: dict[str, float] = {}
    for metric in ("allocated", "unused"):
        for (model,), value in store.totals(metric, ("cost_model",)).items():
            charged[model] = charged.get(model, 0.0) + value
    idle = {model: v for (model,), v in store.totals("idle", ("cost_model",)).items()}
    models = "; ".join(f"{model}: charged {charged.get(model, 0.0):.6f}, idle {idle.get(model, 0.0):.6f}"
                       for model in pipeline.config.attribution.cost_models)
    return f"interval ending {time.strftime('%H:%M:%S', time.gmtime(end_ns / NS))} UTC closed; totals so far, {models}\n"


def run_demo(keep_running: bool = False, metrics_port: int | None = None, out: TextIO = sys.stdout) -> Pipeline:
    started = time.monotonic()
    pipeline = Pipeline(demo_config(metrics_port), keep_ended=True)
    pipeline.start()
    dt = pipeline.config.attribution.interval_seconds
    start_ns = (time.time_ns() // NS - 3600 - dt) // dt * dt * NS  # the last full hour, interval-aligned
    out.write(f"otelgpu demo: sidecar listening on OTLP/gRPC 127.0.0.1:{pipeline.grpc.port}; "
              f"replaying one hour of a 3-node GPU cluster in {dt // 60}-minute intervals\n")
    replay(pipeline, start_ns, 3600)
    pipeline.drain()
    pipeline.close_due(flush=True)
    report(pipeline, out)
    metrics = pipeline.metrics
    rejected = by_label(metrics.points_rejected)
    out.write(f"intervals computed: {total(metrics.intervals_computed):.0f}, "
              f"points received: {total(metrics.points_received):.0f}, rejected: {sum(rejected.values()):.0f}, "
              f"in {time.monotonic() - started:.1f} s\n")
    for reason, n in sorted(rejected.items()):
        out.write(f"  rejected {n:.0f}: {reason}\n")
    if pipeline.metrics_server:
        out.write(f"metrics: {pipeline.metrics_server.url}\n")
    if keep_running:
        out.write("running until interrupted (Ctrl-C); the cluster keeps reporting every minute\n")
        out.flush()
        pipeline.on_interval.append(lambda iv: (out.write(progress(pipeline, iv.end_ns)), out.flush()))
        try:
            while True:
                replay(pipeline, time.time_ns() - 30 * NS, SCRAPE_S)  # one scrape, now
                time.sleep(SCRAPE_S)
        except KeyboardInterrupt:
            out.write("\n")
    pipeline.shutdown()
    return pipeline
