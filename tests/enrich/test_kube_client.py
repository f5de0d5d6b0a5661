"""Credentials for the Kubernetes API source: kubeconfig, an explicit URL with a token file that
rotates, and a clear error where none can be found."""

from __future__ import annotations

import pytest
import yaml
from kubeapi import FakeKubeApi
from support import eventually

from otelgpu.enrich.config import KubernetesConfig, default_tags
from otelgpu.enrich.kube.source import KubeSource
from otelgpu.enrich.labels import TagResolver
from otelgpu.errors import ConfigError
from otelgpu.telemetry import SelfMetrics, by_label


def _pod(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "ml"},
            "spec": {"nodeName": "n1", "containers": []}, "status": {"phase": "Running"}}


def _source(cfg: KubernetesConfig) -> KubeSource:
    return KubeSource(cfg, TagResolver(default_tags()), SelfMetrics())


def test_kubeconfig_with_a_context(tmp_path):
    with FakeKubeApi(token="from-kubeconfig") as api:
        api.apply(_pod("a"))
        kubeconfig = tmp_path / "config"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "other",
            "clusters": [{"name": "gpu", "cluster": {"server": api.url}},
                         {"name": "elsewhere", "cluster": {"server": "http://127.0.0.1:9"}}],
            "users": [{"name": "otelgpu", "user": {"token": "from-kubeconfig"}}],
            "contexts": [{"name": "gpu", "context": {"cluster": "gpu", "user": "otelgpu"}},
                         {"name": "other", "context": {"cluster": "elsewhere", "user": "otelgpu"}}]}))
        source = _source(KubernetesConfig(enabled=True, auth="kubeconfig", kubeconfig=str(kubeconfig), context="gpu"))
        source.start()
        try:
            assert source.wait_synced(5.0)
            assert ("ml", "a") in source.view().pods
        finally:
            source.shutdown()


def test_token_file_is_reread_when_it_rotates(tmp_path):
    token = tmp_path / "token"
    token.write_text("first\n")
    with FakeKubeApi(token="first") as api:
        source = _source(KubernetesConfig(enabled=True, auth="token", api_url=api.url, token_file=str(token),
                                          backoff_initial_seconds=0.05, backoff_max_seconds=0.1))
        source.start()
        try:
            assert source.wait_synced(5.0)
            # A rotation as the kubelet does it: the new token is valid before it is written, the
            # old one stays valid a while after, so no request is ever refused.
            api.token = ("first", "second")
            token.write_text("second\n")
            api.drop_watches()  # the next requests carry the file's new content
            api.apply(_pod("after-rotation"))
            eventually(lambda: ("ml", "after-rotation") in source.view().pods)
            api.token = "second"  # the old token expires: only a client that re-read the file goes on
            api.drop_watches()
            api.apply(_pod("after-expiry"))
            eventually(lambda: ("ml", "after-expiry") in source.view().pods)
            assert not {k: v for k, v in by_label(source.metrics.kube_errors).items() if k[2] == "unauthorized"}
        finally:
            source.shutdown()


def test_no_credentials_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConfigError, match="kubernetes: no credentials .*in-cluster.*kubeconfig"):
        _source(KubernetesConfig(enabled=True, auth="auto", kubeconfig=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="kubernetes.token_file: cannot read"):
        _source(KubernetesConfig(enabled=True, auth="token", api_url="https://x", token_file=str(tmp_path / "none")))
