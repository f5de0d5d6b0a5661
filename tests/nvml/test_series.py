"""The agent's series look like dcgm-exporter's: the same names and label sets as its real output
for the same devices and pods (the shared fixtures), and, sent through the OpenTelemetry SDK's
OTLP exporter, the sidecar's own decoder takes every point as dcgm data."""

from __future__ import annotations

import numpy as np
import pytest
from otlpsink import MetricsSink, serve_sink
from prometheus_client.parser import text_string_to_metric_families
from support import fixtures_dir

from otelgpu.enrich.samples import dcgm_samples
from otelgpu.nvml.agent import Agent, Options, PodMapper
from otelgpu.nvml.export import OtlpSeries, exporter_config
from otelgpu.nvml.holders import Holder
from otelgpu.nvml.podresources import PodResourcesClient
from otelgpu.nvml.procpods import ProcessPods
from otelgpu.nvml.reader import NvmlReader, Reading, Snapshot
from otelgpu.nvml.series import METRICS, points
from otelgpu.receiver.config import SourcesConfig
from otelgpu.receiver.decode import decode_reference
from otelgpu.receiver.interner import Interner
from otelgpu.receiver.limits import Limits
from otelgpu.receiver.schema import DCGM_FIELDS, STORED_UNIT
from otelgpu.receiver.sources import SourceTrust

from .kubelet import pod
from .standin import Gpu, Mig

H100 = "NVIDIA H100 80GB HBM3"
P5 = "ip-10-20-3-41.us-west-2.compute.internal"
GPU0, GPU1 = "GPU-be839661-c0f5-7452-284b-b875666df60c", "GPU-21c6d9d7-46cd-7e91-99c3-7b6a06a3faea"
A10G = "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52"


def exposition(name: str) -> dict[str, list[dict[str, str]]]:
    """Each metric's label sets in a dcgm-exporter fixture."""
    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families((fixtures_dir() / "dcgm" / name).read_text()):
        for s in family.samples:
            out.setdefault(family.name, []).append(dict(s.labels))  # a counter's family, not its _total sample
    return out


def same(ours: list[dict[str, str]], theirs: list[dict[str, str]]) -> bool:
    """The same label sets, in any order."""
    return sorted(sorted(d.items()) for d in ours) == sorted(sorted(d.items()) for d in theirs)


def labels_of(found, metric: str) -> list[dict[str, str]]:
    return [dict(p.labels) for p in found if p.metric.name == metric]


def test_whole_gpus_and_mig_instances_labelled_as_dcgm_exporter_labels_them():
    """The p5 of h100x8_mig_mixed_k8s_v4.prom: GPU 0's GPU instance 11 held by ollama, 13 by nobody,
    GPU 1 by a vLLM pod."""
    snapshot = Snapshot("575.51.03", (
        Reading(0, GPU0, H100, 0, "00000000:1B:00.0", gi=11, profile="1g.10gb", fb_used=14.0, fb_free=9969.0, power=142.318),
        Reading(0, GPU0, H100, 0, "00000000:1B:00.0", gi=13, profile="1g.10gb", fb_used=14.0, fb_free=9969.0, power=142.318),
        Reading(1, GPU1, H100, 1, "00000000:43:00.0", util=87.0, fb_used=0.0, fb_free=81079.0, power=512.44)))
    holders = {(GPU0, 11): [Holder("testing", "ollama-76f687f4cd-xcvvp", "ollama")],
               (GPU1, None): [Holder("team-a", "vllm-llama3-8b-5c9d7b8f6d-k2x7q", "vllm")]}
    found = points(snapshot, P5, holders)
    dcgm = exposition("h100x8_mig_mixed_k8s_v4.prom")
    for metric in ("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_UTIL"):
        theirs = [ls for ls in dcgm[metric] if ls["UUID"] in (GPU0, GPU1)]
        assert same(labels_of(found, metric), theirs), metric
    assert [p.value for p in found if p.metric.name == "DCGM_FI_DEV_GPU_UTIL"] == [87.0]  # none on MIG instances


