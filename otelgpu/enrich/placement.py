"""Who holds each unit DCGM reported. A holder named by DCGM is the pod that holds the unit.
Where DCGM names nobody, a Running pod that kube-state-metrics says requests that kind of unit
on that node (and that DCGM shows nowhere) is placed on it, attributed `ksm_request` with
activity unmeasured; a unit nobody holds but that shows activity is booked
`active_without_pod`; the rest is idle. While a unit's exporter is dark, the pod that held it
last holds it if it still runs."""

from __future__ import annotations

from typing import Container

import numpy as np

from otelgpu.core.grouping import group_ids
from otelgpu.enrich.devices import DeviceMemory
from otelgpu.enrich.holdings import (ACTIVE, DEVICE, EQUAL_SPLIT, GPU, KSM_REQUEST, MIG, NOBODY, PER_POD, POD,
                                     REPLICA, UNMEASURED)
from otelgpu.enrich.nodes import mig_resource
from otelgpu.enrich.reported import Reported, Rows
from otelgpu.enrich.scope import PodKey, Scope
from otelgpu.enrich.timeline import DARK
from otelgpu.receiver.schema import GPU_RESOURCES

ACTIVE_WITHOUT_POD = 0.01  # mean activity above which an unheld unit is in use by someone


def holder_rows(scope: Scope, units: Reported) -> Rows:
    """The units DCGM shows held by a pod. On a shared (time-sliced) GPU a holder holds the
    replicas DCGM counts for it (else as many as its requests ask per GPU it holds), of the
    node's replicas (else of the pods sharing the GPU); its activity is per replica."""
    held = units.tenures
    i = np.flatnonzero(held.holder_pod >= 0)
    e = held.entity[i]
    holder_of, first = group_ids(held.holder_ns[i], held.holder_pod[i])
    st = scope.string
    table = np.array([scope.holders.index((st(n), st(p))) for n, p in
                      zip(held.holder_ns[i][first].tolist(), held.holder_pod[i][first].tolist())], np.int64)
    holder = table[holder_of] if len(i) else np.zeros(0, np.int64)
    f, unit_kind = units.fraction[e].copy(), units.kind[e].copy()
    basis = np.full(len(i), DEVICE, np.int8)
    mean = held.mean_activity[i]
    sh = np.flatnonzero(units.shared[e])
    if len(sh):
        per_holder = np.bincount(holder)[holder[sh]]  # units each holder holds
        k = held.replicas[i][sh].astype(np.int64)
        ask = np.flatnonzero(k == 0)
        if len(ask):
            which, first = group_ids(holder[sh][ask], per_holder[ask])
            asked = [_requested_replicas(scope, scope.holders.values[h], n)
                     for h, n in zip(holder[sh][ask][first].tolist(), per_holder[ask][first].tolist())]
            k[ask] = np.array(asked, np.int64)[which]
        pods_per_ent = np.bincount(held.entity[held.holder_pod >= 0], minlength=len(units.shared))
        node_r = units.node_replicas[e[sh]]
        r = np.where(node_r > 1, node_r, np.maximum(pods_per_ent[e[sh]], 1))
        f[sh] = f[sh] * np.minimum(k, r) / r
        unit_kind[sh] = REPLICA
        basis[sh] = np.where(held.per_pod_activity[i[sh]], PER_POD, EQUAL_SPLIT)
        m = mean[sh]
        with np.errstate(invalid="ignore", divide="ignore"):
            mean[sh] = np.where((f[sh] > 0) & ~np.isnan(m), np.minimum(m / f[sh], 1.0), m)
    basis[np.isnan(mean)] = UNMEASURED
    return Rows.of(units.gpu[e], f, np.minimum(held.held_s[i] / scope.seconds, 1.0), held.measured_share[i], mean,
                   holder, unit_kind, units.profile[e], POD, basis)


def _requested_replicas(scope: Scope, holder: PodKey, n_gpus: int) -> int:
    pod = scope.pod(holder)
    if pod is None:
        return 1
    k = sum(pod.requested(r) for r in GPU_RESOURCES)
    return max(int(round(k / max(n_gpus, 1))), 1)


