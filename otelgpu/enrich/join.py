"""The interval join: DCGM entities and their holders, plus pod, namespace and node facts, into
the kernel's rows and the attributes of each row's cost series.

A holder named by DCGM is the pod that holds the unit. Where DCGM names nobody, a Running pod
that kube-state-metrics says requests that kind of unit on that node (and that DCGM shows
nowhere) is placed on it, attributed `ksm_request` with activity unmeasured; a unit nobody holds
but that shows activity is booked `active_without_pod`; the rest is idle. On a GPU that HAMi or
KAI Scheduler shares out (enrich/sharing.py), the pods they granted parts of it hold those parts
(`unit_kind="fraction"`), in place of the pod that reserves it for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Generic, Hashable, Iterator, TypeVar

import numpy as np

from otelgpu.attribution.engine import UnitRows
from otelgpu.attribution.prices import NodePrice, Pricer
from otelgpu.config import TAG_NAMES
from otelgpu.core.attrs import Attrs, attrs_of, with_attrs
from otelgpu.core.catalog import gpu_model_key
from otelgpu.core.grouping import group_ids
from otelgpu.core.mig import MigProfiles, normalise_per_gpu
from otelgpu.enrich.devices import DeviceMemory
from otelgpu.enrich.labels import GPU_COUNT as GPU_COUNT_LABEL, MIG_STRATEGY, TagResolver, Tags
from otelgpu.enrich.model import FactSource, FactsView, PodFacts
from otelgpu.enrich.nodes import (
    NodeInfo,
    gpu_count,
    mig_resource,
    node_info,
    profile_of_resource,
)
from otelgpu.enrich.samples import Samples
from otelgpu.enrich.sharing import HAMI, Sharing, model_memory_mib, release, sharing_of
from otelgpu.enrich.timeline import DARK, Holdings, dedupe, entities_of, holdings
from otelgpu.enrich.usage import PodUse
from otelgpu.enrich.workload import workload
from otelgpu.receiver.interner import Interner
from otelgpu.receiver.schema import GPU_RESOURCES, MIG_PREFIX, Metric, gpu_count_label

ACTIVE_WITHOUT_POD = 0.01  # mean activity above which an unheld unit is in use by someone
NOTHING_LEFT = 1e-9  # share of a GPU below which what its holders leave of it is rounding


KINDS = ("gpu", "mig", "replica", "fraction")  # unit_kind
GPU, MIG, REPLICA, FRACTION = 0, 1, 2, 3
BASES = ("device", "per_pod", "equal_split", "none", "by_fraction")  # activity_basis
DEVICE, PER_POD, EQUAL_SPLIT, UNMEASURED, BY_FRACTION = 0, 1, 2, 3, 4
ATTRIBUTIONS = ("pod", "ksm_request", "active_without_pod", "pod_unknown", "dra_claim")
POD, KSM_REQUEST, ACTIVE, POD_UNKNOWN, DRA_CLAIM = 0, 1, 2, 3, 4
NOBODY = 0  # the holder ("", "") of a unit held by no pod

T = TypeVar("T", bound=Hashable)


class Names(Generic[T]):
    """Distinct values numbered in the order they were first met."""

    def __init__(self, *first: T) -> None:
        self.values: list[T] = []
        self._index: dict[T, int] = {}
        for value in first:
            self.index(value)

    def index(self, value: T) -> int:
        i = self._index.get(value)
        if i is None:
            i = self._index[value] = len(self.values)
            self.values.append(value)
        return i

    def __len__(self) -> int:
        return len(self.values)


@dataclass
class NodeCost:
    """One node in the interval: what it costs and the attributes of its capacity series."""

    name: str
    price: NodePrice
    attrs: Attrs  # capacity_type, gpu_model, instance_type, node
    gpus: int  # physical GPUs costed this interval
    vcpus: float  # the capacity scad splits (the instance type's figures where known)
    memory_gib: float


@dataclass
class PodRow:
    """A pod on a costed node, with what scad splits besides GPUs: CPU and memory reserved
    (requests) and used (cAdvisor), time-weighted by the share of the interval it ran."""

    node: int  # index into Joined.nodes
    attrs: Attrs  # tags, namespace, pod, node attributes, attribution
    tags_found: tuple[bool, ...]
    share: float
    cpu_request: float  # cores
    memory_request_gib: float
    cpu_used: float  # mean cores while running; NaN when not measured
    memory_used_gib: float  # NaN when not measured


@dataclass
class Pods:
    """The pods on costed nodes (`PodRow`s) as columns; `set` indexes `Joined.sets`."""

    node: np.ndarray  # int64
    set: np.ndarray  # int64
    share: np.ndarray
    cpu_request: np.ndarray
    memory_request_gib: np.ndarray
    cpu_used: np.ndarray
    memory_used_gib: np.ndarray

    @staticmethod
    def empty() -> "Pods":
        i, f = np.zeros(0, np.int64), np.zeros(0)
        return Pods(i, i, f, f, f, f, f)

    def __len__(self) -> int:
        return len(self.node)


@dataclass
class Joined:
    """The kernel's rows and the attribute set of each. The distinct sets of an interval's rows
    and pods are listed once (`sets`), with what the cost models read of them as columns."""

    rows: UnitRows  # gpu_price_hour: the per-GPU price by the configured split convention
    row_set: np.ndarray  # int64, per row: index into sets
    sets: list[Attrs]
    set_found: np.ndarray  # bool [set, tag]: the tags (TAG_NAMES order) the holder's labels gave
    set_holder: np.ndarray  # int64: index into holders (NOBODY: no pod)
    set_namespace: np.ndarray  # int64: index into namespaces ("" first)
    set_attribution: np.ndarray  # int8: index into ATTRIBUTIONS
    set_node: np.ndarray  # int64: index into nodes
    holders: list[tuple[str, str]]  # (namespace, pod)
    namespaces: list[str]
    gpu_node: np.ndarray  # int64, per GPU: index into nodes
    nodes: list[NodeCost]
    pods: Pods  # filled when a model needs CPU and memory (scad)
    split: str  # the instance-price split convention in force (prices can be reloaded)
    unpriced_gpus: int = 0
    gpus_without_device_data: int = 0  # GPUs of nodes known only from kube-state-metrics
    fraction_problems: dict[str, int] = field(default_factory=dict)  # pods whose grant holds nothing, by reason

    @property
    def row_attrs(self) -> list[Attrs]:
        return [self.sets[s] for s in self.row_set.tolist()]

    @property
    def row_tags_found(self) -> list[tuple[bool, ...]]:
        return [tuple(f) for f in self.set_found[self.row_set].tolist()]

    def pod_rows(self) -> list[PodRow]:
        p = self.pods
        return [PodRow(n, self.sets[s], tuple(self.set_found[s].tolist()), *values) for n, s, *values in
                zip(p.node.tolist(), p.set.tolist(), p.share.tolist(), p.cpu_request.tolist(),
                    p.memory_request_gib.tolist(), p.cpu_used.tolist(), p.memory_used_gib.tolist())]


@dataclass
class _Rows:
    """Rows of the join (a unit and its holder) as columns."""

    gpu: np.ndarray  # int64: index into the interval's GPUs
    f: np.ndarray  # share of the GPU the unit is
    share: np.ndarray  # share of the interval held
    measured: np.ndarray  # share of the held time with an activity figure
    activity: np.ndarray  # NaN where unmeasured
    holder: np.ndarray  # int64: index into Joiner's holders
    kind: np.ndarray  # int8: KINDS
    profile: np.ndarray  # int64: index into Joiner's profiles (a fraction's: its basis)
    attribution: np.ndarray  # int8: ATTRIBUTIONS
    basis: np.ndarray  # int8: BASES

    @staticmethod
    def of(gpu, f, share, measured, activity, holder, kind, profile, attribution, basis) -> "_Rows":  # noqa: ANN001
        """Columns from sequences or scalars (broadcast to the length of `gpu`)."""
        n = len(gpu)

        def col(x, dtype) -> np.ndarray:  # noqa: ANN001
            return np.full(n, x, dtype) if np.isscalar(x) else np.asarray(x, dtype).reshape(n)

        return _Rows(col(gpu, np.int64), col(f, np.float64), col(share, np.float64), col(measured, np.float64),
                     col(activity, np.float64), col(holder, np.int64), col(kind, np.int8), col(profile, np.int64),
                     col(attribution, np.int8), col(basis, np.int8))

    @staticmethod
    def concat(parts: list["_Rows"]) -> "_Rows":
        return _Rows(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(_Rows)))

    def take(self, index: np.ndarray) -> "_Rows":
        return _Rows(*(getattr(self, f.name)[index] for f in fields(_Rows)))

    def __len__(self) -> int:
        return len(self.gpu)


class _Sets(Names[Attrs]):
    """The distinct attribute sets of one join, with what the cost models read of each."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[bool, ...]] = []
        self.holder: list[int] = []
        self.namespace: list[int] = []
        self.attribution: list[int] = []
        self.node: list[int] = []

    def add(self, attrs: Attrs, found: tuple[bool, ...], holder: int, namespace: int, attribution: int,
            node: int) -> int:
        i = self.index(attrs)
        if i == len(self.found):  # new: what the models read of it
            self.found.append(found)
            self.holder.append(holder)
            self.namespace.append(namespace)
            self.attribution.append(attribution)
            self.node.append(node)
        return i


