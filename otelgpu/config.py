"""Configuration: a frozen dataclass tree loaded from YAML, validated once at start. Each stage
owns its sections (`receiver/config.py`, `enrich/config.py`, `attribution/config.py`,
`exporter/config.py`; what they share is in `core/settings.py`); this module composes them into
the document's root and reads the file.

Unknown keys are rejected, every problem is reported together with its YAML path, and
`${env:NAME}` and `${env:NAME:-default}` references (the Collector's syntax) are expanded and
checked at load.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic.dataclasses import dataclass

from otelgpu.attribution.config import AttributionConfig, TenantsConfig
from otelgpu.core.settings import STRICT, TAG_NAMES, CheckpointConfig, format_loc, known_tags, problem_message
from otelgpu.enrich.config import KubernetesConfig, TagRule, TagValuesConfig, default_tags
from otelgpu.errors import ConfigError
from otelgpu.exporter.config import ExporterConfig, SeriesConfig
from otelgpu.receiver.config import ReceiverConfig, SourcesConfig


_ENV_REF = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


@dataclass(config=STRICT)
class ClusterConfig:
    name: str = Field("default", min_length=1)


@dataclass(config=STRICT)
class Config:
    cluster: ClusterConfig = ClusterConfig()
    kernels: Literal["compiled", "interpreted"] = "compiled"  # see otelgpu/core/jit.py
    receiver: ReceiverConfig = ReceiverConfig()
    attribution: AttributionConfig = AttributionConfig()
    tags: dict[str, TagRule] = Field(default_factory=default_tags)
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
        known_tags(value)
        defaults = default_tags()
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
            path = format_loc(err["loc"])
            if path in unset:
                continue
            msg = problem_message(err)
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
