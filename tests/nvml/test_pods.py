"""Pod mapping: the stand-in kubelet's pod-resources replies (dcgm-exporter's own fixture among them)
joined to NVML's entities, and the fallback to the cgroups of the processes on each device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import fixtures_dir

from otelgpu.nvml.agent import PodMapper
from otelgpu.nvml.holders import Holder, holders_by_key
from otelgpu.nvml.podresources import Allocation, PodResourcesClient, PodResourcesUnavailable
from otelgpu.nvml.procpods import ProcessPods
from otelgpu.nvml.reader import Reading

from .kubelet import Kubelet, pod

A, B = "GPU-be839661-c0f5-7452-284b-b875666df60c", "GPU-21c6d9d7-46cd-7e91-99c3-7b6a06a3faea"
MIG_11, MIG_13 = "MIG-5c5a8f2b-0000-5d1e-9f31-44d1b2a3c4d5", "MIG-6d6b9a3c-1111-5e2f-8a42-55e2c3b4d5e6"
H100 = "NVIDIA H100 80GB HBM3"
READINGS = (Reading(0, A, H100, 0, gi=11, profile="1g.10gb", mig_uuids=(MIG_11,)),
            Reading(0, A, H100, 0, gi=13, profile="1g.10gb", mig_uuids=(MIG_13,)),
            Reading(1, B, H100, 1))


def listed(kubelet: Kubelet, reply: dict) -> list[Allocation]:
    kubelet.set(reply)
    client = PodResourcesClient(kubelet.socket)
    try:
        return client.list()
    finally:
        client.close()


def test_dcgm_exporters_pod_resources_fixture_over_the_kubelets_socket(kubelet):
    reply = json.loads((fixtures_dir() / "dcgm" / "kubernetes_mig_test.samplePodResources.json").read_text())
    got = listed(kubelet, reply)
    assert got == [Allocation("testing", "ollama-76f687f4cd-xcvvp", "ollama", "nvidia.com/gpu",
                              "GPU-be839661-c0f5-7452-284b-b875666df60c"),
                   Allocation("testing", "ollama-76f687f4cd-xcvvp", "ollama", "nvidia.com/gpu",
                              "MIG-GPU-be839661-c0f5-7452-284b-b875666df60c")]
    whole = (Reading(0, A, H100, 0),)
    # Both ids name the whole GPU, as dcgm-exporter reads them (`MIG-GPU-<uuid>`: the GPU's uuid)
    assert holders_by_key(got, whole) == {(A, None): [Holder("testing", "ollama-76f687f4cd-xcvvp", "ollama")]}


def test_whole_gpus_mig_devices_and_a_gpu_nobody_holds(kubelet):
    got = listed(kubelet, {"pod_resources": [
        pod("testing", "ollama-76f687f4cd-xcvvp", "ollama", "nvidia.com/mig-1g.10gb", MIG_11),
        pod("team-b", "finetune-job-7xk2p", "trainer", "nvidia.com/gpu", B),
        pod("kube-system", "sriov", "cni", "intel.com/sriov", "0000:3b:02.1"),  # not a GPU: never a holder
        pod("lost", "elsewhere", "main", "nvidia.com/gpu", "GPU-00000000-0000-0000-0000-000000000000"),
    ]})
    assert holders_by_key(got, READINGS) == {
        (A, 11): [Holder("testing", "ollama-76f687f4cd-xcvvp", "ollama")],
        (B, None): [Holder("team-b", "finetune-job-7xk2p", "trainer")],
    }  # GPU instance 13 is held by nobody: its series carry no pod


def test_time_sliced_replicas_one_holder_per_pod_and_replica(kubelet):
    got = listed(kubelet, {"pod_resources": [
        pod("tenant-blue", "chat-api-6f7d9c8b7-4xq2m", "server", "nvidia.com/gpu", f"{B}::0", f"{B}::3"),
        pod("tenant-green", "embedder-85b4d6f9c-wz8pl", "embed", "nvidia.com/gpu.shared", f"{B}::1"),
    ]})
    assert holders_by_key(got, READINGS)[(B, None)] == [
        Holder("tenant-blue", "chat-api-6f7d9c8b7-4xq2m", "server", "0"),
        Holder("tenant-blue", "chat-api-6f7d9c8b7-4xq2m", "server", "3"),
        Holder("tenant-green", "embedder-85b4d6f9c-wz8pl", "embed", "1")]


def test_older_and_gke_device_ids():
    got = [Allocation("a", "legacy", "c", "nvidia.com/mig-1g.10gb", f"MIG-{A}/13/0"),
           Allocation("b", "gke", "c", "nvidia.com/gpu", "nvidia1/vgpu2"),
           Allocation("c", "gke-mig", "c", "nvidia.com/gpu", "nvidia0/gi11")]
    assert holders_by_key(got, READINGS) == {(A, 13): [Holder("a", "legacy", "c")], (B, None): [Holder("b", "gke", "c", "2")],
                                             (A, 11): [Holder("c", "gke-mig", "c")]}


def test_a_missing_socket_is_unavailable_not_an_error(tmp_path):
    client = PodResourcesClient(str(tmp_path / "kubelet.sock"), timeout_s=2)
    with pytest.raises(PodResourcesUnavailable, match="kubelet.sock: UNAVAILABLE"):
        client.list()
    client.close()


def container_id(n: int) -> str:
    return f"{n:064x}"


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A host's /proc and /var/log/containers as the fallback reads them: containerd's systemd
    cgroups, cgroupfs paths, a process outside Kubernetes."""
    cgroups = {
        101: f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b2.slice/cri-containerd-{container_id(1)}.scope",
        102: f"12:memory:/kubepods/besteffort/pod9f3/{container_id(2)}\n11:cpu:/kubepods/besteffort/pod9f3/{container_id(2)}",
        103: "0::/system.slice/nvidia-persistenced.service",
        104: f"0::/kubepods.slice/kubepods-pod77.slice/cri-containerd-{container_id(3)}.scope",  # no log link: unnamed
    }
    for pid, text in cgroups.items():
        (tmp_path / "proc" / str(pid)).mkdir(parents=True)
        (tmp_path / "proc" / str(pid) / "cgroup").write_text(text + "\n")
    logs = tmp_path / "containers"
    logs.mkdir()
    (logs / f"trainer-0_ml_main-{container_id(1)}.log").touch()
    (logs / f"notebook-7c9d_research_jupyter-lab-{container_id(2)}.log").touch()
    (logs / "not-a-kubelet-link.log").touch()
    return tmp_path