def unheld_rows(scope: Scope, units: Reported, devices: DeviceMemory, taken: Container[tuple[str, str]],
                sharing: Container[PodKey]) -> Rows:
    """Place kube-state-metrics claims on unheld units; book active unheld units; the rest is
    idle. `taken`: the (node, GPU UUID)s that grants or DRA claims give out (they take no
    request: they are theirs); `sharing`: the pods that hold through grants."""
    held, entities = units.tenures, units.entities
    claims, dark_claims = _requests(scope, units, sharing)
    # Unheld replicas are idle: claims on shared GPUs are not placed (no unit identity).
    i = np.flatnonzero((held.holder_pod < 0) & ~units.shared[held.entity])
    e = held.entity[i]
    share, mean = np.minimum(held.held_s[i] / scope.seconds, 1.0), held.mean_activity[i]
    with np.errstate(invalid="ignore"):
        active = mean > ACTIVE_WITHOUT_POD  # False where NaN (unmeasured)
    # Which pod a claim or a dark unit goes to is decided unit by unit, in order; the other
    # units are booked active_without_pod where active, and are idle otherwise.
    claimed = np.array(sorted({scope.strings.find(node) for node, _ in claims}), np.int64)
    slow = (held.holder_pod[i] == DARK) | np.isin(entities.node[e], claimed)
    fast = np.flatnonzero(~slow & active)
    parts = [Rows.of(units.gpu[e[fast]], units.fraction[e[fast]], share[fast], held.measured_share[i[fast]],
                     mean[fast], NOBODY, units.kind[e[fast]], units.profile[e[fast]], ACTIVE, DEVICE)]
    at = [fast]
    placed = [_placed(scope, units, devices, taken, claims, dark_claims, int(e[x]), int(i[x]), bool(active[x]), x,
                      mean[x]) for x in np.flatnonzero(slow).tolist()]
    placed = [row for row in placed if row is not None]
    if placed:
        x, u, measured, activity, holder, attribution, basis = (np.array(c) for c in zip(*placed))
        parts.append(Rows.of(units.gpu[u], units.fraction[u], share[x], measured, activity, holder, units.kind[u],
                             units.profile[u], attribution, basis))
        at.append(x)
    return Rows.concat(parts).take(np.argsort(np.concatenate(at), kind="stable"))


Queues = dict[tuple[str, str], list[PodKey]]  # (node, resource) -> pods, one per unit requested


def _requests(scope: Scope, units: Reported, sharing: Container[PodKey]) -> tuple[Queues, Queues]:
    """The Running pods' GPU requests, as queues per node and resource: those that may be placed
    on units DCGM shows nobody on, and those that may hold units while DCGM is dark."""
    held = units.tenures
    shown = set(scope.holders.values)  # the pods DCGM shows holding a unit
    # Where dcgm-exporter maps devices to pods on a node, it is the authority there: a pod it
    # does not show holds nothing (it ended, or has not started). Claims fill in only on nodes
    # whose exporter maps no pods at all (pod mapping off or broken).
    mapped = {scope.string(c) for c in np.unique(units.entities.node[held.entity[held.holder_pod >= 0]]).tolist()}
    claims: Queues = {}
    dark_claims: Queues = {}  # the same for time DCGM went dark
    for node, key, resource, qty in scope.gpu_requests(sharing):
        if node not in mapped:
            claims.setdefault((node, resource), []).extend([key] * qty)
        if key not in shown:
            dark_claims.setdefault((node, resource), []).extend([key] * qty)
    return claims, dark_claims


def _placed(scope: Scope, units: Reported, devices: DeviceMemory, taken: Container[tuple[str, str]], claims: Queues,
            dark_claims: Queues, unit: int, tenure: int, active: bool, row: int, mean: float) -> tuple | None:
    """The row of unheld unit `u` (tenure `tenure`, row `x`): a claim's pod or a dark unit's
    holder (`ksm_request`, unmeasured), else nobody where it is active; None: idle."""
    st, entities, held = scope.string, units.entities, units.tenures
    node, uuid = st(int(entities.node[unit])), st(int(entities.uuid[unit]))
    prof = scope.profiles.values[units.profile[unit]]
    single = units.node_infos[units.node[unit]].mig_strategy == "single"
    resource = mig_resource(prof) if units.kind[unit] == MIG and not single else "nvidia_com_gpu"
    # A GPU that grants or DRA claims give out takes no request: it is theirs.
    is_taken = units.kind[unit] == GPU and (node, uuid) in taken
    if held.holder_pod[tenure] == DARK:
        holder = _dark_holder(scope, devices, node, uuid, st(int(entities.gi[unit])),
                              None if is_taken else dark_claims.get((node, resource)))
        return None if holder is None else (row, unit, 0.0, np.nan, scope.holders.index(holder), KSM_REQUEST,
                                            UNMEASURED)
    queue = None if is_taken else claims.get((node, resource))
    if queue:
        return row, unit, 0.0, np.nan, scope.holders.index(queue.pop(0)), KSM_REQUEST, UNMEASURED
    if active:
        return row, unit, held.measured_share[tenure], mean, NOBODY, ACTIVE, DEVICE
    return None


def _dark_holder(scope: Scope, devices: DeviceMemory, node: str, uuid: str, gi: str,
                 queue: list[PodKey] | None) -> PodKey | None:
    """Who holds a unit while its exporter is dark: the pod that held it last, if it is still
    Running, else a Running pod of the node that requests that kind of unit; else nobody."""
    last = devices.last_holder(node, uuid, gi)
    pod = scope.pod(last) if last is not None else None
    if last is not None and pod is not None and pod.phase == "Running" and not pod.deleted and not scope.gone(pod):
        if queue and last in queue:
            queue.remove(last)
        return last
    return queue.pop(0) if queue else None
