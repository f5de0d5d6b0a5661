"""Pod, namespace and node facts from kube-state-metrics series, latest value wins, and the view
the join reads: those facts merged with the Kubernetes API's (enrich/kube; the facts' classes and
their merge are in enrich/model.py, their checkpoint form in enrich/factstate.py).

Facts are per Kubernetes object (a few per pod), not per GPU sample, so they live in small
dicts keyed by name. A fact not refreshed within `ttl_ns` is forgotten; a deleted pod (its
series went stale) is kept for the same grace so its last interval is still attributed, and its
staleness markers say when it ended (`PodFacts.ended_ns`), which ends it for the join whichever
source its other facts come from. Labels and annotations are keyed as kube-state-metrics writes
them (`label_team`, `annotation_example_com_team`), whichever source they came from.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import numpy as np

from otelgpu.enrich import factstate
from otelgpu.enrich.factrows import FactRows, last_of_each_in
from otelgpu.enrich.model import (FactSource, FactsView, NamespaceFacts, NodeFacts, OwnerFacts, OwnerKey, PodFacts,
                                  merge, same_number, shared_map)
from otelgpu.enrich.repeats import NODE, POD, Found, Repeats, key_parts
from otelgpu.receiver.decode import PointBatch
from otelgpu.receiver.interner import Interner
from otelgpu.receiver.schema import Metric, is_ksm


_METRICS = {int(m): m for m in Metric}
# The members each row is told apart by, read from the enum once: in CPython 3.11 a member read
# through its class calls a descriptor (some 90 ns), and a row read up to six (at 100,000 GPUs
# an interval's 600,000 rows read them in some half a CPU-second)
_NODE_ROWS = frozenset({Metric.NODE_INFO, Metric.NODE_LABELS, Metric.NODE_CAPACITY})
_OWNER_ROWS = frozenset({Metric.REPLICASET_OWNER, Metric.JOB_OWNER})
_NAMESPACE_LABELS, _NODE_LABELS, _NODE_INFO, _REPLICASET_OWNER = (Metric.NAMESPACE_LABELS, Metric.NODE_LABELS,
                                                                  Metric.NODE_INFO, Metric.REPLICASET_OWNER)
_POD_LABELS, _POD_ANNOTATIONS, _POD_INFO, _POD_PHASE, _POD_REQUESTS = (Metric.POD_LABELS, Metric.POD_ANNOTATIONS,
                                                                       Metric.POD_INFO, Metric.POD_PHASE,
                                                                       Metric.POD_REQUESTS)


APPLY_CHUNK = 4096  # rows whose labels are turned into Python lists at once
FACT_PIECE = 16 * APPLY_CHUNK  # an interval's fact rows built at once (`update`)


class KsmFacts:
    key = "facts"  # its checkpoint entry (core/state.py)

    def __init__(self, strings: Interner, ttl_ns: int) -> None:
        self._strings = strings
        self.ttl_ns = ttl_ns
        self.pods: dict[tuple[str, str], PodFacts] = {}
        self.namespaces: dict[str, NamespaceFacts] = {}
        self.nodes: dict[str, NodeFacts] = {}
        self.owners: dict[OwnerKey, OwnerFacts] = {}
        self.reported_ns = 0  # the newest pod row applied: whether it reported pods after one ended
        self.version = 0  # changes so far: what was computed from these facts knows whether they moved
        self._encoded: tuple[int, dict[str, Any]] | None = None  # `state()` as of a version, made ahead
        # The facts as a mark or `encode_ahead` last spilled them, as of a version: the next mark
        # reads them there while the facts stay as they were (every interval computed ahead)
        self._spilled: tuple[int, Mapping[str, Any]] | None = None
        # What keeps a mark's facts in a file (the checkpoint's `spill`); None: copies in memory
        self.spill: Optional[Callable[[dict[str, Any]], Mapping[str, Any]]] = None
        self.repeats = Repeats()  # what the last update applied, object by object

    def update(self, batch: PointBatch | FactRows) -> int:
        """Apply the kube-state-metrics rows of `batch`; returns how many rows were used.

        Rows in time order (an interval's) are applied once per series: of rows that differ only
        in their timestamp (every scrape repeats the whole state), only the last is applied. That
        is exact: the last one rewrites every field the earlier ones wrote, after them, and in
        time order every row is newer than what is known. Only the order in which new objects
        (or a pod's requests, a node's capacities) are first met can change, never a value.

        An interval's fact rows (`FactRows`, folded: each series' last already, in time order,
        enrich/window.py) are read a piece at a time: their rows are never built all at once."""
        self.version += 1
        if isinstance(batch, FactRows):
            return self._update_rows(batch)
        if len(batch):
            self.repeats.forget(int(batch.time_ns.max()))
        rows = _ksm_rows(batch)
        used = len(rows)
        if used > 1 and _in_time_order(rows):
            rows = _latest_in_order(rows)  # what latest() keeps of rows in time order already
        self._apply_rows(rows)
        return used

    def _update_rows(self, rows: FactRows) -> int:
        """`update` of an interval's rows: the objects whose rows repeat what the last update
        applied to them have their times moved (enrich/repeats.py), the other rows are applied."""
        found = self.repeats.find(rows, self._names(), self._strings.epoch)
        moved = self._move_times(found)
        apply = np.ones(len(rows), bool)
        apply[found.rows[np.repeat(moved, np.diff(found.start))]] = False
        if not apply.all():
            rows = FactRows(rows.time_ns[apply], rows.row[apply], rows.shared, rows.own)
        used = int(np.count_nonzero(~apply))
        for piece in rows.pieces(FACT_PIECE):
            ksm = _ksm_rows(piece)
            used += len(ksm)
            self._apply_rows(ksm)
        return used

    def _names(self) -> tuple[int, int, int]:
        return self._strings.find("namespace"), self._strings.find("pod"), self._strings.find("node")

    def _move_times(self, found: Found) -> np.ndarray:
        """Move the times of the objects that repeat (what applying their rows again would
        change); returns which objects moved: one no longer known (forgotten since) is applied."""
        moved = found.repeat.copy()
        strings = self._strings.strings()
        pods, nodes, namespaces = self.pods, self.nodes, self.namespaces
        for i, key, newest in zip(np.flatnonzero(moved).tolist(), found.keys[moved].tolist(),
                                  found.newest_ns[moved].tolist()):
            kind, first, second = key_parts(key)
            if kind == POD:
                pod = pods.get((strings[first], strings[second]))
                if pod is None:
                    moved[i] = False
                    continue
                # Every row of both updates is applied (Repeats): none is older than it, and the
                # last update's cleared its end (a staleness marker is never a repeat).
                pod.seen_ns = newest
                self.reported_ns = max(self.reported_ns, newest)
            else:
                known = (nodes if kind == NODE else namespaces).get(strings[first])
                if known is None:
                    moved[i] = False
                    continue
                known.seen_ns = newest
        return moved

    def _apply_rows(self, rows: PointBatch) -> None:
        strings = self._strings.strings()
        for first in range(0, len(rows), APPLY_CHUNK):  # a chunk at a time: its lists are all that is built
            last = min(first + APPLY_CHUNK, len(rows))
            lo, hi = int(rows.attr_off[first]), int(rows.attr_off[last])
            off = (rows.attr_off[first:last + 1] - lo).tolist()  # plain lists: no numpy scalar per label
            keys, values = rows.attr_key[lo:hi].tolist(), rows.attr_val[lo:hi].tolist()
            metric, value, stale, time_ns = (c[first:last].tolist() for c in (rows.metric, rows.value, rows.stale,
                                                                              rows.time_ns))
            for i in range(last - first):
                begin, end = off[i], off[i + 1]
                attrs = {strings[k]: strings[v] for k, v in zip(keys[begin:end], values[begin:end])}
                self._apply(_METRICS[metric[i]], attrs, value[i], stale[i], time_ns[i])

    def _apply(self, metric: Metric, attrs: dict[str, str], value: float, stale: bool, time_ns: int) -> None:
        if metric in _NODE_ROWS:
            self._apply_node(metric, attrs, value, stale, time_ns)
        elif metric in _OWNER_ROWS:
            self._apply_owner(metric, attrs, stale, time_ns)
        elif metric == _NAMESPACE_LABELS:
            ns = self.namespaces.setdefault(attrs["namespace"], NamespaceFacts())
            if not stale and time_ns >= ns.seen_ns:
                ns.seen_ns = time_ns
                _replace(ns, "labels", {k: v for k, v in attrs.items() if k.startswith("label_")})
        else:
            self._apply_pod(metric, attrs, value, stale, time_ns)

    def _apply_node(self, metric: Metric, attrs: dict[str, str], value: float, stale: bool, time_ns: int) -> None:
        node = self.nodes.setdefault(attrs["node"], NodeFacts())
        if stale or time_ns < node.seen_ns:
            return
        node.seen_ns = time_ns
        if metric == _NODE_LABELS:
            _replace(node, "labels", {k: v for k, v in attrs.items() if k.startswith("label_")})
        elif metric == _NODE_INFO:
            node.provider_id = attrs.get("provider_id", "")
        else:
            known = node.capacity.get(attrs["resource"])
            if known is None or not same_number(known, value):
                node.capacity = {**node.capacity, attrs["resource"]: value}

    def _apply_owner(self, metric: Metric, attrs: dict[str, str], stale: bool, time_ns: int) -> None:
        name = attrs["replicaset"] if metric == _REPLICASET_OWNER else attrs["job_name"]
        owner = attrs["owner_kind"] if attrs["owner_kind"] != "<none>" else ""  # "<none>": known to have none
        kind = "ReplicaSet" if metric == _REPLICASET_OWNER else "Job"
        known = self.owners.get((attrs["namespace"], kind, name))
        if not stale and (known is None or time_ns >= known.seen_ns) \
                and (not owner or attrs.get("owner_is_controller", "true") == "true"):
            self.owners[(attrs["namespace"], kind, name)] = OwnerFacts(owner, attrs["owner_name"] if owner else "",
                                                                       time_ns)

    def _apply_pod(self, metric: Metric, attrs: dict[str, str], value: float, stale: bool, time_ns: int) -> None:
        key = (attrs["namespace"], attrs["pod"])
        pod = self.pods.get(key)
        if pod is None:
            if stale:
                return
            pod = self.pods[key] = PodFacts(labels=shared_map({}), annotations=shared_map({}))  # until rows say more
        if stale:  # going away: its facts are kept for the grace period, its end noted
            if time_ns > pod.seen_ns:  # not a series replaced in the same scrape (a relabel)
                pod.ended_ns = max(pod.ended_ns, time_ns)
            return
        if time_ns < pod.seen_ns:
            return  # older than what is known
        pod.seen_ns = time_ns
        self.reported_ns = max(self.reported_ns, time_ns)
        if time_ns >= pod.ended_ns:
            pod.ended_ns = 0  # reported again: a failed scrape's markers, or a pod recreated under its name
        pod.uid = attrs.get("uid", pod.uid)
        if metric == _POD_LABELS:
            pod.labels = shared_map({k: v for k, v in attrs.items() if k.startswith("label_")})
        elif metric == _POD_ANNOTATIONS:
            pod.annotations = shared_map({k: v for k, v in attrs.items() if k.startswith("annotation_")})
        elif metric == _POD_INFO:
            pod.info_node = attrs.get("node", "")
            pod.node = pod.info_node or pod.request_node
            pod.owner_kind = attrs.get("created_by_kind", "")
            pod.owner_name = attrs.get("created_by_name", "")
        elif metric == _POD_PHASE:
            if value == 1.0:
                pod.phase = attrs["phase"]
        elif metric == _POD_REQUESTS:
            pod.request(attrs.get("container", ""), attrs["resource"], value)
            pod.request_node = attrs.get("node") or pod.request_node
            pod.node = pod.info_node or pod.request_node

    def mark(self) -> Callable[[], None]:
        """What puts the facts back as they are now. With `spill`, the facts are encoded as a
        checkpoint encodes them into its file, and read back only to be put back (an interval
        computed ahead and then redone: rare); else updates mutate objects in place, so each one
        that can change is copied (the dicts in them are replaced, never changed: the copies share
        them). At 100,000 GPUs the copies are some 15 MiB, held while an interval is computed ahead
        and until its close."""
        if self.spill is not None:
            return self._mark_in_file()
        pods = {k: _copy(p) for k, p in self.pods.items()}  # labels and requests are replaced, not changed
        nodes = {k: _copy(n) for k, n in self.nodes.items()}  # labels and capacities alike
        namespaces = {k: _copy(n) for k, n in self.namespaces.items()}
        owners = dict(self.owners)  # replaced whole, never changed in place
        reported, repeats = self.reported_ns, self.repeats.mark()

        def undo() -> None:
            self.pods, self.nodes, self.namespaces, self.owners = pods, nodes, namespaces, owners
            self.reported_ns = reported
            repeats()
            self.version += 1  # not the facts anything computed since the mark read

        return undo

    def _mark_in_file(self) -> Callable[[], None]:
        """The facts encoded into a file, or the file they were last encoded into if they have not
        changed since (the interval computed ahead before encoded them for its close's checkpoint:
        at 100,000 GPUs some 0.5 CPU-s an interval, and 24 MiB of arrays built, not built again)."""
        if self._spilled is not None and self._spilled[0] == self.version:
            state = self._spilled[1]
        else:
            state = self._spill(factstate.encode(self.pods, self.nodes, self.namespaces, self.owners))
        reported, repeats = self.reported_ns, self.repeats.mark()

        def undo() -> None:
            self.pods, self.nodes, self.namespaces, self.owners = factstate.decode(state)
            self.reported_ns = reported
            repeats()
            self.version += 1  # not the facts anything computed since the mark read

        return undo

    def expire(self, now_ns: int) -> None:
        """Forget facts older than the grace period."""
        cutoff = now_ns - self.ttl_ns
        for table in (self.pods, self.namespaces, self.nodes, self.owners):
            for key in [k for k, v in table.items() if v.seen_ns < cutoff]:
                del table[key]
                self.version += 1

    def view(self, as_of_ns: int | None = None) -> FactsView:
        """The facts applied so far; the pipeline applies each interval's rows at its close, so
        they are the facts as of the interval's end already."""
        return FactsView(self.pods, self.nodes, self.namespaces, self.owners, ksm_reported_ns=self.reported_ns)

    # Checkpoint state: a restart continues with these facts instead of waiting for every object
    # to be scraped again (the log is replayed only from the oldest open interval).

    def state(self) -> dict[str, Any]:
        """As arrays (enrich/factstate.py): the ones `encode_ahead` made if nothing changed since."""
        encoded, self._encoded = self._encoded, None
        if encoded is not None and encoded[0] == self.version:
            return encoded[1]

        return factstate.encode(self.pods, self.nodes, self.namespaces, self.owners)

    def encode_ahead(self) -> None:
        """Make the next `state()` now (an interval computed ahead of its close: its checkpoint
        then has the facts ready), kept only while the facts do not change: in a file with
        `spill`, else in memory."""
        state = self.state()
        self._encoded = (self.version, self._spill(state) if self.spill is not None else state)

    def _spill(self, state: dict[str, Any]) -> Mapping[str, Any]:
        """`state` in a file (`spill`), kept for the next mark while the facts stay as they are
        now; where the file cannot be written `state` itself, kept no longer than its use."""
        spilled = self.spill(state)
        self._spilled = (self.version, spilled) if spilled is not state else None
        return spilled

    def restore(self, state: Mapping[str, Any] | None) -> None:
        """Raises KeyError, TypeError or ValueError on a malformed state (nothing is changed then).
        Reads the arrays of `state()` and the JSON lists written before them; None: no facts."""
        if state is None:
            state = {"pods": [], "nodes": [], "namespaces": [], "owners": []}
        self.version += 1
        if state.get("version") == factstate.VERSION:
            self.pods, self.nodes, self.namespaces, self.owners = factstate.decode(state)
            self._restored()
            return
        pods = {(str(ns), str(name)): _pod(d) for ns, name, d in state["pods"]}
        nodes = {str(name): NodeFacts(dict(d["labels"]), {str(k): float(v) for k, v in d["capacity"].items()},
                                      int(d["seen_ns"])) for name, d in state["nodes"]}
        namespaces = {str(name): NamespaceFacts(dict(d["labels"]), int(d["seen_ns"])) for name, d in state["namespaces"]}
        owners = {(str(k[0]), str(k[1]), str(k[2])): OwnerFacts(str(d["kind"]), str(d["name"]), int(d["seen_ns"]))
                  for k, d in state["owners"]}
        self.pods, self.nodes, self.namespaces, self.owners = pods, nodes, namespaces, owners
        self._restored()

    def _restored(self) -> None:
        self.reported_ns = max((p.seen_ns for p in self.pods.values()), default=0)
        self.repeats = Repeats()
        self.repeats.forget(max((f.seen_ns for table in (self.pods, self.nodes, self.namespaces, self.owners)
                                 for f in table.values()), default=0))


