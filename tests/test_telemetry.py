"""The sidecar's own telemetry: typed metrics, the Collector's names, counts held back from work
that may be thrown away, and every series documented."""

from __future__ import annotations

import re
import threading

from prometheus_client import Counter
from prometheus_client.exposition import generate_latest

import otelgpu
from otelgpu.telemetry import SelfMetrics, by_label, total
from support import REPO


def test_counts_held_by_one_thread_wait_for_apply_while_other_threads_count() -> None:
    metrics = SelfMetrics()
    with metrics.held() as pending:
        metrics.scad_request_fallbacks.labels("cpu").inc(3)
        metrics.intervals_computed.inc()
        other = threading.Thread(target=lambda: metrics.intervals_computed.inc(5))
        other.start()
        other.join()
    assert total(metrics.intervals_computed) == 5 and not by_label(metrics.scad_request_fallbacks)
    metrics.apply(pending)
    assert total(metrics.intervals_computed) == 6 and by_label(metrics.scad_request_fallbacks) == {"cpu": 3}
    metrics.intervals_computed.inc()  # outside the block: counted at once
    assert total(metrics.intervals_computed) == 7


def test_counts_held_and_dropped_are_never_counted() -> None:
    metrics = SelfMetrics()
    with metrics.held():
        metrics.tag_values_capped.labels("team", "distinct").inc()
    assert not by_label(metrics.tag_values_capped)


def test_the_exposition_names_the_service_and_its_process_as_the_collector_does() -> None:
    metrics = SelfMetrics(instance="otelgpu-7d9f")
    metrics.receiver_accepted_points.labels("otlp", "grpc").inc(41)
    text = generate_latest(metrics.registry).decode()
    assert ('target_info{service_instance_id="otelgpu-7d9f",service_name="otelgpu",'
            f'service_version="{otelgpu.__version__}"}} 1.0') in text
    assert 'otelgpu_receiver_accepted_metric_points_total{receiver="otlp",transport="grpc"} 41.0' in text
    assert re.search(r"^otelgpu_process_cpu_seconds_total \d", text, re.M)
    assert re.search(r"^otelgpu_process_resident_memory_bytes \d", text, re.M)
    assert "_created" not in text  # as the Collector: no creation-time series beside every counter


def test_every_series_is_documented_with_its_labels() -> None:
    doc = (REPO / "docs" / "metrics.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([a-z_]+)`[^|]*\| ([^|]*)\|", doc, re.M)}
    metrics = SelfMetrics()
    for field, metric in vars(metrics).items():
        if field == "registry":
            continue
        labels = metric._labelnames  # prometheus_client keeps them there; there is no accessor
        if labels:
            metric.labels(*labels).inc() if isinstance(metric, Counter) else metric.labels(*labels).set(1)
    families = list(metrics.registry.collect())
    assert len(families) > 50
    for family in families:
        if family.name.startswith("otelgpu_process_"):
            continue  # prometheus_client's process collector: one row for them all
        name = family.name + {"counter": "_total", "info": "_info"}.get(family.type, "")
        assert name in rows, f"{name} is not in docs/metrics.md"
        for label in {label for s in family.samples for label in s.labels}:
            assert f"`{label}`" in rows[name], f"{name}: label {label} is not documented"
