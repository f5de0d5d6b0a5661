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
    configuration = client.Configuration()
    configuration.host = str(cfg.api_url).rstrip("/")
    configuration.api_key_prefix = {"authorization": "Bearer"}
    if cfg.token_file:
        path = cfg.token_file
        configuration.api_key = {"authorization": _read_token(path)}

        def refresh(conf: client.Configuration) -> None:  # projected tokens rotate: read it per request
            try:
                conf.api_key["authorization"] = _read_token(path)
            except ConfigError as exc:
                log.warning("%s; keeping the previous token", exc.problems[0])

        configuration.refresh_api_key_hook = refresh
    else:
        configuration.api_key = {"authorization": str(cfg.token)}
    return configuration


def api_client(cfg: KubernetesConfig) -> client.ApiClient:
    """Raises ConfigError when no credentials can be loaded the way `cfg.auth` asks."""
    if cfg.auth == "token":
        configuration = _token_configuration(cfg)
    else:
        configuration = client.Configuration()
        tried: list[str] = []
        loaded = False
        if cfg.auth in ("auto", "in_cluster"):
            try:
                kube_config.load_incluster_config(client_configuration=configuration)
                loaded = True
            except ConfigException as exc:
                tried.append(f"in-cluster: {exc}")
        if not loaded and cfg.auth in ("auto", "kubeconfig"):
            try:
                kube_config.load_kube_config(config_file=cfg.kubeconfig, context=cfg.context,
                                             client_configuration=configuration, persist_config=False)
                loaded = True
            except (ConfigException, OSError) as exc:
                tried.append(f"kubeconfig: {exc}")
        if not loaded:
            raise ConfigError([f"kubernetes: no credentials ({'; '.join(tried)})"])
        if cfg.api_url:
            configuration.host = cfg.api_url.rstrip("/")
    if cfg.ca_file:
        configuration.ssl_ca_cert = cfg.ca_file
    if cfg.insecure_skip_tls_verify:
        configuration.verify_ssl = False
    return client.ApiClient(configuration)