def fact_rows(batch: PointBatch) -> np.ndarray:
    """Which rows of `batch` the facts read: its kube-state-metrics rows, but for
    kube_pod_status_phase's series of the phases a pod is not in. kube-state-metrics writes a
    series per phase, 1 for the pod's phase and 0 for the four others, all at one scrape's
    timestamp: a 0 says nothing the 1 beside it does not (the pod, its uid, that it was reported
    then), and it was four rows in ten of what an open interval held of the facts. Their staleness
    markers stay: they end the pod. (Pods' phases for their use are read from the whole batch:
    enrich/usage.py.)"""
    phase_not_held = (batch.metric == Metric.POD_PHASE) & (batch.value != 1.0) & ~batch.stale
    return is_ksm(batch.metric) & ~phase_not_held


def _replace(facts: Any, name: str, new: dict) -> None:
    """Set `facts.name` to `new` unless it equals it already: maps are replaced, never changed in
    place, and only when they change, so a mark's copies (`mark`) share them while they stay (at
    100,000 GPUs, some 17,000 nodes' labels)."""
    if getattr(facts, name) != new:
        setattr(facts, name, new)


def _copy(obj: Any) -> Any:
    """A shallow copy of a facts object (faster than dataclasses.replace): its dicts are shared,
    as updates replace them rather than change them."""
    cls = type(obj)
    new = object.__new__(cls)
    slots = getattr(cls, "__slots__", None)
    if slots is None:
        new.__dict__.update(obj.__dict__)
    else:
        for name in slots:
            setattr(new, name, getattr(obj, name))
    return new


