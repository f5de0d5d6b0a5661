"""The interner's codes against a dict and a list: strings numbered as first met, found by value,
and renumbered in their order by a compaction."""

from __future__ import annotations

import sys
import threading

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from otelgpu.receiver.interner import Interner

TEXTS = st.one_of(st.integers(0, 3000).map(str), st.text(max_size=6))  # many strings (tables grown) and odd ones


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(("code", "find", "compact")), st.lists(TEXTS, max_size=400)),
                max_size=12))
def test_codes_are_those_a_dict_of_strings_in_the_order_met_gives(ops: list[tuple[str, list[str]]]) -> None:
    strings, reference = Interner(), {}
    for op, texts in ops:
        if op == "code":
            assert [strings.code(t) for t in texts] == [reference.setdefault(t, len(reference)) for t in texts]
        elif op == "find":
            assert [strings.find(t) for t in texts] == [reference.get(t, -1) for t in texts]
        else:  # keep the strings of `texts` that are interned, renumbered in their old order
            used = np.array([reference[t] for t in texts if t in reference] + [-1], np.int64)
            epoch = strings.epoch
            remap = strings.compact(used)
            kept = sorted({reference[t] for t in texts if t in reference})
            old = list(reference)
            reference = {old[c]: i for i, c in enumerate(kept)}
            assert strings.epoch == epoch + 1
            assert [int(remap[c]) for c in range(len(old))] == [reference.get(t, -1) for t in old]
            assert int(remap[-1]) == -1
        assert len(strings) == len(reference)
        assert strings.strings() == list(reference)
        assert [strings.string(c) for c in range(len(reference))] == list(reference)
    assert strings.string(-1) == ""


def test_threads_interning_at_once_give_each_string_one_code() -> None:
    """Several threads code overlapping strings while the table grows: each string gets one code,
    every code one string."""
    strings = Interner()
    texts = [f"pod-{k}" for k in range(20_000)]
    got: list[list[int]] = [[] for _ in range(4)]
    start = threading.Barrier(4)

    def work(n: int) -> None:
        start.wait()
        got[n] = [strings.code(t) for t in (texts if n % 2 else reversed(texts))]

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got[1] == got[3] == got[0][::-1] == got[2][::-1]
    assert sorted(got[1]) == list(range(len(texts)))
    assert [strings.string(c) for c in got[1]] == texts
    assert [strings.find(t) for t in texts] == got[1]


def test_a_string_interned_before_is_found_while_other_threads_grow_the_table() -> None:
    """`find` takes no lock: while another thread interns enough strings to grow the index again
    and again, every string interned before is found, at its code, every time it is looked up."""
    strings = Interner()
    known = [f"node-{k}" for k in range(3000)]
    codes = [strings.code(t) for t in known]
    done, missed = threading.Event(), []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # hand the interpreter's lock over as often as it will

    def grow() -> None:
        try:
            for k in range(150_000):
                strings.code(f"pod-{k}")
        finally:
            done.set()

    def look() -> None:
        while not done.is_set():
            missed.extend(t for t, c in zip(known, codes) if strings.find(t) != c)

    threads = [threading.Thread(target=grow), threading.Thread(target=look)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    assert not missed
    assert len(strings) == 153_000


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(max_size=3), min_size=1, max_size=8, unique=True), st.lists(st.integers(-1, 7), max_size=30))
def test_texts_of_codes_are_the_strings_one_at_a_time(words: list[str], picks: list[int]) -> None:
    interner = Interner()
    known = [interner.code(w) for w in words]
    codes = np.array([known[p % len(known)] if p >= 0 else -1 for p in picks], np.int32)
    assert interner.texts(codes).tolist() == [interner.string(int(c)) for c in codes.tolist()]
    assert [t for t, c in zip(interner.texts(codes).tolist(), codes.tolist()) if c < 0] == [""] * int((codes < 0).sum())
