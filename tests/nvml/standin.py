"""The stand-in NVML (stand_in_nvml.c) built into a real libnvidia-ml.so.1, and the device files it
answers from, written from plain descriptions of GPUs."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

SOURCE = Path(__file__).with_name("stand_in_nvml.c")
SONAME = "libnvidia-ml.so.1"
DEVICES_ENV = "STAND_IN_NVML_DEVICES"
MIB = 1 << 20


def build(directory: Path) -> Path:
    """Compile the stand-in into `directory`/libnvidia-ml.so.1, with that soname, as the driver's is."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError("the NVML tests build a stand-in libnvidia-ml.so.1 with gcc: install gcc "
                           "(.ci/run does on CI machines)")
    out = directory / SONAME
    subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", f"-Wl,-soname,{SONAME}", "-o", str(out),
                    str(SOURCE)], check=True, capture_output=True, timeout=120)
    return out


@dataclass
class Mig:
    slot: int
    uuid: str
    profile: str  # "1g.10gb"
    gi: int
    ci: int = 0
    mem_total_mib: int = 9984
    mem_used_mib: Optional[int] = 14
    procs: tuple[int, ...] = ()


@dataclass
class Gpu:
    """One GPU as the stand-in reports it. None: NVML does not support that value on it."""

    uuid: str
    name: str = "NVIDIA A100-SXM4-40GB"
    minor: Optional[int] = 0
    pci: str = "00000000:10:00.0"
    util: Optional[int] = 0
    mem_total_mib: Optional[int] = 40960
    mem_used_mib: Optional[int] = 0
    power_mw: Optional[int] = 60_000
    energy_mj: Optional[int] = 1_000_000
    mig: Optional[bool] = None  # None: not MIG-capable
    migs: list[Mig] = field(default_factory=list)
    procs: tuple[int, ...] = ()


def _value(v: object) -> str:
    return "-" if v is None else str(int(v)) if isinstance(v, bool) else str(v)


def _procs(pids: tuple[int, ...]) -> str:
    return ",".join(f"{pid}:{256 * MIB}" for pid in pids)


def render(gpus: list[Gpu], driver: str = "575.51.03", init_error: int = 0, generation: int = 0) -> str:
    """`generation`: the driver's load; a new one (a driver reloaded) stops an NVML started before it."""
    lines = [f"system|driver={driver}|init_error={init_error}|generation={generation}"]
    for i, g in enumerate(gpus):
        mem_used = None if g.mem_used_mib is None else g.mem_used_mib * MIB
        mem_total = None if g.mem_total_mib is None else g.mem_total_mib * MIB
        lines.append("|".join([
            "gpu", f"uuid={g.uuid}", f"name={g.name}", f"minor={_value(g.minor)}", f"pci={g.pci}",
            f"mig={_value(g.mig)}", f"util={_value(g.util)}", f"mem_total={_value(mem_total)}",
            f"mem_used={_value(mem_used)}", f"power={_value(g.power_mw)}", f"energy={_value(g.energy_mj)}",
            f"procs={_procs(g.procs)}"]))
        for m in g.migs:
            used = None if m.mem_used_mib is None else m.mem_used_mib * MIB
            lines.append("|".join([
                "mig", f"gpu={i}", f"slot={m.slot}", f"uuid={m.uuid}", f"name={g.name} MIG {m.profile}",
                f"gi={m.gi}", f"ci={m.ci}", f"mem_total={m.mem_total_mib * MIB}", f"mem_used={_value(used)}",
                f"procs={_procs(m.procs)}"]))
    return "\n".join(lines) + "\n"


class Devices:
    """The device file the stand-in reads (its path goes in STAND_IN_NVML_DEVICES)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, gpus: list[Gpu], driver: str = "575.51.03", init_error: int = 0, generation: int = 0) -> None:
        """Replace what the GPUs report, atomically: a reading never sees half a file."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(render(gpus, driver, init_error, generation))
        tmp.replace(self.path)