def _pod(document: Mapping[str, Any]) -> PodFacts:
    fields = dict(document)
    fields["requests"] = {}
    pod = PodFacts(**fields)
    for c, r, q in document["requests"]:
        pod.request(str(c), str(r), float(q))
    if not isinstance(pod.labels, dict) or not isinstance(pod.annotations, dict):
        raise TypeError("pod labels and annotations must be mappings")
    return pod


def last_of_each(rows: np.ndarray, metric: np.ndarray, value_bits: np.ndarray, stale: np.ndarray,
                 attr_off: np.ndarray, attr_key: np.ndarray, attr_val: np.ndarray) -> np.ndarray:
    """Per entry of `rows`, whether no later entry is the same row but for its timestamp (same
    metric, value bits, staleness and labels in the same order): the last row of each series.
    An open-addressing table of row hashes, filled from the end; equal hashes are compared in full
    (enrich/factrows.py `last_of_each_in`, here of one batch)."""
    columns = (metric, value_bits, stale, attr_off, attr_key, attr_val)
    return last_of_each_in(rows, len(metric), *columns, *columns)


def latest(batch: PointBatch) -> PointBatch:
    """The rows of `batch` (kube-state-metrics rows) in time order, each series' last alone: what
    `KsmFacts.update` applies of them, so applying the result instead of `batch`, or the result
    followed by newer-arriving rows, changes no fact and no order of first meeting. An open
    interval folds its rows with it as they arrive (enrich/window.py): every scrape repeats the
    whole state, and without the fold an interval would hold every copy until it closes."""
    ordered = batch if _in_time_order(batch) else batch.select(np.argsort(batch.time_ns, kind="stable"))
    return _latest_in_order(ordered)


