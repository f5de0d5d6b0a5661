"""A batch's labels lifted into columns for many keys at once (`PointBatch.columns`) are what
`PointBatch.column` gives key by key: absent keys, keys never interned (-1), a key asked twice,
a row carrying a key twice (the last one wins in both) and rows without labels."""

from __future__ import annotations

import numpy as np
import pytest
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


BATCH_FIELDS = ("metric", "time_ns", "value", "stale", "resource_node", "resource_pod", "attr_off", "attr_key",
                "attr_val")


@settings(max_examples=300, deadline=None)
@given(rows, st.data())
def test_a_selection_is_the_reference_s_rows_and_labels(labels, data):
    """`select` gathers labels with a kernel, `select_reference` with numpy's indices: the same
    rows in the order asked (a mask, indices repeated or counted from the end, none), each with its
    labels, same types; a row that is not there is refused before any label is read."""
    batch = batch_of(labels)
    batch.time_ns[:] = np.arange(len(batch))  # rows told apart by more than their labels
    n_row = len(batch)
    chosen = [np.array(data.draw(st.lists(st.booleans(), min_size=n_row, max_size=n_row)), bool),
              np.array(data.draw(st.lists(st.integers(-n_row, max(n_row - 1, 0)), max_size=40 if n_row else 0)),
                       np.int64),
              np.zeros(0, np.int64)]
    for rows_wanted in chosen:
        got, want = batch.select(rows_wanted), batch.select_reference(rows_wanted)
        for name in BATCH_FIELDS:
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and a.tolist() == b.tolist(), name
    with pytest.raises(IndexError):
        batch.select(np.array([n_row], np.int64))


@settings(max_examples=100, deadline=None)
@given(rows, st.lists(st.integers(0, 29), max_size=40))
def test_the_interpreted_selection_of_labels_is_the_kernel_s(labels, indices):
    """What interpreted kernels run in place of the labels' gathering gives what it gives."""
    from otelgpu.receiver.decode import _select_labels_numpy, select_labels

    batch = batch_of(labels)
    idx = np.array([i for i in indices if i < len(batch)], np.int64)
    got = select_labels(batch.attr_off, batch.attr_key, batch.attr_val, idx)
    want = _select_labels_numpy(batch.attr_off, batch.attr_key, batch.attr_val, idx)
    assert all(a.dtype == b.dtype and a.tolist() == b.tolist() for a, b in zip(got, want))
