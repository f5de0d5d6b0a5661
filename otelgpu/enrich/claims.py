"""Whole GPUs given out by claims rather than shown by DCGM: those that DRA ResourceClaims
allocate, and those that HAMi or KAI Scheduler share out in fractions (enrich/sharing.py), whose
pods hold those parts (`unit_kind="fraction"`) in place of the pod that reserves the GPU for
them. What DCGM shows stands (docs/cost-model.md section 11). Claims that hold nothing are
counted by reason (`problems`)."""

from __future__ import annotations

import numpy as np

from otelgpu.core.grouping import group_ids
from otelgpu.enrich.holdings import (BY_FRACTION, DEVICE, DRA_CLAIM, EQUAL_SPLIT, FRACTION, GPU, NOBODY, POD,
                                     REPLICA, UNMEASURED)
from otelgpu.enrich.labels import GPU_COUNT as GPU_COUNT_LABEL, MIG_STRATEGY
from otelgpu.enrich.nodes import node_info
from otelgpu.enrich.reported import Hardware, Reported, Rows, device_activity, rows_by_entity
from otelgpu.enrich.scope import PodKey, Scope
from otelgpu.enrich.sharing import HAMI, model_memory_mib, release, sharing_of
from otelgpu.receiver.schema import MIG_PREFIX, Metric, gpu_count_label

NOTHING_LEFT = 1e-9  # share of a GPU below which what its holders leave of it is rounding


