"""The instance catalog: each GPU instance type's GPUs, GPU model, vCPUs, memory and on-demand
price (data/aws_gpu_instances.yaml, with its source), and a GPU model's name whatever its spelling.
Hardware facts that enrich (a node's GPUs) and attribution (its price) both read."""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Optional

import yaml

INSTANCE_ID = re.compile(r"(?:^|/)(?P<id>i-[0-9a-z]+)$")  # the whole id, or what follows a `/`


def instance_of(provider_id: str) -> Optional[str]:
    """The EC2 instance id of a Kubernetes node's `providerID` (`aws:///us-east-1a/i-0abc...`), or of
    a bill's resource id (bare, or ending an ARN); None when it names no EC2 instance."""
    match = INSTANCE_ID.search(provider_id.strip())
    return match.group("id") if match else None


@dataclass(frozen=True)
class InstanceType:
    name: str
    gpus: int
    gpu_model: str
    vcpus: float
    memory_gib: float
    usd_per_hour: float


def load_catalog(path: Optional[str] = None) -> dict[str, InstanceType]:
    if path is None:
        text = resources.files("otelgpu.core").joinpath("data/aws_gpu_instances.yaml").read_text()
    else:
        text = Path(path).read_text(encoding="utf-8")
    doc = yaml.safe_load(text)
    return {
        e["instance_type"]: InstanceType(e["instance_type"], int(e["gpus"]), e.get("gpu_model", ""),
                                         float(e["vcpus"]), float(e["memory_gib"]), float(e["on_demand_usd_per_hour"]))
        for e in doc["instances"]
        if e.get("on_demand_usd_per_hour") is not None
    }


def gpu_model_key(name: str) -> str:
    """A GPU model's name whatever its spelling: DCGM's `NVIDIA H100 80GB HBM3` and GFD's
    `NVIDIA-H100-80GB-HBM3` are one model."""
    return re.sub(r"[\s_\-]+", " ", name.strip().lower())
