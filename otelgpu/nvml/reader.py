"""The node's GPUs as NVML shows them: one Reading per entity dcgm-exporter would report.

A whole GPU is one entity; a GPU in MIG mode is one entity per GPU instance (its compute
instances share the instance's memory and are held through their MIG devices), as dcgm-exporter
reports them. A value NVML cannot give for a device (NVMLError_NotSupported: utilisation of a
MIG instance, power on some boards) is None, and its series is skipped for that device; any other
error of a value call is logged once per call and device and read as None, so one odd GPU never
stops the others' series.
"""

from __future__ import annotations

import ctypes
import logging
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import pynvml

log = logging.getLogger(__name__)

MIB = 1 << 20
LIBRARY = "libnvidia-ml.so.1"
# A MIG device's name ends with its profile: "NVIDIA H100 80GB HBM3 MIG 1g.10gb"; a compute
# instance smaller than its GPU instance says so first ("... MIG 1c.2g.10gb").
_MIG_NAME = re.compile(r"\bMIG\s+(?:\d+c\.)?(\d+g\.\S+)\s*$")


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used on this machine: the message says why and what to check."""


@dataclass(frozen=True)
class Reading:
    """One entity: a whole GPU (gi None) or a MIG GPU instance of GPU `uuid`."""

    index: int  # NVML's index of the (parent) GPU: dcgm-exporter's `gpu`
    uuid: str  # the (parent) GPU's UUID
    model: str  # the (parent) GPU's name: dcgm-exporter's `modelName`
    minor: Optional[int] = None  # /dev/nvidia<minor>
    pci_bus_id: str = ""
    gi: Optional[int] = None  # GPU instance id
    profile: str = ""  # MIG profile, "1g.10gb"
    mig_uuids: tuple[str, ...] = ()  # the instance's MIG devices (one per compute instance)
    util: Optional[float] = None  # percent
    fb_used: Optional[float] = None  # MiB
    fb_free: Optional[float] = None  # MiB
    power: Optional[float] = None  # W, of the whole board (repeated on each MIG instance)
    energy: Optional[float] = None  # mJ since the driver loaded, of the whole board
    pids: tuple[int, ...] = ()  # processes running on the entity


@dataclass(frozen=True)
class Snapshot:
    driver: str
    readings: tuple[Reading, ...] = field(default_factory=tuple)


class NvmlReader:
    """NVML, opened once (`open`), read every cycle (`read`). `library`: the path of
    libnvidia-ml.so.1 where the dynamic linker would not find it; it is loaded first, and NVML's
    own bindings then find it loaded under its name."""

    def __init__(self, library: Optional[str] = None) -> None:
        self._library = library
        self._failed: set[tuple[str, str]] = set()
        self._open = False

    def open(self) -> str:
        """Load and initialise NVML; the driver's version. NvmlUnavailable if it cannot be used."""
        where = self._library or LIBRARY
        if self._library:
            try:
                ctypes.CDLL(self._library)
            except OSError as exc:
                raise NvmlUnavailable(_no_library(where, str(exc))) from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            raise NvmlUnavailable(_no_library(where, "not found by the dynamic linker")) from None
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML ({where}) did not start: {exc}; is the NVIDIA driver loaded on "
                                  "this node, and its version the one the container was given?") from None
        self._open = True
        return str(pynvml.nvmlSystemGetDriverVersion())

    @property
    def opened(self) -> bool:
        return self._open

    def close(self) -> None:
        if self._open:
            self._open = False
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as exc:  # a driver that went away: nothing left to release
                log.debug("NVML shutdown: %s", exc)

    def read(self) -> Snapshot:
        """Every GPU's entities now. A GPU whose identity cannot be read is left out this time."""
        driver = self._value("driver", "system", pynvml.nvmlSystemGetDriverVersion) or ""
        readings: list[Reading] = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                readings += self._gpu(index)
            except pynvml.NVMLError as exc:
                self._once(f"gpu {index}", "identity", exc)
        return Snapshot(str(driver), tuple(readings))

    def _gpu(self, index: int) -> list[Reading]:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        uuid = str(pynvml.nvmlDeviceGetUUID(handle))

        def value(what: str, fn: Callable[..., Any]) -> Any:
            return self._value(what, uuid, fn, handle)

        pci = value("pci", pynvml.nvmlDeviceGetPciInfo)
        gpu = Reading(index, uuid, str(pynvml.nvmlDeviceGetName(handle)), value("minor", pynvml.nvmlDeviceGetMinorNumber),
                      _text(pci.busId) if pci is not None else "",
                      power=_scaled(value("power", pynvml.nvmlDeviceGetPowerUsage), 1e-3),
                      energy=_scaled(value("energy", pynvml.nvmlDeviceGetTotalEnergyConsumption), 1.0))
        mode = value("mig mode", pynvml.nvmlDeviceGetMigMode)
        if mode is not None and mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE:
            instances = self._instances(gpu, handle)
            if instances:  # a MIG GPU not partitioned yet is still seen, whole and unheld
                return instances
        util = value("utilization", pynvml.nvmlDeviceGetUtilizationRates)
        return [replace(gpu, util=float(util.gpu) if util is not None else None,
                        **self._memory_and_pids(uuid, handle))]

    def _instances(self, gpu: Reading, handle: Any) -> list[Reading]:
        """The GPU instances of a MIG GPU, each with its MIG devices (compute instances)."""
        count = self._value("mig count", gpu.uuid, pynvml.nvmlDeviceGetMaxMigDeviceCount, handle) or 0
        by_gi: dict[int, Reading] = {}
        for slot in range(count):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except pynvml.NVMLError_NotFound:  # an empty slot
                continue
            except pynvml.NVMLError as exc:
                self._once(gpu.uuid, f"mig device {slot}", exc)
                continue
            try:
                gi = int(pynvml.nvmlDeviceGetGpuInstanceId(mig))
                mig_uuid, name = str(pynvml.nvmlDeviceGetUUID(mig)), str(pynvml.nvmlDeviceGetName(mig))
            except pynvml.NVMLError as exc:
                self._once(gpu.uuid, f"mig device {slot}", exc)
                continue
            if gi in by_gi:  # another compute instance of the same GPU instance
                seen = by_gi[gi]
                by_gi[gi] = replace(seen, mig_uuids=seen.mig_uuids + (mig_uuid,),
                                    pids=seen.pids + self._pids(mig_uuid, mig))
                continue
            match = _MIG_NAME.search(name)
            by_gi[gi] = replace(gpu, gi=gi, profile=match.group(1) if match else "", mig_uuids=(mig_uuid,),
                                **self._memory_and_pids(mig_uuid, mig))
        return [by_gi[gi] for gi in sorted(by_gi)]

    def _memory_and_pids(self, uuid: str, handle: Any) -> dict[str, Any]:
        memory = self._value("memory", uuid, pynvml.nvmlDeviceGetMemoryInfo, handle)
        used = float(memory.used // MIB) if memory is not None else None
        free = float(memory.free // MIB) if memory is not None else None
        return {"fb_used": used, "fb_free": free, "pids": self._pids(uuid, handle)}

    def _pids(self, uuid: str, handle: Any) -> tuple[int, ...]:
        processes = self._value("processes", uuid, pynvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
        return tuple(int(p.pid) for p in processes)

    def _value(self, what: str, uuid: str, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), or None where NVML cannot give it."""
        try:
            return fn(*args)
        except pynvml.NVMLError_NotSupported:
            return None
        except pynvml.NVMLError as exc:
            self._once(uuid, what, exc)
            return None

    def _once(self, uuid: str, what: str, exc: Exception) -> None:
        if (uuid, what) not in self._failed:
            self._failed.add((uuid, what))
            log.warning("NVML: %s of %s failed (%s): skipped while it fails", what, uuid, exc)


def _no_library(where: str, why: str) -> str:
    return (f"cannot load the NVIDIA Management Library {where} ({why}): is the NVIDIA driver installed on this "
            "node, and does this container get it (runtimeClassName: nvidia, or the nvidia runtime with "
            "NVIDIA_VISIBLE_DEVICES=all and NVIDIA_DRIVER_CAPABILITIES=utility)?")


def _scaled(value: Optional[int], factor: float) -> Optional[float]:
    return float(value) * factor if value is not None else None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
