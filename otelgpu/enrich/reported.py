"""What DCGM reported in one interval, per entity (a whole GPU or a MIG instance): its node, its
GPU, its share of that GPU, who held it for how long and how active it was; and the join's rows
(a unit and its holder) as columns, which every job of the join adds to.

A unit's share of its GPU is hardware data: 1 for a whole GPU, its MIG profile's share of the
GPU's slices (core/mig.py, by the configured fraction rule) for a MIG instance. Placement needs
it, for a GPU is never given out twice; what the share costs is attribution's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Optional

import numpy as np

from otelgpu.core.catalog import InstanceType, gpu_model_key
from otelgpu.core.grouping import group_ids, id_type
from otelgpu.core.mig import MigProfiles, normalise_per_gpu
from otelgpu.enrich.holdings import GPU, MIG
from otelgpu.enrich.nodes import NodeInfo, node_info
from otelgpu.enrich.samples import AnySamples
from otelgpu.enrich.scope import Scope
from otelgpu.enrich.timeline import Entities, Readings, Tenures, dedupe, entities_of, tenures


@dataclass
class Hardware:
    """What the join knows of hardware: the instance catalog, the MIG profiles and the rule that
    turns a profile into a share of its GPU, and one spelling per GPU model on the series (the
    driver's, DCGM's modelName, also for nodes known only from GFD's product label, which spells
    it with hyphens): from the catalog, then from what DCGM reports."""

    catalog: dict[str, InstanceType]
    mig: MigProfiles
    fraction_rule: str

    def __post_init__(self) -> None:
        self.spelling = {gpu_model_key(t.gpu_model): t.gpu_model for t in self.catalog.values() if t.gpu_model}

    def learn_spelling(self, model: str) -> None:
        """DCGM's spelling of a model it reports: the one its series carry from now on."""
        self.spelling[gpu_model_key(model)] = model

    def catalog_gpus(self, instance_type: str) -> int | None:
        """The instance type's GPUs, where the catalog knows it to have some."""
        known = self.catalog.get(instance_type)
        return known.gpus if known is not None and known.gpus > 0 else None

    def mig_fraction(self, model: str, profile: str) -> float:
        return self.mig.fraction(model, profile, self.fraction_rule)[0]


@dataclass
class Rows:
    """Rows of the join (a unit and its holder) as columns."""

    gpu: np.ndarray  # int64: index into the interval's GPUs
    f: np.ndarray  # share of the GPU the unit is
    share: np.ndarray  # share of the interval held
    measured: np.ndarray  # share of the held time with an activity figure
    activity: np.ndarray  # NaN where unmeasured
    holder: np.ndarray  # int64: index into Scope.holders
    kind: np.ndarray  # int8: KINDS
    profile: np.ndarray  # int64: index into Scope.profiles (a fraction's: its basis)
    attribution: np.ndarray  # int8: ATTRIBUTIONS
    basis: np.ndarray  # int8: BASES

    @staticmethod
    def of(gpu, fraction, share, measured, activity, holder, kind, profile, attribution,
           basis) -> "Rows":  # noqa: ANN001
        """Columns from sequences or scalars (broadcast to the length of `gpu`)."""
        n_row = len(gpu)

        def col(value, dtype) -> np.ndarray:  # noqa: ANN001
            return np.full(n_row, value, dtype) if np.isscalar(value) else np.asarray(value, dtype).reshape(n_row)

        return Rows(col(gpu, np.int64), col(fraction, np.float64), col(share, np.float64), col(measured, np.float64),
                    col(activity, np.float64), col(holder, np.int64), col(kind, np.int8), col(profile, np.int64),
                    col(attribution, np.int8), col(basis, np.int8))

    @staticmethod
    def concat(parts: list["Rows"]) -> "Rows":
        return Rows(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(Rows)))

    def take(self, index: np.ndarray) -> "Rows":
        return Rows(*(getattr(self, f.name)[index] for f in fields(Rows)))

    def __len__(self) -> int:
        return len(self.gpu)


@dataclass
class Reported:
    """Per entity of the interval (a DCGM device or MIG instance), and the holdings of each."""

    samples: Optional[AnySamples]  # the interval's DCGM samples, resent ones dropped (where `memory` is None)
    sample_entity: Optional[np.ndarray]  # per sample: its entity (the same)
    entities: Entities
    tenures: Tenures  # per (entity, holder): how long held, how active
    node_names: list[str]  # the nodes that reported
    node_infos: list[NodeInfo]
    node: np.ndarray  # per entity: index into node_names
    shared: np.ndarray  # bool per entity: time-shared (several holders at once)
    node_replicas: np.ndarray  # per entity: its node's time-slicing replicas
    gpu: np.ndarray  # per entity: its GPU, numbered by (node, UUID)
    gpu_first: np.ndarray  # per GPU: its first entity
    fraction: np.ndarray  # per entity: its share of its GPU
    kind: np.ndarray  # int8 per entity: GPU or MIG
    profile: np.ndarray  # per entity: index into Scope.profiles
    memory: Callable[[], AnySamples] | None = None  # the framebuffer samples, where `samples` leave them out

    def memory_samples(self) -> tuple[AnySamples, np.ndarray]:
        """The interval's DCGM samples that hold the framebuffer's values, resent ones dropped,
        and each one's entity (-1: one this join has not, another node's)."""
        if self.memory is None:
            assert self.samples is not None and self.sample_entity is not None
            return self.samples, self.sample_entity
        fb = dedupe(self.memory())
        entities, n_entity = self.entities, len(self.entities.node)
        ids, first = group_ids(*(np.concatenate([getattr(entities, name), getattr(fb, name)])
                                 for name in ("node", "uuid", "gi")))
        entity_of = np.full(len(first), -1, np.int64)
        entity_of[ids[:n_entity]] = np.arange(n_entity)
        return fb, entity_of[ids[n_entity:]]

    def whole_gpus(self, scope: Scope) -> dict[tuple[str, str], int]:
        """(node, GPU UUID) -> entity, for the entities that are whole GPUs (not MIG instances)."""
        st = scope.string
        entities = self.entities
        named = zip(entities.node.tolist(), entities.uuid.tolist(), entities.gi.tolist())
        return {(st(n), st(u)): i for i, (n, u, gi) in enumerate(named) if gi < 0}

    def shown(self) -> np.ndarray:
        """Per entity: whether DCGM showed a pod holding it."""
        out = np.zeros(len(self.entities.node), dtype=bool)
        out[self.tenures.entity[self.tenures.holder_pod >= 0]] = True
        return out


