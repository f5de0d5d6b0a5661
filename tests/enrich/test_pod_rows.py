"""The GPU holders scad's pod rows look up: per (node, holder), the longest share held there and the
attribution of the last row, found for every pod at once; against the plain way, a dict."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from otelgpu.enrich.holdings import NOBODY
from otelgpu.enrich.pods import _GpuHolders
from otelgpu.enrich.reported import Rows

ROW = st.tuples(st.integers(0, 5), st.integers(0, 6), st.floats(0, 1), st.integers(0, 3))  # gpu, holder, share, attr


def reference(rows: list[tuple[int, int, float, int]], gpu_node: list[int]) -> dict[tuple[int, int], tuple]:
    """(node, holder): (longest share, last row's attribution), in the order the rows name them."""
    out: dict[tuple[int, int], tuple[float, int]] = {}
    for gpu, holder, share, attribution in rows:
        if holder == NOBODY:
            continue
        key = (gpu_node[gpu], holder)
        longest = max(out[key][0], share) if key in out else share
        out[key] = (longest, attribution)
    return out


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(ROW, max_size=40), gpu_node=st.lists(st.integers(0, 2), min_size=6, max_size=6),
       asked=st.lists(st.tuples(st.integers(-1, 2), st.integers(0, 7)), max_size=20))
def test_holders_found_at_once_are_the_dict_s(rows, gpu_node, asked) -> None:
    gpu, holder, share, attribution = (list(c) for c in zip(*rows)) if rows else ([], [], [], [])
    held = _GpuHolders(Rows.of(gpu, 1.0, share, 1.0, np.nan, holder, 0, 0, attribution, 0), np.array(gpu_node), 3)
    want = reference(rows, gpu_node)
    assert list(zip(held.node.tolist(), held.holder.tolist())) == list(want)
    assert list(zip(held.longest.tolist(), held.attribution.tolist())) == list(want.values())
    nodes, holders = (np.array(c, np.int64) for c in zip(*asked)) if asked else (np.zeros(0, np.int64),) * 2
    index = {key: i for i, key in enumerate(want)}
    found = held.find(nodes, holders).tolist()
    assert found == [index.get((n, h), -1) if n >= 0 else -1 for n, h in asked]
