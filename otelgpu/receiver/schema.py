"""The series otelgpu consumes, and what each must carry. Everything else is ignored cheaply."""

from __future__ import annotations

import re
from enum import IntEnum


class Metric(IntEnum):
    """Codes of the consumed metrics; order is part of no wire format."""

    GR_ENGINE_ACTIVE = 0
    GPU_UTIL = 1
    FB_USED = 2
    FB_FREE = 3
    POWER_USAGE = 4
    ENERGY = 5
    NODE_INFO = 9  # the first of kube-state-metrics' (is_ksm)
    POD_LABELS = 10
    NAMESPACE_LABELS = 11
    POD_REQUESTS = 12
    POD_INFO = 13
    POD_PHASE = 14
    NODE_LABELS = 15
    NODE_CAPACITY = 16
    POD_ANNOTATIONS = 17
    REPLICASET_OWNER = 18
    JOB_OWNER = 19
    CPU_USAGE = 20
    MEMORY_WORKING_SET = 21
    PROMPT_TOKENS = 30
    GENERATION_TOKENS = 31


# Units DCGM fields are sent in, as multiples of one base unit per quantity (a 0..1 ratio, bytes,
# watts, joules). A field's unit is the one its definition in DCGM's dcgm_fields.h gives, not the
# one its name suggests: DCGM 4.6 renamed field 203 DCGM_FI_DEV_GPU_UTIL_RATIO and still fills it
# with NVML's 0..100 percentage.
UNIT_FACTOR = {"1": 1.0, "%": 0.01, "MiB": 2.0**20, "W": 1.0, "mJ": 1e-3, "J": 1.0}

# Each consumed DCGM field under every name DCGM gives it, with the unit it is sent in.
# dcgm-exporter names a series as its counters CSV names the field: DCGM 4.6 renamed fields and
# keeps the old names as aliases, so a cluster may send either name, or both during a change of
# CSV. DCGM 4.6.1 added the energy in joules as a field of its own. The first name of each metric
# names it in rejection reasons.
DCGM_FIELDS: dict[str, tuple[Metric, str]] = {
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": (Metric.GR_ENGINE_ACTIVE, "1"),
    "DCGM_FI_DEV_GPU_UTIL": (Metric.GPU_UTIL, "%"),
    "DCGM_FI_DEV_FB_USED": (Metric.FB_USED, "MiB"),
    "DCGM_FI_DEV_FB_FREE": (Metric.FB_FREE, "MiB"),
    "DCGM_FI_DEV_POWER_USAGE": (Metric.POWER_USAGE, "W"),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": (Metric.ENERGY, "mJ"),
    "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO": (Metric.GR_ENGINE_ACTIVE, "1"),  # 4.6: field 1001 renamed
    "DCGM_FI_DEV_GPU_UTIL_RATIO": (Metric.GPU_UTIL, "%"),  # 4.6: field 203 renamed, still a percentage
    "DCGM_FI_DEV_BOARD_POWER_WATTS": (Metric.POWER_USAGE, "W"),  # 4.6: field 155 renamed
    "DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL": (Metric.ENERGY, "J"),  # 4.6.1: field 1611, new
}
DCGM_METRICS = {name: metric for name, (metric, _) in DCGM_FIELDS.items()}
# The unit each metric is stored in: a point's value is converted to it whatever name it came under,
# so that activity, and with it effective cost, does not depend on the spelling.
STORED_UNIT = {Metric.GR_ENGINE_ACTIVE: "1", Metric.GPU_UTIL: "%", Metric.FB_USED: "MiB", Metric.FB_FREE: "MiB",
               Metric.POWER_USAGE: "W", Metric.ENERGY: "mJ"}
# The factor that converts a value sent under each name to its metric's stored unit (1 for most).
TO_STORED_UNIT = {name: UNIT_FACTOR[unit] / UNIT_FACTOR[STORED_UNIT[metric]]
                  for name, (metric, unit) in DCGM_FIELDS.items()}

KSM_METRICS = {
    "kube_pod_labels": Metric.POD_LABELS,
    "kube_namespace_labels": Metric.NAMESPACE_LABELS,
    "kube_pod_container_resource_requests": Metric.POD_REQUESTS,
    "kube_pod_info": Metric.POD_INFO,
    "kube_pod_status_phase": Metric.POD_PHASE,
    "kube_node_info": Metric.NODE_INFO,
    "kube_node_labels": Metric.NODE_LABELS,
    "kube_node_status_capacity": Metric.NODE_CAPACITY,
    "kube_pod_annotations": Metric.POD_ANNOTATIONS,
    "kube_replicaset_owner": Metric.REPLICASET_OWNER,
    "kube_job_owner": Metric.JOB_OWNER,
}

# kubelet/cAdvisor (/metrics/cadvisor) or kubelet /metrics/resource: per-container CPU and memory
# use, which the scad model charges where it exceeds the request.
CADVISOR_METRICS = {
    "container_cpu_usage_seconds_total": Metric.CPU_USAGE,
    "container_memory_working_set_bytes": Metric.MEMORY_WORKING_SET,
}

