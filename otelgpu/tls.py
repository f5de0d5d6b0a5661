"""TLS and bearer tokens for the receivers, /metrics and the exporters, from `tls:` and `auth:`
(config.ServerTLSConfig, ClientTLSConfig, ServerAuthConfig).

Certificates, keys, CAs and token files are read at start (a file that cannot be read or used is
a ConfigError naming the setting) and read again when they change on disk, so a rotation needs
no restart: servers hand new connections the new certificate; a token file's new tokens are
accepted from the next request. A change that cannot be used (a key that does not match its
certificate, a half-written file) keeps what was loaded before, is logged and counted
(`otelgpu_tls_reload_errors_total`), and is tried again at the next change.
"""

from __future__ import annotations

import hmac
import logging
import os
import ssl
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional, Protocol, TypeVar

import grpc

from otelgpu.core.settings import ClientTLSConfig, ServerAuthConfig, ServerTLSConfig
from otelgpu.errors import ConfigError

if TYPE_CHECKING:
    from otelgpu.telemetry import SelfMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")

VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}


class _Files:
    """Whether any of some files changed since the last look (modification time, size, inode)."""

    def __init__(self, *paths: Optional[str]) -> None:
        self.paths = [p for p in paths if p]
        self._seen = self._stamp()

    def _stamp(self) -> tuple:
        out = []
        for path in self.paths:
            try:
                st = os.stat(path)
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append(None)
        return tuple(out)

    def changed(self) -> bool:
        now = self._stamp()
        if now == self._seen:
            return False
        self._seen = now
        return True


def _fresh(files: _Files, load: Callable[[], T], current: T) -> T:
    """What `load()` reads if the files changed since the last look, else `current`; a change
    that cannot be read (a file being replaced) keeps `current`, logged."""
    if not files.changed():
        return current
    try:
        return load()
    except ConfigError as exc:
        log.error("%s; keeping what was read before", exc.problems[0])
        return current


