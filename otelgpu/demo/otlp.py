"""Build ExportMetricsServiceRequest messages shaped like a Collector's prometheus receiver sends
them (see shared fixtures): one ResourceMetrics per scrape target, workload labels as sorted
data-point attributes, empty labels dropped, gauges as Gauge, counters as cumulative Sum."""

from __future__ import annotations

import time
from typing import Iterable, Mapping

import grpc
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric, ResourceMetrics, ScopeMetrics

SCOPE = InstrumentationScope(
    name="github.com/open-telemetry/opentelemetry-collector-contrib/receiver/prometheusreceiver",
    version="0.142.0",
)

Series = tuple[Mapping[str, str], float]  # labels, value


def kvs(labels: Mapping[str, str]) -> list[KeyValue]:
    return [KeyValue(key=k, value=AnyValue(string_value=v)) for k, v in sorted(labels.items()) if v != ""]


def scrape(job: str, instance: str, node: str, time_ns: int,
           gauges: Mapping[str, Iterable[Series]]) -> ResourceMetrics:
    """One scrape of one target, with the `up` gauge the receiver adds."""
    host, _, port = instance.partition(":")
    resource = {"service.name": job, "service.instance.id": instance, "server.address": host,
                "server.port": port, "url.scheme": "http", "k8s.node.name": node}
    rm = ResourceMetrics()
    rm.resource.attributes.extend(kvs(resource))
    sm = ScopeMetrics(scope=SCOPE)
    for name, series in list(gauges.items()) + [("up", [({}, 1.0)])]:
        if not series:  # a scrape without the metric: the receiver sends no metric, not an empty one
            continue
        metric = Metric(name=name)
        for labels, value in series:
            point = metric.gauge.data_points.add()
            point.attributes.extend(kvs(labels))
            point.time_unix_nano = time_ns
            point.as_double = value
        sm.metrics.append(metric)
    rm.scope_metrics.append(sm)
    return rm


def request(*scrapes: ResourceMetrics) -> ExportMetricsServiceRequest:
    req = ExportMetricsServiceRequest()
    req.resource_metrics.extend(scrapes)
    return req


def send(stub, req) -> None:  # noqa: ANN001
    """Export one request, retrying while the sidecar answers UNAVAILABLE, as the Collector does."""
    for attempt in range(20):
        try:
            stub.Export(req, timeout=10)
            return
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            time.sleep(min(0.05 * 2**attempt, 1.0))  # the sidecar said "retry later"
    raise RuntimeError("the sidecar stayed unavailable")
