"""The reader against the stand-in libnvidia-ml.so.1, through NVML's Python bindings: whole GPUs,
MIG instances, values a device does not support, processes, and a device file changed while the
reader is open."""

from __future__ import annotations

import pytest

from otelgpu.nvml.reader import NvmlReader, NvmlUnavailable, Reading

from .standin import Gpu, Mig

A, B = "GPU-be839661-c0f5-7452-284b-b875666df60c", "GPU-21c6d9d7-46cd-7e91-99c3-7b6a06a3faea"
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def reader(devices, stand_in_library):
    r = NvmlReader(str(stand_in_library))
    yield r
    r.close()


def test_whole_gpus_in_dcgm_exporters_units(devices, reader):
    devices.write([Gpu(A, H100, minor=0, pci="00000000:1B:00.0", util=87, mem_total_mib=81559, mem_used_mib=480,
                       power_mw=512_440, energy_mj=3_344_556_677, procs=(4242,)),
                   Gpu(B, H100, minor=1, pci="00000000:43:00.0")])
    assert reader.open() == "575.51.03"
    snapshot = reader.read()
    assert snapshot.driver == "575.51.03"
    a, b = snapshot.readings
    assert a == Reading(0, A, H100, 0, "00000000:1B:00.0", util=87.0, fb_used=480.0, fb_free=81079.0,
                        power=pytest.approx(512.44), energy=3_344_556_677.0, pids=(4242,))
    assert (b.index, b.uuid, b.minor, b.gi, b.util, b.pids) == (1, B, 1, None, 0.0, ())


def test_mig_instances_one_entity_per_gpu_instance(devices, reader):
    devices.write([Gpu(A, H100, mig=True, power_mw=142_318, util=None, migs=[
        Mig(0, "MIG-5c5a8f2b-0000-5d1e-9f31-44d1b2a3c4d5", "1g.10gb", gi=11, mem_used_mib=14, procs=(77,)),
        Mig(1, "MIG-6d6b9a3c-1111-5e2f-8a42-55e2c3b4d5e6", "1g.10gb", gi=13),
        # a second compute instance of GPU instance 13: the same entity
        Mig(2, "MIG-7e7cab4d-2222-5f30-9b53-66f3d4c5e6f7", "1g.10gb", gi=13, ci=1, procs=(78,))])])
    reader.open()
    gi11, gi13 = reader.read().readings
    assert (gi11.uuid, gi11.model, gi11.gi, gi11.profile) == (A, H100, 11, "1g.10gb")
    assert gi11.mig_uuids == ("MIG-5c5a8f2b-0000-5d1e-9f31-44d1b2a3c4d5",) and gi11.pids == (77,)
    assert (gi11.fb_used, gi11.fb_free) == (14.0, 9970.0)
    assert gi11.util is None  # NVML measures no utilisation per MIG instance
    assert gi11.power == gi13.power == pytest.approx(142.318)  # the board's, on each instance, as dcgm-exporter
    assert gi13.mig_uuids == ("MIG-6d6b9a3c-1111-5e2f-8a42-55e2c3b4d5e6", "MIG-7e7cab4d-2222-5f30-9b53-66f3d4c5e6f7")
    assert gi13.pids == (78,)


def test_a_mig_gpu_without_instances_is_still_seen_whole(devices, reader):
    devices.write([Gpu(A, H100, mig=True)])
    reader.open()
    (gpu,) = reader.read().readings
    assert (gpu.uuid, gpu.gi, gpu.util) == (A, None, None)


def test_values_a_device_does_not_support_are_left_out(devices, reader):
    devices.write([Gpu(A, minor=None, pci="", util=None, mem_used_mib=None, power_mw=None, energy_mj=None),
                   Gpu(B, minor=1, util=12)])
    reader.open()
    a, b = reader.read().readings
    assert a == Reading(0, A, "NVIDIA A100-SXM4-40GB")  # nothing but the identity
    assert (b.util, b.power, b.energy) == (12.0, 60.0, 1_000_000.0)


def test_every_reading_sees_the_device_file_as_it_is_now(devices, reader):
    devices.write([Gpu(A, util=10)])
    reader.open()
    assert [r.util for r in reader.read().readings] == [10.0]
    devices.write([Gpu(A, util=90), Gpu(B, minor=1, util=5)])
    assert [r.util for r in reader.read().readings] == [90.0, 5.0]


def test_a_library_that_cannot_be_loaded_is_named_with_what_to_check(tmp_path):
    with pytest.raises(NvmlUnavailable) as err:
        NvmlReader(str(tmp_path / "libnvidia-ml.so.1")).open()
    message = str(err.value)
    assert str(tmp_path / "libnvidia-ml.so.1") in message and "driver" in message
    assert "NVIDIA_DRIVER_CAPABILITIES=utility" in message and "\n" not in message


def test_a_driver_that_does_not_start_is_reported_not_raised(devices, stand_in_library):
    devices.write([Gpu(A)], init_error=9)  # NVML_ERROR_DRIVER_NOT_LOADED
    with pytest.raises(NvmlUnavailable, match="did not start: Driver Not Loaded"):
        NvmlReader(str(stand_in_library)).open()
