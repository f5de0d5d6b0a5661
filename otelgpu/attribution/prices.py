"""GPU hourly price per node, from the first source that applies (docs/cost-model.md section 3):

1. an explicit per-GPU-hour price for the node's GPU model, then for its instance type;
2. the instance's hourly price (configured, else the shipped AWS catalog) split into a per-GPU
   price by a convention: `scad` (AWS Split Cost Allocation Data weights GPU 9, vCPU 0.9, GB 0.1),
   `opencost` (OpenCost's base-price ratios) or `gpu_only` (the whole instance over its GPUs);
3. a configured default per-GPU-hour price.
The source used travels with the price so every cost series can say where its price came from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from otelgpu.attribution.config import PricesConfig, load_prices_file
from otelgpu.core.catalog import InstanceType, gpu_model_key, load_catalog
from otelgpu.errors import ConfigError

SCAD_WEIGHTS = (9.0, 0.9, 0.1)  # GPU, vCPU, GB of memory on accelerated instances
SCAD_WEIGHTS_CPU = (0.0, 9.0, 1.0)  # instances without accelerators
OPENCOST_BASE = (0.95, 0.031611, 0.004237)  # $/GPU-h, $/vCPU-h, $/GiB-h


@dataclass(frozen=True)
class GpuPrice:
    per_gpu_hour: float
    source: str  # e.g. "config:gpu_model", "catalog:scad", "catalog:scad+spot_discount", "none"


@dataclass(frozen=True)
class NodePrice:
    """What one node costs per hour, at the rate of its capacity type, in the forms each cost
    model needs: an explicit per-GPU price and/or the whole instance's price, with the shape
    (GPUs, vCPUs, GiB) that splits the instance price."""

    gpu_hour: Optional[float]  # explicit per-GPU-hour price
    gpu_source: str
    instance_hour: Optional[float]  # the whole instance
    instance_source: str
    default_gpu_hour: Optional[float]
    gpu_suffix: str  # "+spot_discount" where the price is the on-demand one discounted
    instance_suffix: str
    default_suffix: str
    gpus: int
    vcpus: float
    memory_gib: float

    def per_gpu(self, convention: str) -> GpuPrice:
        """Per-GPU hourly price: explicit, else the instance price split by `convention`, else
        the configured default."""
        if self.gpu_hour is not None:
            return GpuPrice(self.gpu_hour, self.gpu_source + self.gpu_suffix)
        if self.instance_hour is not None and self.gpus > 0:
            price = gpu_share_of_instance(convention, self.instance_hour, self.gpus, self.vcpus, self.memory_gib)
            return GpuPrice(price, f"{self.instance_source}:{convention}{self.instance_suffix}")
        if self.default_gpu_hour is not None:
            return GpuPrice(self.default_gpu_hour, "config:default" + self.default_suffix)
        return GpuPrice(0.0, "none")

    def scad_rates(self) -> tuple[tuple[float, float, float], str]:
        """SCAD's hourly rates per GPU, vCPU and GiB, and their source. The instance price is
        split by the accelerated weights (GPU 9, vCPU 0.9, GB 0.1), or vCPU 9 / GB 1 on an
        instance without GPUs. With no instance price, an explicit or default GPU price prices
        the GPUs alone (CPU and memory then cost nothing, and the source says so)."""
        if self.instance_hour is not None:
            weights = SCAD_WEIGHTS if self.gpus > 0 else SCAD_WEIGHTS_CPU
            denom = weights[0] * self.gpus + weights[1] * self.vcpus + weights[2] * self.memory_gib
            if denom > 0:
                unit = self.instance_hour / denom
                return (weights[0] * unit, weights[1] * unit, weights[2] * unit), f"{self.instance_source}:scad{self.instance_suffix}"
        gpu = self.per_gpu("scad")
        source = gpu.source if gpu.source == "none" else gpu.source + ";gpu_only"
        return (gpu.per_gpu_hour, 0.0, 0.0), source


def gpu_share_of_instance(convention: str, price: float, gpus: int, vcpus: float, memory_gib: float) -> float:
    """Per-GPU hourly price carved out of an instance price."""
    if gpus <= 0:
        return 0.0
    if convention == "gpu_only":
        return price / gpus
    if convention == "scad":
        w_gpu, w_cpu, w_mem = SCAD_WEIGHTS
        unit = price / (w_gpu * gpus + w_cpu * vcpus + w_mem * memory_gib)
        return w_gpu * unit
    gpu, cpu, ram = OPENCOST_BASE
    ram_price = price / (gpus * gpu / ram + vcpus * cpu / ram + memory_gib)
    return ram_price * gpu / ram


_RATE_OF_CAPACITY = {"spot": "spot", "reserved": "reserved"}


class Pricer:
    """Resolves each node's price from the configuration, the catalog and the node's capacity
    type. `reload_if_changed` re-reads the configured price file when it changes, so prices can
    move while running; costs already accrued keep the prices of their intervals."""

    def __init__(self, config: PricesConfig, catalog: Optional[dict[str, InstanceType]] = None) -> None:
        self.base = config
        self.catalog = catalog if catalog is not None else load_catalog(config.catalog)
        self._file_mtime: Optional[int] = None
        self._use(config)

    def _use(self, config: PricesConfig) -> None:
        self.config = config
        self._by_model = {gpu_model_key(k): v for k, v in config.gpu_hour_by_gpu_model.items()}
        self._rates = {name: getattr(config.capacity_types, name) for name in ("on_demand", "spot", "reserved")}
        self._rate_by_model = {name: {gpu_model_key(k): v for k, v in getattr(r, "gpu_hour_by_gpu_model", {}).items()}
                               for name, r in self._rates.items()}

    def reload_if_changed(self) -> bool:
        """Re-read the price file if its modification time changed. Returns True when new prices
        took effect; raises ConfigError (old prices stay) when the file is bad."""
        path = self.base.file
        if path is None:
            return False
        try:
            mtime = os.stat(path).st_mtime_ns
        except OSError as exc:
            if self._file_mtime == -1:
                return False  # still missing: reported when it went missing
            self._file_mtime = -1
            raise ConfigError([f"{path}: cannot read: {exc.strerror}"]) from exc
        if mtime == self._file_mtime:
            return False
        self._file_mtime = mtime  # a bad file is reported once per change, not every interval
        self._use(load_prices_file(path, self.base))
        return True

    def node_price(self, instance_type: str, gpu_models: tuple[str, ...], capacity_type: str, gpus: int,
                   vcpus: float = 0.0, memory_gib: float = 0.0, instance_id: str = "") -> NodePrice:
        """`gpu_models`: names the node's GPU goes by (DCGM modelName, GFD product label). `gpus`,
        `vcpus`, `memory_gib`: the node's own figures, used where the catalog lacks the type.
        `instance_id`: its EC2 instance, whose own rate (`instance_hour_by_instance_id`) beats all."""
        if instance_id in self.config.instance_hour_by_instance_id:
            return self._instance_own(instance_type, instance_id, gpus, vcpus, memory_gib)
        return self._type_price(instance_type, gpu_models, capacity_type, gpus, vcpus, memory_gib)

    def _type_price(self, instance_type: str, gpu_models: tuple[str, ...], capacity_type: str, gpus: int,
                    vcpus: float, memory_gib: float) -> NodePrice:
        """The node's price by its type, GPU model and capacity type (section 3's order)."""
        cfg = self.config
        rate_name = _RATE_OF_CAPACITY.get(capacity_type, "on_demand")
        rate = self._rates[rate_name]
        factor, suffix = 1.0, ""
        if rate.discount > 0:
            factor, suffix = 1.0 - rate.discount, f"+{rate_name}_discount"

        gpu_hour, gpu_source = None, ""
        tag = "" if rate_name == "on_demand" else rate_name + "."
        by_model = self._rate_by_model[rate_name] if tag else {}
        for model in gpu_models:  # a capacity type's own price, exact, no discount
            if model and gpu_model_key(model) in by_model:
                gpu_hour, gpu_source = by_model[gpu_model_key(model)], f"config:{tag}gpu_model"
                break
        if gpu_hour is None and tag and instance_type in rate.gpu_hour_by_instance_type:
            gpu_hour, gpu_source = rate.gpu_hour_by_instance_type[instance_type], f"config:{tag}instance_type"
        explicit_own = gpu_hour is not None
        own_instance = bool(tag) and instance_type in rate.instance_hour_by_instance_type
        if gpu_hour is None and not own_instance:  # the type's own instance price beats discounted ones
            for model in gpu_models:
                if model and gpu_model_key(model) in self._by_model:
                    gpu_hour, gpu_source = self._by_model[gpu_model_key(model)] * factor, "config:gpu_model"
                    break
        if gpu_hour is None and not own_instance and instance_type in cfg.gpu_hour_by_instance_type:
            gpu_hour, gpu_source = cfg.gpu_hour_by_instance_type[instance_type] * factor, "config:instance_type"

        known = self.catalog.get(instance_type)
        instance_hour, instance_source, instance_own = None, "", False
        if tag and instance_type in rate.instance_hour_by_instance_type:
            instance_hour, instance_source = rate.instance_hour_by_instance_type[instance_type], f"config:{tag}instance"
            instance_own = True
        elif instance_type in cfg.instance_hour_by_instance_type:
            instance_hour, instance_source = cfg.instance_hour_by_instance_type[instance_type] * factor, "config"
        elif known is not None:
            instance_hour, instance_source = known.usd_per_hour * factor, "catalog"

        default = cfg.default_gpu_hour * factor if cfg.default_gpu_hour is not None else None
        # A capacity type's own price is exact: the discount suffix marks only discounted prices.
        return NodePrice(
            gpu_hour=gpu_hour, gpu_source=gpu_source, instance_hour=instance_hour, instance_source=instance_source,
            default_gpu_hour=default, gpu_suffix="" if explicit_own else suffix,
            instance_suffix="" if instance_own else suffix, default_suffix=suffix,
            gpus=known.gpus if known else gpus, vcpus=known.vcpus if known else vcpus,
            memory_gib=known.memory_gib if known else memory_gib,
        )

    def _instance_own(self, instance_type: str, instance_id: str, gpus: int, vcpus: float,
                      memory_gib: float) -> NodePrice:
        """The node at its instance's own rate: the whole instance's price, split by the model's
        convention; no per-GPU price and no discount apply."""
        known = self.catalog.get(instance_type)
        return NodePrice(
            gpu_hour=None, gpu_source="", instance_hour=self.config.instance_hour_by_instance_id[instance_id],
            instance_source="config:instance_id", default_gpu_hour=None, gpu_suffix="", instance_suffix="",
            default_suffix="", gpus=known.gpus if known else gpus, vcpus=known.vcpus if known else vcpus,
            memory_gib=known.memory_gib if known else memory_gib)

    def prices_instance(self, instance_type: str, capacity_type: str, instance_id: str = "") -> bool:
        """Whether the type's whole instance (or the instance itself) has a price (configured, or in
        the catalog): the nodes without GPUs that scad costs are those."""
        return self.node_price(instance_type, (), capacity_type, 0, instance_id=instance_id).instance_hour is not None

    def gpu_hour(self, instance_type: str, gpu_models: tuple[str, ...], gpus: int,
                 vcpus: float = 0.0, memory_gib: float = 0.0, capacity_type: str = "on-demand") -> GpuPrice:
        """Per-GPU price by the configured split convention (`instance_price_split`)."""
        node = self.node_price(instance_type, gpu_models, capacity_type, gpus, vcpus, memory_gib)
        return node.per_gpu(self.config.instance_price_split)
