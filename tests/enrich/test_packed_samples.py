"""Samples waiting in an open interval are packed (each batch's label combinations once): they
come back as they went in, and a string compaction rewrites them as it rewrites plain samples."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from otelgpu.enrich.samples import Samples
from otelgpu.enrich.window import PackedSamples

code = st.integers(-1, 6)


@st.composite
def samples(draw) -> Samples:  # noqa: ANN001
    n = draw(st.integers(0, 30))
    combos = draw(st.lists(st.lists(code, min_size=10, max_size=10), min_size=1, max_size=4))
    rows = np.array([combos[draw(st.integers(0, len(combos) - 1))] for _ in range(n)], np.int32).reshape(n, 10)
    return Samples(np.array(draw(st.lists(st.integers(0, 9), min_size=n, max_size=n)), np.int16),
                   np.array(draw(st.lists(st.integers(0, 10**12), min_size=n, max_size=n)), np.int64),
                   np.array(draw(st.lists(st.floats(allow_nan=True), min_size=n, max_size=n)), np.float64),
                   np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool),
                   *(rows[:, j].copy() for j in range(10)))


def same(a: Samples, b: Samples) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f), equal_nan=f == "value") and
               getattr(a, f).dtype == getattr(b, f).dtype for f in ("metric", "time_ns", "value", "stale", *Samples.CODES))


@settings(max_examples=200, deadline=None)
@given(samples())
def test_packed_samples_unpack_to_what_was_packed(s):
    packed = PackedSamples.pack(s)
    assert same(packed.unpack(), s)
    assert len(packed) == len(s)
    assert len(packed.labels) == len({tuple(r) for r in np.stack([getattr(s, c) for c in Samples.CODES], 1).tolist()})


@settings(max_examples=100, deadline=None)
@given(samples(), st.lists(st.integers(-1, 20), min_size=8, max_size=8))
def test_a_compaction_rewrites_packed_samples_as_plain_ones(s, kept):
    table = np.array(kept[:7] + [-1], np.int64)  # as Interner.compact returns it: table[-1] is -1
    packed, plain = PackedSamples.pack(s), s.take(np.arange(len(s)))
    packed.remap(table)
    plain.remap(table)
    assert same(packed.unpack(), plain)
    assert np.array_equal(np.sort(packed.codes()[0]), np.sort(packed.labels.reshape(-1)))


@settings(max_examples=100, deadline=None)
@given(st.lists(samples(), min_size=1, max_size=5))
def test_packed_parts_joined_then_unpacked_are_the_parts_unpacked_then_joined(parts):
    joined = PackedSamples.concat([PackedSamples.pack(s) for s in parts])
    assert same(joined.unpack(), Samples.concat(parts))
    assert len(joined) == sum(map(len, parts))
