"""Configuration: a frozen dataclass tree loaded from YAML, validated once at start.

Unknown keys are rejected, every problem is reported together with its YAML path, and
`${env:NAME}` and `${env:NAME:-default}` references (the Collector's syntax) are expanded and
checked at load.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic.dataclasses import dataclass

from otelgpu.errors import ConfigError

_STRICT = ConfigDict(extra="forbid", frozen=True)
_ENV_REF = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
TAG_NAMES = ("team", "project", "environment", "model", "cost_center")


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def split_endpoint(value: str) -> tuple[str, int]:
    """`host:port`, `[v6 address]:port` or `:port` (every interface) as (host, port); the one
    parser of listen and send endpoints. Port 0: any free port. ValueError when malformed."""
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not host or ":" not in host:
            raise ValueError(f"expected [IPv6 address]:port, got {value!r}")
    elif ":" in host:
        raise ValueError(f"an IPv6 address takes brackets: [{host}]:{port}, got {value!r}")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected host:port, got {value!r}")
    if not re.fullmatch(r"[A-Za-z0-9_.:%-]*", host):
        raise ValueError(f"expected a host name or address before :{port}, got {value!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host.lower() in LOOPBACK_HOSTS:  # not *.localhost: cluster DNS resolves such names through its search path
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen_address(endpoint: str) -> str:
    """`endpoint` as gRPC and the socket module take it: `[v6]:port`, `host:port`; `:port` is
    every interface, IPv6 and IPv4 (`[::]:port`)."""
    host, port = split_endpoint(endpoint)
    if not host:
        return f"[::]:{port}"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _endpoint(value: str) -> str:
    split_endpoint(value)
    return value


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")


def _duration(value: Any) -> float:
    """Seconds from a number or a duration such as `30s`, `5m`, `1h`, `500ms` (the Collector's)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and _DURATION.match(value.strip()):
        number, unit = _DURATION.match(value.strip()).groups()  # type: ignore[union-attr]
        seconds = float(number) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    else:
        raise ValueError(f"expected a duration such as 30s, 5m or 1h, got {value!r}")
    if not 0 <= seconds <= 86_400:
        raise ValueError(f"expected a duration from 0s to 24h, got {value!r}")
    return seconds


@dataclass(config=_STRICT)
class ServerTLSConfig:
    """TLS of a server, in the shape of the Collector's `tls:` (configtls): its certificate and key
    (PEM), and with `client_ca_file` mutual TLS: clients must present a certificate that CA signed.
    The files are read again when they change (checked at most every `reload_interval`; 0s: at
    every new connection), so rotated certificates (cert-manager, a Secret update) take effect
    without a restart; connections already open keep theirs."""

    cert_file: str
    key_file: str
    client_ca_file: Optional[str] = None
    min_version: Literal["1.2", "1.3"] = "1.2"
    reload_interval: float = 30.0

    _check_reload = field_validator("reload_interval", mode="before")(_duration)


@dataclass(config=_STRICT)
class ClientTLSConfig:
    """TLS of an exporter, in the shape of the Collector's `tls:` (configtls). The server's
    certificate is verified against `ca_file` (default: the system's CAs); `cert_file` and
    `key_file` are the client certificate for mutual TLS. `insecure: true` sends plaintext (OTLP
    over gRPC; remote write follows its URL's scheme); left unset, plaintext is used only to a
    loopback endpoint, and otelgpu refuses to start with plaintext to any other."""

    insecure: Optional[bool] = None
    insecure_skip_verify: bool = False
    ca_file: Optional[str] = None
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    server_name_override: Optional[str] = None
    min_version: Literal["1.2", "1.3"] = "1.2"

    @model_validator(mode="after")
    def _pair(self) -> "ClientTLSConfig":
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("cert_file and key_file go together (the client certificate and its key)")
        return self


@dataclass(config=_STRICT)
class ServerAuthConfig:
    """Bearer-token authentication: a request must carry `Authorization: Bearer <token>` with one
    of the tokens in `bearer_token_file`, one per line (two during a rotation). The file is read
    again when it changes."""

    bearer_token_file: str


@dataclass(config=_STRICT)
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

    _check_endpoint = field_validator("endpoint")(_endpoint)

    @field_validator("tls")
    @classmethod
    def _grpc_tls(cls, value: Optional[ServerTLSConfig]) -> Optional[ServerTLSConfig]:
        if value is not None and value.min_version != "1.2":
            raise ValueError("min_version: gRPC negotiates TLS 1.2 or 1.3 itself; only 1.2 can be set here")
        return value


@dataclass(config=_STRICT)
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

    _check_endpoint = field_validator("endpoint")(_endpoint)


@dataclass(config=_STRICT)
class MemoryLimiterConfig:
    """The receivers' memory limits (otelgpu/memory.py), as the Collector's memory_limiter
    sets them: `limit_mib` (hard) and `spike_limit_mib` (hard - spike = soft), or, when unset,
    `limit_percentage` and `spike_limit_percentage` of the container's memory limit (its cgroup's),
    else of the machine's memory. At or above the soft limit new requests are refused "retry later"
    before they are decoded; at or above the hard limit garbage is collected as well.
    `max_inflight_mib`: the requests in flight (received, decompressed, decoded, queued) may reserve
    this much; unset, the spike limit."""

    enabled: bool = True
    limit_mib: Optional[int] = Field(None, ge=64, le=1 << 22)
    spike_limit_mib: Optional[int] = Field(None, ge=16, le=1 << 22)
    limit_percentage: int = Field(80, ge=10, le=100)
    spike_limit_percentage: int = Field(20, ge=1, le=90)
    max_inflight_mib: Optional[int] = Field(None, ge=16, le=1 << 22)

    @model_validator(mode="after")
    def _spike_below_limit(self) -> "MemoryLimiterConfig":
        if self.limit_mib is not None and self.spike_limit_mib is not None and self.spike_limit_mib >= self.limit_mib:
            raise ValueError("spike_limit_mib must be below limit_mib")
        if self.spike_limit_percentage >= self.limit_percentage:
            raise ValueError("spike_limit_percentage must be below limit_percentage")
        return self


@dataclass(config=_STRICT)
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


def _non_negative(value: dict[str, float]) -> dict[str, float]:
    bad = [k for k, v in value.items() if v < 0]
    if bad:
        raise ValueError(f"prices must be >= 0: {', '.join(bad)}")
    return value


@dataclass(config=_STRICT)
class RateConfig:
    """Prices of one capacity type (spot, reserved).

    A node of this capacity type takes its type's own per-GPU price (GPU model, then instance
    type), else its type's own instance price split by the model's convention; failing those,
    the on-demand price it would have had, times (1 - discount)."""

    gpu_hour_by_gpu_model: dict[str, float] = Field(default_factory=dict)
    gpu_hour_by_instance_type: dict[str, float] = Field(default_factory=dict)
    instance_hour_by_instance_type: dict[str, float] = Field(default_factory=dict)
    discount: float = Field(0.0, ge=0, lt=1)

    _check = field_validator("gpu_hour_by_gpu_model", "gpu_hour_by_instance_type",
                             "instance_hour_by_instance_type")(_non_negative)


@dataclass(config=_STRICT)
class DiscountConfig:
    discount: float = Field(0.0, ge=0, lt=1)  # e.g. a savings plan covering on-demand use


@dataclass(config=_STRICT)
class CapacityTypesConfig:
    """Rates by the node's capacity type (`eks.amazonaws.com/capacityType`,
    `karpenter.sh/capacity-type`): `on_demand` can carry a savings-plan discount; `reserved`
    covers reserved instances, capacity reservations and capacity blocks."""

    on_demand: DiscountConfig = DiscountConfig()  # on-demand prices are the top-level ones
    spot: RateConfig = RateConfig()
    reserved: RateConfig = RateConfig()


@dataclass(config=_STRICT)
class PricesConfig:
    """Explicit prices win over the shipped catalog; see docs/cost-model.md section 3."""

    gpu_hour_by_gpu_model: dict[str, float] = Field(default_factory=dict)
    gpu_hour_by_instance_type: dict[str, float] = Field(default_factory=dict)
    instance_hour_by_instance_type: dict[str, float] = Field(default_factory=dict)
    default_gpu_hour: Optional[float] = Field(None, ge=0)
    instance_price_split: Literal["scad", "opencost", "gpu_only"] = "scad"
    capacity_types: CapacityTypesConfig = CapacityTypesConfig()
    catalog: Optional[str] = None
    file: Optional[str] = None  # a YAML file of these keys, re-read when it changes

    _check = field_validator("gpu_hour_by_gpu_model", "gpu_hour_by_instance_type",
                             "instance_hour_by_instance_type")(_non_negative)


COST_MODELS = ("request", "scad", "opencost", "hybrid")


@dataclass(config=_STRICT)
class IdleConfig:
    """What happens to capacity nobody holds: `keep` it as its own series, `share` it among the
    holders pro rata to their allocated cost (per node or across the cluster), or book it to the
    `platform` tags."""

    policy: Literal["keep", "share", "platform"] = "keep"
    share_scope: Literal["node", "cluster"] = "node"
    platform_tags: dict[str, str] = Field(default_factory=lambda: {"team": "platform"})

    @field_validator("platform_tags")
    @classmethod
    def _known(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(value) - set(TAG_NAMES))
        if unknown:
            raise ValueError(f"unknown tag(s) {', '.join(unknown)}; tags are {', '.join(TAG_NAMES)}")
        return value


@dataclass(config=_STRICT)
class ScadConfig:
    cpu_only_nodes: bool = False  # also split nodes without GPUs (needs their instance prices)


@dataclass(config=_STRICT)
class AttributionConfig:
    interval_seconds: int = Field(60, ge=1, le=3600)
    lateness_seconds: int = Field(30, ge=0, le=3600)
    cost_models: tuple[Literal["request", "scad", "opencost", "hybrid"], ...] = ("request",)
    hybrid_alpha: float = Field(0.5, ge=0, le=1)
    # What hybrid's usage pool is split by: `used` = activity x allocated (the GPU time a holder
    # really used: four GPUs at 80 % weigh four times one GPU at 80 %); `activity` = the activity
    # figure alone, the formula as published (a_p / sum a_q), whatever the holding's size.
    hybrid_weight: Literal["used", "activity"] = "used"
    idle: IdleConfig = IdleConfig()
    scad: ScadConfig = ScadConfig()
    mig_fraction_rule: Literal["compute", "max"] = "compute"
    currency: str = "USD"
    prices: PricesConfig = PricesConfig()
    # Compute the interval that closes next as soon as every scrape target has sent data past its
    # end, while waiting for the lateness; its close then only records, checkpoints and exports.
    # Data or facts for it that still arrive make the close compute it again (that CPU is wasted).
    compute_ahead: bool = True

    @field_validator("cost_models")
    @classmethod
    def _distinct(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError(f"name at least one cost model ({', '.join(COST_MODELS)})")
        if len(set(value)) != len(value):
            raise ValueError("a cost model is listed twice")
        return value


@dataclass(config=_STRICT)
class TagRule:
    """Where one tag's value comes from, first match wins: the pod's label keys in order, then the
    namespace's label keys, then the pod's annotation keys, then `default`."""

    pod_labels: tuple[str, ...] = ()
    namespace_labels: tuple[str, ...] = ()
    annotations: tuple[str, ...] = ()
    default: str = "unallocated"


@dataclass(config=_STRICT)
class TagValuesConfig:
    """How tag values are normalised and capped, so a bad label cannot explode series cardinality.

    Values are trimmed, runs of inner whitespace replaced by `whitespace`, case changed by `case`,
    cut to `max_length` characters; once a tag has `max_distinct` distinct values, new ones become
    `overflow_value`. One namespace holds at most `max_distinct_per_namespace` of a tag's values (a
    quarter of `max_distinct` when unset), so that one namespace minting values cannot take the
    places of the others'. A value unused for 10 intervals gives its place back. Each capped value is
    counted in `otelgpu_tag_values_capped_total`."""

    case: Literal["keep", "lower", "upper"] = "keep"
    whitespace: str = Field("-", max_length=1)
    max_length: int = Field(63, ge=1, le=1024)
    max_distinct: int = Field(1000, ge=1, le=1_000_000)
    max_distinct_per_namespace: Optional[int] = Field(None, ge=1, le=1_000_000)
    overflow_value: str = Field("other", min_length=1)


@dataclass(config=_STRICT)
class TenantsConfig:
    """Splitting a shared inference pod's cost among its tenants by the tokens vLLM served them
    (docs/cost-model.md section 8). A token series' tenant is the first of `labels` it carries
    (a gateway's or a LoRA adapter's label); a series with none is its pod's namespace's. Each
    pod-interval keeps its `max_tenants_per_pod` largest tenants; the rest are one, `other`."""

    enabled: bool = True
    labels: tuple[str, ...] = ("tenant",)
    prompt_weight: float = Field(1.0, ge=0, le=1e6)
    generation_weight: float = Field(1.0, ge=0, le=1e6)
    # The tenant of a serving pod's cost in an interval whose counters show no token served (idle,
    # or the counters' first scrape)
    without_tokens: str = Field("(no tokens)", min_length=1)
    max_tenants_per_pod: int = Field(100, ge=1, le=10_000)

    @property
    def reserved(self) -> frozenset[str]:
        """Tenant values no series may claim: otelgpu's own buckets."""
        return frozenset((self.without_tokens, "other"))

    @model_validator(mode="after")
    def _some_weight(self) -> "TenantsConfig":
        if self.prompt_weight == 0 and self.generation_weight == 0:
            raise ValueError("prompt_weight and generation_weight cannot both be 0: no token would weigh anything")
        return self


def _default_tags() -> dict[str, TagRule]:
    keys = {
        "team": ("team",),
        "project": ("project",),
        "environment": ("environment", "env"),
        "model": ("model",),
        "cost_center": ("cost-center", "cost_center"),
    }
    return {name: TagRule(pod_labels=k, namespace_labels=k) for name, k in keys.items()}


@dataclass(config=_STRICT)
class DeliveryConfig:
    """An exporter's queue and retries. Each closed interval queues one snapshot of the cumulative
    series; when `queue_size` snapshots wait, the two oldest are merged (newest value per series),
    which costs time resolution during an outage but never money."""

    queue_size: int = Field(60, ge=2, le=10_000)
    backoff_initial_seconds: float = Field(1.0, gt=0, le=300)
    backoff_max_seconds: float = Field(60.0, gt=0, le=3600)
    shutdown_timeout_seconds: float = Field(10.0, ge=0, le=300)  # flushing the last interval at stop


@dataclass(config=_STRICT)
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
        _one_authorization(self.headers, self.bearer_token_file)
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


def _one_authorization(headers: dict[str, str], bearer_token_file: Optional[str], sigv4: bool = False) -> None:
    given = [what for what, on in (("an Authorization header", any(k.lower() == "authorization" for k in headers)),
                                   ("bearer_token_file", bool(bearer_token_file)), ("sigv4", sigv4)) if on]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} both set the Authorization header: keep one")


@dataclass(config=_STRICT)
class SigV4Config:
    """AWS Signature Version 4 for Amazon Managed Service for Prometheus. Credentials come from the
    standard AWS chain (environment, IRSA web identity, profile, container and instance roles)."""

    region: str = Field(min_length=1)
    service: str = "aps"


@dataclass(config=_STRICT)
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
        _one_authorization(self.headers, self.bearer_token_file, self.sigv4 is not None)
        return self

    @field_validator("external_labels")
    @classmethod
    def _check_labels(cls, value: dict[str, str]) -> dict[str, str]:
        for name, v in value.items():
            if not _LABEL_NAME.match(name) or name.startswith("__") or name == "cluster":
                raise ValueError(f"external label {name!r} is not a usable Prometheus label name "
                                 "(letters, digits, _; not starting with __; cluster comes from cluster.name)")
            if v == "":
                raise ValueError(f"external label {name!r} has an empty value")
        return value


@dataclass(config=_STRICT)
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

    _check_endpoint = field_validator("endpoint")(_endpoint)


@dataclass(config=_STRICT)
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


@dataclass(config=_STRICT)
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


@dataclass(config=_STRICT)
class CheckpointConfig:
    """Where the cumulative series are saved after every interval, so a restart (kill -9 included)
    continues them with their start times. None: no checkpoint, counters start afresh on restart."""

    directory: Optional[str] = None


@dataclass(config=_STRICT)
class KubernetesConfig:
    """Pod, namespace and node facts from the Kubernetes API (list, then watch).

    `scope: node` watches only the pods of `node_name` (a per-node sidecar; set it from the downward
    API, `${env:NODE_NAME}`); `scope: cluster` watches every pod (a gateway). Credentials: `auto`
    tries in-cluster, then kubeconfig; `token` uses `api_url` with `token_file` (or `token`)."""

    enabled: bool = False
    scope: Literal["cluster", "node"] = "cluster"
    node_name: str = ""
    auth: Literal["auto", "in_cluster", "kubeconfig", "token"] = "auto"
    kubeconfig: Optional[str] = None  # default: $KUBECONFIG, then ~/.kube/config
    context: Optional[str] = None
    api_url: Optional[str] = None
    token: Optional[str] = None  # prefer token_file; `${env:NAME}` works here
    token_file: Optional[str] = None  # re-read on every reconnect (projected tokens rotate)
    ca_file: Optional[str] = None
    insecure_skip_tls_verify: bool = False
    resolve_owners: bool = True  # get ReplicaSets and Jobs to reach their Deployments and CronJobs
    # Watch DRA ResourceClaims and ResourceSlices (resource.k8s.io/v1, Kubernetes 1.34+): the GPUs
    # claims allocate to pods, where dcgm-exporter does not map them (docs/cost-model.md section 11).
    dra: bool = True
    deleted_pod_grace_seconds: float = Field(600.0, ge=0, le=86_400)
    # Changes of each object kept, so an interval reads facts as they were at its end: at least
    # the interval plus the lateness (the interval waits that long before it is computed).
    history_seconds: float = Field(900.0, ge=0, le=86_400)
    page_size: int = Field(500, ge=1, le=10_000)
    watch_timeout_seconds: int = Field(300, ge=1, le=3600)  # the server ends a watch after this; rewatched
    backoff_initial_seconds: float = Field(0.5, gt=0, le=60)
    backoff_max_seconds: float = Field(30.0, gt=0, le=600)
    # How long the start waits for the first lists (kube-state-metrics facts serve meanwhile).
    initial_sync_timeout_seconds: float = Field(10.0, ge=0, le=600)

    @model_validator(mode="after")
    def _check(self) -> "KubernetesConfig":
        if self.enabled and self.scope == "node" and not self.node_name:
            raise ValueError("scope node needs node_name (e.g. \"${env:NODE_NAME}\" from the downward API)")
        if self.enabled and self.auth == "token" and not self.api_url:
            raise ValueError("auth token needs api_url")
        if self.enabled and self.auth == "token" and not (self.token or self.token_file):
            raise ValueError("auth token needs token_file or token")
        return self


Matcher = dict[str, Union[str, tuple[str, ...]]]


@dataclass(config=_STRICT)
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


@dataclass(config=_STRICT)
class ClusterConfig:
    name: str = Field("default", min_length=1)


@dataclass(config=_STRICT)
class Config:
    cluster: ClusterConfig = ClusterConfig()
    receiver: ReceiverConfig = ReceiverConfig()
    attribution: AttributionConfig = AttributionConfig()
    tags: dict[str, TagRule] = Field(default_factory=_default_tags)
    tag_values: TagValuesConfig = TagValuesConfig()
    tenants: TenantsConfig = TenantsConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()
    exporter: ExporterConfig = ExporterConfig()
    series: SeriesConfig = SeriesConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    sources: SourcesConfig = SourcesConfig()

    @field_validator("tags")
    @classmethod
    def _known_tags(cls, value: dict[str, TagRule]) -> dict[str, TagRule]:
        unknown = sorted(set(value) - set(TAG_NAMES))
        if unknown:
            raise ValueError(f"unknown tag(s) {', '.join(unknown)}; tags are {', '.join(TAG_NAMES)}")
        defaults = _default_tags()
        return {name: value.get(name, defaults[name]) for name in TAG_NAMES}

    @model_validator(mode="after")
    def _one_node_sees_one_node(self) -> "Config":
        idle = self.attribution.idle
        if self.kubernetes.enabled and self.kubernetes.scope == "node" and idle.policy == "share" \
                and idle.share_scope == "cluster":
            raise ValueError("attribution.idle.share_scope cluster needs the whole cluster, but kubernetes.scope "
                             "node (a per-node sidecar) sees one node: use share_scope node, or a gateway")
        if self.kubernetes.enabled and self.kubernetes.scope == "node" and "node" in self.series.drop_attributes:
            raise ValueError("series.drop_attributes cannot drop node with kubernetes.scope node: every node's "
                             "sidecar would write the same series")
        return self


_ADAPTER = TypeAdapter(Config)


def _expand_env(node: Any, path: str, problems: list[str]) -> Any:
    if isinstance(node, dict):
        return {k: _expand_env(v, f"{path}.{k}" if path else str(k), problems) for k, v in node.items()}
    if isinstance(node, list):
        return [_expand_env(v, f"{path}[{i}]", problems) for i, v in enumerate(node)]
    if isinstance(node, str):
        def sub(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if os.environ.get(name):
                return os.environ[name]
            if default is not None:  # `${env:NAME:-default}`: the default when unset or empty
                return default
            if name not in os.environ:
                problems.append(f"{path}: environment variable {name} is not set "
                                f"(set it, or give a default: ${{env:{name}:-value}})")
                return ""
            return os.environ[name]
        return _ENV_REF.sub(sub, node)
    return node


def _format_loc(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif str(item).startswith("function-") or item in ("dict[str,float]",):
            continue
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or "(top level)"


def _message(err: Any) -> str:
    if err["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        return "unknown key"
    return str(err["msg"]).removeprefix("Value error, ")


def parse_config(data: Any) -> Config:
    """Validate an already-parsed YAML document. Raises ConfigError listing every problem."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(["(top level): expected a mapping"])
    problems: list[str] = []
    data = _expand_env(data, "", problems)
    unset = {p.split(":", 1)[0] for p in problems}  # their follow-on validation errors say nothing new
    try:
        config = _ADAPTER.validate_python(data)
    except ValidationError as exc:
        for err in exc.errors():
            path = _format_loc(err["loc"])
            if path in unset:
                continue
            msg = _message(err)
            problems.append(f"{path}: {msg}")
        config = None
    if problems:
        raise ConfigError(problems)
    assert config is not None
    return config


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"(file): cannot read {path}: {exc.strerror}"]) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"(file): {path} is not valid YAML: {exc}"]) from exc
    return parse_config(data)


_PRICES = TypeAdapter(PricesConfig)


def load_prices_file(path: str | Path, base: PricesConfig) -> PricesConfig:
    """Prices from a YAML mapping of `prices` keys; each key given replaces the same key of `base`.
    Raises ConfigError naming the file and every problem."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror}"]) from exc
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: expected a mapping of price keys"])
    if "file" in data or "catalog" in data:
        raise ConfigError([f"{path}: `file` and `catalog` are set in the main configuration only"])
    merged = {**_PRICES.dump_python(base), **data}
    try:
        return _PRICES.validate_python(merged)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            msg = _message(err)
            problems.append(f"{path}: {_format_loc(err['loc'])}: {msg}")
        raise ConfigError(problems) from exc
