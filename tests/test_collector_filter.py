"""collector-config's filter/otelgpu in the pinned Collector: of what the prometheus receiver
scrapes, exactly the series otelgpu reads (otelgpu/receiver/schema.py, READ_NAMES) go on to
otelgpu, under every name DCGM gives a field, and nothing else: not dcgm-exporter's other default
counters, not kube-state-metrics' or vLLM's other families, not the receiver's own scrape_*
series; and raw-gpu-to-amp.yaml's pipeline beside it still gets every DCGM_FI_* series. The scrape
targets serve the shared fixtures' real exposition, a sample of every field of dcgm-exporter's
default counters CSV, and every name otelgpu reads (with some a character away from one)."""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import otelcol
import pytest
import yaml
from chain import FILTERED
from scrapecluster import Target
from sidecar import free_port
from support import CollectorSink, eventually, fixtures_dir

from otelgpu.receiver.schema import LIVENESS_METRIC, READ_NAMES

pytestmark = pytest.mark.slow(seconds=10)  # real time: a few 1 s scrapes
REPO = Path(__file__).resolve().parents[1]
FIXTURES = {"dcgm-exporter": "dcgm/h100x8_mig_mixed_k8s_v4.prom",
            "kube-state-metrics": "ksm/golden_full_scrape_pod0_server_test.txt",
            "vllm": "vllm/v1_text_0.0.4_prometheus_client_0.26.prom"}
COUNTERS = {"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL",
            "container_cpu_usage_seconds_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
            "vllm_prompt_tokens_total", "vllm_generation_tokens_total"}
# Names otelgpu does not read that differ from one it reads by a prefix, a suffix or a part
NEAR = ("DCGM_FI_DEV_FB_USED_PERCENT", "DCGM_FI_DEV_GPU_UTIL_SAMPLES", "DCGM_FI_PROF_GR_ENGINE_ACTIVE_RATIO",
        "kube_pod_container_resource_limits", "kube_pod_labels_info", "kube_node_status_allocatable",
        "container_memory_usage_bytes", "vllm:prompt_tokens_created", "upstream", "xup")


def every_name_read(now_ms: int) -> str:
    """One sample of every metric otelgpu reads (but `up`, which the receiver makes) and of each
    near name, as an exporter serves them."""
    lines = []
    for name in sorted(READ_NAMES - {LIVENESS_METRIC}) + list(NEAR):
        lines += [f"# TYPE {name} {'counter' if name in COUNTERS else 'gauge'}", f'{name}{{UUID="GPU-1"}} 1']
    return "\n".join(lines) + "\n"


def default_counters(now_ms: int) -> str:
    """One sample of every field dcgm-exporter's default counters CSV exports (its labels aside),
    typed as the CSV types it."""
    lines = []
    for row in (fixtures_dir() / "dcgm" / "default-counters.csv").read_text().splitlines():
        field, kind = ([part.strip() for part in row.split(",")] + ["", ""])[:2]
        if field.startswith("DCGM_FI_") and kind in ("gauge", "counter"):
            lines += [f"# TYPE {field} {kind}", f'{field}{{gpu="0",UUID="GPU-0"}} 1']
    return "\n".join(lines) + "\n"


def names(text: str) -> set[str]:
    """The metric names of an exposition's samples, as written."""
    return {m.group(1) for m in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.MULTILINE)}


def received_names(sink: CollectorSink) -> dict[str, int]:
    """Each metric name the sink took, with how many of its data points."""
    out: dict[str, int] = {}
    with sink._lock:
        for request in sink.requests:
            for rm in request.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        out[m.name] = out.get(m.name, 0) + len(getattr(m, m.WhichOneof("data")).data_points)
    return out