def test_the_fallback_names_pods_from_process_cgroups_and_the_kubelets_log_links(host):
    processes = ProcessPods(str(host / "proc"), str(host / "containers"))
    readings = (Reading(0, A, H100, 0, pids=(101, 103)), Reading(1, B, H100, 1, pids=(102, 104, 999)))
    assert processes.holders_by_key(readings) == {
        (A, None): [Holder("ml", "trainer-0", "main")],
        (B, None): [Holder("research", "notebook-7c9d", "jupyter-lab")],
    }


def test_the_mapper_uses_pod_resources_and_falls_back_while_they_are_unavailable(kubelet, host):
    kubelet.set({"pod_resources": [pod("team-b", "finetune-job-7xk2p", "trainer", "nvidia.com/gpu", B)]})
    readings = (Reading(0, A, H100, 0, pids=(101,)), Reading(1, B, H100, 1))
    mapper = PodMapper(PodResourcesClient(kubelet.socket), ProcessPods(str(host / "proc"), str(host / "containers")))
    assert mapper.holders(readings) == {(B, None): [Holder("team-b", "finetune-job-7xk2p", "trainer")]}
    kubelet.stop()
    assert mapper.holders(readings) == {(A, None): [Holder("ml", "trainer-0", "main")]}
    mapper.close()
