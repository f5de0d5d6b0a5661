"""Attribution's configuration (`attribution:`: the interval, the cost models, idle, prices), the
tenants' split of a serving pod's cost (`tenants:`), and price files read again when they change."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import yaml
from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic.dataclasses import dataclass

from otelgpu.core.settings import STRICT, format_loc, known_tags, problem_message
from otelgpu.errors import ConfigError


def _non_negative(value: dict[str, float]) -> dict[str, float]:
    bad = [k for k, v in value.items() if v < 0]
    if bad:
        raise ValueError(f"prices must be >= 0: {', '.join(bad)}")
    return value


@dataclass(config=STRICT)
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


@dataclass(config=STRICT)
class DiscountConfig:
    discount: float = Field(0.0, ge=0, lt=1)  # e.g. a savings plan covering on-demand use


@dataclass(config=STRICT)
class CapacityTypesConfig:
    """Rates by the node's capacity type (`eks.amazonaws.com/capacityType`,
    `karpenter.sh/capacity-type`): `on_demand` can carry a savings-plan discount; `reserved`
    covers reserved instances, capacity reservations and capacity blocks."""

    on_demand: DiscountConfig = DiscountConfig()  # on-demand prices are the top-level ones
    spot: RateConfig = RateConfig()
    reserved: RateConfig = RateConfig()


@dataclass(config=STRICT)
class PricesConfig:
    """Explicit prices win over the shipped catalog; see docs/cost-model.md section 3."""

    gpu_hour_by_gpu_model: dict[str, float] = Field(default_factory=dict)
    gpu_hour_by_instance_type: dict[str, float] = Field(default_factory=dict)
    instance_hour_by_instance_type: dict[str, float] = Field(default_factory=dict)
    # One instance's own rate (its EC2 instance id): what the bill charged it, beating every other
    # price of the node (`otelgpu prices --from-bill --per-instance` writes them)
    instance_hour_by_instance_id: dict[str, float] = Field(default_factory=dict)
    default_gpu_hour: Optional[float] = Field(None, ge=0)
    instance_price_split: Literal["scad", "opencost", "gpu_only"] = "scad"
    capacity_types: CapacityTypesConfig = CapacityTypesConfig()
    catalog: Optional[str] = None
    file: Optional[str] = None  # a YAML file of these keys, re-read when it changes

    _check = field_validator("gpu_hour_by_gpu_model", "gpu_hour_by_instance_type",
                             "instance_hour_by_instance_type", "instance_hour_by_instance_id")(_non_negative)


COST_MODELS = ("request", "scad", "opencost", "hybrid")


@dataclass(config=STRICT)
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
        known_tags(value)
        return value


@dataclass(config=STRICT)
class ScadConfig:
    cpu_only_nodes: bool = False  # also split nodes without GPUs (needs their instance prices)


@dataclass(config=STRICT)
class AttributionConfig:
    interval_seconds: int = Field(60, ge=1, le=3600)
    lateness_seconds: int = Field(30, ge=0, le=3600)
    # An open interval folds what waits in it (DCGM samples into steps, kube-state-metrics rows to
    # each series' last) once it holds this many rows and, after that, twice (steps) or 1.25 times
    # (facts) what its last fold left: lower holds less between folds for more folding (enrich/window.py)
    fold_rows: int = Field(8192, ge=1, le=1 << 30)
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


@dataclass(config=STRICT)
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
            msg = problem_message(err)
            problems.append(f"{path}: {format_loc(err['loc'])}: {msg}")
        raise ConfigError(problems) from exc
