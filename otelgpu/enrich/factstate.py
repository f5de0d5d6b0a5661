"""The kube-state-metrics facts in a checkpoint, as arrays.

Every string is written once, in a table; each object's string fields are columns of ids into it,
its numbers columns of numbers, and its labels, annotations, requests and capacities rows of
(object, key id, value). Writing them is one pass over the objects, with no dict per object and
no JSON text of every label (the checkpoint writes arrays as their bytes). `decode` checks that
the arrays fit together before anything is built from them.
"""

from __future__ import annotations

from array import array
from typing import Any, Mapping

import numpy as np

from otelgpu.checkpoint import string_arrays, texts_of
from otelgpu.enrich.model import NamespaceFacts, NodeFacts, OwnerFacts, OwnerKey, PodFacts, shared_map

VERSION = 2
POD_TEXT = ("uid", "node", "phase", "owner_kind", "owner_name", "info_node", "request_node")


class _Texts:
    """Ids of strings, in the order first met."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        code = self.ids.get(text)
        if code is None:
            code = self.ids[text] = len(self.ids)
        return code

    def arrays(self) -> dict[str, np.ndarray]:
        utf8, ends = string_arrays(list(self.ids))
        return {"utf8": utf8, "ends": ends}


def _rows(flat: array, width: int) -> np.ndarray:
    """Rows of `width` numbers written end to end, as an array over their memory (no copy)."""
    return np.frombuffer(flat, np.uint32 if flat.typecode == "I" else np.int64).reshape(-1, width)


def _ids() -> array:
    """Numbers gathered for `_rows`: 4 bytes each (string ids, object indices), with no Python
    number kept per entry."""
    return array("I")


def encode(pods: Mapping[tuple[str, str], PodFacts], nodes: Mapping[str, NodeFacts],
           namespaces: Mapping[str, NamespaceFacts], owners: Mapping[OwnerKey, OwnerFacts]) -> dict[str, Any]:
    texts = _Texts()
    pod_arrays = _encode_pods(texts, pods)
    node_labels, capacity, amounts = _ids(), _ids(), []
    for i, node in enumerate(nodes.values()):
        for k, v in node.labels.items():
            node_labels.extend((i, texts(k), texts(v)))
        for resource, q in node.capacity.items():
            capacity.extend((i, texts(resource)))
            amounts.append(q)
    ns_labels = _ids()
    for i, ns in enumerate(namespaces.values()):
        for k, v in ns.labels.items():
            ns_labels.extend((i, texts(k), texts(v)))
    owner_text = array("I", [texts(x) for key, o in owners.items() for x in (*key, o.kind, o.name)])
    return {
        "version": VERSION,
        "pods": pod_arrays,
        "nodes": {"name": np.array([texts(n) for n in nodes], np.int64),
                  "seen_ns": np.array([n.seen_ns for n in nodes.values()], np.int64),
                  "provider_id": np.array([texts(n.provider_id) for n in nodes.values()], np.int64),
                  "labels": _rows(node_labels, 3), "capacity": _rows(capacity, 2),
                  "amount": np.array(amounts, np.float64)},
        "namespaces": {"name": np.array([texts(n) for n in namespaces], np.int64),
                       "seen_ns": np.array([n.seen_ns for n in namespaces.values()], np.int64),
                       "labels": _rows(ns_labels, 3)},
        "owners": {"text": _rows(owner_text, 5),
                   "seen_ns": np.array([o.seen_ns for o in owners.values()], np.int64)},
        "strings": texts.arrays(),  # last: every string above is in it
    }


def _encode_pods(texts: _Texts, pods: Mapping[tuple[str, str], PodFacts]) -> dict[str, np.ndarray]:
    keys, text, labels, annotations, requests = _ids(), _ids(), _ids(), _ids(), _ids()
    numbers = array("q")
    ended: list[int] = []
    deleted: list[bool] = []
    quantities: list[float] = []
    for i, ((namespace, name), p) in enumerate(pods.items()):
        keys.extend((texts(namespace), texts(name)))
        text.extend((texts(p.uid), texts(p.node), texts(p.phase), texts(p.owner_kind), texts(p.owner_name),
                     texts(p.info_node), texts(p.request_node)))
        numbers.extend((p.seen_ns, p.created_ns))
        ended.append(p.ended_ns)
        deleted.append(p.deleted)
        for k, v in p.labels.items():
            labels.extend((i, texts(k), texts(v)))
        for k, v in p.annotations.items():
            annotations.extend((i, texts(k), texts(v)))
        for (container, resource), q in p.requests.items():
            requests.extend((i, texts(container), texts(resource)))
            quantities.append(q)
    return {"key": _rows(keys, 2), "text": _rows(text, len(POD_TEXT)),
            "ns": _rows(numbers, 2), "ended": np.array(ended, np.int64), "deleted": np.array(deleted, bool),
            "labels": _rows(labels, 3), "annotations": _rows(annotations, 3),
            "requests": _rows(requests, 3), "quantity": np.array(quantities, np.float64)}


class _Table:
    """A state's string table, and its arrays read with their shapes checked."""

    def __init__(self, strings: Mapping[str, Any]) -> None:
        self.words = texts_of(strings["utf8"], strings["ends"])

    @staticmethod
    def ids(table: Any, width: int, rows: int | None = None) -> list:
        table = np.asarray(table)
        if table.dtype.kind not in "iu" or table.ndim != 2 or table.shape[1] != width or \
                (rows is not None and table.shape[0] != rows):
            raise ValueError(f"facts state: an id table of shape {table.shape} ({table.dtype}), expected (n, {width})")
        return table.tolist()

    @staticmethod
    def column(values: Any, rows: int | None, kind: str) -> list:
        values = np.asarray(values)
        if values.ndim != 1 or (rows is not None and values.shape[0] != rows) or values.dtype.kind not in kind:
            raise ValueError(f"facts state: a column of shape {values.shape} ({values.dtype}) where {rows} were "
                             "expected")
        return values.tolist()

    def word(self, index: int) -> str:
        if not 0 <= index < len(self.words):
            raise ValueError(f"facts state: string id {index} is not in the table of {len(self.words)}")
        return self.words[index]

    def attach(self, rows: list, objects: list, mapping: str) -> None:
        """(object, key, value) rows into a dict field of the objects."""
        for o, k, v in rows:
            getattr(_at(objects, o), mapping)[self.word(k)] = self.word(v)


