"""The interval join: DCGM entities and their holders, plus pod, namespace and node facts, into
the kernel's rows and the attributes of each row's cost series.

A holder named by DCGM is the pod that holds the unit. Where DCGM names nobody, a Running pod
that kube-state-metrics says requests that kind of unit on that node (and that DCGM shows
nowhere) is placed on it, attributed `ksm_request` with activity unmeasured; a unit nobody holds
but that shows activity is booked `active_without_pod`; the rest is idle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from otelgpu.attribution.engine import UnitRows
from otelgpu.attribution.fractions import MigProfiles, normalise_per_gpu
from otelgpu.attribution.prices import NodePrice, Pricer
from otelgpu.config import TAG_NAMES
from otelgpu.enrich.devices import DeviceMemory
from otelgpu.enrich.facts import FactSource, FactsView, PodFacts
from otelgpu.enrich.labels import TagResolver, Tags
from otelgpu.enrich.nodes import (
    GPU_RESOURCES,
    MIG_PREFIX,
    NodeInfo,
    gpu_count,
    mig_resource,
    node_info,
    profile_of_resource,
)
from otelgpu.enrich.samples import Samples
from otelgpu.enrich.timeline import DARK, Holdings, dedupe, entities_of, group_ids, holdings
from otelgpu.enrich.usage import PodUse
from otelgpu.enrich.workload import workload
from otelgpu.exporter.store import Attrs, attrs_of, with_attrs
from otelgpu.receiver.interner import Interner

ACTIVE_WITHOUT_POD = 0.01  # mean activity above which an unheld unit is in use by someone


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
class Joined:
    rows: UnitRows  # gpu_price_hour: the per-GPU price by the configured split convention
    row_attrs: list[Attrs]
    row_tags_found: list[tuple[bool, ...]]
    gpu_node: np.ndarray  # int64, per GPU: index into nodes
    nodes: list[NodeCost]
    pods: list[PodRow]  # filled when a model needs CPU and memory (scad)
    split: str  # the instance-price split convention in force (prices can be reloaded)
    unpriced_gpus: int = 0
    gpus_without_device_data: int = 0  # GPUs of nodes known only from kube-state-metrics


@dataclass
class _Row:
    gpu: int
    f: float
    share: float
    measured: float
    activity: float
    holder: tuple[str, str]  # (namespace, pod); ("", "") when unattributed
    unit_kind: str
    profile: str
    attribution: str
    basis: str


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
        self._holders: dict[tuple, tuple[Attrs, tuple[bool, ...]]] = {}

    def join(self, samples: Samples, start_ns: int, end_ns: int,
             use: dict[tuple[int, int], PodUse] | None = None, only_node: str | None = None,
             without_pods: bool = False, facts: FactsView | None = None) -> Joined:
        """`only_node`: the join of that node alone (its samples must be the only ones given);
        `without_pods`: as if no pod were known (its capacity alone); `facts`: the facts as of
        `end_ns` when the caller has them already."""
        self.facts, self._start = facts if facts is not None else self.source.view(end_ns), start_ns
        self._holders = {}
        if only_node is not None:
            self.facts = _one_node(self.facts, only_node, without_pods)
        # kube-state-metrics drops a finished or deleted pod's series while its facts linger (TTL).
        # When it reported pods during this interval, a pod it did not report is gone: it holds
        # and pays nothing. When it reported none (down, not scraped), the last facts stand.
        self._ksm_reporting = any(p.seen_ns >= start_ns for p in self.facts.pods.values() if not p.created_ns)
        S = dedupe(samples)
        dt = (end_ns - start_ns) / 1e9
        st = self.s.string
        ent, E = entities_of(S)
        codes, node_of_ent = np.unique(E.node, return_inverse=True)
        nodes = {c: node_info(self.facts.nodes.get(st(c))) for c in codes.tolist()}
        has_vgpu = np.zeros(len(E.node), dtype=bool)
        has_vgpu[ent[S.vgpu >= 0]] = True
        replicated = np.array([nodes[c].replicas > 1 for c in codes.tolist()], dtype=bool)
        shared = replicated[node_of_ent.reshape(-1)] | has_vgpu
        H = holdings(S, ent, shared, start_ns, end_ns)

        gpu_of_ent, gpu_first = group_ids(E.node, E.uuid)
        base_f, kind = self._base_fractions(E, gpu_of_ent)
        rows = self._holder_rows(H, E, gpu_of_ent, base_f, kind, shared, nodes, dt)
        rows += self._unheld_rows(H, E, gpu_of_ent, base_f, kind, shared, nodes, dt)
        gpus = [(st(int(E.node[g])), st(int(E.model[g])), nodes[int(E.node[g])]) for g in gpu_first]
        seen: dict[str, list[str]] = {}
        for node_name, model, _ in gpus:
            seen.setdefault(node_name, []).append(model)
        blind_gpus, blind_rows = self._nodes_without_device_data(seen, len(gpus))
        joined = self._finish(rows + blind_rows, gpus + blind_gpus)
        joined.gpus_without_device_data = len(blind_gpus)
        if self.pod_resources:
            if self.cpu_only_nodes:
                self._add_cpu_only_nodes(joined)
            joined.pods = self._pod_rows(joined, rows + blind_rows, use or {})
        self._holders = {}
        return joined

    def _base_fractions(self, E, gpu_of_ent: np.ndarray) -> tuple[np.ndarray, list[str]]:
        """Each unit's share of its GPU: 1 for a whole GPU, its MIG profile's fraction (a function
        of the GPU model and the profile: worked out once per pair) for a MIG instance."""
        st = self.s.string
        f = np.ones(len(E.node))
        mig = np.asarray(E.gi) >= 0
        pairs, pair_of = np.unique(np.stack([E.model[mig], E.profile[mig]], axis=1).reshape(-1, 2), axis=0,
                                   return_inverse=True)
        by_pair = np.array([self.mig.fraction(st(m), st(p), self.rule)[0] for m, p in pairs.tolist()], np.float64)
        f[mig] = normalise_per_gpu(gpu_of_ent[mig], by_pair[pair_of.reshape(-1)])
        kind = np.where(mig, "mig", "gpu").tolist()
        return f, kind

    def _holder_rows(self, H: Holdings, E, gpu_of_ent, base_f, kind, shared, nodes, dt) -> list[_Row]:
        st = self.s.string
        out: list[_Row] = []
        means, measured = H.mean_activity, H.measured_share
        pods_per_ent = np.bincount(H.entity[H.holder_pod >= 0], minlength=len(E.node))
        gpus_per_pod: dict[tuple[int, int], int] = {}
        for e, n, p in zip(H.entity, H.holder_ns, H.holder_pod):
            if p >= 0:
                gpus_per_pod[(int(n), int(p))] = gpus_per_pod.get((int(n), int(p)), 0) + 1
        for i in np.flatnonzero(H.holder_pod >= 0):
            e = int(H.entity[i])
            holder = (st(int(H.holder_ns[i])), st(int(H.holder_pod[i])))
            f = float(base_f[e])
            unit_kind, basis = kind[e], "device"
            mean = means[i]
            if shared[e]:
                node = nodes[int(E.node[e])]
                held = gpus_per_pod[(int(H.holder_ns[i]), int(H.holder_pod[i]))]
                k = int(H.replicas[i]) or self._requested_replicas(holder, held)
                r = node.replicas if node.replicas > 1 else max(int(pods_per_ent[e]), 1)
                f = f * min(k, r) / r
                unit_kind = "replica"
                basis = "per_pod" if H.per_pod_activity[i] else "equal_split"
                mean = min(mean / f, 1.0) if f > 0 and not np.isnan(mean) else mean
            out.append(_Row(int(gpu_of_ent[e]), f, min(H.held_s[i] / dt, 1.0), measured[i], mean, holder,
                            unit_kind, st(int(E.profile[e])), "pod", basis if not np.isnan(mean) else "none"))
        return out

    def _requested_replicas(self, holder: tuple[str, str], n_gpus: int) -> int:
        pod = self.facts.pod(holder, self._start)
        if pod is None:
            return 1
        k = sum(pod.requested(r) for r in GPU_RESOURCES)
        return max(int(round(k / max(n_gpus, 1))), 1)

    def _unheld_rows(self, H: Holdings, E, gpu_of_ent, base_f, kind, shared, nodes, dt) -> list[_Row]:
        """Place kube-state-metrics claims on unheld units; book active unheld units; the rest is idle."""
        st = self.s.string
        # Where dcgm-exporter maps devices to pods on a node, it is the authority there: a pod it
        # does not show holds nothing (it ended, or has not started). Claims fill in only on nodes
        # whose exporter maps no pods at all (pod mapping off or broken).
        held = H.holder_pod >= 0
        mapped = {st(c) for c in np.unique(E.node[H.entity[held]]).tolist()}
        pairs = np.unique(np.stack([H.holder_ns[held], H.holder_pod[held]], axis=1).reshape(-1, 2), axis=0)
        shown = {(st(n), st(p)) for n, p in pairs.tolist()}
        claims: dict[tuple[str, str], list[tuple[str, str]]] = {}  # (node, resource) -> pods, one per unit
        dark_claims: dict[tuple[str, str], list[tuple[str, str]]] = {}  # the same for time DCGM went dark
        for node, key, resource, qty in self._gpu_requests():
            if node not in mapped:
                claims.setdefault((node, resource), []).extend([key] * qty)
            if key not in shown:
                dark_claims.setdefault((node, resource), []).extend([key] * qty)
        means, measured = H.mean_activity, H.measured_share
        out: list[_Row] = []
        for i in np.flatnonzero(H.holder_pod < 0):
            e = int(H.entity[i])
            if shared[e]:
                continue  # unheld replicas are idle; claims on shared GPUs are not placed (no unit identity)
            node, profile = st(int(E.node[e])), st(int(E.profile[e]))
            single = nodes[int(E.node[e])].mig_strategy == "single"
            resource = mig_resource(profile) if kind[e] == "mig" and not single else "nvidia_com_gpu"
            share = min(H.held_s[i] / dt, 1.0)
            if H.holder_pod[i] == DARK:
                holder = self._dark_holder(node, st(int(E.uuid[e])), st(int(E.gi[e])), dark_claims.get((node, resource)))
                if holder is not None:
                    out.append(_Row(int(gpu_of_ent[e]), float(base_f[e]), share, 0.0, np.nan, holder,
                                    kind[e], profile, "ksm_request", "none"))
                continue
            queue = claims.get((node, resource))
            mean = means[i]
            if queue:
                out.append(_Row(int(gpu_of_ent[e]), float(base_f[e]), share, 0.0, np.nan, queue.pop(0),
                                kind[e], profile, "ksm_request", "none"))
            elif not np.isnan(mean) and mean > ACTIVE_WITHOUT_POD:
                out.append(_Row(int(gpu_of_ent[e]), float(base_f[e]), share, measured[i], mean,
                                ("", ""), kind[e], profile, "active_without_pod", "device"))
        return out

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
        """A pod known from kube-state-metrics only (API facts, which carry the creation time, say
        for themselves) that kube-state-metrics no longer reports while it reports others."""
        return self._ksm_reporting and not pod.created_ns and pod.seen_ns < self._start

    def _gpu_requests(self) -> Iterator[tuple[str, tuple[str, str], str, int]]:
        """(node, pod key, resource, quantity) of every GPU request of a Running, scheduled pod."""
        for key, pod in self.facts.pods.items():
            if pod.phase != "Running" or not pod.node or pod.deleted or self._gone(pod):
                continue
            for (_, resource), qty in sorted(pod.requests.items()):
                if resource in GPU_RESOURCES or resource.startswith(MIG_PREFIX):
                    yield pod.node, key, resource, int(qty)

    def _nodes_without_device_data(self, seen: dict[str, list[str]],
                                   first: int) -> tuple[list[tuple[str, str, NodeInfo]], list[_Row]]:
        """GPUs kube-state-metrics counts (GFD's nvidia.com/gpu.count) but DCGM did not report this
        interval still cost money. A node with no DCGM series at all (exporter down, scrape lost)
        gets its Running pods' GPU requests placed on them (attribution `ksm_request`, activity
        unmeasured); GPUs missing from a node that does report (fallen off the bus, say) are idle."""
        gpus: list[tuple[str, str, NodeInfo]] = []
        rows: list[_Row] = []
        for name, facts in self.facts.nodes.items():
            info = node_info(facts)
            count = gpu_count(facts, info)
            if name in seen:
                missing = count - len(seen[name])
                gpus += [(name, seen[name][0], info)] * max(missing, 0)
                continue
            if count == 0:
                continue
            model = info.gpu_product.split("-SHARED")[0].split("-MIG-")[0]  # GFD's product label
            base, free = first + len(gpus), [1.0] * count
            gpus += [(name, model, info)] * count
            for node, key, resource, qty in self._gpu_requests():
                if node != name:
                    continue
                f, unit_kind, profile = self._unit_of_resource(resource, model, info)
                for _ in range(qty):
                    g = next((i for i in range(count) if free[i] >= f - 1e-9), None)
                    if g is None:
                        break  # more requested than the node has: never sell a GPU twice
                    free[g] -= f
                    rows.append(_Row(base + g, f, 1.0, 0.0, np.nan, key, unit_kind, profile, "ksm_request", "none"))
        return gpus, rows

    def _unit_of_resource(self, resource: str, model: str, info: NodeInfo) -> tuple[float, str, str]:
        """(fraction, unit kind, MIG profile) of one unit of a requested GPU resource."""
        if resource.startswith(MIG_PREFIX):
            profile = profile_of_resource(resource)
            return self.mig.fraction(model, profile, self.rule)[0], "mig", profile
        return (1.0 / info.replicas, "replica", "") if info.replicas > 1 else (1.0, "gpu", "")

    def _finish(self, rows: list[_Row], gpus: list[tuple[str, str, NodeInfo]]) -> Joined:
        node_index: dict[str, int] = {}
        first_gpu: list[int] = []
        for g, (node_name, _, _) in enumerate(gpus):
            if node_name not in node_index:
                node_index[node_name] = len(node_index)
                first_gpu.append(g)
        gpu_node = np.array([node_index[name] for name, _, _ in gpus], dtype=np.int64)
        gpus_on_node = np.bincount(gpu_node, minlength=len(node_index))
        nodes = [self._node_cost(name, gpus[g][1], gpus[g][2], int(gpus_on_node[n]))
                 for (name, n), g in zip(node_index.items(), first_gpu)]
        split = self.pricer.config.instance_price_split
        node_prices = [node.price.per_gpu(split) for node in nodes]
        prices = [node_prices[n].per_gpu_hour for n in gpu_node]
        unpriced = sum(int(gpus_on_node[n]) for n, price in enumerate(node_prices) if price.source == "none")
        node_attrs: dict[tuple[str, str], Attrs] = {}  # a node's GPUs share one set
        gpu_attrs = [node_attrs.get((name, model)) or node_attrs.setdefault((name, model), _node_attrs(name, model, info))
                     for name, model, info in gpus]
        # The rows of one holding (a pod's GPUs on a node, of one kind and profile) share their set.
        sets: dict[tuple, tuple[Attrs, tuple[bool, ...]]] = {}
        row_attrs, found = [], []
        for r in rows:
            key = (r.holder, r.attribution, gpu_attrs[r.gpu], r.unit_kind, r.profile, r.basis)
            known = sets.get(key)
            if known is None:
                attrs, tags_found = self._holder_attrs(r.holder, r.attribution, gpu_attrs[r.gpu])
                known = sets[key] = (with_attrs(attrs, {"unit_kind": r.unit_kind, "mig_profile": r.profile,
                                                        "activity_basis": r.basis}), tags_found)
            row_attrs.append(known[0])
            found.append(known[1])
        unit_rows = UnitRows(
            np.array(prices, dtype=np.float64), np.array([r.gpu for r in rows], dtype=np.int64),
            np.array([r.f for r in rows]), np.array([r.share for r in rows]),
            np.array([r.measured for r in rows]), np.array([r.activity for r in rows]),
        )
        return Joined(unit_rows, row_attrs, found, gpu_node, nodes, [], split, unpriced)

    def _node_cost(self, name: str, model: str, info: NodeInfo, gpus: int) -> NodeCost:
        price = self.pricer.node_price(info.instance_type, (model, info.gpu_product), info.capacity_type,
                                       gpus, info.vcpus, info.memory_gib)
        return NodeCost(name, price, _node_attrs(name, model, info), gpus,
                        price.vcpus or info.vcpus, price.memory_gib or info.memory_gib)

    def _holder_attrs(self, holder: tuple[str, str], attribution: str, node_attrs: Attrs) -> tuple[Attrs, tuple[bool, ...]]:
        """The holder's attributes and which tags its labels gave; worked out once per join for
        each holder, attribution and node (a pod holds several units, and it is a GPU holder and a
        pod row), so the sets of its rows share their pairs."""
        key = (holder, attribution, node_attrs)
        known = self._holders.get(key)
        if known is None:
            attrs, found = self._holder_attrs_of(holder, attribution, node_attrs)
            known = self._holders[key] = (attrs_of(attrs), found)
        return known

    def _holder_attrs_of(self, holder: tuple[str, str], attribution: str,
                         node_attrs: Attrs) -> tuple[dict[str, str], tuple[bool, ...]]:
        pod = self.facts.pod(holder, self._start)
        tags = self._tags(holder, pod)
        attrs = dict(zip(TAG_NAMES, tags.values))
        if attribution == "pod" and pod is None:
            attribution = "pod_unknown"
        kind, name = workload(holder[0], holder[1], pod, self.facts.owners)
        attrs.update(dict(node_attrs), namespace=holder[0], pod=holder[1], attribution=attribution,
                     workload_kind=kind, workload_name=name)
        return attrs, tags.from_labels

    def _add_cpu_only_nodes(self, joined: Joined) -> None:
        """Nodes without GPUs that have an instance price, for scad on every instance."""
        costed = {n.name for n in joined.nodes}
        for name, facts in self.facts.nodes.items():
            info = node_info(facts)
            if name in costed or gpu_count(facts, info) > 0:
                continue
            node = self._node_cost(name, "", info, 0)
            if node.price.instance_hour is not None:
                joined.nodes.append(node)

    def _pod_rows(self, joined: Joined, rows: list[_Row], use: dict[tuple[int, int], PodUse]) -> list[PodRow]:
        """Every pod that ran on a costed node in the interval: the Running pods kube-state-metrics
        places there, and the GPU holders DCGM shows there."""
        node_of = {n.name: i for i, n in enumerate(joined.nodes)}
        gpu_share: dict[tuple[int, tuple[str, str]], tuple[float, str]] = {}
        for r in rows:
            if r.holder != ("", ""):
                key = (int(joined.gpu_node[r.gpu]), r.holder)
                gpu_share[key] = (max(gpu_share.get(key, (0.0, ""))[0], r.share), r.attribution)
        code = self.s.find
        out: list[PodRow] = []
        seen: set[tuple[int, tuple[str, str]]] = set()
        for holder, pod in self.facts.pods.items():
            n = node_of.get(pod.node)
            if n is None:
                continue
            u = use.get((code(holder[0]), code(holder[1])))
            running = pod.phase == "Running" and not pod.deleted
            if u is not None and not np.isnan(u.running_share):
                share = u.running_share
            elif self._gone(pod):
                share = 0.0
            else:
                share = float(running)
            held = gpu_share.get((n, holder))
            if held is not None:
                share = max(share, held[0])
            if share <= 0:
                continue
            seen.add((n, holder))
            out.append(self._pod_row(joined, n, holder, "pod" if held is None else held[1], share, u))
        for (n, holder), (share, attribution) in gpu_share.items():
            if (n, holder) not in seen:  # unknown to kube-state-metrics: GPUs only
                out.append(self._pod_row(joined, n, holder, attribution, share, None))
        return out

    def _pod_row(self, joined: Joined, n: int, holder: tuple[str, str], attribution: str, share: float,
                 use: PodUse | None) -> PodRow:
        pod = self.facts.pod(holder, self._start)
        attrs, found = self._holder_attrs(holder, attribution, joined.nodes[n].attrs)
        nan = float("nan")
        return PodRow(
            n, attrs, found, min(share, 1.0),
            pod.requested("cpu") if pod else 0.0, pod.requested("memory") / 2**30 if pod else 0.0,
            use.cpu_cores if use else nan, use.memory_bytes / 2**30 if use else nan,
        )

    def _tags(self, holder: tuple[str, str], pod: PodFacts | None) -> Tags:
        if holder == ("", ""):
            return self.tags.resolve({}, {})
        return self.tags.resolve(pod.labels if pod else {}, self.facts.namespace_labels(holder[0]),
                                 pod.annotations if pod else None, holder[0])


def _one_node(facts: FactsView, node: str, without_pods: bool) -> FactsView:
    return FactsView({k: p for k, p in facts.pods.items() if p.node == node and not without_pods},
                     {n: f for n, f in facts.nodes.items() if n == node}, facts.namespaces, facts.owners,
                     {k: p for k, p in facts.previous.items() if p.node == node})


def _node_attrs(name: str, model: str, info: NodeInfo) -> Attrs:
    return attrs_of({"capacity_type": info.capacity_type, "gpu_model": model,
                     "instance_type": info.instance_type, "node": name})