def _latest_in_order(ordered: PointBatch) -> PointBatch:
    """`latest` of rows in time order: each series' last row alone."""
    keep = last_of_each(np.arange(len(ordered), dtype=np.int64), ordered.metric, ordered.value.view(np.int64),
                        ordered.stale, ordered.attr_off, ordered.attr_key, ordered.attr_val)
    return ordered.select(keep)


def _ksm_rows(batch: PointBatch) -> PointBatch:
    """The kube-state-metrics rows of `batch` (an interval's facts: all of them, no copy)."""
    ksm = is_ksm(batch.metric)
    return batch if ksm.all() else batch.select(ksm)


def _in_time_order(batch: PointBatch) -> bool:
    return bool(np.all(batch.time_ns[1:] >= batch.time_ns[:-1]))


def last_of_each_reference(rows: np.ndarray, batch: PointBatch) -> np.ndarray:
    """`last_of_each`, readable: the same, with a set of row keys."""
    seen: set = set()
    keep = np.zeros(len(rows), bool)
    bits = batch.value.view(np.int64)
    for i in range(len(rows) - 1, -1, -1):
        row = int(rows[i])
        lo, hi = int(batch.attr_off[row]), int(batch.attr_off[row + 1])
        key = (int(batch.metric[row]), int(bits[row]), bool(batch.stale[row]), tuple(batch.attr_key[lo:hi].tolist()),
               tuple(batch.attr_val[lo:hi].tolist()))
        keep[i] = key not in seen
        seen.add(key)
    return keep


def warm_up() -> str:
    """Compile (or load from numba's cache) `last_of_each` and the open intervals' table of rows
    (enrich/factrows.py); returns how the first was (otelgpu.core.jit.how_loaded)."""
    from otelgpu.core.jit import how_loaded
    from otelgpu.enrich import factrows

    one = np.zeros(1, np.int32)
    last_of_each(np.zeros(1, np.int64), np.zeros(1, np.int16), np.zeros(1, np.int64), np.zeros(1, bool),
                 np.array([0, 1], np.int64), one, one)
    factrows.warm_up()
    return how_loaded(last_of_each_in)




class MergedFacts:
    """kube-state-metrics facts and the Kubernetes API's, merged per object at each view (see merge)."""

    def __init__(self, ksm: KsmFacts, api: FactSource) -> None:
        self.ksm, self.api = ksm, api

    def view(self, as_of_ns: int | None = None) -> FactsView:
        return merge(self.ksm.view(as_of_ns), self.api.view(as_of_ns))