class Claims:
    """The claims of one interval's facts: HAMi and KAI grants (`sharing`) and the whole GPUs
    DRA claims allocate, by (node, GPU UUID)."""

    def __init__(self, scope: Scope, hardware: Hardware) -> None:
        self.scope, self.hardware = scope, hardware
        self.sharing = sharing_of(scope.facts, scope.held)
        self.dra = self._dra_gpus() if scope.facts.claims else {}  # (node, GPU UUID) -> its claims' pods
        self._placed: set[tuple[str, str]] = set()  # the (node, GPU UUID)s whose grants hold fractions

    def __bool__(self) -> bool:
        return bool(self.sharing) or bool(self.dra)

    def taken(self) -> set[tuple[str, str]]:
        """The (node, GPU UUID)s that grants or DRA claims give out."""
        return set(self.sharing.claims) | set(self.dra)

    def _dra_gpus(self) -> dict[tuple[str, str], list[PodKey]]:
        """Per (node, GPU UUID): the pods that DRA claims allocating that whole GPU are reserved
        for and that ran in the interval. Admin-access results (monitoring) hold nothing. A claim
        device of a GPU driver that no ResourceSlice lists is counted."""
        facts = self.scope.facts
        index = {key: (s.node, device) for s in facts.slices.values() for key, device in s.devices.items()}
        drivers = {key[0] for key in index}
        out: dict[tuple[str, str], list[PodKey]] = {}
        for (namespace, _), claim in sorted(facts.claims.items()):
            pods = [(namespace, name) for name in claim.pods
                    if (pod := facts.pods.get((namespace, name))) is not None
                    and self.scope.held((namespace, name), pod)]
            for key in claim.devices if pods else ():
                found = index.get(key)
                if found is None:
                    if key[0] in drivers:
                        self.sharing.problems["DRA device not in its driver's ResourceSlices"] += len(pods)
                    continue
                node, device = found
                if device.parent_uuid:  # MIG devices: dcgm-exporter's DRA mapping names their pods
                    continue
                held_by = out.setdefault((node, device.uuid), [])
                held_by += [p for p in pods if p not in held_by]
        return out

    def admit_grants(self, units: Reported, whole: dict[tuple[str, str], int]) -> None:
        """Take back the grants HAMi or KAI cannot have made: HAMi's on nodes that advertise no
        vGPUs, and any naming a whole GPU its node reports no such thing as (their pods are then
        priced by their requests, counted)."""
        names = units.node_names
        reported = dict(zip(names, np.bincount(units.node[units.gpu_first], minlength=len(names)).tolist()))
        entities = units.entities
        mig = {self.scope.string(int(c)) for c in np.unique(entities.node[np.asarray(entities.gi) >= 0]).tolist()}
        claims = self.sharing.claims
        plain = {n for n in self.sharing.nodes(HAMI) if not self._advertises_vgpus(n, reported.get(n, 0), n in mig)}
        release(self.sharing, {c.pod for key, held in claims.items() if key[0] in plain
                               for c in held if c.scheduler == HAMI}, "HAMi grant on a node that advertises no vGPUs")
        release(self.sharing, {c.pod for key, held in claims.items() if key[0] in reported and key not in whole
                               for c in held}, "grant naming a GPU its node does not report")

    def _advertises_vgpus(self, node: str, reported: int, mig: bool) -> bool:
        """Whether a node advertises HAMi's vGPUs: at least twice as many `nvidia.com/gpu` as it has
        GPUs (GFD's count, else the more of those DCGM reports and the instance type's), with no
        time-slicing and no MIG (whose instances the single strategy advertises as GPUs)."""
        facts = self.scope.facts.nodes.get(node)
        if facts is None or mig or facts.labels.get(MIG_STRATEGY) == "single" \
                or any(r.startswith(MIG_PREFIX) for r in facts.capacity):
            return False
        info = node_info(facts)
        physical = gpu_count_label(facts.labels.get(GPU_COUNT_LABEL, "")) or \
            max(reported, self.hardware.catalog_gpus(info.instance_type) or 0)
        return info.replicas == 1 and physical > 0 and facts.capacity.get("nvidia_com_gpu", 0) >= 2 * physical

    def with_claims(self, rows: Rows, units: Reported, whole: dict[tuple[str, str], int]) -> Rows:
        """`rows` with the GPUs that DRA claims allocate and that grants share out held by them."""
        by_entity = rows_by_entity(units.tenures, len(units.entities.node))
        if self.dra:
            rows = self._with_dra_claims(rows, units, whole, by_entity)
        if self.sharing:
            rows = self._with_fractions(rows, units, whole, by_entity)
        return rows

    def _with_dra_claims(self, rows: Rows, units: Reported, whole: dict[tuple[str, str], int],
                         by_entity: list[np.ndarray]) -> Rows:
        """Whole GPUs that DRA ResourceClaims allocate, where dcgm-exporter shows no pod on them: the
        claim's pods hold them (`attribution="dra_claim"`) for the time they ran, a claim reserved
        for several pods split equally as replicas, in place of the rows of nobody. Where DCGM
        names a pod, it stands."""
        shown = units.shown()
        placed: dict[int, list[PodKey]] = {}
        for key, pods in self.dra.items():
            entity = whole.get(key)
            if entity is None:
                self.sharing.problems["DRA GPU not reported on its node"] += len(pods)
            elif not shown[entity]:
                placed[entity] = pods
        if not placed:
            return rows
        gpus = units.gpu[np.array(list(placed), np.int64)]
        out: list[tuple] = []  # (gpu, fraction, share, measured, activity, holder, kind, activity basis)
        for entity, pods in placed.items():
            gpu_share, measured, activity = device_activity(units.tenures, by_entity[entity], self.scope.seconds)
            n_pod = len(pods)
            how = UNMEASURED if np.isnan(activity) else (DEVICE if n_pod == 1 else EQUAL_SPLIT)
            out += [(int(units.gpu[entity]), 1.0 / n_pod, self.scope.held_share(p, gpu_share), measured, activity,
                     self.scope.holders.index(p), GPU if n_pod == 1 else REPLICA, how) for p in pods]
        gpu, fraction, share, measured, activity, holder, kind, how = (list(c) for c in zip(*out))
        rest = rows.take(np.flatnonzero(~(np.isin(rows.gpu, gpus) & (rows.holder == NOBODY))))
        return Rows.concat([rest, Rows.of(gpu, fraction, share, measured, activity, holder, kind, 0, DRA_CLAIM, how)])

    def _with_fractions(self, rows: Rows, units: Reported, whole: dict[tuple[str, str], int],
                        by_entity: list[np.ndarray]) -> Rows:
        """`rows` without the reservation pods' (they hold GPUs for others, and are never charged),
        and with each GPU that grants name held by the grants' fractions of it, each for the time
        its pod ran, in place of the rows of nobody. What DCGM shows stands: a pod it shows on a
        GPU keeps that holding, which no grant, its own or another pod's, can reduce; the grants
        share what those holders leave of the GPU, scaled down together where they ask more (none
        left: they hold nothing there, counted). A fraction's activity is the device's, shared in
        proportion to the fractions held (`by_fraction`)."""
        scope, st = self.scope, self.scope.string
        reserving = np.isin(rows.holder, np.array([h for h, key in enumerate(scope.holders.values)
                                                   if key in self.sharing.reservations], np.int64))
        claimed = {key: whole[key] for key in self.sharing.claims if key in whole}
        drop = reserving.copy()
        if claimed:
            drop |= np.isin(rows.gpu, units.gpu[np.array(list(claimed.values()), np.int64)]) & (rows.holder == NOBODY)
        reserved_gpus = set(rows.gpu[reserving].tolist())
        memory = _device_memory_mib(units, np.array(list(claimed.values()), np.int64)) if claimed else {}
        parts = [rows.take(np.flatnonzero(~drop))]
        shown_on, shown_part = _shown(scope, parts[0])
        out: list[tuple] = []  # (gpu, fraction, share, measured, activity, holder, basis, activity basis)
        for (node, uuid), e in claimed.items():
            gpu = int(units.gpu[e])
            reserved_gpus.discard(gpu)
            gpu_share, measured, activity = device_activity(units.tenures, by_entity[e], scope.seconds)
            total = memory.get(e) or model_memory_mib(st(int(units.entities.model[e])))
            fraction, holder, basis = self.fractions(node, uuid, total, exclude=shown_on.get(gpu, set()))
            if not len(fraction):
                continue
            share = [scope.held_share(scope.holders.values[h], gpu_share) for h in holder.tolist()]
            asked, left = float(np.dot(fraction, share)), 1.0 - shown_part.get(gpu, 0.0)
            if asked > left:  # the GPU is never sold twice, and what DCGM shows is not cut
                if left < NOTHING_LEFT:
                    self.sharing.problems["grant on a GPU that pods dcgm-exporter shows hold whole"] += len(fraction)
                    continue
                fraction = fraction * (left / asked)
            sold = float(np.dot(fraction, share)) / gpu_share if gpu_share > 0 else 0.0  # of the time the GPU was seen
            unit_activity = min(activity / sold, 1.0) if sold > 0 and not np.isnan(activity) else np.nan
            how = UNMEASURED if np.isnan(unit_activity) else BY_FRACTION
            out += [(gpu, x, s, measured, unit_activity, h, b, how)
                    for x, s, h, b in zip(fraction.tolist(), share, holder.tolist(), basis.tolist())]
        if out:
            gpu, fraction, share, measured, activity, holder, basis, how = (list(c) for c in zip(*out))
            parts.append(Rows.of(gpu, fraction, share, measured, activity, holder, FRACTION, basis, POD, how))
        if reserved_gpus:
            self.sharing.problems["GPU a reservation pod holds with no fraction pod on it"] += len(reserved_gpus)
        return Rows.concat(parts)

    def fractions(self, node: str, uuid: str, total_mib: float | None,
                  exclude: set[PodKey] = frozenset()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The claims on one GPU (but those of the pods in `exclude`, which hold it otherwise) as
        (fraction, holder, basis) columns, as granted. A memory grant on a GPU of unknown memory
        holds nothing (counted)."""
        fraction, holder, basis = [], [], []
        for claim in self.sharing.claims[(node, uuid)]:
            if claim.pod in exclude:
                continue
            share, why = claim.fraction(total_mib, self.hardware.fraction_rule)
            if share <= 0:
                self.sharing.problems["memory grant on a GPU of unknown memory"] += 1
                continue
            fraction.append(share)
            holder.append(self.scope.holders.index(claim.pod))
            basis.append(self.scope.profiles.index(why))
        self._placed.add((node, uuid))
        return np.array(fraction, np.float64), np.array(holder, np.int64), np.array(basis, np.int64)

    def problems(self) -> dict[str, int]:
        """The sharing problems of this interval, with each claim that no GPU took counted."""
        problems = self.sharing.problems
        for key, claims in self.sharing.claims.items():
            if key not in self._placed:
                problems["GPU named by a grant not found on its node"] += len(claims)
        return dict(problems)


def _shown(scope: Scope, rows: Rows) -> tuple[dict[int, set[PodKey]], dict[int, float]]:
    """Per GPU: the pods DCGM (or a request) shows on it, and the share of it they hold over the
    interval."""
    held = np.flatnonzero(rows.holder != NOBODY)
    shown_on: dict[int, set[PodKey]] = {}
    shown_part: dict[int, float] = {}
    for g, h, x in zip(rows.gpu[held].tolist(), rows.holder[held].tolist(), (rows.f[held] * rows.share[held]).tolist()):
        shown_on.setdefault(g, set()).add(scope.holders.values[h])
        shown_part[g] = shown_part.get(g, 0.0) + x
    return shown_on, shown_part


def _device_memory_mib(units: Reported, entities: np.ndarray) -> dict[int, float]:
    """Device memory of these entities: the most DCGM_FI_DEV_FB_USED + FB_FREE of one sample time."""
    samples, entity = units.memory_samples()
    rows = np.flatnonzero(np.isin(entity, entities) & ~samples.stale
                          & ((samples.metric == Metric.FB_USED) | (samples.metric == Metric.FB_FREE)))
    if not len(rows):
        return {}
    key, first = group_ids(entity[rows], samples.time_ns[rows])
    total = np.bincount(key, weights=samples.value[rows])
    kinds = np.bincount(key, weights=np.where(samples.metric[rows] == Metric.FB_USED, 1, 2))
    out: dict[int, float] = {}
    for e, t, k in zip(entity[rows][first].tolist(), total.tolist(), kinds.tolist()):
        if k == 3 and t > out.get(e, 0.0):  # both series of the same scrape
            out[e] = t
    return out
