"""GPU hourly price per node, from the first source that applies (docs/cost-model.md section 3):

1. an explicit per-GPU-hour price for the node's GPU model, then for its instance type;
2. the instance's hourly price (configured, else the shipped AWS catalog) split into a per-GPU
   price by a convention: `scad` (AWS Split Cost Allocation Data weights GPU 9, vCPU 0.9, GB 0.1),
   `opencost` (OpenCost's base-price ratios) or `gpu_only` (the whole instance over its GPUs);
3. a configured default per-GPU-hour price.
The source used travels with the price so every cost series can say where its price came from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Optional

import yaml

from otelgpu.config import PricesConfig

SCAD_WEIGHTS = (9.0, 0.9, 0.1)  # GPU, vCPU, GB of memory on accelerated instances
OPENCOST_BASE = (0.95, 0.031611, 0.004237)  # $/GPU-h, $/vCPU-h, $/GiB-h


@dataclass(frozen=True)
class InstanceType:
    name: str
    gpus: int
    gpu_model: str
    vcpus: float
    memory_gib: float
    usd_per_hour: float


@dataclass(frozen=True)
class GpuPrice:
    per_gpu_hour: float
    source: str  # e.g. "config:gpu_model", "catalog:scad", "none"


def load_catalog(path: Optional[str] = None) -> dict[str, InstanceType]:
    if path is None:
        text = resources.files("otelgpu.attribution").joinpath("data/aws_gpu_instances.yaml").read_text()
    else:
        text = Path(path).read_text(encoding="utf-8")
    doc = yaml.safe_load(text)
    return {
        e["instance_type"]: InstanceType(e["instance_type"], int(e["gpus"]), e.get("gpu_model", ""),
                                         float(e["vcpus"]), float(e["memory_gib"]), float(e["on_demand_usd_per_hour"]))
        for e in doc["instances"]
        if e.get("on_demand_usd_per_hour") is not None
    }


def _norm(name: str) -> str:
    return re.sub(r"[\s_\-]+", " ", name.strip().lower())


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


class Pricer:
    def __init__(self, config: PricesConfig, catalog: Optional[dict[str, InstanceType]] = None) -> None:
        self.config = config
        self.catalog = catalog if catalog is not None else load_catalog(config.catalog)
        self._by_model = {_norm(k): v for k, v in config.gpu_hour_by_gpu_model.items()}

    def gpu_hour(self, instance_type: str, gpu_models: tuple[str, ...], gpus: int,
                 vcpus: float = 0.0, memory_gib: float = 0.0) -> GpuPrice:
        """`gpu_models`: names the node's GPU goes by (DCGM modelName, GFD product label).
        `gpus`, `vcpus`, `memory_gib`: the node's own figures, used where the catalog lacks the type."""
        cfg = self.config
        for model in gpu_models:
            if model and _norm(model) in self._by_model:
                return GpuPrice(self._by_model[_norm(model)], "config:gpu_model")
        if instance_type in cfg.gpu_hour_by_instance_type:
            return GpuPrice(cfg.gpu_hour_by_instance_type[instance_type], "config:instance_type")
        known = self.catalog.get(instance_type)
        price = cfg.instance_hour_by_instance_type.get(instance_type)
        source = "config"
        if price is None and known is not None:
            price, source = known.usd_per_hour, "catalog"
        if price is not None:
            g = known.gpus if known else gpus
            v = known.vcpus if known else vcpus
            m = known.memory_gib if known else memory_gib
            if g > 0:
                split = cfg.instance_price_split
                return GpuPrice(gpu_share_of_instance(split, price, g, v, m), f"{source}:{split}")
        if cfg.default_gpu_hour is not None:
            return GpuPrice(cfg.default_gpu_hour, "config:default")
        return GpuPrice(0.0, "none")
