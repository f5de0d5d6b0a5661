"""What every stage's configuration shares: the strict frozen dataclass they are all made of,
endpoints and durations as the Collector writes them, the TLS and bearer-token settings of servers
and clients, the receivers' memory limits, the checkpoint's directory, the tag names, and the
wording of a configuration problem (its YAML path, then what is wrong)."""

from __future__ import annotations

import re
from typing import Any, Iterable, Literal, Optional

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic.dataclasses import dataclass


STRICT = ConfigDict(extra="forbid", frozen=True)


LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


TAG_NAMES = ("team", "project", "environment", "model", "cost_center")


def known_tags(names: Iterable[str]) -> None:
    """ValueError naming those of `names` that are not tags."""
    unknown = sorted(set(names) - set(TAG_NAMES))
    if unknown:
        raise ValueError(f"unknown tag(s) {', '.join(unknown)}; tags are {', '.join(TAG_NAMES)}")


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


def checked_endpoint(value: str) -> str:
    split_endpoint(value)
    return value


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")


def duration(value: Any) -> float:
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


@dataclass(config=STRICT)
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

    _check_reload = field_validator("reload_interval", mode="before")(duration)


@dataclass(config=STRICT)
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


@dataclass(config=STRICT)
class ServerAuthConfig:
    """Bearer-token authentication: a request must carry `Authorization: Bearer <token>` with one
    of the tokens in `bearer_token_file`, one per line (two during a rotation). The file is read
    again when it changes."""

    bearer_token_file: str


@dataclass(config=STRICT)
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


@dataclass(config=STRICT)
class CheckpointConfig:
    """Where the cumulative series are saved after every interval, so a restart (kill -9 included)
    continues them with their start times. None: no checkpoint, counters start afresh on restart."""

    directory: Optional[str] = None


def format_loc(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif str(item).startswith("function-") or item in ("dict[str,float]",):
            continue
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or "(top level)"


def problem_message(err: Any) -> str:
    if err["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        return "unknown key"
    return str(err["msg"]).removeprefix("Value error, ")
