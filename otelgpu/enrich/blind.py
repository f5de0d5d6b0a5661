"""GPUs kube-state-metrics counts (GFD's nvidia.com/gpu.count) but DCGM did not report in the
interval: they still cost money. A node with no DCGM series at all (exporter down, scrape lost)
gets its Running pods' GPU requests, and the GPUs its grants name, placed on them (attribution
`ksm_request`, activity unmeasured); GPUs missing from a node that does report (fallen off the
bus, say) are idle."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from otelgpu.core.catalog import gpu_model_key
from otelgpu.core.grouping import Numbering
from otelgpu.enrich.claims import Claims
from otelgpu.enrich.holdings import FRACTION, GPU, KSM_REQUEST, MIG, REPLICA, UNMEASURED
from otelgpu.enrich.labels import GPU_COUNT as GPU_COUNT_LABEL
from otelgpu.enrich.model import NodeFacts
from otelgpu.enrich.nodes import NodeInfo, gpu_count, node_info, profile_of_resource
from otelgpu.enrich.reported import Hardware, Rows
from otelgpu.enrich.scope import PodKey, Scope
from otelgpu.enrich.sharing import HAMI, model_memory_mib
from otelgpu.receiver.schema import MIG_PREFIX, gpu_count_label


@dataclass
class Gpus:
    """The interval's GPUs: each one's node (an index into `nodes`) and model (into `models`)."""

    node: np.ndarray  # int64
    model: np.ndarray  # int64
    nodes: list[tuple[str, NodeInfo]]
    models: Numbering[str]


def without_device_data(scope: Scope, claims: Claims, hardware: Hardware, gpus: Gpus) -> tuple[Gpus, Rows, int]:
    """`gpus` (those DCGM reported) with the GPUs it did not report appended, their rows, and how
    many GPUs had no device data."""
    seen = {name: n for n, (name, _) in enumerate(gpus.nodes)}
    reported = np.bincount(gpus.node, minlength=len(gpus.nodes))
    first = np.zeros(len(gpus.nodes), np.int64)
    reporting, first_gpu = np.unique(gpus.node, return_index=True)
    first[reporting] = first_gpu  # each node's first GPU
    extra_node: list[int] = []
    extra_model: list[int] = []
    rows: list[tuple] = []
    # HAMi advertises each GPU as several vGPUs: without GFD's count, a node's capacity overstates
    # its GPUs, and DCGM's count stands.
    hami_nodes = claims.sharing.nodes(HAMI)
    requests: dict[str, list[tuple[PodKey, str, int]]] = {}
    for node, key, resource, qty in scope.gpu_requests(claims.sharing.pods):
        requests.setdefault(node, []).append((key, resource, qty))
    granted: dict[str, set[str]] = {}
    for node, uuid in claims.sharing.claims:
        granted.setdefault(node, set()).add(uuid)
    nodes = list(gpus.nodes)
    for name, facts in scope.facts.nodes.items():
        info = node_info(facts)
        count, label = _gpus_of(facts, info, hardware)
        seen_gpus = seen.get(name)
        if seen_gpus is not None:
            missing = 0 if name in hami_nodes and label is None else max(count - int(reported[seen_gpus]), 0)
            extra_node += [seen_gpus] * missing
            extra_model += [int(gpus.model[first[seen_gpus]])] * missing
            continue
        if count == 0:
            continue
        model = info.gpu_product.split("-SHARED")[0].split("-MIG-")[0]  # GFD's product label
        model = hardware.spelling.get(gpu_model_key(model), model)
        seen_gpus = len(nodes)
        nodes.append((name, info))
        base = len(gpus.node) + len(extra_node)
        extra_node += [seen_gpus] * count
        extra_model += [gpus.models.index(model)] * count
        rows += _placed(scope, claims, hardware, name, info, model, count, base, requests.get(name, ()),
                        sorted(granted.get(name, ())))
    node = np.concatenate([gpus.node, np.array(extra_node, np.int64)]).astype(np.int64)
    model = np.concatenate([gpus.model, np.array(extra_model, np.int64)]).astype(np.int64)
    gpu, fraction, holder, unit_kind, profile, share = (list(c) for c in zip(*rows)) if rows else ([],) * 6
    return (Gpus(node, model, nodes, gpus.models),
            Rows.of(gpu, fraction, share, 0.0, np.nan, holder, unit_kind, profile, KSM_REQUEST, UNMEASURED),
            len(extra_node))


def _gpus_of(facts: NodeFacts, info: NodeInfo, hardware: Hardware) -> tuple[int, int | None]:
    """A node's GPUs as its facts count them, and GFD's count where it labels one."""
    count = gpu_count(facts, info)
    label = gpu_count_label(facts.labels.get(GPU_COUNT_LABEL, ""))
    catalog = hardware.catalog_gpus(info.instance_type)
    if label is None and catalog is not None and count > catalog:
        count = catalog  # advertised beyond the instance's GPUs: HAMi's vGPUs, not GPUs
    return count, label


def _placed(scope: Scope, claims: Claims, hardware: Hardware, name: str, info: NodeInfo, model: str, count: int,
            base: int, requests: list[tuple[PodKey, str, int]] | tuple, granted: list[str]) -> list[tuple]:
    """The rows of a node DCGM did not report: its Running pods' requests, then its grants (each
    GPU a grant names taking a GPU of its own), packed onto its `count` GPUs (the first is GPU
    `base`) in order; what does not fit is not placed (a GPU is never sold twice)."""
    rows: list[tuple] = []  # (gpu, fraction, holder, unit kind, profile, share)
    free = [1.0] * count
    for key, resource, qty in requests:
        fraction, unit_kind, profile = _unit_of_resource(hardware, resource, model, info)
        for _ in range(qty):
            gpu = next((i for i in range(count) if free[i] >= fraction - 1e-9), None)
            if gpu is None:
                break  # more requested than the node has
            free[gpu] -= fraction
            rows.append((base + gpu, fraction, scope.holders.index(key), unit_kind, scope.profiles.index(profile), 1.0))
    for uuid in granted:
        gpu = next((i for i in range(count) if free[i] >= 1 - 1e-9), None)  # a GPU of its own
        if gpu is None:
            break
        free[gpu] = 0.0
        fraction, holder, basis = claims.fractions(name, uuid, model_memory_mib(model))
        rows += [(base + gpu, x, h, FRACTION, b, scope.held_share(scope.holders.values[h], 1.0))
                 for x, h, b in zip(fraction.tolist(), holder.tolist(), basis.tolist())]
    return rows


def _unit_of_resource(hardware: Hardware, resource: str, model: str, info: NodeInfo) -> tuple[float, int, str]:
    """(fraction, unit kind, MIG profile) of one unit of a requested GPU resource."""
    if resource.startswith(MIG_PREFIX):
        profile = profile_of_resource(resource)
        return hardware.mig_fraction(model, profile), MIG, profile
    return (1.0 / info.replicas, REPLICA, "") if info.replicas > 1 else (1.0, GPU, "")