# vLLM's token counters (V1 PrometheusStatLogger, labels model_name and engine), by which the cost
# of a serving pod is split among its tenants. The pod is the scrape target's own (the resource's
# k8s.namespace.name and k8s.pod.name, from service discovery), never a label of the point.
VLLM_METRICS = {
    "vllm:prompt_tokens_total": Metric.PROMPT_TOKENS,
    "vllm:generation_tokens_total": Metric.GENERATION_TOKENS,
    # The same, scraped as OpenMetrics with underscore escaping (prometheus_client writes the colon
    # of a sample's name as `_` there)
    "vllm_prompt_tokens_total": Metric.PROMPT_TOKENS,
    "vllm_generation_tokens_total": Metric.GENERATION_TOKENS,
}
# Metrics whose points belong to the pod that exposes them: the decoders give each point the
# `namespace` and `pod` labels of its resource, in place of any it carries.
OWN_POD_METRICS = frozenset(VLLM_METRICS.values())

KNOWN_METRICS = {**DCGM_METRICS, **KSM_METRICS, **CADVISOR_METRICS, **VLLM_METRICS}
# A failed scrape still sends `up` (0) with the scrape's time: it moves the source's clock on, so
# intervals close while a target is down.
LIVENESS_METRIC = "up"
# Every metric name otelgpu reads: collector-config's filter/otelgpu forwards these and no other.
READ_NAMES = frozenset(KNOWN_METRICS) | {LIVENESS_METRIC}
# Each code's name in rejection reasons: its first name (vLLM's, not the escaped one)
METRIC_NAME: dict[int, str] = {}
for _name, _code in KNOWN_METRICS.items():
    METRIC_NAME.setdefault(int(_code), _name)


def is_dcgm(metric):  # noqa: ANN001, ANN201 - numpy array or int
    return metric <= Metric.ENERGY


def is_ksm(metric):  # noqa: ANN001, ANN201 - numpy array or int
    return (metric >= Metric.NODE_INFO) & (metric <= Metric.JOB_OWNER)

# Labels a point must carry to be usable; a point without them is rejected with this reason.
REQUIRED_LABELS: dict[Metric, tuple[str, ...]] = {
    **{m: ("UUID",) for m in DCGM_METRICS.values()},
    Metric.POD_LABELS: ("namespace", "pod"),
    Metric.NAMESPACE_LABELS: ("namespace",),
    Metric.POD_REQUESTS: ("namespace", "pod", "resource"),
    Metric.POD_INFO: ("namespace", "pod"),
    Metric.POD_PHASE: ("namespace", "pod", "phase"),
    Metric.NODE_INFO: ("node",),
    Metric.NODE_LABELS: ("node",),
    Metric.NODE_CAPACITY: ("node", "resource"),
    Metric.POD_ANNOTATIONS: ("namespace", "pod"),
    Metric.REPLICASET_OWNER: ("namespace", "replicaset", "owner_kind", "owner_name"),
    Metric.JOB_OWNER: ("namespace", "job_name", "owner_kind", "owner_name"),
    # cAdvisor series without namespace/pod/container are cgroups above containers (node, pod,
    # system slices): not rejected, just not container use (enrich/usage.py skips them).
    Metric.CPU_USAGE: (),
    Metric.MEMORY_WORKING_SET: (),
    Metric.PROMPT_TOKENS: ("model_name",),
    Metric.GENERATION_TOKENS: ("model_name",),
}
REQUIRED_KEYS = tuple(sorted({k for keys in REQUIRED_LABELS.values() for k in keys}))

# Valid value ranges, in each metric's stored unit (values are converted first). GR_ENGINE_ACTIVE is
# a 0..1 ratio and GPU_UTIL a 0..100 percentage: a ratio above 1 is a percentage sent where a ratio
# belongs, and is refused rather than read as 100 times the activity. The rest are bounds no real
# cluster reaches, so that one absurd point is rejected instead of turning into a billion GPUs or an
# infinite cost. Info-style series (labels, phase) are 0 or 1.
HUGE = 1e15
VALUE_RANGE: dict[Metric, tuple[float, float]] = {
    Metric.GR_ENGINE_ACTIVE: (0.0, 1.0 + 1e-6),
    Metric.GPU_UTIL: (0.0, 100.0 + 1e-6),
    Metric.FB_USED: (0.0, HUGE),
    Metric.FB_FREE: (0.0, HUGE),
    Metric.POWER_USAGE: (0.0, 1e6),
    Metric.ENERGY: (0.0, 1e18),
    Metric.POD_LABELS: (0.0, 1.0),
    Metric.NAMESPACE_LABELS: (0.0, 1.0),
    Metric.POD_INFO: (0.0, 1.0),
    Metric.POD_PHASE: (0.0, 1.0),
    Metric.NODE_INFO: (0.0, 1.0),
    Metric.NODE_LABELS: (0.0, 1.0),
    Metric.POD_ANNOTATIONS: (0.0, 1.0),
    Metric.REPLICASET_OWNER: (0.0, 1.0),
    Metric.JOB_OWNER: (0.0, 1.0),
    Metric.CPU_USAGE: (0.0, HUGE),  # core-seconds: a year of 10,000 cores is 3e11
    Metric.MEMORY_WORKING_SET: (0.0, HUGE),  # bytes: 1 PB
    Metric.PROMPT_TOKENS: (0.0, HUGE),  # a million tokens a second for thirty years is 1e15
    Metric.GENERATION_TOKENS: (0.0, HUGE),
}

