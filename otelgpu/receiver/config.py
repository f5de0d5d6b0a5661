"""The receivers' configuration (`receiver:`) and which scrape targets each kind of fact is taken
from (`sources:`)."""

from __future__ import annotations

from typing import Optional, Union

from pydantic import Field, field_validator
from pydantic.dataclasses import dataclass

from otelgpu.core.settings import STRICT, MemoryLimiterConfig, ServerAuthConfig, ServerTLSConfig, checked_endpoint


@dataclass(config=STRICT)
class GrpcReceiverConfig:
    """Exports beyond `max_concurrent_requests` running plus `max_queued_requests` waiting are
    answered UNAVAILABLE with RetryInfo. Connections are closed after `max_connection_idle_seconds`
    without an RPC, and after `max_connection_age_seconds` (in-flight RPCs get the grace period),
    so senders reconnect and spread over new replicas; null turns either off."""

    endpoint: str = "127.0.0.1:4317"
    tls: Optional[ServerTLSConfig] = None
    auth: Optional[ServerAuthConfig] = None
    max_recv_msg_size_mib: int = Field(64, ge=1, le=1024)
    max_concurrent_requests: int = Field(16, ge=10, le=256)
    max_queued_requests: int = Field(16, ge=0, le=10_000)
    max_connection_idle_seconds: Optional[float] = Field(300.0, gt=0, le=86_400)
    max_connection_age_seconds: Optional[float] = Field(600.0, gt=0, le=86_400)
    max_connection_age_grace_seconds: float = Field(30.0, ge=0, le=3600)

    _check_endpoint = field_validator("endpoint")(checked_endpoint)

    @field_validator("tls")
    @classmethod
    def _grpc_tls(cls, value: Optional[ServerTLSConfig]) -> Optional[ServerTLSConfig]:
        if value is not None and value.min_version != "1.2":
            raise ValueError("min_version: gRPC negotiates TLS 1.2 or 1.3 itself; only 1.2 can be set here")
        return value


@dataclass(config=STRICT)
class HttpReceiverConfig:
    """At most `max_connections` open connections, served by one event loop and a few worker threads
    whatever their number; beyond it the connection that has waited longest for a request is closed
    to make room, or, when every connection has a request under way, the newcomer is answered 503
    with Retry-After. A connection waiting for a request (idle keep-alive, its TLS handshake and the
    whole header block) is closed `idle_timeout_seconds` after it began waiting; a request's body
    must arrive whole within `read_timeout_seconds` of its headers, and its answer be taken within as
    long again. `tls` and `auth` as receiver.grpc's: TLS or mutual TLS with rotated files used for new
    connections; the bearer token checked from the headers, before the body is read (401)."""

    endpoint: str = "127.0.0.1:4318"
    enabled: bool = True
    tls: Optional[ServerTLSConfig] = None
    auth: Optional[ServerAuthConfig] = None
    max_connections: int = Field(32, ge=1, le=10_000)
    read_timeout_seconds: float = Field(30.0, gt=0, le=3600)
    idle_timeout_seconds: float = Field(60.0, gt=0, le=3600)

    _check_endpoint = field_validator("endpoint")(checked_endpoint)


@dataclass(config=STRICT)
class ReceiverConfig:
    grpc: GrpcReceiverConfig = GrpcReceiverConfig()
    http: HttpReceiverConfig = HttpReceiverConfig()
    memory_limiter: MemoryLimiterConfig = MemoryLimiterConfig()
    queue_size: int = Field(64, ge=1, le=100_000)
    retry_after_seconds: float = Field(5.0, gt=0, le=300)
    # Points stamped further from this sidecar's clock are rejected: one point must not drag the
    # interval watermark ahead, nor open an interval in 1970. 0 turns the age limit off (replays).
    max_point_age_seconds: int = Field(86_400, ge=0)
    max_future_seconds: int = Field(120, ge=1, le=86_400)
    max_label_value_bytes: int = Field(4096, ge=64, le=1 << 20)  # of the labels otelgpu reads
    max_attributes_per_point: int = Field(512, ge=16, le=100_000)


Matcher = dict[str, Union[str, tuple[str, ...]]]


@dataclass(config=STRICT)
class SourcesConfig:
    """Which scrape targets otelgpu takes each kind of fact from, by the resource attributes the
    Collector's prometheus receiver gives their series (`service.name` is the scrape job, and
    processors may add others, `k8s.namespace.name` say). A source is a list of matchers; a
    matcher maps attributes to a value or a list of values, all of which must match. The series
    of each kind from any other resource (a pod that got itself scraped under another job, with
    honor_labels, say) are refused and counted (`otelgpu_points_rejected_total`), so nothing
    else can move money: relabel a pod, invent a node, claim a GPU. `[{}]` takes any source."""

    dcgm: tuple[Matcher, ...] = ({"service.name": ("dcgm-exporter", "nvidia-dcgm-exporter", "otelgpu-nvml")},)
    kube_state_metrics: tuple[Matcher, ...] = ({"service.name": "kube-state-metrics"},)
    # kubernetes-cadvisor is the job of Prometheus's example Kubernetes configuration
    # (documentation/examples/prometheus-kubernetes.yml): its targets are the nodes' kubelets (node
    # discovery), which no pod can join. Annotation-driven jobs (kubernetes-pods,
    # kubernetes-service-endpoints) scrape any pod that asks to be scraped, so are never defaults.
    cadvisor: tuple[Matcher, ...] = ({"service.name": ("kubelet", "kubelet-cadvisor", "cadvisor",
                                                       "kubernetes-cadvisor")},)
    # vLLM's token counters split only the cost of the pod that exposes them (the scrape target's
    # own pod, from service discovery), from the shipped Collector configs' job.
    vllm: tuple[Matcher, ...] = ({"service.name": "vllm"},)
