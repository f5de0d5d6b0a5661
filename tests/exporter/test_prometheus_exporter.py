"""CostCollector and TelemetryServer over real HTTP."""

from __future__ import annotations

import pytest
import requests
from certs import Authority
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from otelgpu.core.attrs import attrs_of
from otelgpu.core.settings import ServerAuthConfig, ServerTLSConfig
from otelgpu.exporter.config import PrometheusConfig
from otelgpu.exporter.prometheus import CostCollector, TelemetryServer, cost_registry, label_name
from otelgpu.exporter.store import CostStore
from otelgpu.telemetry import SelfMetrics, by_label


def _samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _steady(text: bytes) -> bytes:
    """The text without the process's own series (its CPU time moves between two scrapes)."""
    return b"".join(line for line in text.splitlines(keepends=True) if b"otelgpu_process_" not in line)


def _server(registry: CollectorRegistry, ready=lambda: True) -> TelemetryServer:
    return TelemetryServer(PrometheusConfig(endpoint="127.0.0.1:0"), registry, ready)


def test_metrics_over_http(store: CostStore, intervals) -> None:
    metrics = SelfMetrics()
    metrics.points_received.inc(7)
    metrics.points_rejected.labels("DCGM_FI_DEV_GPU_UTIL", "out_of_range").inc(2)
    metrics.requests.labels("grpc", "ok").inc()
    metrics.exports.labels("otlp").inc(3)
    metrics.export_failures.labels("otlp", "unavailable").inc()
    intervals.record(0)
    intervals.record(1)
    server = _server(cost_registry(store, metrics, cluster="prod-eu"))
    server.start()
    try:
        resp = requests.get(server.url, timeout=5)
    finally:
        server.shutdown()
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/plain")
    samples = _samples(resp.text)

    (alloc,) = samples["gpu_cost_allocated_total"]
    assert alloc.value == 3.0
    assert alloc.labels == {"namespace": "ml", "pod": "train-0", "team": "a",
                            "cluster": "prod-eu", "cost_model": "request"}
    (held,) = samples["gpu_held_seconds_total"]
    assert held.value == 120.0 and "cost_model" not in held.labels and held.labels["cluster"] == "prod-eu"
    assert samples["gpu_cost_idle_total"][0].labels["node"] == "n1"
    (activity,) = samples["gpu_activity_ratio"]
    assert abs(activity.value - 0.6) < 1e-9 and "cost_model" not in activity.labels
    # Every spec's family is declared, even with no series yet.
    for spec in store.specs.values():
        assert f"# TYPE {spec.prometheus} " in resp.text

    assert samples["otelgpu_points_received_total"][0].value == 7
    assert samples["otelgpu_points_late_total"][0].value == 0
    assert samples["otelgpu_unpriced_gpu_seconds_total"][0].value == 0
    assert samples["otelgpu_intervals_computed_total"][0].value == 0
    assert samples["otelgpu_points_ignored_total"][0].value == 0
    assert [(s.labels, s.value) for s in samples["otelgpu_points_rejected_total"]] == \
        [({"metric": "DCGM_FI_DEV_GPU_UTIL", "reason": "out_of_range"}, 2)]
    assert samples["otelgpu_requests_total"][0].labels == {"transport": "grpc", "outcome": "ok"}
    assert samples["otelgpu_exports_total"][0].labels == {"exporter": "otlp"}
    assert samples["otelgpu_export_failures_total"][0].value == 1


def test_without_cost_series_metrics_serves_self_metrics_only(store: CostStore, intervals) -> None:
    """exporter.prometheus.cost_series: false, where the cost reaches the backend over OTLP."""
    intervals.record(0)
    metrics = SelfMetrics()
    metrics.points_received.inc(7)
    server = _server(cost_registry(store, metrics, cluster="prod-eu", cost_series=False))
    server.start()
    try:
        text = requests.get(server.url, timeout=5).text
    finally:
        server.shutdown()
    samples = _samples(text)
    assert samples["otelgpu_points_received_total"][0].value == 7
    assert store.points() and not [name for name in samples if not name.startswith("otelgpu_") and name != "target_info"]


def test_label_names_are_sanitised(store: CostStore) -> None:
    store.record(0, 10, sums={"allocated": {(("k8s.pod-name", "p"), ("9lives", "x")): 1.0}}, gauges={})
    registry = cost_registry(store, SelfMetrics(), cluster="c")
    (alloc,) = _samples(generate_latest(registry).decode())["gpu_cost_allocated_total"]
    assert alloc.labels == {"k8s_pod_name": "p", "key_9lives": "x", "cluster": "c"}
    assert label_name("a.b/c") == "a_b_c"