def test_a_time_sliced_gpu_gets_one_copy_per_pod_and_replica_as_with_virtual_gpus():
    """a10g_timesliced_virtual_gpus_v4.8.prom: the device-wide series copied per sharing pod, with
    `vgpu` (dcgm-exporter's per-process GPU_UTIL and FB_USED, with pod_uid, have no NVML equivalent
    here: the sidecar splits the device's activity among the holders)."""
    snapshot = Snapshot("570.172.08", (Reading(0, A10G, "NVIDIA A10G", 0, "00000000:00:1E.0", util=78.0,
                                               power=187.211, energy=3344556677.0),))
    holders = {(A10G, None): [Holder("tenant-blue", "chat-api-6f7d9c8b7-4xq2m", "server", "0"),
                              Holder("tenant-green", "embedder-85b4d6f9c-wz8pl", "embed", "1")]}
    found = points(snapshot, "ip-10-20-7-12.us-west-2.compute.internal", holders)
    dcgm = exposition("a10g_timesliced_virtual_gpus_v4.8.prom")
    for metric in ("DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"):
        assert same(labels_of(found, metric), dcgm[metric]), metric
    assert {ls["vgpu"] for ls in labels_of(found, "DCGM_FI_DEV_GPU_UTIL")} == {"0", "1"}


@pytest.fixture
def sink():
    s = MetricsSink()
    with serve_sink(s):
        yield s


def test_the_sidecars_decoder_takes_the_exported_points_as_dcgm_data(devices, stand_in_library, kubelet, sink):
    devices.write([Gpu(GPU0, H100, mig=True, power_mw=142_318, migs=[Mig(0, "MIG-5c5a8f2b-0000-5d1e-9f31-44d1b2a3c4d5",
                                                                          "1g.10gb", gi=11)]),
                   Gpu(GPU1, H100, minor=1, pci="00000000:43:00.0", util=50)])
    kubelet.set({"pod_resources": [pod("testing", "ollama-76f687f4cd-xcvvp", "ollama", "nvidia.com/mig-1g.10gb",
                                       "MIG-5c5a8f2b-0000-5d1e-9f31-44d1b2a3c4d5")]})
    reader = NvmlReader(str(stand_in_library))
    reader.open()
    series = OtlpSeries(exporter_config(sink.endpoint), "gpu-node-1")
    mapper = PodMapper(PodResourcesClient(kubelet.socket), ProcessPods())
    try:
        exported = Agent(Options("gpu-node-1", mode="nvml"), reader, series, mapper).cycle()
    finally:
        series.shutdown()
        mapper.close()
        reader.close()
    (received,) = sink.received
    resource = {kv.key: kv.value.string_value for kv in received.request.resource_metrics[0].resource.attributes}
    assert resource["service.name"] == "otelgpu-nvml" and resource["service.instance.id"] == "gpu-node-1"
    strings = Interner()
    batch = decode_reference(received.request, strings, Limits(trust=SourceTrust(SourcesConfig())))
    assert not batch.rejected and len(batch) == exported == 9  # GI 11: 4 series (no util); GPU 1: 5
    assert batch.sources  # its timestamps move the interval clock, as a dcgm-exporter target's do
    s = dcgm_samples(batch, strings)
    by_entity = {(strings.string(int(u)), strings.string(int(g)) if g >= 0 else "", strings.string(int(p)) if p >= 0 else "")
                 for u, g, p in zip(s.uuid, s.gi, s.pod)}
    assert by_entity == {(GPU0, "11", "ollama-76f687f4cd-xcvvp"), (GPU1, "", "")}
    assert {strings.string(int(n)) for n in np.unique(s.node)} == {"gpu-node-1"}


def test_each_series_is_sent_in_the_unit_the_sidecar_reads_its_name_in():
    """The agent keeps the names of dcgm-exporter's default counters (DCGM before 4.6, which 4.6
    keeps as aliases) and sends each in the unit the sidecar reads that name in, its stored unit."""
    for spec in METRICS:
        metric, unit = DCGM_FIELDS[spec.name]
        assert (unit, STORED_UNIT[metric]) == (spec.unit, spec.unit), spec.name