def collector_config(mode: str, targets: dict[str, Target], sink: CollectorSink) -> dict:
    """The shipped mode's metrics/gpu pipeline as it is (its processors as the file defines them,
    the batch's timeout shortened), its receiver scraping `targets` every second and its exporter
    sending to `sink`."""
    shipped = yaml.safe_load((REPO / "collector-config" / f"{mode}.yaml").read_text())
    pipeline = shipped["service"]["pipelines"]["metrics/gpu"]
    processors = {name: shipped["processors"][name] for name in pipeline["processors"]}
    processors["batch"] = {**processors["batch"], "timeout": "200ms"}
    jobs = [{"job_name": job, "scrape_interval": "1s", "scrape_timeout": "900ms", "honor_labels": True,
             "static_configs": [{"targets": [f"127.0.0.1:{target.port}"]}]} for job, target in targets.items()]
    return {"receivers": {"prometheus": {"config": {"scrape_configs": jobs}}},
            "processors": processors,
            "exporters": {"otlp_grpc/otelgpu": {"endpoint": sink.endpoint, "tls": {"insecure": True},
                                                "compression": "none"}},
            "service": {"pipelines": {"metrics/gpu": {"receivers": ["prometheus"], "processors": pipeline["processors"],
                                                      "exporters": ["otlp_grpc/otelgpu"]}}}}


@contextmanager
def scraped(tmp_path: Path, mode: str, raw: Optional[CollectorSink] = None) -> Iterator[tuple]:
    """The fixtures' targets, the default counters' and the one with every name read, scraped by
    the mode's metrics/gpu pipeline into a sink (and with `raw`, raw-gpu-to-amp.yaml's pipeline
    into that one) until three scrapes of each have gone through: (what was served, the sink,
    the Collector)."""
    texts = {job: (fixtures_dir() / path).read_text() for job, path in FIXTURES.items()}
    served = set().union(*(names(text) for text in texts.values()))
    targets = {job: Target(job, "127.0.0.1", free_port(), "/metrics", lambda ms, text=text: text)
               for job, text in texts.items()}
    made = {"every-name-read": every_name_read, "default-counters": default_counters}
    served |= set().union(*(names(render(0)) for render in made.values()))
    targets.update({job: Target(job, "127.0.0.1", free_port(), "/metrics", render) for job, render in made.items()})
    sink = CollectorSink()
    config = collector_config(mode, targets, sink)
    if raw is not None:
        variant = yaml.safe_load((REPO / "collector-config" / "raw-gpu-to-amp.yaml").read_text())
        config["processors"].update(variant["processors"])
        (pipeline,) = variant["service"]["pipelines"].values()
        config["exporters"]["otlp_grpc/raw"] = {"endpoint": raw.endpoint, "tls": {"insecure": True}}
        config["service"]["pipelines"]["metrics/gpu-raw"] = {**pipeline, "exporters": ["otlp_grpc/raw"]}
    collector = otelcol.Collector(tmp_path, config, {})
    try:
        collector.start()
        # Each scrape sends `up`: whatever else the scrapes held has gone through with it
        eventually(lambda: received_names(sink).get(LIVENESS_METRIC, 0) >= 3 * len(targets), 60,
                   message=lambda: f"{received_names(sink)}\n{collector.tail(3000)}")
        yield served, sink, collector
    finally:
        collector.close()
        for each in (sink, raw):
            if each is not None:
                each.server.stop(0)
        for target in targets.values():
            target.close()


@pytest.mark.parametrize("mode", ["gateway", "node"])
def test_filter_otelgpu_forwards_exactly_the_series_otelgpu_reads(mode, tmp_path) -> None:
    with scraped(tmp_path, mode) as (served, sink, collector):
        unread = served - READ_NAMES
        assert len(unread) > 40 and set(NEAR) <= unread  # the fixtures carry much otelgpu does not read
        received = received_names(sink)
        assert set(received) == READ_NAMES, (sorted(set(received) - READ_NAMES), sorted(READ_NAMES - set(received)))
        assert collector.total(FILTERED, filter="filter/otelgpu") > 0, collector.telemetry()


def test_the_raw_series_to_amp_keep_every_dcgm_field_beside_the_filter(tmp_path) -> None:
    """raw-gpu-to-amp.yaml's pipeline reads the same receiver: filter/otelgpu in metrics/gpu takes
    nothing from it (the Collector hands each pipeline its own copy)."""
    raw = CollectorSink()
    with scraped(tmp_path, "gateway", raw) as (served, sink, collector):
        dcgm = {name for name in served if name.startswith("DCGM_FI_")}
        assert len(dcgm - READ_NAMES) > 10
        eventually(lambda: set(received_names(raw)) >= dcgm, 30,
                   message=lambda: f"{sorted(dcgm - set(received_names(raw)))}\n{collector.tail(3000)}")
        assert set(received_names(raw)) == dcgm
        assert set(received_names(sink)) == READ_NAMES
