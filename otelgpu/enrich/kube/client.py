"""An ApiClient of the official `kubernetes` client from otelgpu's `kubernetes:` settings:
in-cluster service account, kubeconfig, or an explicit API URL and bearer token."""

from __future__ import annotations

import logging
from pathlib import Path

from kubernetes import client, config as kube_config
from kubernetes.config.config_exception import ConfigException

from otelgpu.enrich.config import KubernetesConfig
from otelgpu.errors import ConfigError

log = logging.getLogger(__name__)


def _read_token(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError([f"kubernetes.token_file: cannot read {path}: {exc.strerror}"]) from exc


def _token_configuration(cfg: KubernetesConfig) -> client.Configuration:
    c = client.Configuration()
    c.host = str(cfg.api_url).rstrip("/")
    c.api_key_prefix = {"authorization": "Bearer"}
    if cfg.token_file:
        path = cfg.token_file
        c.api_key = {"authorization": _read_token(path)}

        def refresh(conf: client.Configuration) -> None:  # projected tokens rotate: read it per request
            try:
                conf.api_key["authorization"] = _read_token(path)
            except ConfigError as exc:
                log.warning("%s; keeping the previous token", exc.problems[0])

        c.refresh_api_key_hook = refresh
    else:
        c.api_key = {"authorization": str(cfg.token)}
    return c


def api_client(cfg: KubernetesConfig) -> client.ApiClient:
    """Raises ConfigError when no credentials can be loaded the way `cfg.auth` asks."""
    if cfg.auth == "token":
        c = _token_configuration(cfg)
    else:
        c = client.Configuration()
        tried: list[str] = []
        loaded = False
        if cfg.auth in ("auto", "in_cluster"):
            try:
                kube_config.load_incluster_config(client_configuration=c)
                loaded = True
            except ConfigException as exc:
                tried.append(f"in-cluster: {exc}")
        if not loaded and cfg.auth in ("auto", "kubeconfig"):
            try:
                kube_config.load_kube_config(config_file=cfg.kubeconfig, context=cfg.context,
                                             client_configuration=c, persist_config=False)
                loaded = True
            except (ConfigException, OSError) as exc:
                tried.append(f"kubeconfig: {exc}")
        if not loaded:
            raise ConfigError([f"kubernetes: no credentials ({'; '.join(tried)})"])
        if cfg.api_url:
            c.host = cfg.api_url.rstrip("/")
    if cfg.ca_file:
        c.ssl_ca_cert = cfg.ca_file
    if cfg.insecure_skip_tls_verify:
        c.verify_ssl = False
    return client.ApiClient(c)
