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
    held_rows = np.flatnonzero(held.holder_pod >= 0)
    entity = held.entity[held_rows]
    holder_of, first = group_ids(held.holder_ns[held_rows], held.holder_pod[held_rows])
    st = scope.string
    table = np.array([scope.holders.index((st(n), st(p))) for n, p in
                      zip(held.holder_ns[held_rows][first].tolist(), held.holder_pod[held_rows][first].tolist())],
                     np.int64)
    holder = table[holder_of] if len(held_rows) else np.zeros(0, np.int64)
    fraction, unit_kind = units.fraction[entity].copy(), units.kind[entity].copy()
    basis = np.full(len(held_rows), DEVICE, np.int8)
    mean = held.mean_activity[held_rows]
    sh = np.flatnonzero(units.shared[entity])
    if len(sh):
        per_holder = np.bincount(holder)[holder[sh]]  # units each holder holds
        replicas = held.replicas[held_rows][sh].astype(np.int64)
        ask = np.flatnonzero(replicas == 0)
        if len(ask):
            which, first = group_ids(holder[sh][ask], per_holder[ask])
            asked = [_requested_replicas(scope, scope.holders.values[h], n)
                     for h, n in zip(holder[sh][ask][first].tolist(), per_holder[ask][first].tolist())]
            replicas[ask] = np.array(asked, np.int64)[which]
        pods_per_ent = np.bincount(held.entity[held.holder_pod >= 0], minlength=len(units.shared))
        node_r = units.node_replicas[entity[sh]]
        sharers = np.where(node_r > 1, node_r, np.maximum(pods_per_ent[entity[sh]], 1))
        fraction[sh] = fraction[sh] * np.minimum(replicas, sharers) / sharers
        unit_kind[sh] = REPLICA
        basis[sh] = np.where(held.per_pod_activity[held_rows[sh]], PER_POD, EQUAL_SPLIT)
        means = mean[sh]
        with np.errstate(invalid="ignore", divide="ignore"):
            mean[sh] = np.where((fraction[sh] > 0) & ~np.isnan(means), np.minimum(means / fraction[sh], 1.0), means)
    basis[np.isnan(mean)] = UNMEASURED
    return Rows.of(units.gpu[entity], fraction, np.minimum(held.held_s[held_rows] / scope.seconds, 1.0),
                   held.measured_share[held_rows], mean,
                   holder, unit_kind, units.profile[entity], POD, basis)


def _requested_replicas(scope: Scope, holder: PodKey, n_gpus: int) -> int:
    pod = scope.pod(holder)
    if pod is None:
        return 1
    replicas = sum(pod.requested(r) for r in GPU_RESOURCES)
    return max(int(round(replicas / max(n_gpus, 1))), 1)


def unheld_rows(scope: Scope, units: Reported, devices: DeviceMemory, taken: Container[tuple[str, str]],
                sharing: Container[PodKey]) -> Rows:
    """Place kube-state-metrics claims on unheld units; book active unheld units; the rest is
    idle. `taken`: the (node, GPU UUID)s that grants or DRA claims give out (they take no
    request: they are theirs); `sharing`: the pods that hold through grants."""
    held, entities = units.tenures, units.entities
    claims, dark_claims = _requests(scope, units, sharing)
    # Unheld replicas are idle: claims on shared GPUs are not placed (no unit identity).
    unheld = np.flatnonzero((held.holder_pod < 0) & ~units.shared[held.entity])
    entity = held.entity[unheld]
    share, mean = np.minimum(held.held_s[unheld] / scope.seconds, 1.0), held.mean_activity[unheld]
    with np.errstate(invalid="ignore"):
        active = mean > ACTIVE_WITHOUT_POD  # False where NaN (unmeasured)
    # Which pod a claim or a dark unit goes to is decided unit by unit, in order; the other
    # units are booked active_without_pod where active, and are idle otherwise.
    claimed = np.array(sorted({scope.strings.find(node) for node, _ in claims}), np.int64)
    slow = (held.holder_pod[unheld] == DARK) | np.isin(entities.node[entity], claimed)
    fast = np.flatnonzero(~slow & active)
    parts = [Rows.of(units.gpu[entity[fast]], units.fraction[entity[fast]], share[fast],
                     held.measured_share[unheld[fast]],
                     mean[fast], NOBODY, units.kind[entity[fast]], units.profile[entity[fast]], ACTIVE, DEVICE)]
    at = [fast]
    placed = [_placed(scope, units, devices, taken, claims, dark_claims, int(entity[x]), int(unheld[x]),
                      bool(active[x]), x,
                      mean[x]) for x in np.flatnonzero(slow).tolist()]
    placed = [row for row in placed if row is not None]
    if placed:
        placed_row, unit, measured, activity, holder, attribution, basis = (np.array(c) for c in zip(*placed))
        parts.append(Rows.of(units.gpu[unit], units.fraction[unit], share[placed_row], measured, activity, holder,
                             units.kind[unit],
                             units.profile[unit], attribution, basis))
        at.append(placed_row)
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