def reported(samples: AnySamples, scope: Scope, hardware: Hardware, memory: Callable[[], AnySamples] | None = None
             ) -> Reported:
    samples = dedupe(samples)
    entity, entities = entities_of(samples)
    n_entity = len(entities.node)
    codes, node = np.unique(entities.node, return_inverse=True)
    node = node.reshape(-1)
    names = [scope.string(c) for c in codes.tolist()]
    infos = [node_info(scope.facts.nodes.get(name)) for name in names]
    has_vgpu = np.zeros(n_entity, dtype=bool)
    has_vgpu[entity[samples.vgpu >= 0]] = True
    replicas = np.array([info.replicas for info in infos], np.int64)[node]
    shared = (replicas > 1) | has_vgpu | _held_by_several(samples, entity, n_entity)
    # Where the framebuffer's samples come from `memory`, nothing after the timeline reads the
    # samples (the close's largest arrays): it is handed the columns it reads, the rest let go.
    kept, kept_entity = (samples, entity) if memory is None else (None, None)
    readings = Readings.of(samples)
    del samples
    if memory is not None:  # entity ids in 4 bytes where they fit (`entities_of` gives them so: no copy)
        entity = entity.astype(id_type(n_entity), copy=False)
    held = tenures(readings, entity, shared, scope.start_ns, scope.end_ns)
    del readings, entity
    gpu, gpu_first = group_ids(entities.node, entities.uuid)
    fraction, kind = _base_fractions(scope, hardware, entities, gpu)
    return Reported(kept, kept_entity, entities, held, names, infos, node, shared, replicas, gpu, gpu_first,
                    fraction, kind, scope.indices(scope.profiles, entities.profile), memory)


def _base_fractions(scope: Scope, hardware: Hardware, entities: Entities,
                    gpu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each unit's share of its GPU: 1 for a whole GPU, its MIG profile's fraction (a function
    of the GPU model and the profile: worked out once per pair) for a MIG instance; and its
    kind (GPU or MIG)."""
    fraction = np.ones(len(entities.node))
    mig = np.asarray(entities.gi) >= 0
    pairs, pair_of = np.unique(np.stack([entities.model[mig], entities.profile[mig]], axis=1).reshape(-1, 2), axis=0,
                               return_inverse=True)
    st = scope.string
    by_pair = np.array([hardware.mig_fraction(st(m), st(p)) for m, p in pairs.tolist()], np.float64)
    fraction[mig] = normalise_per_gpu(gpu[mig], by_pair[pair_of.reshape(-1)])
    return fraction, np.where(mig, MIG, GPU).astype(np.int8)


def _held_by_several(samples: AnySamples, entity: np.ndarray, entities: int) -> np.ndarray:
    """Per entity: whether DCGM showed it held by several pods at one sample time, as dcgm-exporter
    shows a device that a DRA ResourceClaim shared by several pods allocates, or one shared in a
    way the node's labels do not announce. Such a device is time-shared: it is split among them."""
    out = np.zeros(entities, dtype=bool)
    live = np.flatnonzero((samples.pod >= 0) & ~samples.stale)
    if not len(live):
        return out
    # each pod once a step
    _, first = group_ids(entity[live], samples.time_ns[live], samples.namespace[live], samples.pod[live])
    step, step_first = group_ids(entity[live][first], samples.time_ns[live][first])
    several = np.flatnonzero(np.bincount(step) > 1)
    out[entity[live][first][step_first[several]]] = True
    return out


def rows_by_entity(tenures: Tenures, entities: int) -> list[np.ndarray]:
    """The indices of the tenures of each of `n` entities (one sort, not a scan per entity)."""
    order = np.argsort(tenures.entity, kind="stable")
    return np.split(order, np.searchsorted(tenures.entity[order], np.arange(1, entities)))


def device_activity(tenures: Tenures, mine: np.ndarray, seconds: float) -> tuple[float, float, float]:
    """Of one entity's tenures: the share of the interval it was reported, the share of that
    with an activity figure, and its mean activity (NaN where none)."""
    held_s, act_s = float(tenures.held_s[mine].sum()), float(tenures.act_s[mine].sum())
    activity = float(tenures.act_integral[mine].sum()) / act_s if act_s > 0 else np.nan
    return min(held_s / seconds, 1.0), act_s / held_s if held_s > 0 else 0.0, activity
