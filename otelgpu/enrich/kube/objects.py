"""Kubernetes API objects (JSON as the API serves them) into the compact facts the join reads.

Only the fields otelgpu uses are kept, so memory stays bounded whatever the objects carry:
labels the tag rules or node pricing read, annotations the tag rules name, container requests,
phase, node, controlling owner. Keys take kube-state-metrics' form, so facts from either
source compare equal.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Collection, Mapping, Optional

from kubernetes.utils.quantity import parse_quantity

from otelgpu.enrich.labels import NODE_LABELS, ksm_annotation_name, ksm_label_name, ksm_resource_name
from otelgpu.enrich.model import (ClaimFacts, DraDevice, NamespaceFacts, NodeFacts, OwnerFacts, PodFacts, SliceFacts,
                                  shared_map)

Obj = Mapping[str, Any]


def quantity(value: object) -> float:
    """`500m` -> 0.5, `8Gi` -> 8589934592.0. Raises ValueError on a malformed quantity."""
    return float(parse_quantity(value))


def _kept(mapping: Optional[Mapping[str, str]], name: Any, keep: Collection[str],
          prefixes: tuple[str, ...] = ()) -> dict[str, str]:
    out = {}
    for key, value in (mapping or {}).items():
        kept = name(key)
        if kept in keep or (prefixes and kept.startswith(prefixes)):
            out[kept] = str(value)
    return out


def meta(obj: Obj) -> Obj:
    return obj.get("metadata") or {}


def controller(obj: Obj) -> tuple[str, str]:
    """(kind, name) of the controlling owner reference; ("", "") when there is none."""
    refs = meta(obj).get("ownerReferences") or []
    ref = next((r for r in refs if r.get("controller")), None)
    return (ref.get("kind", ""), ref.get("name", "")) if ref else ("", "")


def pod_facts(obj: Obj, label_keys: Collection[str], annotation_keys: Collection[str], now_ns: int,
              label_prefixes: tuple[str, ...] = (), annotation_prefixes: tuple[str, ...] = ()) -> PodFacts:
    """`*_prefixes`: keys kept by their beginning as well (in kube-state-metrics' form)."""
    metadata, spec, status = meta(obj), obj.get("spec") or {}, obj.get("status") or {}
    requests: dict[tuple[str, str], float] = {}
    for container in spec.get("containers") or []:
        for resource, qty in ((container.get("resources") or {}).get("requests") or {}).items():
            requests[(container.get("name", ""), ksm_resource_name(resource))] = quantity(qty)
    kind, name = controller(obj)
    return PodFacts(
        uid=metadata.get("uid", ""), node=spec.get("nodeName") or "", phase=status.get("phase") or "",
        labels=shared_map(_kept(metadata.get("labels"), ksm_label_name, label_keys, label_prefixes)),
        requests=shared_map(requests), owner_kind=kind, owner_name=name, seen_ns=now_ns,
        annotations=shared_map(_kept(metadata.get("annotations"), ksm_annotation_name, annotation_keys,
                                     annotation_prefixes)),
        created_ns=timestamp_ns(metadata.get("creationTimestamp")),
    )


def timestamp_ns(value: Optional[str]) -> int:
    """RFC 3339 `2026-11-21T10:00:00Z` -> ns since the epoch; 0 when absent or malformed."""
    if not value:
        return 0
    try:
        return int(datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()) * 1_000_000_000
    except ValueError:
        return 0


def node_facts(obj: Obj, now_ns: int) -> NodeFacts:
    capacity = (obj.get("status") or {}).get("capacity") or {}
    return NodeFacts(labels=_kept(meta(obj).get("labels"), ksm_label_name, NODE_LABELS),
                     capacity={ksm_resource_name(k): quantity(v) for k, v in capacity.items()}, seen_ns=now_ns,
                     provider_id=str((obj.get("spec") or {}).get("providerID") or ""))


def namespace_facts(obj: Obj, label_keys: Collection[str], now_ns: int) -> NamespaceFacts:
    return NamespaceFacts(labels=_kept(meta(obj).get("labels"), ksm_label_name, label_keys), seen_ns=now_ns)


def claim_facts(obj: Obj, now_ns: int) -> ClaimFacts:
    """A ResourceClaim's allocated devices (`status.allocation.devices.results`; an admin-access
    result, a monitoring tool's view of a device in use, holds nothing) and the pods it is
    reserved for (`status.reservedFor`)."""
    status = obj.get("status") or {}
    results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
    devices = tuple((str(r.get("driver", "")), str(r.get("pool", "")), str(r.get("device", ""))) for r in results
                    if not r.get("adminAccess"))
    pods = tuple(str(r.get("name", "")) for r in status.get("reservedFor") or []
                 if r.get("resource") == "pods" and not r.get("apiGroup"))
    return ClaimFacts(devices, pods, now_ns)


def _attribute(attributes: Mapping[str, Any], driver: str, name: str) -> str:
    """A device attribute's string value, named bare or qualified by the driver's domain."""
    value = attributes.get(name) or attributes.get(f"{driver}/{name}") or {}
    return str(value.get("string", "")) if isinstance(value, Mapping) else ""


def slice_facts(obj: Obj, now_ns: int) -> SliceFacts:
    """A ResourceSlice's GPU and MIG devices: those with an NVML `uuid` attribute."""
    spec = obj.get("spec") or {}
    driver, pool = str(spec.get("driver", "")), str((spec.get("pool") or {}).get("name", ""))
    devices: dict[tuple[str, str, str], DraDevice] = {}
    for device in spec.get("devices") or []:
        attributes = device.get("attributes") or {}
        uuid = _attribute(attributes, driver, "uuid")
        if uuid.startswith(("GPU-", "MIG-")):
            devices[(driver, pool, str(device.get("name", "")))] = DraDevice(
                uuid, _attribute(attributes, driver, "parentUUID"), _attribute(attributes, driver, "profile"))
    return SliceFacts(str(spec.get("nodeName") or ""), devices, now_ns)


def owner_facts(obj: Obj, now_ns: int) -> OwnerFacts:
    kind, name = controller(obj)
    return OwnerFacts(kind, name, now_ns)
