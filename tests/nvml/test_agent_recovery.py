"""The agent through a driver reload: NVML started before it answers Uninitialized. Held between
readings (`--hold-nvml`), the agent starts it afresh after the failed reading and reads the GPUs
again, rather than exporting nothing until restarted; released between readings (the default),
no reading fails at all."""

from __future__ import annotations

from support import CollectorSink

from otelgpu.nvml.agent import Agent, Options, PodMapper
from otelgpu.nvml.export import OtlpSeries, exporter_config
from otelgpu.nvml.podresources import PodResourcesClient
from otelgpu.nvml.procpods import ProcessPods
from otelgpu.nvml.reader import NvmlReader

import pytest

from .standin import Gpu

A100 = "NVIDIA A100-SXM4-40GB"
GPU = "GPU-3f6a1c2e-8b4d-4e5f-9a6b-7c8d9e0f1a2b"


@pytest.mark.parametrize("hold", [True, False])
def test_a_driver_reload_is_read_through_after_nvml_starts_again(hold, devices, stand_in_library, kubelet, tmp_path):
    gpus = [Gpu(GPU, A100, minor=0, pci="00000000:10:00.0", util=40)]
    devices.write(gpus)
    sink = CollectorSink()
    reader = NvmlReader(str(stand_in_library))
    series = OtlpSeries(exporter_config(sink.endpoint, insecure=True), "node-1")
    mapper = PodMapper(PodResourcesClient(kubelet.socket), ProcessPods(str(tmp_path), str(tmp_path)))
    agent = Agent(Options("node-1", mode="nvml", hold_nvml=hold), reader, series, mapper)
    try:
        reader.open()
        assert agent.cycle() > 0
        assert reader.opened == hold  # released, the driver's device files are free between readings
        devices.write(gpus, generation=1)  # the driver is reloaded: an NVML started before is stale
        if hold:
            assert agent.cycle() == 0  # this reading fails
        assert agent.cycle() > 0  # NVML started afresh: the GPUs are read again
        assert agent.cycle() > 0
        util = [p.as_double for p in sink.latest("DCGM_FI_DEV_GPU_UTIL").values()]
        assert util == [40.0]
    finally:
        series.shutdown()
        mapper.close()
        reader.close()
        sink.stop()


def test_a_driver_upgrade_the_library_cannot_follow_ends_the_agent_for_a_restart(devices, stand_in_library, kubelet,
                                                                                tmp_path):
    """After an upgrade the container's library no longer matches the driver (NVML answers an RM
    version mismatch at every start): after three failed readings in a row the process exits with
    status 1 and says why, so that the kubelet starts it again with the node's new library."""
    from support import eventually

    from .agentproc import AgentProcess

    gpus = [Gpu(GPU, A100, minor=0, pci="00000000:10:00.0", util=40)]
    devices.write(gpus)
    sink = CollectorSink()
    agent = AgentProcess(tmp_path, stand_in_library, devices.path, f"--endpoint={sink.endpoint}", "--interval=0.1",
                         "--mode=nvml", f"--pod-resources-socket={kubelet.socket}")
    try:
        eventually(lambda: sink.latest("DCGM_FI_DEV_GPU_UTIL"), 60, message=agent.text)  # exporting
        devices.write(gpus, driver="580.65.06", init_error=18, generation=1)  # NVML_ERROR_LIB_RM_VERSION_MISMATCH
        assert agent.proc.wait(60) == 1
        assert "NVML failed 3 readings in a row" in agent.text() and "Traceback" not in agent.text()
    finally:
        agent.close()
        sink.stop()