class Joiner:
    def __init__(self, strings: Interner, facts: FactSource, tags: TagResolver, mig: MigProfiles,
                 pricer: Pricer, fraction_rule: str, *, pod_resources: bool = False,
                 cpu_only_nodes: bool = False, device_memory_ns: int = 600 * 10**9) -> None:
        self.s, self.source, self.tags, self.mig = strings, facts, tags, mig
        self.devices = DeviceMemory(strings, device_memory_ns)
        self.facts = FactsView({}, {}, {}, {})  # this interval's, taken at the start of join()
        self._start = 0
        self._ksm_reporting = False
        self.pricer, self.rule = pricer, fraction_rule
        self.pod_resources, self.cpu_only_nodes = pod_resources, cpu_only_nodes
        # One spelling per GPU model on the series: the driver's (DCGM modelName), also for nodes
        # known only from GFD's product label, which spells it with hyphens. From the catalog,
        # then from what DCGM reports.
        self._model_spelling = {gpu_model_key(t.gpu_model): t.gpu_model for t in pricer.catalog.values() if t.gpu_model}
        self._begin()

    def _begin(self) -> None:
        """The tables of one join: holders, profiles and node sets numbered as they are met, the
        attribute sets of the rows, and each holder's attributes worked out once."""
        self._holders: Names[tuple[str, str]] = Names(("", ""))
        self._profiles: Names[str] = Names("")
        self._node_sets: Names[Attrs] = Names()
        self._namespaces: Names[str] = Names("")
        self._sets = _Sets()
        self._holder_memo: dict[tuple[int, int, int], tuple[Attrs, tuple[bool, ...], int]] = {}
        self._sharing = Sharing()
        self._placed: set[tuple[str, str]] = set()  # the (node, GPU UUID)s whose claims hold fractions
        self._use: dict[tuple[int, int], PodUse] = {}
        self._dra: dict[tuple[str, str], list[tuple[str, str]]] = {}  # (node, GPU UUID) -> its DRA claims' pods
        self._taken: set[tuple[str, str]] = set()  # (node, GPU UUID)s that grants or DRA claims give out

    def join(self, samples: Samples, start_ns: int, end_ns: int,
             use: dict[tuple[int, int], PodUse] | None = None, only_node: str | None = None,
             without_pods: bool = False, facts: FactsView | None = None) -> Joined:
        """`only_node`: the join of that node alone (its samples must be the only ones given);
        `without_pods`: as if no pod were known (its capacity alone); `facts`: the facts as of
        `end_ns` when the caller has them already."""
        self.facts, self._start = facts if facts is not None else self.source.view(end_ns), start_ns
        self._begin()
        if only_node is not None:
            self.facts = _one_node(self.facts, only_node, without_pods)
        # kube-state-metrics drops a finished or deleted pod's series while its facts linger (TTL).
        # When it reported pods during this interval (the API's pods included), a pod it did not
        # report is gone: it holds and pays nothing. When it reported none (down, not scraped),
        # the last facts stand.
        self._ksm_reporting = self.facts.ksm_reported_ns >= start_ns
        self._use = use or {}
        self._sharing = sharing_of(self.facts, self._held)
        self._dra = self._dra_gpus() if self.facts.claims else {}
        S = dedupe(samples)
        dt = (end_ns - start_ns) / 1e9
        st = self.s.string
        ent, E = entities_of(S)
        codes, node_of_ent = np.unique(E.node, return_inverse=True)
        node_of_ent = node_of_ent.reshape(-1)
        names = [st(c) for c in codes.tolist()]
        infos = [node_info(self.facts.nodes.get(name)) for name in names]
        has_vgpu = np.zeros(len(E.node), dtype=bool)
        has_vgpu[ent[S.vgpu >= 0]] = True
        ent_replicas = np.array([info.replicas for info in infos], np.int64)[node_of_ent]
        shared = (ent_replicas > 1) | has_vgpu | _held_by_several(S, ent, len(E.node))
        H = holdings(S, ent, shared, start_ns, end_ns)

        gpu_of_ent, gpu_first = group_ids(E.node, E.uuid)
        base_f, kind = self._base_fractions(E, gpu_of_ent)
        whole = self._whole_gpus(E) if self._sharing or self._dra else {}
        if self._sharing.claims:
            self._admit_grants(E, node_of_ent, gpu_first, names, whole)
        self._taken = set(self._sharing.claims) | set(self._dra)
        profile = self._indices(self._profiles, E.profile)
        rows = self._holder_rows(H, gpu_of_ent, base_f, kind, profile, shared, ent_replicas, dt)
        shown = set(self._holders.values)  # the pods DCGM shows holding a unit
        unheld = self._unheld_rows(H, E, gpu_of_ent, base_f, kind, profile, shared, infos, node_of_ent, shown, dt)
        if self._sharing or self._dra:
            rows = _Rows.concat([rows, unheld])
            unheld = _Rows.of([], 1.0, 1.0, 0.0, np.nan, NOBODY, GPU, 0, POD, DEVICE)
            by_entity = _rows_by(H.entity, len(E.node))
            if self._dra:
                rows = self._with_dra_claims(rows, H, E, gpu_of_ent, whole, by_entity, dt)
            if self._sharing:
                rows = self._with_fractions(rows, S, ent, H, E, gpu_of_ent, whole, by_entity, dt)
        models: Names[str] = Names()
        gpu_node = node_of_ent[gpu_first]  # index into names, for now
        gpu_model = self._indices(models, E.model[gpu_first])
        for model in models.values:
            self._model_spelling[gpu_model_key(model)] = model
        specs = list(zip(names, infos))
        gpu_node, gpu_model, blind_rows, blind = self._nodes_without_device_data(specs, gpu_node, gpu_model, models)
        all_rows = _Rows.concat([rows, unheld, blind_rows])
        joined = self._finish(all_rows, gpu_node, gpu_model, specs, models.values)
        joined.gpus_without_device_data = blind
        joined.fraction_problems = self._fraction_problems()
        if self.pod_resources:
            if self.cpu_only_nodes:
                self._add_cpu_only_nodes(joined)
            joined.pods = self._pod_rows(joined, all_rows, use or {})
        self._finish_sets(joined)
        self._begin()
        return joined

    def _indices(self, names: Names[str], codes: np.ndarray) -> np.ndarray:
        """Interned codes -> indices into `names` (each distinct code looked up once)."""
        distinct, inverse = np.unique(codes, return_inverse=True)
        st = self.s.string
        table = np.array([names.index(st(c)) for c in distinct.tolist()], np.int64)
        return table[inverse.reshape(-1)] if len(codes) else np.zeros(0, np.int64)

    def _base_fractions(self, E, gpu_of_ent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each unit's share of its GPU: 1 for a whole GPU, its MIG profile's fraction (a function
        of the GPU model and the profile: worked out once per pair) for a MIG instance; and its
        kind (GPU or MIG)."""
        st = self.s.string
        f = np.ones(len(E.node))
        mig = np.asarray(E.gi) >= 0
        pairs, pair_of = np.unique(np.stack([E.model[mig], E.profile[mig]], axis=1).reshape(-1, 2), axis=0,
                                   return_inverse=True)
        by_pair = np.array([self.mig.fraction(st(m), st(p), self.rule)[0] for m, p in pairs.tolist()], np.float64)
        f[mig] = normalise_per_gpu(gpu_of_ent[mig], by_pair[pair_of.reshape(-1)])
        return f, np.where(mig, MIG, GPU).astype(np.int8)

    def _holder_rows(self, H: Holdings, gpu_of_ent, base_f, kind, profile, shared, ent_replicas, dt) -> _Rows:  # noqa: ANN001
        """The units DCGM shows held by a pod. On a shared (time-sliced) GPU a holder holds the
        replicas DCGM counts for it (else as many as its requests ask per GPU it holds), of the
        node's replicas (else of the pods sharing the GPU); its activity is per replica."""
        i = np.flatnonzero(H.holder_pod >= 0)
        e = H.entity[i]
        holder_of, first = group_ids(H.holder_ns[i], H.holder_pod[i])
        st = self.s.string
        table = np.array([self._holders.index((st(n), st(p))) for n, p in
                          zip(H.holder_ns[i][first].tolist(), H.holder_pod[i][first].tolist())], np.int64)
        holder = table[holder_of] if len(i) else np.zeros(0, np.int64)
        f, unit_kind = base_f[e].copy(), kind[e].copy()
        basis = np.full(len(i), DEVICE, np.int8)
        mean = H.mean_activity[i]
        sh = np.flatnonzero(shared[e])
        if len(sh):
            held = np.bincount(holder)[holder[sh]]  # units each holder holds
            k = H.replicas[i][sh].astype(np.int64)
            ask = np.flatnonzero(k == 0)
            if len(ask):
                which, first = group_ids(holder[sh][ask], held[ask])
                asked = [self._requested_replicas(self._holders.values[h], n)
                         for h, n in zip(holder[sh][ask][first].tolist(), held[ask][first].tolist())]
                k[ask] = np.array(asked, np.int64)[which]
            pods_per_ent = np.bincount(H.entity[H.holder_pod >= 0], minlength=len(shared))
            node_r = ent_replicas[e[sh]]
            r = np.where(node_r > 1, node_r, np.maximum(pods_per_ent[e[sh]], 1))
            f[sh] = f[sh] * np.minimum(k, r) / r
            unit_kind[sh] = REPLICA
            basis[sh] = np.where(H.per_pod_activity[i[sh]], PER_POD, EQUAL_SPLIT)
            m = mean[sh]
            with np.errstate(invalid="ignore", divide="ignore"):
                mean[sh] = np.where((f[sh] > 0) & ~np.isnan(m), np.minimum(m / f[sh], 1.0), m)
        basis[np.isnan(mean)] = UNMEASURED
        return _Rows.of(gpu_of_ent[e], f, np.minimum(H.held_s[i] / dt, 1.0), H.measured_share[i], mean, holder,
                        unit_kind, profile[e], POD, basis)

    def _requested_replicas(self, holder: tuple[str, str], n_gpus: int) -> int:
        pod = self.facts.pod(holder, self._start)
        if pod is None:
            return 1
        k = sum(pod.requested(r) for r in GPU_RESOURCES)
        return max(int(round(k / max(n_gpus, 1))), 1)

    def _unheld_rows(self, H: Holdings, E, gpu_of_ent, base_f, kind, profile, shared, infos, node_of_ent,  # noqa: ANN001
                     shown: set[tuple[str, str]], dt: float) -> _Rows:
        """Place kube-state-metrics claims on unheld units; book active unheld units; the rest is idle."""
        st = self.s.string
        # Where dcgm-exporter maps devices to pods on a node, it is the authority there: a pod it
        # does not show holds nothing (it ended, or has not started). Claims fill in only on nodes
        # whose exporter maps no pods at all (pod mapping off or broken).
        mapped = {st(c) for c in np.unique(E.node[H.entity[H.holder_pod >= 0]]).tolist()}
        claims: dict[tuple[str, str], list[tuple[str, str]]] = {}  # (node, resource) -> pods, one per unit
        dark_claims: dict[tuple[str, str], list[tuple[str, str]]] = {}  # the same for time DCGM went dark
        for node, key, resource, qty in self._gpu_requests():
            if node not in mapped:
                claims.setdefault((node, resource), []).extend([key] * qty)
            if key not in shown:
                dark_claims.setdefault((node, resource), []).extend([key] * qty)
        # Unheld replicas are idle: claims on shared GPUs are not placed (no unit identity).
        i = np.flatnonzero((H.holder_pod < 0) & ~shared[H.entity])
        e = H.entity[i]
        share, mean = np.minimum(H.held_s[i] / dt, 1.0), H.mean_activity[i]
        with np.errstate(invalid="ignore"):
            active = mean > ACTIVE_WITHOUT_POD  # False where NaN (unmeasured)
        # Which pod a claim or a dark unit goes to is decided unit by unit, in order; the other
        # units are booked active_without_pod where active, and are idle otherwise.
        claimed = np.array(sorted({self.s.find(node) for node, _ in claims}), np.int64)
        slow = (H.holder_pod[i] == DARK) | np.isin(E.node[e], claimed)
        fast = np.flatnonzero(~slow & active)
        parts = [_Rows.of(gpu_of_ent[e[fast]], base_f[e[fast]], share[fast], H.measured_share[i[fast]], mean[fast],
                          NOBODY, kind[e[fast]], profile[e[fast]], ACTIVE, DEVICE)]
        at = [fast]
        placed: list[tuple] = []
        for x in np.flatnonzero(slow).tolist():
            u = int(e[x])
            node, prof = st(int(E.node[u])), self._profiles.values[profile[u]]
            single = infos[node_of_ent[u]].mig_strategy == "single"
            resource = mig_resource(prof) if kind[u] == MIG and not single else "nvidia_com_gpu"
            # A GPU that grants or DRA claims give out takes no request: it is theirs.
            taken = kind[u] == GPU and (node, st(int(E.uuid[u]))) in self._taken
            if H.holder_pod[i[x]] == DARK:
                holder = self._dark_holder(node, st(int(E.uuid[u])), st(int(E.gi[u])),
                                           None if taken else dark_claims.get((node, resource)))
                if holder is not None:
                    placed.append((x, u, 0.0, np.nan, self._holders.index(holder), KSM_REQUEST, UNMEASURED))
                continue
            queue = None if taken else claims.get((node, resource))
            if queue:
                placed.append((x, u, 0.0, np.nan, self._holders.index(queue.pop(0)), KSM_REQUEST, UNMEASURED))
            elif active[x]:
                placed.append((x, u, H.measured_share[i[x]], mean[x], NOBODY, ACTIVE, DEVICE))
        if placed:
            x, u, measured, activity, holder, attribution, basis = (np.array(c) for c in zip(*placed))
            parts.append(_Rows.of(gpu_of_ent[u], base_f[u], share[x], measured, activity, holder, kind[u],
                                  profile[u], attribution, basis))
            at.append(x)
        return _Rows.concat(parts).take(np.argsort(np.concatenate(at), kind="stable"))

    def _held(self, key: tuple[str, str], pod: PodFacts) -> bool:
        """Whether a pod ran on its node in the interval: its kube-state-metrics phases say so
        where they were scraped, else whether it is Running at the interval's end."""
        share = self._running_share(key)
        return bool(pod.node) and share > 0 if share is not None else self._running(pod)

    def _running_share(self, key: tuple[str, str]) -> float | None:
        """The share of the interval the pod was Running, where its phase was scraped."""
        u = self._use.get((self.s.find(key[0]), self.s.find(key[1])))
        return None if u is None or np.isnan(u.running_share) else float(u.running_share)

    def _held_share(self, key: tuple[str, str], gpu_share: float) -> float:
        """A grant's or claim's share of the interval: the GPU's, no longer than its pod ran."""
        share = self._running_share(key)
        return gpu_share if share is None else min(gpu_share, share)

    def _dra_gpus(self) -> dict[tuple[str, str], list[tuple[str, str]]]:
        """Per (node, GPU UUID): the pods that DRA claims allocating that whole GPU are reserved
        for and that ran in the interval. Admin-access results (monitoring) hold nothing. A claim
        device of a GPU driver that no ResourceSlice lists is counted."""
        index = {key: (s.node, device) for s in self.facts.slices.values() for key, device in s.devices.items()}
        drivers = {key[0] for key in index}
        out: dict[tuple[str, str], list[tuple[str, str]]] = {}
        for (namespace, _), claim in sorted(self.facts.claims.items()):
            pods = [(namespace, name) for name in claim.pods
                    if (pod := self.facts.pods.get((namespace, name))) is not None and self._held((namespace, name), pod)]
            for key in claim.devices if pods else ():
                found = index.get(key)
                if found is None:
                    if key[0] in drivers:
                        self._sharing.problems["DRA device not in its driver's ResourceSlices"] += len(pods)
                    continue
                node, device = found
                if device.parent_uuid:  # MIG devices: dcgm-exporter's DRA mapping names their pods
                    continue
                held_by = out.setdefault((node, device.uuid), [])
                held_by += [p for p in pods if p not in held_by]
        return out

    def _admit_grants(self, E, node_of_ent: np.ndarray, gpu_first: np.ndarray, names: list[str],  # noqa: ANN001
                      whole: dict[tuple[str, str], int]) -> None:
        """Take back the grants HAMi or KAI cannot have made: HAMi's on nodes that advertise no
        vGPUs, and any naming a whole GPU its node reports no such thing as (their pods are then
        priced by their requests, counted)."""
        reported = dict(zip(names, np.bincount(node_of_ent[gpu_first], minlength=len(names)).tolist()))
        mig = {self.s.string(int(c)) for c in np.unique(E.node[np.asarray(E.gi) >= 0]).tolist()}
        plain = {n for n in self._sharing.nodes(HAMI) if not self._advertises_vgpus(n, reported.get(n, 0), n in mig)}
        release(self._sharing, {c.pod for key, claims in self._sharing.claims.items() if key[0] in plain
                                for c in claims if c.scheduler == HAMI}, "HAMi grant on a node that advertises no vGPUs")
        release(self._sharing, {c.pod for key, claims in self._sharing.claims.items()
                                if key[0] in reported and key not in whole for c in claims},
                "grant naming a GPU its node does not report")

    def _advertises_vgpus(self, node: str, reported: int, mig: bool) -> bool:
        """Whether a node advertises HAMi's vGPUs: at least twice as many `nvidia.com/gpu` as it has
        GPUs (GFD's count, else the more of those DCGM reports and the instance type's), with no
        time-slicing and no MIG (whose instances the single strategy advertises as GPUs)."""
        facts = self.facts.nodes.get(node)
        if facts is None or mig or facts.labels.get(MIG_STRATEGY) == "single" \
                or any(r.startswith(MIG_PREFIX) for r in facts.capacity):
            return False
        info = node_info(facts)
        physical = gpu_count_label(facts.labels.get(GPU_COUNT_LABEL, "")) or \
            max(reported, self._catalog_gpus(info.instance_type) or 0)
        return info.replicas == 1 and physical > 0 and facts.capacity.get("nvidia_com_gpu", 0) >= 2 * physical

    def _catalog_gpus(self, instance_type: str) -> int | None:
        known = self.pricer.catalog.get(instance_type)
        return known.gpus if known is not None and known.gpus > 0 else None

    def _whole_gpus(self, E) -> dict[tuple[str, str], int]:  # noqa: ANN001
        """(node, GPU UUID) -> entity, for the entities that are whole GPUs (not MIG instances)."""
        st = self.s.string
        return {(st(n), st(u)): e for e, (n, u, gi) in enumerate(zip(E.node.tolist(), E.uuid.tolist(), E.gi.tolist()))
                if gi < 0}

    def _with_dra_claims(self, rows: _Rows, H: Holdings, E, gpu_of_ent: np.ndarray,  # noqa: ANN001
                         whole: dict[tuple[str, str], int], by_entity: list[np.ndarray], dt: float) -> _Rows:
        """Whole GPUs that DRA ResourceClaims allocate, where dcgm-exporter shows no pod on them: the
        claim's pods hold them (`attribution="dra_claim"`) for the time they ran, a claim reserved
        for several pods split equally as replicas, in place of the rows of nobody. Where DCGM
        names a pod, it stands."""
        shown = np.zeros(len(E.node), dtype=bool)
        shown[H.entity[H.holder_pod >= 0]] = True
        placed: dict[int, list[tuple[str, str]]] = {}
        for key, pods in self._dra.items():
            e = whole.get(key)
            if e is None:
                self._sharing.problems["DRA GPU not reported on its node"] += len(pods)
            elif not shown[e]:
                placed[e] = pods
        if not placed:
            return rows
        gpus = gpu_of_ent[np.array(list(placed), np.int64)]
        out: list[tuple] = []  # (gpu, fraction, share, measured, activity, holder, kind, activity basis)
        for e, pods in placed.items():
            gpu_share, measured, activity = _device_activity(H, by_entity[e], dt)
            n = len(pods)
            how = UNMEASURED if np.isnan(activity) else (DEVICE if n == 1 else EQUAL_SPLIT)
            out += [(int(gpu_of_ent[e]), 1.0 / n, self._held_share(p, gpu_share), measured, activity,
                     self._holders.index(p), GPU if n == 1 else REPLICA, how) for p in pods]
        g, f, share, measured, activity, holder, kind, how = (list(c) for c in zip(*out))
        rest = rows.take(np.flatnonzero(~(np.isin(rows.gpu, gpus) & (rows.holder == NOBODY))))
        return _Rows.concat([rest, _Rows.of(g, f, share, measured, activity, holder, kind, 0, DRA_CLAIM, how)])

    def _with_fractions(self, rows: _Rows, S: Samples, ent: np.ndarray, H: Holdings, E, gpu_of_ent: np.ndarray,  # noqa: ANN001
                        whole: dict[tuple[str, str], int], by_entity: list[np.ndarray], dt: float) -> _Rows:
        """`rows` without the reservation pods' (they hold GPUs for others, and are never charged),
        and with each GPU that grants name held by the grants' fractions of it, each for the time
        its pod ran, in place of the rows of nobody. What DCGM shows stands (docs/cost-model.md
        section 11): a pod it shows on a GPU keeps that holding, which no grant, its own or
        another pod's, can reduce; the grants share what those holders leave of the GPU, scaled
        down together where they ask more (none left: they hold nothing there, counted). A
        fraction's activity is the device's, shared in proportion to the fractions held
        (`by_fraction`)."""
        st = self.s.string
        reserving = np.isin(rows.holder, np.array([h for h, key in enumerate(self._holders.values)
                                                   if key in self._sharing.reservations], np.int64))
        claimed = {key: whole[key] for key in self._sharing.claims if key in whole}
        drop = reserving.copy()
        if claimed:
            drop |= np.isin(rows.gpu, gpu_of_ent[np.array(list(claimed.values()), np.int64)]) & (rows.holder == NOBODY)
        reserved_gpus = set(rows.gpu[reserving].tolist())
        memory = self._device_memory_mib(S, ent, np.array(list(claimed.values()), np.int64)) if claimed else {}
        parts = [rows.take(np.flatnonzero(~drop))]
        held = np.flatnonzero(parts[0].holder != NOBODY)
        shown_on: dict[int, set[tuple[str, str]]] = {}  # GPU -> the pods DCGM (or a request) shows on it
        shown_part: dict[int, float] = {}  # GPU -> the share of it they hold over the interval
        for g, h, x in zip(parts[0].gpu[held].tolist(), parts[0].holder[held].tolist(),
                           (parts[0].f[held] * parts[0].share[held]).tolist()):
            shown_on.setdefault(g, set()).add(self._holders.values[h])
            shown_part[g] = shown_part.get(g, 0.0) + x
        out: list[tuple] = []  # (gpu, fraction, share, measured, activity, holder, basis, activity basis)
        for (node, uuid), e in claimed.items():
            g = int(gpu_of_ent[e])
            reserved_gpus.discard(g)
            gpu_share, measured, activity = _device_activity(H, by_entity[e], dt)
            total = memory.get(e) or model_memory_mib(st(int(E.model[e])))
            f, holder, basis = self._fractions(node, uuid, total, exclude=shown_on.get(g, set()))
            if not len(f):
                continue
            share = [self._held_share(self._holders.values[h], gpu_share) for h in holder.tolist()]
            asked, left = float(np.dot(f, share)), 1.0 - shown_part.get(g, 0.0)
            if asked > left:  # the GPU is never sold twice, and what DCGM shows is not cut
                if left < NOTHING_LEFT:
                    self._sharing.problems["grant on a GPU that pods dcgm-exporter shows hold whole"] += len(f)
                    continue
                f = f * (left / asked)
            sold = float(np.dot(f, share)) / gpu_share if gpu_share > 0 else 0.0  # of the time the GPU was seen
            unit_activity = min(activity / sold, 1.0) if sold > 0 and not np.isnan(activity) else np.nan
            how = UNMEASURED if np.isnan(unit_activity) else BY_FRACTION
            out += [(g, x, s, measured, unit_activity, h, b, how)
                    for x, s, h, b in zip(f.tolist(), share, holder.tolist(), basis.tolist())]
        if out:
            g, f, share, measured, activity, holder, basis, how = (list(c) for c in zip(*out))
            parts.append(_Rows.of(g, f, share, measured, activity, holder, FRACTION, basis, POD, how))
        if reserved_gpus:
            self._sharing.problems["GPU a reservation pod holds with no fraction pod on it"] += len(reserved_gpus)
        return _Rows.concat(parts)

    def _fractions(self, node: str, uuid: str, total_mib: float | None,
                   exclude: set[tuple[str, str]] = frozenset()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The claims on one GPU (but those of the pods in `exclude`, which hold it otherwise) as
        (fraction, holder, basis) columns, as granted. A memory grant on a GPU of unknown memory
        holds nothing (counted)."""
        f, holder, basis = [], [], []
        for claim in self._sharing.claims[(node, uuid)]:
            if claim.pod in exclude:
                continue
            share, why = claim.fraction(total_mib, self.rule)
            if share <= 0:
                self._sharing.problems["memory grant on a GPU of unknown memory"] += 1
                continue
            f.append(share)
            holder.append(self._holders.index(claim.pod))
            basis.append(self._profiles.index(why))
        self._placed.add((node, uuid))
        return np.array(f, np.float64), np.array(holder, np.int64), np.array(basis, np.int64)

    def _device_memory_mib(self, S: Samples, ent: np.ndarray, entities: np.ndarray) -> dict[int, float]:
        """Device memory of these entities: the most DCGM_FI_DEV_FB_USED + FB_FREE of one sample time."""
        rows = np.flatnonzero(np.isin(ent, entities) & ~S.stale
                              & ((S.metric == Metric.FB_USED) | (S.metric == Metric.FB_FREE)))
        if not len(rows):
            return {}
        key, first = group_ids(ent[rows], S.time_ns[rows])
        total = np.bincount(key, weights=S.value[rows])
        kinds = np.bincount(key, weights=np.where(S.metric[rows] == Metric.FB_USED, 1, 2))
        out: dict[int, float] = {}
        for e, t, k in zip(ent[rows][first].tolist(), total.tolist(), kinds.tolist()):
            if k == 3 and t > out.get(e, 0.0):  # both series of the same scrape
                out[e] = t
        return out

    def _fraction_problems(self) -> dict[str, int]:
        """The sharing problems of this join, with each claim that no GPU took counted."""
        problems = self._sharing.problems
        for key, claims in self._sharing.claims.items():
            if key not in self._placed:
                problems["GPU named by a grant not found on its node"] += len(claims)
        self._placed = set()
        return dict(problems)

    def _dark_holder(self, node: str, uuid: str, gi: str, queue: list[tuple[str, str]] | None) -> tuple[str, str] | None:
        """Who holds a unit while its exporter is dark: the pod that held it last, if it is still
        Running, else a Running pod of the node that requests that kind of unit; else nobody."""
        last = self.devices.last_holder(node, uuid, gi)
        pod = self.facts.pod(last, self._start) if last is not None else None
        if last is not None and pod is not None and pod.phase == "Running" and not pod.deleted and not self._gone(pod):
            if queue and last in queue:
                queue.remove(last)
            return last
        return queue.pop(0) if queue else None

    def _gone(self, pod: PodFacts) -> bool:
        """A pod whose kube-state-metrics series ended with staleness markers before the interval
        began, in a scrape that reported other pods (a failed scrape marks every series stale),
        whatever the API says of it; or a pod known from kube-state-metrics only (API facts, which
        carry the creation time, say for themselves) that it no longer reports while it reports
        others."""
        if 0 < pod.ended_ns <= self._start and pod.ended_ns <= self.facts.ksm_reported_ns:
            return True
        return self._ksm_reporting and not pod.created_ns and pod.seen_ns < self._start

    def _running(self, pod: PodFacts) -> bool:
        """Running on a node, and neither deleted nor gone from kube-state-metrics."""
        return pod.phase == "Running" and bool(pod.node) and not pod.deleted and not self._gone(pod)

    def _gpu_requests(self) -> Iterator[tuple[str, tuple[str, str], str, int]]:
        """(node, pod key, resource, quantity) of every GPU request of a Running, scheduled pod
        that holds whole units (not one that HAMi or KAI shares a GPU with, or reserves one for)."""
        for key, pod in self.facts.pods.items():
            if not self._running(pod) or key in self._sharing.pods:
                continue
            for (_, resource), qty in sorted(pod.requests.items()):
                if resource in GPU_RESOURCES or resource.startswith(MIG_PREFIX):
                    yield pod.node, key, resource, int(qty)

    def _nodes_without_device_data(self, specs: list[tuple[str, NodeInfo]], gpu_node: np.ndarray,
                                   gpu_model: np.ndarray, models: Names[str]) -> tuple[np.ndarray, np.ndarray, _Rows, int]:
        """GPUs kube-state-metrics counts (GFD's nvidia.com/gpu.count) but DCGM did not report this
        interval still cost money. A node with no DCGM series at all (exporter down, scrape lost)
        gets its Running pods' GPU requests placed on them (attribution `ksm_request`, activity
        unmeasured); GPUs missing from a node that does report (fallen off the bus, say) are idle.
        `specs` (extended here) are the nodes of `gpu_node`; returns the GPUs' nodes and models
        with these GPUs appended, their rows, and how many GPUs had no device data."""
        seen = {name: n for n, (name, _) in enumerate(specs)}
        reported = np.bincount(gpu_node, minlength=len(specs))
        first = np.zeros(len(specs), np.int64)
        reporting, first_gpu = np.unique(gpu_node, return_index=True)
        first[reporting] = first_gpu  # each node's first GPU
        extra_node: list[int] = []
        extra_model: list[int] = []
        rows: list[tuple] = []
        blind = 0
        # HAMi advertises each GPU as several vGPUs: without GFD's count, a node's capacity overstates
        # its GPUs, and DCGM's count stands.
        hami_nodes = self._sharing.nodes(HAMI)
        requests: dict[str, list[tuple[tuple[str, str], str, int]]] = {}
        for node, key, resource, qty in self._gpu_requests():
            requests.setdefault(node, []).append((key, resource, qty))
        granted: dict[str, set[str]] = {}
        for node, uuid in self._sharing.claims:
            granted.setdefault(node, set()).add(uuid)
        for name, facts in self.facts.nodes.items():
            info = node_info(facts)
            count = gpu_count(facts, info)
            label = gpu_count_label(facts.labels.get(GPU_COUNT_LABEL, ""))
            catalog = self._catalog_gpus(info.instance_type)
            if label is None and catalog is not None and count > catalog:
                count = catalog  # advertised beyond the instance's GPUs: HAMi's vGPUs, not GPUs
            n = seen.get(name)
            if n is not None:
                missing = 0 if name in hami_nodes and label is None else max(count - int(reported[n]), 0)
                extra_node += [n] * missing
                extra_model += [int(gpu_model[first[n]])] * missing
                blind += missing
                continue
            if count == 0:
                continue
            model = info.gpu_product.split("-SHARED")[0].split("-MIG-")[0]  # GFD's product label
            model = self._model_spelling.get(gpu_model_key(model), model)
            n = len(specs)
            specs.append((name, info))
            base, free = len(gpu_node) + len(extra_node), [1.0] * count
            extra_node += [n] * count
            extra_model += [models.index(model)] * count
            blind += count
            for key, resource, qty in requests.get(name, ()):
                f, unit_kind, profile = self._unit_of_resource(resource, model, info)
                for _ in range(qty):
                    g = next((i for i in range(count) if free[i] >= f - 1e-9), None)
                    if g is None:
                        break  # more requested than the node has: never sell a GPU twice
                    free[g] -= f
                    rows.append((base + g, f, self._holders.index(key), unit_kind, self._profiles.index(profile), 1.0))
            for uuid in sorted(granted.get(name, ())):
                g = next((i for i in range(count) if free[i] >= 1 - 1e-9), None)  # a GPU of its own
                if g is None:
                    break
                free[g] = 0.0
                f, holder, basis = self._fractions(name, uuid, model_memory_mib(model))
                rows += [(base + g, x, h, FRACTION, b, self._held_share(self._holders.values[h], 1.0))
                         for x, h, b in zip(f.tolist(), holder.tolist(), basis.tolist())]
        gpu_node = np.concatenate([gpu_node, np.array(extra_node, np.int64)]).astype(np.int64)
        gpu_model = np.concatenate([gpu_model, np.array(extra_model, np.int64)]).astype(np.int64)
        gpu, f, holder, unit_kind, profile, share = (list(c) for c in zip(*rows)) if rows else ([],) * 6
        return gpu_node, gpu_model, _Rows.of(gpu, f, share, 0.0, np.nan, holder, unit_kind, profile, KSM_REQUEST,
                                             UNMEASURED), blind

    def _unit_of_resource(self, resource: str, model: str, info: NodeInfo) -> tuple[float, int, str]:
        """(fraction, unit kind, MIG profile) of one unit of a requested GPU resource."""
        if resource.startswith(MIG_PREFIX):
            profile = profile_of_resource(resource)
            return self.mig.fraction(model, profile, self.rule)[0], MIG, profile
        return (1.0 / info.replicas, REPLICA, "") if info.replicas > 1 else (1.0, GPU, "")

    def _finish(self, rows: _Rows, gpu_spec: np.ndarray, gpu_model: np.ndarray,
                specs: list[tuple[str, NodeInfo]], models: list[str]) -> Joined:
        """Nodes numbered in the order their first GPU comes; each row's attribute set: one per
        holding (a pod's units on a node, of one kind and profile), worked out once."""
        spec_of, first_gpu = np.unique(gpu_spec, return_index=True)
        order = np.argsort(first_gpu, kind="stable")
        renumber = np.zeros(len(specs), np.int64)
        renumber[spec_of[order]] = np.arange(len(order))
        gpu_node = renumber[gpu_spec]
        gpus_on_node = np.bincount(gpu_node, minlength=len(order))
        nodes = [self._node_cost(*specs[s], models[gpu_model[g]], int(gpus_on_node[n]))
                 for n, (s, g) in enumerate(zip(spec_of[order].tolist(), first_gpu[order].tolist()))]
        split = self.pricer.config.instance_price_split
        node_prices = [node.price.per_gpu(split) for node in nodes]
        prices = np.array([p.per_gpu_hour for p in node_prices], np.float64)[gpu_node]
        unpriced = sum(int(gpus_on_node[n]) for n, price in enumerate(node_prices) if price.source == "none")
        # A node's GPUs of one model share one set of node attributes.
        pair_of_gpu, pair_first = group_ids(gpu_node, gpu_model)
        pair_set = np.array([self._node_sets.index(_node_attrs(nodes[n].name, models[m], specs[spec_of[order][n]][1]))
                             for n, m in zip(gpu_node[pair_first].tolist(), gpu_model[pair_first].tolist())], np.int64)
        row_set = np.zeros(len(rows), np.int64)
        if len(rows):
            pair = pair_of_gpu[rows.gpu]
            key, first = group_ids(rows.holder, rows.attribution, pair, rows.kind, rows.profile, rows.basis)
            # In the order of their first rows: holders' tag values are admitted under the caps
            # (tag_values) in the order their units come, whatever the order of their names.
            sets = np.zeros(len(first), np.int64)
            for k in np.argsort(first).tolist():
                r = int(first[k])
                sets[k] = self._holding_set(int(rows.holder[r]), int(rows.attribution[r]), int(pair_set[pair[r]]),
                                            int(gpu_node[rows.gpu[r]]), int(rows.kind[r]), int(rows.profile[r]),
                                            int(rows.basis[r]))
            row_set = sets[key]
        unit_rows = UnitRows(prices, rows.gpu, rows.f, rows.share, rows.measured, rows.activity)
        e = np.zeros(0, np.int64)
        return Joined(unit_rows, row_set, [], np.zeros((0, len(TAG_NAMES)), bool), e, e, np.zeros(0, np.int8), e,
                      [], [], gpu_node, nodes, Pods.empty(), split, unpriced)

    def _holding_set(self, holder: int, attribution: int, node_set: int, node: int, kind: int, profile: int,
                     basis: int) -> int:
        attrs, found, attribution = self._holder_attrs(holder, attribution, node_set)
        named = self._profiles.values[profile]
        attrs = with_attrs(attrs, {"unit_kind": KINDS[kind], "mig_profile": "" if kind == FRACTION else named,
                                   "fraction_basis": named if kind == FRACTION else "",
                                   "activity_basis": BASES[basis]})
        return self._sets.add(attrs, found, holder, self._namespaces.index(self._holders.values[holder][0]),
                              attribution, node)

    def _finish_sets(self, joined: Joined) -> None:
        s = self._sets
        joined.sets = s.values
        joined.set_found = np.array(s.found, bool).reshape(-1, len(TAG_NAMES))
        joined.set_holder = np.array(s.holder, np.int64)
        joined.set_namespace = np.array(s.namespace, np.int64)
        joined.set_attribution = np.array(s.attribution, np.int8)
        joined.set_node = np.array(s.node, np.int64)
        joined.holders, joined.namespaces = self._holders.values, self._namespaces.values

    def _node_cost(self, name: str, info: NodeInfo, model: str, gpus: int) -> NodeCost:
        price = self.pricer.node_price(info.instance_type, (model, info.gpu_product), info.capacity_type,
                                       gpus, info.vcpus, info.memory_gib)
        return NodeCost(name, price, _node_attrs(name, model, info), gpus,
                        price.vcpus or info.vcpus, price.memory_gib or info.memory_gib)

    def _holder_attrs(self, holder: int, attribution: int, node_set: int) -> tuple[Attrs, tuple[bool, ...], int]:
        """The holder's attributes, which tags its labels gave, and its attribution (`pod_unknown`
        for a pod no source knows); worked out once per join for each holder, attribution and
        node (a pod holds several units, and it is a GPU holder and a pod row), so the sets of
        its rows share their pairs."""
        key = (holder, attribution, node_set)
        known = self._holder_memo.get(key)
        if known is None:
            attrs, found, final = self._holder_attrs_of(self._holders.values[holder], ATTRIBUTIONS[attribution],
                                                        self._node_sets.values[node_set])
            known = self._holder_memo[key] = (attrs_of(attrs), found, ATTRIBUTIONS.index(final))
        return known

    def _holder_attrs_of(self, holder: tuple[str, str], attribution: str,
                         node_attrs: Attrs) -> tuple[dict[str, str], tuple[bool, ...], str]:
        pod = self.facts.pod(holder, self._start)
        tags = self._tags(holder, pod)
        attrs = dict(zip(TAG_NAMES, tags.values))
        if attribution == "pod" and pod is None:
            attribution = "pod_unknown"
        kind, name = workload(holder[0], holder[1], pod, self.facts.owners)
        attrs.update(dict(node_attrs), namespace=holder[0], pod=holder[1], attribution=attribution,
                     workload_kind=kind, workload_name=name)
        return attrs, tags.from_labels, attribution

    def _add_cpu_only_nodes(self, joined: Joined) -> None:
        """Nodes without GPUs that have an instance price, for scad on every instance."""
        costed = {n.name for n in joined.nodes}
        for name, facts in self.facts.nodes.items():
            info = node_info(facts)
            if name in costed or gpu_count(facts, info) > 0:
                continue
            node = self._node_cost(name, info, "", 0)
            if node.price.instance_hour is not None:
                joined.nodes.append(node)

    def _pod_rows(self, joined: Joined, rows: _Rows, use: dict[tuple[int, int], PodUse]) -> Pods:
        """Every pod that ran on a costed node in the interval: the Running pods kube-state-metrics
        places there, and the GPU holders DCGM shows there."""
        node_of = {n.name: i for i, n in enumerate(joined.nodes)}
        node_set = [self._node_sets.index(n.attrs) for n in joined.nodes]
        # Per (node, holder): the longest share of the interval it held a unit there, and the
        # attribution of its last row.
        gpu_share: dict[tuple[int, int], tuple[float, int]] = {}
        held = np.flatnonzero(rows.holder != NOBODY)
        if len(held):
            node = joined.gpu_node[rows.gpu[held]]
            key, first = group_ids(node, rows.holder[held])
            by_key = np.lexsort((np.arange(len(held)), key))  # each key's rows, in row order
            starts = np.flatnonzero(np.diff(key[by_key], prepend=-1))
            longest = np.maximum.reduceat(rows.share[held][by_key], starts)
            attribution = rows.attribution[held][by_key[np.append(starts[1:], len(held)) - 1]]  # its last row's
            holder = rows.holder[held]
            for k in np.argsort(first, kind="stable").tolist():  # in the order the rows name them
                gpu_share[(int(node[first[k]]), int(holder[first[k]]))] = (float(longest[k]), int(attribution[k]))
        code = self.s.find
        out: list[tuple] = []
        seen: set[tuple[int, int]] = set()
        for key, pod in self.facts.pods.items():
            n = node_of.get(pod.node)
            if n is None:
                continue
            u = use.get((code(key[0]), code(key[1])))
            running = pod.phase == "Running" and not pod.deleted
            if u is not None and not np.isnan(u.running_share):
                share = u.running_share
            elif self._gone(pod):
                share = 0.0
            else:
                share = float(running)
            h = self._holders.index(key)
            got = gpu_share.get((n, h))
            if got is not None:
                share = max(share, got[0])
            if share <= 0 or (got is None and not _carries_cost(pod, u)):
                continue  # a pod that holds and uses nothing costs nothing: its tags take no place
            seen.add((n, h))
            out.append(self._pod_row(n, node_set[n], h, POD if got is None else got[1], share, u))
        for (n, h), (share, attribution) in gpu_share.items():
            if (n, h) not in seen:  # unknown to kube-state-metrics: GPUs only
                out.append(self._pod_row(n, node_set[n], h, attribution, share, None))
        if not out:
            return Pods.empty()
        n, s, *values = (np.array(c) for c in zip(*out))
        return Pods(n.astype(np.int64), s.astype(np.int64), *(v.astype(np.float64) for v in values))

    def _pod_row(self, n: int, node_set: int, holder: int, attribution: int, share: float,
                 use: PodUse | None) -> tuple:
        pod = self.facts.pod(self._holders.values[holder], self._start)
        attrs, found, final = self._holder_attrs(holder, attribution, node_set)
        s = self._sets.add(attrs, found, holder, self._namespaces.index(self._holders.values[holder][0]), final, n)
        nan = float("nan")
        return (n, s, min(share, 1.0), pod.requested("cpu") if pod else 0.0,
                pod.requested("memory") / 2**30 if pod else 0.0,
                use.cpu_cores if use else nan, use.memory_bytes / 2**30 if use else nan)

    def _tags(self, holder: tuple[str, str], pod: PodFacts | None) -> Tags:
        if holder == ("", ""):
            return self.tags.resolve({}, {})
        return self.tags.resolve(pod.labels if pod else {}, self.facts.namespace_labels(holder[0]),
                                 pod.annotations if pod else None, holder[0])


def _rows_by(entity: np.ndarray, n: int) -> list[np.ndarray]:
    """The indices of the holdings of each of `n` entities (one sort, not a scan per entity)."""
    order = np.argsort(entity, kind="stable")
    return np.split(order, np.searchsorted(entity[order], np.arange(1, n)))


def _device_activity(H: Holdings, mine: np.ndarray, dt: float) -> tuple[float, float, float]:
    """Of one entity's holdings: the share of the interval it was reported, the share of that
    with an activity figure, and its mean activity (NaN where none)."""
    held_s, act_s = float(H.held_s[mine].sum()), float(H.act_s[mine].sum())
    activity = float(H.act_integral[mine].sum()) / act_s if act_s > 0 else np.nan
    return min(held_s / dt, 1.0), act_s / held_s if held_s > 0 else 0.0, activity


def _held_by_several(S: Samples, ent: np.ndarray, n: int) -> np.ndarray:
    """Per entity: whether DCGM showed it held by several pods at one sample time, as dcgm-exporter
    shows a device that a DRA ResourceClaim shared by several pods allocates, or one shared in a
    way the node's labels do not announce. Such a device is time-shared: it is split among them."""
    out = np.zeros(n, dtype=bool)
    live = np.flatnonzero((S.pod >= 0) & ~S.stale)
    if not len(live):
        return out
    _, first = group_ids(ent[live], S.time_ns[live], S.namespace[live], S.pod[live])  # each pod once a step
    step, step_first = group_ids(ent[live][first], S.time_ns[live][first])
    several = np.flatnonzero(np.bincount(step) > 1)
    out[ent[live][first][step_first[several]]] = True
    return out


def _carries_cost(pod: PodFacts, use: PodUse | None) -> bool:
    """Whether scad can charge the pod for vCPU or memory: it requests some or uses some."""
    if pod.requested("cpu") > 0 or pod.requested("memory") > 0:
        return True
    return use is not None and ((use.cpu_cores or 0) > 0 or (use.memory_bytes or 0) > 0)


def _one_node(facts: FactsView, node: str, without_pods: bool) -> FactsView:
    return FactsView({k: p for k, p in facts.pods.items() if p.node == node and not without_pods},
                     {n: f for n, f in facts.nodes.items() if n == node}, facts.namespaces, facts.owners,
                     {k: p for k, p in facts.previous.items() if p.node == node},
                     {} if without_pods else facts.claims, {k: s for k, s in facts.slices.items() if s.node == node},
                     facts.ksm_reported_ns)


def _node_attrs(name: str, model: str, info: NodeInfo) -> Attrs:
    return attrs_of({"capacity_type": info.capacity_type, "gpu_model": model,
                     "instance_type": info.instance_type, "node": name})
