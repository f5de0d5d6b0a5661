"""MIG profiles as hardware data: how much of one physical GPU a MIG instance stands for.

The profile tables are data (data/mig_profiles.yaml, with their source); see docs/cost-model.md
section 4 for the `compute` and `max` rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Optional

import numpy as np
import yaml

from otelgpu.core.catalog import gpu_model_key

_PROFILE = re.compile(r"(\d+)g\.(\d+)gb")


@dataclass(frozen=True)
class MigFamily:
    family: str
    match: tuple[str, ...]
    compute_slices: int
    memory_slices: int
    profiles: dict[str, tuple[int, int]]


class MigProfiles:
    def __init__(self, families: list[MigFamily]) -> None:
        self.families = families

    @classmethod
    def load(cls, text: Optional[str] = None) -> "MigProfiles":
        if text is None:
            text = resources.files("otelgpu.core").joinpath("data/mig_profiles.yaml").read_text()
        doc = yaml.safe_load(text)
        return cls([
            MigFamily(g["family"], tuple(gpu_model_key(m) for m in g["match"]), int(g["compute_slices"]),
                      int(g["memory_slices"]), {p: (int(c), int(m)) for p, (c, m) in g["profiles"].items()})
            for g in doc["gpus"]
        ])

    @lru_cache(maxsize=256)
    def family_for(self, model_name: str) -> Optional[MigFamily]:
        name = gpu_model_key(model_name)  # DCGM "NVIDIA H100 80GB HBM3" and GFD "NVIDIA-H100-80GB-HBM3" alike
        return next((f for f in self.families if any(m in name for m in f.match)), None)

    def slices(self, model_name: str, profile: str) -> Optional[tuple[int, int, int, int]]:
        """(compute, memory, compute slices of the GPU, memory slices of the GPU), or None if unknown.

        `+me`/`+gfx` variants (and resource-name forms such as `mig-1g.10gb`) take the slices of
        their base profile.
        """
        family = self.family_for(model_name)
        match = _PROFILE.search(profile)
        base = match.group(0) if match else profile
        if family is not None:
            cm = family.profiles.get(profile) or family.profiles.get(base)
            if cm is not None:
                return cm[0], cm[1], family.compute_slices, family.memory_slices
        return None

    def fraction(self, model_name: str, profile: str, rule: str) -> tuple[float, bool]:
        """(fraction before per-GPU normalisation, whether the profile was found in the tables).

        An unknown GPU or profile falls back to `<c>g` over 7 compute slices, the common case.
        """
        found = self.slices(model_name, profile)
        if found is None:
            match = _PROFILE.search(profile)
            family = self.family_for(model_name)
            slices = family.compute_slices if family else 7
            return (min(int(match.group(1)) / slices, 1.0) if match else 1.0), False
        compute, mem, cs, ms = found
        share = compute / cs
        if rule == "max":
            share = max(share, mem / ms)
        return share, True


def normalise_per_gpu(gpu: np.ndarray, fractions: np.ndarray) -> np.ndarray:
    """Divide the fractions on each GPU by their sum where it exceeds 1: a GPU is never sold twice."""
    if not len(fractions):
        return fractions
    total = np.bincount(gpu, weights=fractions)
    return fractions / np.maximum(total[gpu], 1.0)
