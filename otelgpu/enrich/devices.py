"""What otelgpu remembers of each node's GPUs between intervals, so that money never vanishes
when dcgm-exporter does.

A failed scrape reaches otelgpu as staleness markers on every series of the target, then as
nothing at all. For a node whose exporter went silent, the GPUs and MIG instances it last reported
are brought into the next intervals as *dark* entities (only a staleness marker at the interval's
start): they still cost their capacity, and the join places on them the pod that held each one
last, or the Running pods that request that kind of unit, unmeasured. A node is remembered while
kube-state-metrics or the Kubernetes API report it, and forgotten once they report nodes without
it (drained, scaled in); a node only DCGM ever showed is remembered for `memory_ns`.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Callable, Iterator, Mapping

import numpy as np

from otelgpu.checkpoint import string_ids, texts_of
from otelgpu.core.grouping import group_ids
from otelgpu.enrich.samples import AnySamples, Samples
from otelgpu.receiver.interner import Interner
from otelgpu.receiver.schema import Metric

Entity = tuple[str, str, str, str]  # uuid, GPU_I_ID, GPU_I_PROFILE, modelName
Key = tuple[str, str, str]  # node, uuid, GPU_I_ID


@dataclass
class _Node:
    seen_ns: int
    # uuid, GPU_I_ID, GPU_I_PROFILE and modelName of each entity in turn: one tuple a node, where
    # a tuple an entity took 35 MiB at 100,000 GPUs (a MIG node has 56 entities)
    entities: tuple[str, ...]

    def each(self) -> Iterator[Entity]:
        fields = iter(self.entities)
        return zip(fields, fields, fields, fields)


class DeviceMemory:
    key = "devices"  # its checkpoint entry (core/state.py)

    def __init__(self, strings: Interner, memory_ns: int) -> None:
        self.strings, self.memory_ns = strings, memory_ns
        self._nodes: dict[str, _Node] = {}
        self._holders: dict[Key, tuple[str, str]] = {}  # the pod that held each entity last

    def fill(self, samples: AnySamples, start_ns: int, end_ns: int, known_nodes: set[str]) -> AnySamples:
        """`s` plus one staleness marker at `start_ns` for each entity of each remembered node
        that sent nothing this interval; remembers what `s` shows."""
        st, code = self.strings.string, self.strings.code
        present = {st(int(c)) for c in np.unique(samples.node)}
        self._remember(samples, present, end_ns)
        rows: list[tuple[int, ...]] = []
        for name in [n for n in self._nodes if n not in present]:
            node = self._nodes[name]
            known = name in known_nodes
            if (known_nodes and not known) or (not known and end_ns - node.seen_ns > self.memory_ns):
                self._forget(name)
                continue
            rows += [(code(name), code(u), code(g) if g else -1, code(p) if p else -1, code(m))
                     for u, g, p, m in node.each()]
        if not rows:
            return samples
        n_row = len(rows)
        cols = np.array(rows, dtype=np.int32).T
        none = np.full(n_row, -1, dtype=np.int32)
        dark = Samples(np.full(n_row, Metric.GR_ENGINE_ACTIVE, np.int16), np.full(n_row, start_ns, np.int64),
                       np.full(n_row, np.nan), np.ones(n_row, bool), cols[0], cols[1], cols[2], cols[3], cols[4],
                       none, none, none, none, none)
        return samples.with_samples(dark)

    def _remember(self, samples: AnySamples, present: set[str], end_ns: int) -> None:
        """The entities each node shows (in the order first seen) and who held each one last;
        strings are looked up once per distinct code (`Interner.texts`)."""
        live = np.flatnonzero(~samples.stale)  # a node with only staleness markers still has what it had
        _, first = group_ids(*(samples.at(name, live) for name in ("node", "uuid", "gi")))
        rows = live[first]
        del live, first
        node_of, node_first = group_ids(samples.at("node", rows))
        order = np.argsort(node_of, kind="stable")  # nodes as first seen, each one's entities in order
        ends = np.cumsum(np.bincount(node_of, minlength=len(node_first))).tolist()
        # each field of the entities, node after node: a list each (no array or list of all four)
        texts = self.strings.texts
        fields = [texts(samples.at(name, rows[order])).tolist() for name in ("uuid", "gi", "profile", "model")]
        for name, lo, hi in zip(texts(samples.at("node", rows[node_first])).tolist(), [0, *ends[:-1]], ends):
            entities = tuple(chain.from_iterable(zip(*(field[lo:hi] for field in fields))))  # four fields each
            known = self._nodes.get(name)
            if known is not None and known.entities == entities:
                entities = known.entities  # the same GPUs: one tuple, not one more each interval a mark keeps
            self._nodes[name] = _Node(end_ns, entities)
        del fields, rows, order
        held = np.flatnonzero(~samples.stale & (samples.pod >= 0))
        if not len(held):
            return
        key, _ = group_ids(*(samples.at(name, held) for name in ("node", "uuid", "gi")))
        order = np.argsort(samples.time_ns[held], kind="stable")  # the latest sample wins, the last of equal times
        rank = np.empty(len(held), np.int64)
        rank[order] = np.arange(len(held))
        latest = np.full(int(key.max()) + 1, -1, np.int64)
        np.maximum.at(latest, key, rank)
        last = held[order[latest]]
        del held, key, order, rank, latest
        node, uuid, gi, ns, pod = (texts(samples.at(name, last)).tolist()
                                   for name in ("node", "uuid", "gi", "namespace", "pod"))
        holders = self._holders
        for key, holder in zip(zip(node, uuid, gi), zip(ns, pod)):
            if holders.get(key) != holder:  # else the tuples a mark shares stay: no second copy each interval
                holders[key] = holder

    def _forget(self, name: str) -> None:
        del self._nodes[name]
        for key in [k for k in self._holders if k[0] == name]:
            del self._holders[key]

    def mark(self) -> Callable[[], None]:
        """What puts the memory back as it is now (`fill` remembers and forgets)."""
        nodes, holders = dict(self._nodes), dict(self._holders)  # _Node entries are replaced, not changed

        def undo() -> None:
            self._nodes, self._holders = nodes, holders

        return undo

    def last_holder(self, node: str, uuid: str, gi: str) -> tuple[str, str] | None:
        return self._holders.get((node, uuid, gi))

    def expire(self, end_ns: int) -> None:
        """Nothing: `fill` forgets the nodes not seen for longer than it remembers them."""

    def state(self) -> dict[str, np.ndarray]:
        """Every node as arrays: its name and each field of its entities in turn as ids in one
        table of strings (`checkpoint.string_ids`), when it was seen, and where its entities end."""
        nodes = self._nodes.values()
        codes, strings, string_ends = string_ids(chain(self._nodes, (f for n in nodes for f in n.entities)))
        names, fields = codes[:len(self._nodes)], codes[len(self._nodes):]
        return {"names": names, "seen_ns": np.fromiter((n.seen_ns for n in nodes), np.int64, len(names)),
                "entity_ends": np.cumsum(np.fromiter((len(n.entities) // 4 for n in nodes), np.int64, len(names))),
                "fields": fields, "strings": strings, "string_ends": string_ends}

    def restore(self, state: Mapping[str, np.ndarray] | list[list] | None) -> None:
        """Reads `state()`'s arrays and the lists versions before them wrote (name, seen, the
        entities' four fields each); ValueError when they do not fit together."""
        if isinstance(state, Mapping):
            state = _listed(state)
        nodes = {}
        for name, seen, ents in state or ():
            if any(len(e) != 4 for e in ents):
                raise ValueError(f"device memory of node {name!r}: an entity without its four fields")
            nodes[str(name)] = _Node(int(seen), tuple(str(field) for e in ents for field in e))
        self._nodes = nodes


def _listed(state: Mapping[str, np.ndarray]) -> list[list]:
    """`DeviceMemory.state()`'s arrays as the lists versions before it wrote."""
    text = texts_of(state["strings"], state["string_ends"])
    names, fields, ends = (np.asarray(state[k], np.int64) for k in ("names", "fields", "entity_ends"))
    seen = np.asarray(state["seen_ns"], np.int64)
    if (len(seen) != len(names) or len(ends) != len(names) or np.any(np.diff(ends, prepend=0) < 0)
            or 4 * (int(ends[-1]) if len(ends) else 0) != len(fields)
            or np.any((names < 0) | (names >= len(text))) or np.any((fields < 0) | (fields >= len(text)))):
        raise ValueError("device memory arrays do not fit together")
    words = [text[c] for c in fields.tolist()]
    entities = [tuple(words[k:k + 4]) for k in range(0, len(words), 4)]
    return [[text[n], s, entities[a:b]]
            for n, s, a, b in zip(names.tolist(), seen.tolist(), [0, *ends[:-1].tolist()], ends.tolist())]
