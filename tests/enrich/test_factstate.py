"""The facts survive a checkpoint as arrays: whatever the strings, the same objects come back in
the same order; arrays that do not fit together are refused with nothing changed; the JSON
lists of older checkpoints are still read."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otelgpu import checkpoint
from otelgpu.enrich.facts import KsmFacts
from otelgpu.enrich.model import NamespaceFacts, NodeFacts, OwnerFacts, PodFacts
from otelgpu.receiver.interner import Interner

IDENTITY = checkpoint.Identity("c", "USD")
text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=6) | st.sampled_from(["", "\0", "\udcff", "é"])
labels = st.dictionaries(text, text, max_size=3)
ns = st.integers(0, 2**62)
pods = st.builds(PodFacts, uid=text, node=text, phase=text, labels=labels,
                 requests=st.dictionaries(st.tuples(text, text), st.floats(0, 1e12), max_size=3),
                 owner_kind=text, owner_name=text, seen_ns=ns, annotations=labels, deleted=st.booleans(),
                 created_ns=ns, info_node=text, request_node=text, ended_ns=ns)
facts_tables = st.tuples(
    st.dictionaries(st.tuples(text, text), pods, max_size=5),
    st.dictionaries(text, st.builds(NodeFacts, labels=labels, capacity=st.dictionaries(text, st.floats(0, 1e6), max_size=3),
                                    seen_ns=ns, provider_id=text), max_size=3),
    st.dictionaries(text, st.builds(NamespaceFacts, labels=labels, seen_ns=ns), max_size=3),
    st.dictionaries(st.tuples(text, text, text), st.builds(OwnerFacts, text, text, ns), max_size=3),
)


def _facts(tables: tuple) -> KsmFacts:
    facts = KsmFacts(Interner(), ttl_ns=1)
    facts.pods, facts.nodes, facts.namespaces, facts.owners = copy.deepcopy(tables)
    return facts


def _tables(facts: KsmFacts) -> list:
    return [list(t.items()) for t in (facts.pods, facts.nodes, facts.namespaces, facts.owners)]


def _through_checkpoint(state: dict) -> dict:
    data = checkpoint.encode(IDENTITY, {"facts": state}, 1)
    return checkpoint.decode(data, IDENTITY)["facts"]


@settings(max_examples=150, deadline=None)
@given(facts_tables)
def test_facts_come_back_from_a_checkpoint_as_they_were(tables):
    facts = _facts(tables)
    restored = KsmFacts(Interner(), ttl_ns=1)
    restored.restore(_through_checkpoint(facts.state()))
    assert _tables(restored) == _tables(facts)  # the same objects, in the same order


def _fields(facts) -> dict:  # noqa: ANN001 - a dataclass of facts
    return {f.name: getattr(facts, f.name) for f in dataclasses.fields(facts)}


def test_the_json_lists_of_older_checkpoints_are_still_read():
    pod = PodFacts(uid="u", node="n1", phase="Running", labels={"label_team": "a"},
                   requests={("c", "nvidia_com_gpu"): 1.0}, seen_ns=5, info_node="n1")
    facts = _facts(({("ns", "p"): pod}, {"n1": NodeFacts({"label_x": "y"}, {"nvidia_com_gpu": 8.0}, 4)},
                    {"ns": NamespaceFacts({"label_team": "b"}, 3)}, {("ns", "ReplicaSet", "rs"): OwnerFacts("Deployment", "d", 2)}))
    plain = dict({f.name: getattr(pod, f.name) for f in dataclasses.fields(pod)}, requests=[[c, r, q] for (c, r), q in pod.requests.items()])
    older = {"pods": [["ns", "p", plain]], "nodes": [["n1", _fields(facts.nodes["n1"])]],
             "namespaces": [["ns", _fields(facts.namespaces["ns"])]],
             "owners": [[["ns", "ReplicaSet", "rs"], vars(facts.owners[("ns", "ReplicaSet", "rs")])]]}
    restored = KsmFacts(Interner(), ttl_ns=1)
    restored.restore(older)
    assert _tables(restored) == _tables(facts)


def test_a_checkpoint_written_before_pods_had_an_end_is_read_with_none_ended():
    facts = _facts(({("ns", "p"): PodFacts(uid="u", seen_ns=5, ended_ns=9)}, {}, {}, {}))
    state = _through_checkpoint(facts.state())
    del state["pods"]["ended"]
    restored = KsmFacts(Interner(), ttl_ns=1)
    restored.restore(state)
    assert restored.pods == {("ns", "p"): PodFacts(uid="u", seen_ns=5)} and restored.reported_ns == 5


def _broken(state: dict, where: str, value: object) -> dict:
    state = copy.deepcopy(state)
    table, key = where.split(".")
    state[table][key] = value
    return state


@pytest.mark.parametrize("where, value", [
    ("pods.key", np.array([[0, 10_000]])),  # a string id past the table
    ("pods.labels", np.array([[7, 0, 0]])),  # a label of a pod that is not there
    ("pods.text", np.zeros((1, 3), np.int64)),  # too few string columns
    ("pods.deleted", np.zeros(0, bool)),  # a column shorter than the pods
    ("pods.ended", np.zeros(2, np.int64)),
    ("nodes.capacity", np.array([[3, 0]])),
    ("owners.text", np.array([[0, 0, 0, 0]])),
    ("strings.ends", np.array([1, 0])),  # ends that go backwards
    ("strings.utf8", np.zeros(3, np.float64)),
])
def test_arrays_that_do_not_fit_together_are_refused_and_nothing_changes(where, value):
    facts = _facts(({("ns", "p"): PodFacts(uid="u", labels={"label_a": "b"})},
                    {"n": NodeFacts({}, {"cpu": 1.0}, 1)}, {}, {("ns", "Job", "j"): OwnerFacts("", "", 1)}))
    target = _facts(({("other", "q"): PodFacts(uid="v")}, {}, {}, {}))
    before = _tables(target)
    with pytest.raises(ValueError):
        target.restore(_broken(_through_checkpoint(facts.state()), where, value))
    assert _tables(target) == before


def test_a_checkpoint_written_before_provider_ids_gives_nodes_without_one():
    facts = KsmFacts(Interner(), ttl_ns=1)
    facts.nodes = {"n1": NodeFacts(labels={"label_a": "b"}, capacity={"cpu": 4.0}, seen_ns=5,
                                   provider_id="aws:///us-east-1a/i-0abc")}
    state = facts.state()
    del state["nodes"]["provider_id"]
    restored = KsmFacts(Interner(), ttl_ns=1)
    restored.restore(_through_checkpoint(state))
    assert restored.nodes == {"n1": NodeFacts(labels={"label_a": "b"}, capacity={"cpu": 4.0}, seen_ns=5)}
