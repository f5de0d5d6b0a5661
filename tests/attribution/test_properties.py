"""Invariants of the `request` model (docs/cost-model.md section 1) as hypothesis properties."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from otelgpu.attribution.engine import Attribution, UnitRows, attribute_request

SETTINGS = settings(max_examples=100, deadline=None)
ROW_OUTPUTS = ("alloc", "effective", "waste", "unmeasured", "held_s")
UNIT = st.floats(0.0, 1.0, allow_nan=False)
FRACTION = st.one_of(st.sampled_from([1.0, 1 / 7, 2 / 7, 3 / 7, 4 / 7, 1 / 2, 1 / 4, 1 / 8, 0.0]), UNIT)
SHARE = st.one_of(st.just(1.0), UNIT)
ACTIVITY = st.one_of(st.just(float("nan")), st.just(0.0), st.just(1.0), UNIT)
PRICE = st.one_of(st.just(0.0), st.floats(0.01, 200.0))
DT = st.one_of(st.sampled_from([1.0, 15.0, 60.0, 300.0, 900.0, 3600.0]), st.floats(0.5, 7200.0))


@st.composite
def clusters(draw, max_gpus: int = 8, max_rows: int = 30) -> tuple[UnitRows, np.ndarray]:
    """(rows, node id of each GPU)."""
    n_gpu = draw(st.integers(1, max_gpus))
    prices = np.array(draw(st.lists(PRICE, min_size=n_gpu, max_size=n_gpu)))
    node = np.array(draw(st.lists(st.integers(0, 2), min_size=n_gpu, max_size=n_gpu)))
    row = st.tuples(st.integers(0, n_gpu - 1), FRACTION, SHARE, UNIT, ACTIVITY)
    rs = draw(st.lists(row, max_size=max_rows))
    cols = list(zip(*rs)) if rs else [()] * 5
    rows = UnitRows(prices, np.array(cols[0], dtype=np.int64), np.array(cols[1], dtype=float),
                    np.array(cols[2], dtype=float), np.array(cols[3], dtype=float), np.array(cols[4], dtype=float))
    return rows, node


def _scale(out: Attribution) -> float:
    return max(1e-300, float(np.max(out.capacity, initial=0.0)))


def _subset(rows: UnitRows, idx: np.ndarray, gpu_map: np.ndarray | None = None, gpus=None) -> UnitRows:
    return UnitRows(rows.gpu_price_hour if gpus is None else rows.gpu_price_hour[gpus],
                    rows.row_gpu[idx] if gpu_map is None else gpu_map[rows.row_gpu[idx]],
                    rows.row_f[idx], rows.row_share[idx], rows.row_measured[idx], rows.row_activity[idx])


@SETTINGS
@given(clusters(), DT)
def test_conservation_per_gpu_node_and_cluster(cluster, dt) -> None:
    rows, node = cluster
    out = attribute_request(rows, dt)
    n_gpu = len(rows.gpu_price_hour)
    np.testing.assert_allclose(out.capacity, rows.gpu_price_hour * dt / 3600.0, rtol=1e-12, atol=0)
    per_gpu = np.bincount(rows.row_gpu, weights=out.alloc, minlength=n_gpu) + out.idle
    np.testing.assert_allclose(per_gpu, out.capacity, rtol=1e-9, atol=1e-300)
    per_node = np.bincount(node, weights=per_gpu, minlength=3)
    node_capacity = np.bincount(node, weights=rows.gpu_price_hour, minlength=3) * dt / 3600.0
    np.testing.assert_allclose(per_node, node_capacity, rtol=1e-9, atol=1e-300)
    cluster_total = out.alloc.sum() + out.idle.sum()
    assert abs(cluster_total - rows.gpu_price_hour.sum() * dt / 3600.0) <= 1e-9 * _scale(out) * n_gpu


@SETTINGS
@given(clusters(), DT)
def test_idle_never_negative_and_parts_add_up(cluster, dt) -> None:
    rows, _ = cluster
    out = attribute_request(rows, dt)
    assert np.all(out.idle >= 0.0)
    assert np.all(out.idle <= out.capacity * (1 + 1e-12))
    for name in ROW_OUTPUTS:
        assert np.all(getattr(out, name) >= 0.0), name
    parts = out.effective + out.waste + out.unmeasured
    np.testing.assert_allclose(parts, out.alloc, rtol=1e-12, atol=1e-15 * _scale(out))
    # Effective cost never exceeds what was held, and unmeasured rows have no effective/waste.
    assert np.all(out.effective <= out.alloc * (1 + 1e-12) + 1e-300)
    nan = np.isnan(rows.row_activity)
    assert np.all(out.effective[nan] == 0.0) and np.all(out.waste[nan] == 0.0)


@SETTINGS
@given(clusters(), DT)
def test_unit_rows_never_billed_above_their_fraction(cluster, dt) -> None:
    """A replica / MIG row (f < 1) never pays more than f * P * dt / 3600, nor holds more than f * dt."""
    rows, _ = cluster
    out = attribute_request(rows, dt)
    cap = rows.row_f * rows.gpu_price_hour[rows.row_gpu] * dt / 3600.0
    assert np.all(out.alloc <= cap * (1 + 1e-12) + 1e-300)
    assert np.all(out.held_s <= rows.row_f * dt * (1 + 1e-12) + 1e-300)
    part = rows.row_f < 1.0
    assert np.all(out.alloc[part] <= cap[part] * (1 + 1e-12) + 1e-300)


@SETTINGS
@given(clusters(), DT, st.randoms(use_true_random=False))
def test_independent_of_row_order(cluster, dt, rnd) -> None:
    rows, _ = cluster
    perm = np.arange(len(rows.row_gpu))
    rnd.shuffle(perm)
    base = attribute_request(rows, dt)
    shuffled = attribute_request(_subset(rows, perm), dt)
    atol = 1e-12 * _scale(base)
    for name in ROW_OUTPUTS:
        np.testing.assert_allclose(getattr(shuffled, name), getattr(base, name)[perm], rtol=1e-12, atol=atol,
                                   err_msg=name)
    np.testing.assert_allclose(shuffled.capacity, base.capacity, rtol=0, atol=0)
    np.testing.assert_allclose(shuffled.idle, base.idle, rtol=1e-12, atol=atol)


@SETTINGS
@given(clusters(), st.integers(1, 12), st.sampled_from([60.0, 900.0, 3600.0, 86400.0]))
def test_sub_intervals_sum_to_one_interval(cluster, k, total) -> None:
    """Attributing `total` seconds as k equal sub-intervals (same inputs) and summing equals one interval."""
    rows, _ = cluster
    whole = attribute_request(rows, total)
    parts = [attribute_request(rows, total / k) for _ in range(k)]
    atol = 1e-12 * _scale(whole)
    for name in ROW_OUTPUTS + ("capacity", "idle"):
        summed = np.sum([getattr(p, name) for p in parts], axis=0)
        np.testing.assert_allclose(summed, getattr(whole, name), rtol=1e-9, atol=atol, err_msg=name)


@SETTINGS
@given(clusters())
def test_cluster_split_by_node_equals_whole_cluster(cluster) -> None:
    """Attribution is per GPU: running each node's GPUs as its own batch gives the same figures."""
    rows, node = cluster
    whole = attribute_request(rows, 60.0)
    alloc = np.full(len(rows.row_gpu), np.nan)
    idle = np.full(len(rows.gpu_price_hour), np.nan)
    for n in np.unique(node):
        gpus = np.flatnonzero(node == n)
        gpu_map = np.full(len(node), -1)
        gpu_map[gpus] = np.arange(len(gpus))
        idx = np.flatnonzero(node[rows.row_gpu] == n)
        part = attribute_request(_subset(rows, idx, gpu_map, gpus), 60.0)
        alloc[idx] = part.alloc
        idle[gpus] = part.idle
    atol = 1e-12 * _scale(whole)
    np.testing.assert_allclose(alloc, whole.alloc, rtol=1e-12, atol=atol)
    np.testing.assert_allclose(idle, whole.idle, rtol=1e-12, atol=atol)
