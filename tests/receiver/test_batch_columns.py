"""A batch's labels lifted into columns for many keys at once (`PointBatch.columns`) are what
`PointBatch.column` gives key by key: absent keys, keys never interned (-1), a key asked twice,
a row carrying a key twice (the last one wins in both) and rows without labels."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from otelgpu.receiver.decode import PointBatch

rows = st.lists(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 50)), max_size=6), max_size=30)


def batch_of(labels: list[list[tuple[int, int]]]) -> PointBatch:
    n_row = len(labels)
    off = np.zeros(n_row + 1, np.int64)
    np.cumsum([len(r) for r in labels], out=off[1:])
    flat = [kv for r in labels for kv in r]
    keys = np.array([k for k, _ in flat], np.int32)
    values = np.array([v for _, v in flat], np.int32)
    zeros = np.zeros(n_row, np.int32)
    return PointBatch(np.zeros(n_row, np.int16), np.zeros(n_row, np.int64), np.zeros(n_row), np.zeros(n_row, bool),
                      zeros, zeros, off, keys, values)


@settings(max_examples=300, deadline=None)
@given(rows, st.lists(st.integers(-1, 8), max_size=10))
def test_columns_are_each_keys_column(labels, keys):
    batch = batch_of(labels)
    got = batch.columns(keys)
    assert len(got) == len(keys)
    for key, column in zip(keys, got):
        assert column.dtype == np.int32 and column.tolist() == batch.column(key).tolist()
