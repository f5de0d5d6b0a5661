"""Points whose labels name nothing or carry absurd numbers are rejected at decode, one by one,
with a reason; their neighbours in the same request are kept."""

from __future__ import annotations

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from otelgpu.enrich import labels as L
from otelgpu.enrich.model import NodeFacts
from otelgpu.enrich.nodes import gpu_count, node_info
from otelgpu.receiver.decode import decode_reference
from otelgpu.receiver.interner import Interner
from otelgpu.receiver.rejection import REASONS
from otelgpu.receiver.schema import LABEL_CHECKS, MAX_GPUS_PER_NODE

T = 1_700_000_000 * 10**9
GPU = {"UUID": "GPU-0", "Hostname": "n1", "modelName": "NVIDIA H100 80GB HBM3"}
MIG = {**GPU, "GPU_I_ID": "9", "GPU_I_PROFILE": "1g.10gb"}
NODE = {"node": "n1", "label_nvidia_com_gpu_count": "8"}


def request(metric: str, *label_sets: dict[str, str], value: float = 1.0) -> ExportMetricsServiceRequest:
    req = ExportMetricsServiceRequest()
    m = req.resource_metrics.add().scope_metrics.add().metrics.add(name=metric)
    for labels in label_sets:
        p = m.gauge.data_points.add(time_unix_nano=T, as_double=value)
        p.attributes.extend(KeyValue(key=k, value=AnyValue(string_value=v)) for k, v in labels.items())
    return req


def outcome(metric: str, bad: dict[str, str], good: dict[str, str], value: float = 1.0) -> tuple[int, str]:
    """(points kept, what the sender is told of the one rejection) of `bad` sent between two copies
    of `good`; the rejection names the metric and one of the short codes the self-metric counts."""
    batch = decode_reference(request(metric, good, bad, good, value=value), Interner(), now_ns=T)
    assert batch.rejected_count == 1, batch.rejected
    why = next(iter(batch.rejected))
    assert why.metric == metric and why.reason in REASONS
    return len(batch), why.text


@pytest.mark.parametrize("bad, reason", [
    ({**GPU, "pod": "", "namespace": "ml"}, "empty label pod"),
    ({**GPU, "Hostname": ""}, "empty label Hostname"),
    ({**MIG, "GPU_I_ID": "-1"}, "GPU_I_ID not in 0..31"),
    ({**MIG, "GPU_I_ID": "abc"}, "GPU_I_ID not in 0..31"),
    ({**MIG, "GPU_I_ID": "18446744073709551617"}, "GPU_I_ID not in 0..31"),
    ({**MIG, "GPU_I_ID": "٣"}, "GPU_I_ID not in 0..31"),  # a digit, but not an ASCII one
    ({**MIG, "GPU_I_PROFILE": "999g.999gb"}, "GPU_I_PROFILE not a MIG profile"),
    ({**MIG, "GPU_I_PROFILE": ""}, "empty label GPU_I_PROFILE"),
    ({**GPU, "GPU_I_ID": "3"}, "has only one of GPU_I_ID and GPU_I_PROFILE"),
])
def test_dcgm_points_that_name_nothing_or_no_possible_mig_instance(bad, reason):
    kept, why = outcome("DCGM_FI_PROF_GR_ENGINE_ACTIVE", bad, MIG, value=0.5)
    assert kept == 2
    assert why == f"DCGM_FI_PROF_GR_ENGINE_ACTIVE {reason}"


@pytest.mark.parametrize("profile", ["1g.10gb", "1g.10gb+me", "7g.80gb", "1g.24gb-me", "4g.96gb+gfx", "7g.141gb"])
def test_real_mig_profiles_pass(profile):
    assert LABEL_CHECKS["GPU_I_PROFILE"](profile) == ""


@pytest.mark.parametrize("count", ["-3", "65", "10000", "99999999999999999999", "1e3", " 8", "eight"])
def test_gpu_counts_no_node_has_are_rejected(count):
    kept, why = outcome("kube_node_labels", {**NODE, "label_nvidia_com_gpu_count": count}, NODE)
    assert kept == 2
    assert why == f"kube_node_labels nvidia.com/gpu.count not in 0..{MAX_GPUS_PER_NODE}"


@pytest.mark.parametrize("replicas", ["0", "-4", "1000000", "99999999999999999999"])
def test_time_slicing_replicas_out_of_range_are_rejected(replicas):
    kept, why = outcome("kube_node_labels", {**NODE, "label_nvidia_com_gpu_replicas": replicas}, NODE)
    assert kept == 2
    assert why == "kube_node_labels nvidia.com/gpu.replicas not in 1..128"


def test_the_checked_keys_are_the_ones_node_facts_read():
    assert {L.GPU_COUNT, L.GPU_REPLICAS} <= LABEL_CHECKS.keys()


def test_node_labels_from_the_api_are_bounded_too():
    """The Kubernetes API source does not pass through decode: an absurd label there is no label."""
    facts = NodeFacts(labels={L.GPU_COUNT: "1000000000000", L.GPU_REPLICAS: "-4"},
                      capacity={"nvidia_com_gpu": 8.0})
    info = node_info(facts)
    assert info.replicas == 1
    assert gpu_count(facts, info) == 8  # from the capacity, as without the label
    assert gpu_count(NodeFacts(labels={}, capacity={"nvidia_com_gpu": 1e12}), info) == MAX_GPUS_PER_NODE


def test_empty_tag_labels_are_not_names_and_do_not_reject():
    """kube-state-metrics writes a Kubernetes label with an empty value as label_x="": a tag
    without a value, not a broken point."""
    batch = decode_reference(request("kube_pod_labels", {"namespace": "ml", "pod": "a", "label_team": ""}), Interner(), now_ns=T)
    assert len(batch) == 1 and not batch.rejected