def decode(state: Mapping[str, Any]) -> tuple[dict, dict, dict, dict]:
    """(pods, nodes, namespaces, owners) of `encode`'s output; ValueError, KeyError or TypeError
    when the arrays do not fit together."""
    table = _Table(state["strings"])
    word, ids, column = table.word, table.ids, table.column
    pods = _decode_pods(table, state["pods"])
    node_rows = state["nodes"]
    names = [word(i) for i in column(node_rows["name"], None, "iu")]
    nodes = [NodeFacts(seen_ns=s) for s in column(node_rows["seen_ns"], len(names), "iu")]
    if "provider_id" in node_rows:  # not in checkpoints written before it
        for node, text in zip(nodes, column(node_rows["provider_id"], len(names), "iu")):
            node.provider_id = word(text)
    table.attach(ids(node_rows["labels"], 3), nodes, "labels")
    capacity = ids(node_rows["capacity"], 2)
    for (at, r), q in zip(capacity, column(node_rows["amount"], len(capacity), "f")):
        _at(nodes, at).capacity[word(r)] = float(q)
    namespace_rows = state["namespaces"]
    ns_names = [word(i) for i in column(namespace_rows["name"], None, "iu")]
    namespaces = [NamespaceFacts(seen_ns=seen) for seen in column(namespace_rows["seen_ns"], len(ns_names), "iu")]
    table.attach(ids(namespace_rows["labels"], 3), namespaces, "labels")
    owner_state = state["owners"]
    owner_rows = [list(map(word, row)) for row in ids(owner_state["text"], 5)]
    owners = {(a, b, c): OwnerFacts(kind, name, seen)
              for (a, b, c, kind, name), seen in zip(owner_rows, column(owner_state["seen_ns"], len(owner_rows), "iu"))}
    return pods, dict(zip(names, nodes)), dict(zip(ns_names, namespaces)), owners


def _decode_pods(table: _Table, encoded: Mapping[str, Any]) -> dict[tuple[str, str], PodFacts]:
    word, ids, column = table.word, table.ids, table.column
    keys = [(word(a), word(b)) for a, b in ids(encoded["key"], 2)]
    n_pod = len(keys)
    # not in checkpoints written before it
    ended = column(encoded["ended"], n_pod, "iu") if "ended" in encoded else [0] * n_pod
    pods = [PodFacts(**dict(zip(POD_TEXT, map(word, row))), seen_ns=seen, created_ns=created, deleted=gone,
                     ended_ns=end)
            for row, (seen, created), gone, end in zip(ids(encoded["text"], len(POD_TEXT), n_pod),
                                                       ids(encoded["ns"], 2, n_pod),
                                                       column(encoded["deleted"], n_pod, "b"), ended)]
    table.attach(ids(encoded["labels"], 3), pods, "labels")
    table.attach(ids(encoded["annotations"], 3), pods, "annotations")
    requests = ids(encoded["requests"], 3)
    for (o, c, r), q in zip(requests, column(encoded["quantity"], len(requests), "f")):
        _at(pods, o).request(word(c), word(r), float(q))
    for pod in pods:  # each pod's own maps, filled above: shared from here on, as updates share them
        pod.labels, pod.annotations = shared_map(pod.labels), shared_map(pod.annotations)
    return dict(zip(keys, pods))


def _at(objects: list, index: int) -> Any:
    if not 0 <= index < len(objects):
        raise ValueError(f"facts state: a row for object {index} of {len(objects)}")
    return objects[index]