def test_health_readiness_and_lifecycle(store: CostStore) -> None:
    ready = {"v": False}
    server = _server(cost_registry(store, SelfMetrics(), "c"), ready=lambda: ready["v"])
    server.shutdown()  # before start: a no-op
    server.start()
    server.start()  # idempotent
    base = server.url.removesuffix("/metrics")
    assert server.port != 0 and base.startswith("http://127.0.0.1:")
    try:
        assert requests.get(base + "/healthz", timeout=5).text == "ok\n"
        assert requests.get(base + "/readyz", timeout=5).status_code == 503
        ready["v"] = True
        assert requests.get(base + "/readyz", timeout=5).status_code == 200
        assert requests.get(base + "/nope", timeout=5).status_code == 404
    finally:
        server.shutdown()
        server.shutdown()
    try:
        requests.get(base + "/healthz", timeout=1)
        raise AssertionError("server still answering after shutdown")
    except requests.ConnectionError:
        pass


def test_display_url_for_wildcard_bind() -> None:
    registry = cost_registry(CostStore(), SelfMetrics(), "c")
    server = TelemetryServer(PrometheusConfig(endpoint="0.0.0.0:9464"), registry, lambda: True)
    assert server.url == "http://127.0.0.1:9464/metrics"


_VALUES = st.text(st.characters(codec="utf-8"), max_size=6) | st.sampled_from(['a"b', "a\\b", "a\nb", "é", ""])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["allocated", "idle", "held"]),
                          st.dictionaries(st.sampled_from(["team", "k8s.pod-name", "9lives", "k8s_pod_name", "cluster",
                                                           "node"]), _VALUES, max_size=4),
                          st.floats(min_value=0, max_value=1e12) | st.sampled_from([1e-7, 123456789.0, 5e21])),
                max_size=12),
       st.dictionaries(_VALUES, st.floats(min_value=0, max_value=1), max_size=3), st.booleans())
def test_the_fast_text_is_prometheus_client_s_text(sums, gauges, cost_series) -> None:
    """`exposition()` writes what `generate_latest` writes for the same collector, byte for byte:
    label names translated and colliding, values quoted and escaped, numbers as Go prints them,
    families in spec order, one with no series included."""
    store = CostStore()
    by_metric: dict = {}
    for metric, labels, value in sums:
        by_metric.setdefault(metric, {})[attrs_of(labels)] = value
    store.record(0, 60 * 10**9, by_metric, {"activity": {attrs_of({"pod": p}): v for p, v in gauges.items()}})
    metrics = SelfMetrics()
    metrics.points_rejected.labels('odd "metric"\n', 'odd "reason"\n').inc(3)
    collector = CostCollector(store, metrics, "prod-\"eu\"", cost_series)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    assert _steady(collector.exposition()) == _steady(generate_latest(registry))


def test_metrics_over_tls_needs_a_token_and_the_probes_do_not(store: CostStore, tmp_path) -> None:
    """exporter.prometheus with tls and auth: /metrics over HTTPS with a bearer token; /healthz and
    /readyz open to the kubelet's probes, which carry no token; a rotated certificate that cannot
    be used yet is counted and kept out."""
    ca = Authority(tmp_path / "pki")
    server_pair = ca.issue("otelgpu", file="server")
    tokens = tmp_path / "tokens"
    tokens.write_text("scrape-token\n")
    metrics = SelfMetrics()
    metrics.points_received.inc(7)
    config = PrometheusConfig(endpoint="127.0.0.1:0", auth=ServerAuthConfig(bearer_token_file=str(tokens)),
                              tls=ServerTLSConfig(cert_file=str(server_pair.cert), key_file=str(server_pair.key),
                                                  reload_interval=0))
    server = TelemetryServer(config, cost_registry(store, metrics, "c"), lambda: True, self_metrics=metrics)
    server.start()
    try:
        assert server.url == f"https://127.0.0.1:{server.port}/metrics"
        url = f"https://localhost:{server.port}"
        get = lambda path, **kw: requests.get(url + path, verify=str(ca.cert), timeout=5, **kw)  # noqa: E731
        assert get("/metrics").status_code == 401
        assert get("/metrics", headers={"Authorization": "Bearer guess"}).status_code == 401
        scraped = get("/metrics", headers={"Authorization": "Bearer scrape-token"})
        assert scraped.status_code == 200 and _samples(scraped.text)["otelgpu_points_received_total"][0].value == 7
        assert get("/healthz").text == "ok\n" and get("/readyz").text == "ready\n"
        assert get("/nope").status_code == 401  # everything but the probes needs the token
        assert requests.post(url + "/metrics", headers={"Authorization": "Bearer scrape-token"}, data=b"x",
                             verify=str(ca.cert), timeout=5).status_code == 405
        with pytest.raises(requests.exceptions.ConnectionError):  # plaintext to the HTTPS port
            requests.get(f"http://127.0.0.1:{server.port}/healthz", timeout=5)
        server_pair.key.write_bytes(ca.issue("other", file="other").key.read_bytes())  # a key of another pair
        assert get("/healthz").status_code == 200  # the certificate loaded before is still served
        assert by_label(metrics.tls_reload_errors)["exporter.prometheus"] == 1
    finally:
        server.shutdown()