def _read(path: str, where: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as exc:
        raise ConfigError([f"{where}: cannot read {path}: {exc.strerror}"]) from exc


class ServerTLS:
    """A server's TLS, reloaded when its files change: `context()` for an HTTP server (each new
    connection takes the context current then), `grpc_credentials()` for a gRPC server."""

    def __init__(self, config: ServerTLSConfig, where: str, on_error: Optional[Callable[[], None]] = None) -> None:
        self.config = config
        self.where = where
        self._on_error = on_error
        self._lock = threading.Lock()
        self._files = _Files(config.cert_file, config.key_file, config.client_ca_file)
        self._next_check = 0.0
        self._context = self._load_context()  # ConfigError now: the server does not start
        self.reloads = 0

    @property
    def mutual(self) -> bool:
        return bool(self.config.client_ca_file)

    def _load_context(self) -> ssl.SSLContext:
        cfg = self.config
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = VERSIONS[cfg.min_version]
        try:
            context.load_cert_chain(cfg.cert_file, cfg.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError([f"{self.where}.tls: cannot use cert_file {cfg.cert_file} with key_file "
                               f"{cfg.key_file}: {exc}"]) from exc
        if cfg.client_ca_file:
            try:
                context.load_verify_locations(cafile=cfg.client_ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError([f"{self.where}.tls: cannot use client_ca_file {cfg.client_ca_file}: {exc}"]) from exc
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def _maybe_reload(self) -> bool:
        """Reload if the files changed (looked at no more often than `reload_interval`); whether
        a new certificate is in use."""
        now = time.monotonic()
        with self._lock:
            if now < self._next_check:
                return False
            self._next_check = now + self.config.reload_interval
            if not self._files.changed():
                return False
            try:
                self._context = self._load_context()
            except ConfigError as exc:
                log.error("%s; keeping the certificate loaded before", exc.problems[0])
                if self._on_error is not None:
                    self._on_error()
                return False
            self.reloads += 1
            log.info("%s.tls: certificate files changed: new connections use them", self.where)
            return True

    def context(self) -> ssl.SSLContext:
        self._maybe_reload()
        return self._context

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Credentials whose certificate is looked up again at each new connection."""

        def configuration() -> grpc.ServerCertificateConfiguration:
            cfg = self.config
            pair = (_read(cfg.key_file, f"{self.where}.tls"), _read(cfg.cert_file, f"{self.where}.tls"))
            ca = _read(cfg.client_ca_file, f"{self.where}.tls") if cfg.client_ca_file else None
            return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)

        def fetch() -> Optional[grpc.ServerCertificateConfiguration]:
            # Called by gRPC at each new connection: None keeps the current certificate.
            if not self._maybe_reload():
                return None
            try:
                return configuration()
            except ConfigError:
                return None

        return grpc.dynamic_ssl_server_credentials(configuration(), fetch,
                                                   require_client_authentication=self.mutual)


def client_context(config: ClientTLSConfig, where: str) -> ssl.SSLContext:
    """An exporter's TLS context (HTTPS): the server verified against `ca_file` or the system's
    CAs, unless `insecure_skip_verify`; the client certificate for mutual TLS."""
    context = ssl.create_default_context(cafile=config.ca_file) if config.ca_file else ssl.create_default_context()
    context.minimum_version = VERSIONS[config.min_version]
    if config.insecure_skip_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if config.cert_file and config.key_file:
        try:
            context.load_cert_chain(config.cert_file, config.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError([f"{where}.tls: cannot use cert_file {config.cert_file} with key_file "
                               f"{config.key_file}: {exc}"]) from exc
    return context


def grpc_channel_credentials(config: ClientTLSConfig, where: str) -> tuple[grpc.ChannelCredentials, list]:
    """gRPC channel credentials and options (`server_name_override`) for an exporter."""
    ca = _read(config.ca_file, f"{where}.tls") if config.ca_file else None
    key = _read(config.key_file, f"{where}.tls") if config.key_file else None
    cert = _read(config.cert_file, f"{where}.tls") if config.cert_file else None
    options = [("grpc.ssl_target_name_override", config.server_name_override)] if config.server_name_override else []
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert), options


class _Secured(Protocol):
    endpoint: str
    tls: Optional[ServerTLSConfig]
    auth: Optional[ServerAuthConfig]


def server_security(config: _Secured, where: str, metrics: Optional[SelfMetrics] = None
                    ) -> tuple[Optional[ServerTLS], Optional["BearerTokens"], str]:
    """A server's TLS and bearer tokens from its `tls:` and `auth:` (each None when not set), and
    a few words saying which, for its start-up log line. Reloads that fail are counted in
    `metrics.tls_reload_errors` under `where`. Tokens taken in plaintext beyond the loopback can
    be read on the way: said at start (a service mesh may encrypt the hop itself)."""
    from otelgpu.core.settings import is_loopback, split_endpoint

    tls = tokens = None
    if config.tls is not None:
        tls = ServerTLS(config.tls, where,
                        metrics.tls_reload_failed(where) if metrics is not None else None)
    if config.auth is not None:
        if tls is None and not is_loopback(split_endpoint(config.endpoint)[0]):
            log.warning("%s: bearer tokens accepted in plaintext on %s: set %s.tls, unless the network itself "
                        "encrypts this hop (a service mesh)", where, config.endpoint, where)
        tokens = BearerTokens(config.auth, where)
    words = "mTLS" if tls and tls.mutual else "TLS" if tls else "plaintext"
    return tls, tokens, words + (", bearer token" if tokens else "")


class BearerTokens:
    """The tokens of a token file, one per line (blank lines and `#` comments skipped), read
    again when the file changes. `check()` compares in constant time."""

    def __init__(self, config: ServerAuthConfig, where: str) -> None:
        self.path = config.bearer_token_file
        self.where = where
        self._files = _Files(self.path)
        self._lock = threading.Lock()
        self._tokens = self._load()
        if not self._tokens:
            raise ConfigError([f"{where}.auth: bearer_token_file {self.path} holds no token"])

    def _load(self) -> list[bytes]:
        text = _read(self.path, f"{self.where}.auth").decode("utf-8", "replace")
        return [line.strip().encode() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]

    def _reload(self) -> list[bytes]:
        tokens = self._load()
        if not tokens:
            log.warning("%s.auth: %s holds no token: every request is refused until it does", self.where, self.path)
        return tokens

    def tokens(self) -> list[bytes]:
        """The tokens accepted now. A file that cannot be read (being replaced, say) keeps the
        tokens read before; a file read and holding no token revokes them all."""
        with self._lock:
            self._tokens = _fresh(self._files, self._reload, self._tokens)
            return self._tokens

    def check(self, authorization: Optional[str]) -> bool:
        """Whether an Authorization header value carries one of the tokens."""
        if not authorization:
            return False
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        given = token.strip().encode()
        ok = False
        for expected in self.tokens():
            ok |= hmac.compare_digest(given, expected)
        return ok


class TokenFile:
    """An exporter's bearer token, read again when the file changes (projected tokens rotate)."""

    def __init__(self, path: str, where: str) -> None:
        self.path = path
        self.where = where
        self._files = _Files(path)
        self._token = self._load()

    def _load(self) -> str:
        token = _read(self.path, self.where).decode("utf-8", "replace").strip()
        if not token:
            raise ConfigError([f"{self.where}: bearer_token_file {self.path} is empty"])
        return token

    def header(self) -> str:
        self._token = _fresh(self._files, self._load, self._token)
        return f"Bearer {self._token}"