# Requests and capacities by kube-state-metrics resource (`nvidia.com/gpu` written `nvidia_com_gpu`).
# GPU units (GPUs, time-slicing replicas, MIG instances) are whole numbers: a node has at most a few
# dozen GPUs, times time-slicing replicas. Cores and bytes stay below any machine's size.
GPU_RESOURCES = ("nvidia_com_gpu", "nvidia_com_gpu_shared")
MIG_PREFIX = "nvidia_com_mig_"
MAX_GPU_UNITS = 4096
MAX_CORES = 100_000.0
MAX_BYTES = HUGE
MAX_OTHER = 1e18
# HAMi's own resources (Project-HAMi/HAMi charts/hami/values.yaml), each a whole number in its own
# unit, not a count of GPUs: the memory a pod asks of each GPU in MiB (HAMi refuses more than an
# int32), and its share of each GPU's memory and cores in percent. otelgpu prices HAMi's grants
# from the pod's hami.io/vgpu-devices-allocated annotation, not from these.
HAMI_RESOURCES = {"nvidia_com_gpumem": 2**31 - 1, "nvidia_com_gpumem_percentage": 100, "nvidia_com_gpucores": 100}


# Labels whose values otelgpu turns into numbers or slice sizes, with their sane forms. A node has at
# most a few dozen GPUs (the largest HGX boards have 16), a time-sliced GPU a few dozen replicas, a
# MIG-capable GPU at most 7 compute slices and instance ids below 32.
MAX_GPUS_PER_NODE = 64
MAX_REPLICAS = 128
MAX_MIG_INSTANCE_ID = 31
_MIG_PROFILE = re.compile(r"[1-7]g\.[0-9]{1,4}gb([+-][a-z][a-z.]{0,15})*\Z")  # 1g.10gb, 1g.10gb+me, 1g.24gb-me


def small_int(value: str, lo: int, hi: int) -> int | None:
    """`value` as a plain decimal integer in [lo, hi], else None (signs, spaces, non-ASCII digits
    and 20-digit numbers are not GPU counts)."""
    if not (value.isascii() and value.isdigit() and len(value) <= 6):
        return None
    number = int(value)
    return number if lo <= number <= hi else None


def gpu_count_label(value: str) -> int | None:
    """GFD's nvidia.com/gpu.count, if sane."""
    return small_int(value, 0, MAX_GPUS_PER_NODE)


def replicas_label(value: str) -> int | None:
    """The device plugin's nvidia.com/gpu.replicas (time-slicing), if sane."""
    return small_int(value, 1, MAX_REPLICAS)


def _bounded(parse, what: str):  # noqa: ANN001, ANN202 - a label check from a parser
    return lambda value: "" if parse(value) is not None else what


# Label key -> check of its value: "" when usable, else why not (the rejection reason).
LABEL_CHECKS = {
    "GPU_I_ID": _bounded(lambda v: small_int(v, 0, MAX_MIG_INSTANCE_ID), f"GPU_I_ID not in 0..{MAX_MIG_INSTANCE_ID}"),
    "GPU_I_PROFILE": _bounded(_MIG_PROFILE.match, "GPU_I_PROFILE not a MIG profile"),
    "label_nvidia_com_gpu_count": _bounded(gpu_count_label, f"nvidia.com/gpu.count not in 0..{MAX_GPUS_PER_NODE}"),
    "label_nvidia_com_gpu_replicas": _bounded(replicas_label, f"nvidia.com/gpu.replicas not in 1..{MAX_REPLICAS}"),
}


def quantity_bounds(resource: str) -> tuple[float, float, bool]:
    """(lowest, highest, whole numbers only) for a request or capacity of `resource`. An extended
    resource otelgpu does not know is bounded as any other quantity, not as a count of GPUs."""
    if resource in GPU_RESOURCES or resource.startswith(MIG_PREFIX):
        return 0.0, MAX_GPU_UNITS, True
    if resource in HAMI_RESOURCES:
        return 0.0, float(HAMI_RESOURCES[resource]), True
    return 0.0, MAX_CORES if resource == "cpu" else MAX_BYTES if resource == "memory" else MAX_OTHER, False


def quantity_problem(resource: str, value: float) -> str:
    """Why a request or capacity of `resource` cannot be used ("" when it can)."""
    lo, hi, whole = quantity_bounds(resource)
    if whole:
        if value != int(value) or not lo <= value <= hi:
            return f"{resource} not a whole number in [{lo:.0f}, {hi:.0f}]"
        return ""
    if not lo <= value <= hi:
        return f"{resource} outside [{lo:g}, {hi:g}]"
    return ""


# Activity values with these metrics describe the device, not the slice: never sum them across MIG instances.
DEVICE_WIDE = frozenset({Metric.POWER_USAGE, Metric.ENERGY})
