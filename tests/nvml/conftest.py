"""The NVML agent's tests run against a stand-in libnvidia-ml.so.1 compiled from stand_in_nvml.c,
loaded through NVML's real loading path, and a stand-in kubelet on a unix socket."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Iterator

import pytest

from .kubelet import Kubelet
from .standin import DEVICES_ENV, Devices, build


@pytest.fixture(scope="session")
def stand_in_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in built once per test process, and loaded: NVML's bindings then find it by its
    soname when they open libnvidia-ml.so.1, as they would find the driver's."""
    library = build(tmp_path_factory.mktemp("nvml"))
    ctypes.CDLL(str(library))
    return library


@pytest.fixture
def devices(tmp_path: Path, stand_in_library: Path, monkeypatch: pytest.MonkeyPatch) -> Devices:
    path = tmp_path / "devices.txt"
    path.write_text("")
    monkeypatch.setenv(DEVICES_ENV, str(path))
    return Devices(path)


@pytest.fixture
def kubelet() -> Iterator[Kubelet]:
    k = Kubelet({"pod_resources": []})
    yield k
    k.stop()
