"""Enrich's configuration: where each tag's value comes from (`tags:`), how tag values are
normalised and capped (`tag_values:`), and the Kubernetes API (`kubernetes:`)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator
from pydantic.dataclasses import dataclass

from otelgpu.core.settings import STRICT


@dataclass(config=STRICT)
class TagRule:
    """Where one tag's value comes from, first match wins: the pod's label keys in order, then the
    namespace's label keys, then the pod's annotation keys, then `default`."""

    pod_labels: tuple[str, ...] = ()
    namespace_labels: tuple[str, ...] = ()
    annotations: tuple[str, ...] = ()
    default: str = "unallocated"


@dataclass(config=STRICT)
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


def default_tags() -> dict[str, TagRule]:
    keys = {
        "team": ("team",),
        "project": ("project",),
        "environment": ("environment", "env"),
        "model": ("model",),
        "cost_center": ("cost-center", "cost_center"),
    }
    return {name: TagRule(pod_labels=k, namespace_labels=k) for name, k in keys.items()}


@dataclass(config=STRICT)
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
