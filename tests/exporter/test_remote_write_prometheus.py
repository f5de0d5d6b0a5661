"""RemoteWriteSender into a real Prometheus (`--web.enable-remote-write-receiver`), read back
through its HTTP API: the reference receiver, which AMP is compatible with, decides whether our
requests are right.

Every scenario ends at the current time: the TSDB refuses samples far behind its newest one."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rwproxy import FAIL, FORWARD, RemoteWriteProxy

from otelgpu.exporter.config import RemoteWriteConfig
from otelgpu.exporter.remote_write import RemoteWriteSender
from otelgpu.exporter.sending import Progress
from otelgpu.exporter.store import Point, cost_metrics

if TYPE_CHECKING:
    from promserver import PrometheusServer

pytest_plugins = ["promserver"]  # the `prometheus` fixture: a real Prometheus server

MS = 1_000_000
MIN_MS = 60_000
POD_A = (("k8s.pod.name", "a"), ("team", "ml"))
POD_B = (("k8s.pod.name", "b"), ("team", "web"))


def _sender(server: PrometheusServer) -> RemoteWriteSender:
    config = RemoteWriteConfig(url=server.write_url, external_labels={"region": "eu-west-1"},
                               max_samples_per_request=2)  # several requests per snapshot
    return RemoteWriteSender(config, cost_metrics(), "prod-eu")


def _point(metric: str, attrs, t_ms: int, value: float, start_ms: int = 0) -> Point:
    return Point(metric, attrs, (start_ms or t_ms) * MS, t_ms * MS, value)


def _ended(metric: str, attrs, t_ms: int) -> Point:
    return Point(metric, attrs, t_ms * MS, t_ms * MS, math.nan, ended=True)


def test_values_and_labels_read_back(prometheus: PrometheusServer) -> None:
    end = prometheus.now_ms()
    t1, t2, t3 = end - 3 * MIN_MS, end - 2 * MIN_MS, end - MIN_MS
    points = [
        _point("allocated", POD_A, t1, 1.0, t1), _point("allocated", POD_A, t2, 2.5, t1),
        _point("allocated", POD_A, t3, 4.25, t1), _point("allocated", POD_B, t3, 7.0, t2),
        _point("held", POD_A, t3, 180.0, t1), _point("activity", POD_A, t3, 0.75),
    ]
    assert _sender(prometheus).send(points).ok

    at = t3 / 1000
    allocated = dict((labels["k8s_pod_name"], (labels, value))
                     for labels, value in prometheus.query("gpu_cost_allocated_total", at))
    assert allocated["a"] == ({"__name__": "gpu_cost_allocated_total", "cluster": "prod-eu", "k8s_pod_name": "a",
                               "region": "eu-west-1", "team": "ml"}, 4.25)
    assert allocated["b"][1] == 7.0
    assert prometheus.query("sum(gpu_cost_allocated_total)", at) == [({}, 11.25)]
    assert prometheus.query("gpu_held_seconds_total", at)[0][1] == 180.0
    (activity,) = prometheus.query("gpu_activity_ratio", at)
    assert activity == ({"__name__": "gpu_activity_ratio", "cluster": "prod-eu", "k8s_pod_name": "a",
                         "region": "eu-west-1", "team": "ml"}, 0.75)

    ((_, samples),) = prometheus.query_range('gpu_cost_allocated_total{k8s_pod_name="a"}', t1 / 1000, t3 / 1000, 60)
    assert samples == [(t1 / 1000, 1.0), (t2 / 1000, 2.5), (t3 / 1000, 4.25)]


def test_stale_marker_ends_the_series(prometheus: PrometheusServer) -> None:
    end = prometheus.now_ms()
    t1, t2 = end - 2 * MIN_MS, end - MIN_MS
    points = [_point("allocated", POD_A, t1, 1.0), _ended("allocated", POD_A, t2),
              _point("allocated", POD_B, t1, 2.0)]
    assert _sender(prometheus).send(points).ok

    before = prometheus.query("gpu_cost_allocated_total", (t2 - 1000) / 1000)
    assert sorted(labels["k8s_pod_name"] for labels, _ in before) == ["a", "b"]
    # Without the marker, a would stay visible for the 5 minute lookback, as b does.
    after = prometheus.query("gpu_cost_allocated_total", end / 1000)
    assert [(labels["k8s_pod_name"], value) for labels, value in after] == [("b", 2.0)]


def test_prometheus_takes_the_newest_sample_again_but_no_older_one(prometheus: PrometheusServer) -> None:
    end = prometheus.now_ms()
    t1, t2, t3 = end - 3 * MIN_MS, end - 2 * MIN_MS, end - MIN_MS
    latest = [_point("allocated", POD_A, t3, 3.0, t1), _ended("activity", POD_B, t3)]
    # Fresh senders remember nothing: each request reaches Prometheus as the queue would resend it.
    assert _sender(prometheus).send(latest).ok
    assert _sender(prometheus).send(latest).ok  # identical to the newest stored sample: a no-op
    assert prometheus.query("count_over_time(gpu_cost_allocated_total[10m])", end / 1000)[0][1] == 1.0

    older = [_point("allocated", POD_A, t, v, t1) for t, v in ((t1, 1.0), (t2, 2.0))]
    result = _sender(prometheus).send(older)
    assert (result.ok, result.reason) == (False, "http_400") and "out of order sample" in result.detail


def test_a_partly_failed_snapshot_lands_once_after_the_resend(prometheus: PrometheusServer) -> None:
    end = prometheus.now_ms()
    times = [end - k * MIN_MS for k in (4, 3, 2, 1)]
    points = [_point("allocated", POD_A, t, float(i), times[0]) for i, t in enumerate(times)]
    points += [_point("allocated", POD_B, times[-1], 9.0), _ended("activity", POD_B, times[-1])]
    # Requests of two samples, in label order: [b's stale marker, a t1], [a t2, a t3], [a t4, b].
    proxy = RemoteWriteProxy(prometheus.write_url, lambda n: FAIL if n == 3 else FORWARD)
    try:
        sender = RemoteWriteSender(RemoteWriteConfig(url=proxy.url, max_samples_per_request=2), cost_metrics(), "c1")
        progress = Progress()
        assert sender.send(points, progress).reason == "http_503"  # two requests stored, the third fails
        assert progress.done == 4
        assert sender.send(points, progress).ok  # what the delivery queue does next
    finally:
        proxy.stop()
    ((_, samples),) = prometheus.query_range('gpu_cost_allocated_total{k8s_pod_name="a"}',
                                             times[0] / 1000, times[-1] / 1000, 60)
    assert samples == [(t / 1000, float(i)) for i, t in enumerate(times)]
    assert prometheus.query('gpu_cost_allocated_total{k8s_pod_name="b"}', end / 1000)[0][1] == 9.0


def test_refused_samples_are_final_with_prometheus_message(prometheus: PrometheusServer) -> None:
    end = prometheus.now_ms()
    sender = _sender(prometheus)
    assert sender.send([_point("allocated", POD_A, end - MIN_MS, 1.0)]).ok

    result = sender.send([_point("allocated", POD_A, end - MIN_MS, 5.0)])  # same timestamp, another value
    assert (result.ok, result.retryable, result.reason) == (False, False, "http_400")
    assert "duplicate sample for timestamp" in result.detail

    result = sender.send([_point("allocated", POD_A, end - 2 * MIN_MS, 0.5)])  # behind the stored sample
    assert (result.ok, result.retryable, result.reason) == (False, False, "http_400")
    assert "out of order sample" in result.detail
    assert prometheus.query("gpu_cost_allocated_total", end / 1000)[0][1] == 1.0
