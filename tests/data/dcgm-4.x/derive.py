"""Writes this folder's fixtures: the shared dcgm-exporter fixtures with every DCGM field under its
DCGM 4.6 name (4.6.1 for the energy), values converted where the unit changed. See PROVENANCE.md.

    python tests/data/dcgm-4.x/derive.py
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from support import fixtures_dir  # noqa: E402

# Old name -> 4.6 name of the same field (dcgm_fields.h @ NVIDIA/DCGM v4.6.0, the deprecated aliases).
RENAMED = {
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO",
    "DCGM_FI_DEV_GPU_UTIL": "DCGM_FI_DEV_GPU_UTIL_RATIO",
    "DCGM_FI_DEV_POWER_USAGE": "DCGM_FI_DEV_BOARD_POWER_WATTS",
    "DCGM_FI_DEV_XID_ERRORS": "DCGM_FI_DEV_XID_ERROR",
    "DCGM_FI_DRIVER_VERSION": "DCGM_FI_SYSTEM_DRIVER_VERSION",  # a `label` field: a label key
}
# mJ counter -> its joule counterpart (a new field, 1611, in DCGM 4.6.1: go-dcgm's dcgm_fields.h).
ENERGY_MJ, ENERGY_J = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL"
ENERGY_HELP = "Total GPU energy consumption in joules since the driver was last reloaded."
NAME = re.compile(r"\bDCGM_FI_[A-Z0-9_]+\b")

PROM = {"h100x8_mig_mixed_k8s_head_hostname_lowercase.prom": "h100x8_mig_mixed_k8s_dcgm4.6_names.prom",
        "a10g_timesliced_virtual_gpus_v4.8.prom": "a10g_timesliced_virtual_gpus_dcgm4.6_names.prom"}
OTLP = {"otlp_dcgm_scrape1_collector_v0.142.json": "otlp_dcgm_scrape1_dcgm4.6_names.json",
        "otlp_dcgm_scrape2_stale_collector_v0.142.json": "otlp_dcgm_scrape2_stale_dcgm4.6_names.json"}


def renamed(name: str) -> str:
    return ENERGY_J if name == ENERGY_MJ else RENAMED.get(name, name)


def exposition_line(line: str) -> str:
    """One line of exposition text, as dcgm-exporter renders it (`%f` for a double field)."""
    if line.startswith("# HELP " + ENERGY_MJ):
        return f"# HELP {ENERGY_J} {ENERGY_HELP}"
    if line.startswith(ENERGY_MJ + "{"):
        head, value = line.rsplit(" ", 1)
        return f"{NAME.sub(lambda m: renamed(m.group()), head)} {int(value) / 1000:f}"
    return NAME.sub(lambda m: renamed(m.group()), line)


def otlp_metric(metric: dict) -> dict:
    joules = metric["name"] == ENERGY_MJ
    metric["name"] = renamed(metric["name"])
    if joules:
        metric["description"] = ENERGY_HELP
    for point in (metric.get("gauge") or metric.get("sum") or {}).get("dataPoints", []):
        for kv in point.get("attributes", []):
            kv["key"] = renamed(kv["key"])
        if joules and "asDouble" in point:
            point["asDouble"] = point["asDouble"] / 1000
    return metric


def main() -> None:
    for source, target in PROM.items():
        lines = (fixtures_dir() / "dcgm" / source).read_text().splitlines()
        (HERE / target).write_text("".join(exposition_line(line) + "\n" for line in lines))
    for source, target in OTLP.items():
        doc = json.loads((fixtures_dir() / "otel" / source).read_text())
        for rm in doc["resourceMetrics"]:
            for sm in rm["scopeMetrics"]:
                sm["metrics"] = [otlp_metric(m) for m in sm["metrics"]]
        (HERE / target).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
