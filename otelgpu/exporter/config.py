"""The exporters' configuration (`exporter:`: OTLP, remote write, /metrics, and each one's queue and
retries) and which dimensions the cost series keep (`series:`)."""

from __future__ import annotations

import re
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator
from pydantic.dataclasses import dataclass

from otelgpu.core.settings import (LABEL_NAME, STRICT, ClientTLSConfig, ServerAuthConfig, ServerTLSConfig,
                                   checked_endpoint, is_loopback, split_endpoint)


@dataclass(config=STRICT)
class DeliveryConfig:
    """An exporter's queue and retries. Each closed interval queues one snapshot of the cumulative
    series; when `queue_size` snapshots wait, the two oldest in one calendar month are merged
    (newest value per series), which costs time resolution during an outage but never money."""

    queue_size: int = Field(60, ge=2, le=10_000)
    backoff_initial_seconds: float = Field(1.0, gt=0, le=300)
    backoff_max_seconds: float = Field(60.0, gt=0, le=3600)
    shutdown_timeout_seconds: float = Field(10.0, ge=0, le=300)  # flushing the last interval at stop


@dataclass(config=STRICT)
class OtlpExporterConfig:
    """OTLP/gRPC to a Collector. `endpoint`: `host:port` (TLS unless `tls.insecure`, which a
    loopback endpoint may leave unset), or `https://host:port`."""

    endpoint: str
    tls: ClientTLSConfig = ClientTLSConfig()
    headers: dict[str, str] = Field(default_factory=dict)
    bearer_token_file: Optional[str] = None  # sent as `authorization: Bearer <token>`; re-read when it changes
    timeout_seconds: float = Field(10.0, gt=0, le=300)  # per attempt
    compression: Literal["gzip", "none"] = "gzip"
    delivery: DeliveryConfig = DeliveryConfig()
    insecure: Optional[bool] = None  # moved to tls.insecure: refused with a message that says so

    @model_validator(mode="after")
    def _check(self) -> "OtlpExporterConfig":
        if self.insecure is not None:
            raise ValueError("insecure moved to tls.insecure (the Collector's shape): tls: {insecure: true}")
        scheme, sep, _ = self.endpoint.partition("://")
        if sep and scheme not in ("http", "https"):
            raise ValueError(f"endpoint: expected host:port or http(s)://host:port, got {self.endpoint!r}")
        address, tls = self.target
        if scheme == "http" and self.tls.insecure is False:
            raise ValueError("endpoint http:// is plaintext, but tls.insecure is false")
        if not tls and not self.tls.insecure and not is_loopback(split_endpoint(address)[0]):
            raise ValueError(f"endpoint {self.endpoint} sends plaintext to a host that is not loopback: use TLS, "
                             "or set tls.insecure: true to allow it")
        if not tls and (self.tls.ca_file or self.tls.cert_file):
            raise ValueError("tls: ca_file and cert_file need TLS, but the endpoint is plaintext "
                             "(tls.insecure, or a loopback endpoint: set tls.insecure: false for TLS there)")
        if self.tls.insecure_skip_verify:
            raise ValueError("tls.insecure_skip_verify is not available over gRPC: give the server's CA in tls.ca_file")
        if self.tls.min_version != "1.2":
            raise ValueError("tls.min_version: gRPC negotiates TLS 1.2 or 1.3 itself; only 1.2 can be set here")
        one_authorization(self.headers, self.bearer_token_file)
        return self

    @property
    def target(self) -> tuple[str, bool]:
        """host:port, and whether TLS is used (ValueError for a malformed endpoint)."""
        scheme, sep, rest = self.endpoint.partition("://")
        if sep:
            address = rest.rstrip("/")
            split_endpoint(address)
            return address, scheme == "https"
        host, _ = split_endpoint(self.endpoint)
        insecure = self.tls.insecure if self.tls.insecure is not None else is_loopback(host)
        return self.endpoint, not insecure


def one_authorization(headers: dict[str, str], bearer_token_file: Optional[str], sigv4: bool = False) -> None:
    given = [what for what, on in (("an Authorization header", any(k.lower() == "authorization" for k in headers)),
                                   ("bearer_token_file", bool(bearer_token_file)), ("sigv4", sigv4)) if on]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} both set the Authorization header: keep one")


@dataclass(config=STRICT)
class SigV4Config:
    """AWS Signature Version 4 for Amazon Managed Service for Prometheus. Credentials come from the
    standard AWS chain (environment, IRSA web identity, profile, container and instance roles)."""

    region: str = Field(min_length=1)
    service: str = "aps"


