"""group_ids (packed keys, one sort) against numpy's unique rows."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from otelgpu.core.grouping import _first_seen_numpy, first_seen, first_seen_reference, group_ids, group_ids_reference

COLUMN_KINDS = {
    "code": lambda rng, n: rng.integers(-1, 6, n).astype(np.int32),  # interned strings, -1 for none
    "flag": lambda rng, n: rng.integers(0, 2, n).astype(bool),
    "time": lambda rng, n: (1_790_000_000_000_000_000 + rng.integers(0, 4, n) * 15_000_000_000).astype(np.int64),
    "wide": lambda rng, n: rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64, endpoint=True),
    "extremes": lambda rng, n: rng.choice(np.array([-2**63, -1, 0, 2**63 - 1], dtype=np.int64), n),
    # narrower integers are packed as they are, without an int64 copy; uint64 wraps to int64
    "metric": lambda rng, n: rng.integers(0, 40, n).astype(np.int16),
    "bits": lambda rng, n: rng.integers(0, 256, n).astype(np.uint8),
    "unsigned": lambda rng, n: rng.choice(np.array([0, 1, 2**31, 2**32 - 1], dtype=np.uint32), n),
    "hash": lambda rng, n: rng.choice(np.array([0, 5, 2**63, 2**64 - 1], dtype=np.uint64), n),
}


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 300), st.lists(st.sampled_from(sorted(COLUMN_KINDS)), min_size=1,
                                                                 max_size=12))
def test_same_ids_and_first_rows_as_unique_rows(seed, n, kinds):
    rng = np.random.default_rng(seed)
    cols = [COLUMN_KINDS[k](rng, n) for k in kinds]
    copies = [c.copy() for c in cols]
    ids, first = group_ids(*cols)
    assert all(np.array_equal(c, copy) for c, copy in zip(cols, copies))  # the columns are left as they were
    want_ids, want_first = group_ids_reference(*cols)
    assert ids.tolist() == want_ids.tolist()
    assert first.tolist() == want_first.tolist()
    narrow = group_ids(*cols, dtype=np.int32)  # what a caller whose rows fit in 4 bytes asks for
    assert [a.dtype for a in narrow] == [np.int32, np.int32]
    assert narrow[0].tolist() == want_ids.tolist() and narrow[1].tolist() == want_first.tolist()


def test_many_narrow_columns_need_several_keys():
    rng = np.random.default_rng(7)
    cols = [rng.integers(0, 1 << 20, 5000) for _ in range(8)]  # 160 bits: three packed keys
    cols[3][:2500] = cols[3][2500:]  # repeated rows
    for c in cols:
        c[:2500] = c[2500:]
    ids, first = group_ids(*cols)
    want_ids, want_first = group_ids_reference(*cols)
    assert ids.tolist() == want_ids.tolist() and first.tolist() == want_first.tolist()
    assert ids.max() + 1 == 2500


def test_empty():
    ids, first = group_ids(np.zeros(0, np.int32), np.zeros(0, np.int64))
    assert len(ids) == 0 and len(first) == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-3, 2**31 - 1) | st.sampled_from([-1, 0, 7, 2**31 - 1]), max_size=400),
       st.sampled_from([np.int32, np.int64]))
def test_first_seen_numbers_the_codes_as_met(values, dtype):
    column = np.array(values, dtype)
    want_distinct, want_place = first_seen_reference(column)
    for distinct, place in (first_seen(column), _first_seen_numpy(column)):  # compiled; what interpreted kernels run
        assert distinct.tolist() == want_distinct.tolist() and distinct.dtype == dtype
        assert place.tolist() == want_place.tolist() and place.dtype == np.int32
    assert np.array_equal(np.where(place >= 0, distinct[np.maximum(place, 0)] if len(distinct) else -1, -1),
                          np.where(column >= 0, column, -1))  # each value found again at its place


def test_first_seen_keeps_each_of_many_codes_once():
    """Five thousand codes spread over a range far larger than the table, each met three times."""
    column = np.tile(np.arange(0, 64 * 5000, 64, dtype=np.int64), 3)
    distinct, place = first_seen(column)
    assert distinct.tolist() == column[:5000].tolist()
    assert place.tolist() == list(range(5000)) * 3