@dataclass(config=STRICT)
class RemoteWriteConfig:
    """Prometheus remote write 1.0 straight to AMP (or any remote-write receiver), for clusters with
    no Collector return path."""

    url: str
    sigv4: Optional[SigV4Config] = None
    headers: dict[str, str] = Field(default_factory=dict)
    external_labels: dict[str, str] = Field(default_factory=dict)  # `cluster` is always cluster.name
    timeout_seconds: float = Field(30.0, gt=0, le=300)  # per request
    max_samples_per_request: int = Field(2000, ge=1, le=100_000)
    tls: ClientTLSConfig = ClientTLSConfig()
    bearer_token_file: Optional[str] = None  # sent as `Authorization: Bearer <token>`; re-read when it changes
    delivery: DeliveryConfig = DeliveryConfig()
    ca_file: Optional[str] = None  # moved to tls.ca_file: refused with a message that says so
    insecure_skip_tls_verify: Optional[bool] = None  # moved to tls.insecure_skip_verify

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+", value):
            raise ValueError(f"expected an http:// or https:// URL, got {value!r}")
        return value

    @model_validator(mode="after")
    def _check(self) -> "RemoteWriteConfig":
        if self.ca_file is not None or self.insecure_skip_tls_verify is not None:
            raise ValueError("ca_file and insecure_skip_tls_verify moved to tls.ca_file and tls.insecure_skip_verify "
                             "(the Collector's shape)")
        import urllib3.util

        # Parsed as the client that sends parses it (urllib.parse reads `http://a\\@b/` as host b,
        # urllib3 as host a), and with nothing before the host that could be read two ways.
        url = urllib3.util.parse_url(self.url)
        if url.auth is not None or "\\" in self.url or "@" in (url.netloc or ""):
            raise ValueError(f"url {self.url!r}: no user information or backslash before the path (put "
                             "credentials in headers or bearer_token_file)")
        if url.scheme == "http" and self.tls.insecure is False:
            raise ValueError("url http:// is plaintext, but tls.insecure is false")
        if url.scheme == "http" and not self.tls.insecure and not is_loopback((url.host or "").strip("[]")):
            raise ValueError(f"url {self.url} sends plaintext to a host that is not loopback: use https://, "
                             "or set tls.insecure: true to allow it")
        if url.scheme == "http" and (self.tls.ca_file or self.tls.cert_file):
            raise ValueError("tls: ca_file and cert_file need an https:// url")
        if url.scheme == "https" and self.tls.insecure:
            raise ValueError("tls.insecure: true with an https:// url: use http:// for plaintext")
        one_authorization(self.headers, self.bearer_token_file, self.sigv4 is not None)
        return self

    @field_validator("external_labels")
    @classmethod
    def _check_labels(cls, value: dict[str, str]) -> dict[str, str]:
        for name, v in value.items():
            if not LABEL_NAME.match(name) or name.startswith("__") or name == "cluster":
                raise ValueError(f"external label {name!r} is not a usable Prometheus label name "
                                 "(letters, digits, _; not starting with __; cluster comes from cluster.name)")
            if v == "":
                raise ValueError(f"external label {name!r} has an empty value")
        return value


@dataclass(config=STRICT)
class PrometheusConfig:
    """`GET /metrics` (with `auth`, a bearer token), `/healthz` and `/readyz` (never authenticated:
    the kubelet's probes carry no token, and they tell nothing but up and ready)."""

    endpoint: str = "127.0.0.1:9464"
    enabled: bool = True
    tls: Optional[ServerTLSConfig] = None
    auth: Optional[ServerAuthConfig] = None
    # Serve the cost series on /metrics beside the self-metrics. Off where the cost reaches the
    # backend another way (OTLP, remote write) and the same backend scrapes /metrics: each cost
    # series would be stored twice, under two job/instance label sets, and sums would double.
    cost_series: bool = True

    _check_endpoint = field_validator("endpoint")(checked_endpoint)


@dataclass(config=STRICT)
class ExporterConfig:
    otlp: Optional[OtlpExporterConfig] = None
    remote_write: Optional[RemoteWriteConfig] = None
    prometheus: PrometheusConfig = PrometheusConfig()


# Attributes a series keeps whatever `series.detail` says: without them the figures of different
# models or resources would be added together.
SERIES_KEPT = ("cost_model", "resource", "idle_policy", "price_source")


# What each detail level drops, from the most to the least detailed.
SERIES_DETAIL = {
    "pod": (),
    "workload": ("pod",),
    "namespace": ("pod", "workload_kind", "workload_name"),
}


@dataclass(config=STRICT)
class SeriesConfig:
    """Which dimensions the cost series keep (active series in AMP cost money too) and when a
    series that stopped receiving cost is ended with a NO_RECORDED_VALUE point."""

    detail: Literal["pod", "workload", "namespace"] = "pod"
    drop_attributes: tuple[str, ...] = ()
    end_after_intervals: int = Field(2, ge=1, le=10_000)

    @field_validator("drop_attributes")
    @classmethod
    def _check_drop(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        kept = sorted(set(value) & set(SERIES_KEPT))
        if kept:
            raise ValueError(f"{', '.join(kept)} cannot be dropped: series of different models, resources, "
                             "policies or prices would be added together")
        return value

    @property
    def dropped(self) -> frozenset[str]:
        return frozenset(SERIES_DETAIL[self.detail]) | frozenset(self.drop_attributes)
