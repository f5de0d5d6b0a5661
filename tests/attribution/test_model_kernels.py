"""The share, hybrid and scad kernels against their plain references on random clusters, and the
public SCAD example (AWS's m5.xlarge) reproduced exactly."""

from __future__ import annotations

import numpy as np
import pytest

from otelgpu.attribution.engine import hybrid, scad, share
from otelgpu.attribution.engine_reference import hybrid_reference, scad_reference, share_reference


@pytest.mark.parametrize("seed", range(100))
def test_share_matches_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_group, n_row = int(rng.integers(1, 8)), int(rng.integers(0, 40))
    group = rng.integers(0, n_group, n_row)
    weight = np.where(rng.random(n_row) < 0.3, 0.0, rng.uniform(0, 10, n_row))
    amount = rng.uniform(0, 50, n_group)
    got_rows, got_left = share(group, weight, amount)
    want_rows, want_left = share_reference(group, weight, amount)
    np.testing.assert_allclose(got_rows, want_rows, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_left, want_left, rtol=1e-12, atol=1e-12)
    # Nothing is lost: what the rows took plus what stayed is what there was.
    assert got_rows.sum() + got_left.sum() == pytest.approx(amount.sum(), rel=1e-12)


@pytest.mark.parametrize("seed", range(100))
def test_hybrid_matches_reference_and_conserves_each_node(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_node, n_row = int(rng.integers(1, 6)), int(rng.integers(0, 30))
    node = rng.integers(0, n_node, n_row)
    alloc = rng.uniform(0, 12, n_row)
    use = alloc * np.where(rng.random(n_row) < 0.2, 0.0, rng.random(n_row))
    measured = rng.random(n_row) < 0.8
    alpha = float(rng.choice([0.0, 0.5, 1.0, rng.random()]))
    got = hybrid(node, n_node, alloc, use, measured, alpha)
    np.testing.assert_allclose(got, hybrid_reference(node, alloc, use, measured, alpha), rtol=1e-12, atol=1e-12)
    for n in range(n_node):
        assert got[node == n].sum() == pytest.approx(alloc[node == n].sum(), rel=1e-12, abs=1e-12)
    assert (got >= -1e-12).all()
    np.testing.assert_allclose(got[~measured], alloc[~measured])  # unmeasured holders pay allocated


def test_hybrid_worked_example() -> None:
    # One node, two whole GPUs at $4/h for an hour: A busy 0.9, B 0.1. alpha 0.5:
    # A = 0.5*4 + 0.5*8*0.9/1.0 = 5.6, B = 0.5*4 + 0.5*8*0.1/1.0 = 2.4. Nobody active: allocated.
    alloc = np.array([4.0, 4.0])
    got = hybrid(np.array([0, 0]), 1, alloc, alloc * np.array([0.9, 0.1]), np.array([True, True]), 0.5)
    np.testing.assert_allclose(got, [5.6, 2.4])
    idle = hybrid(np.array([0, 0]), 1, alloc, np.zeros(2), np.array([True, True]), 0.5)
    np.testing.assert_allclose(idle, alloc)


def random_scad(rng: np.random.Generator):
    n_node, n_pod, n_res = int(rng.integers(1, 5)), int(rng.integers(0, 25)), int(rng.integers(1, 4))
    node = rng.integers(0, n_node, n_pod)
    cap = rng.choice([0.0, 4.0, 8.0, 96.0, 1152.0], (n_node, n_res))
    qty = np.where(rng.random((n_pod, n_res)) < 0.3, 0.0, rng.uniform(0, 40, (n_pod, n_res)))
    rate = rng.uniform(0, 3, (n_node, n_res))
    return node, qty, cap, rate


@pytest.mark.parametrize("seed", range(100))
def test_scad_matches_reference_and_adds_up_per_node(seed: int) -> None:
    rng = np.random.default_rng(seed)
    node, qty, cap, rate = random_scad(rng)
    dt = float(rng.choice([60.0, 900.0, 3600.0]))
    got = scad(node, qty, cap, rate, dt)
    split, unused, idle = scad_reference(node, qty, cap, rate, dt / 3600)
    np.testing.assert_allclose(got.split, split, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got.unused, unused, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got.idle, idle, rtol=1e-12, atol=1e-12)
    cost = cap * rate * dt / 3600
    for n in range(len(cap)):
        pods = node == n
        total = got.split[pods].sum(axis=0) + got.unused[pods].sum(axis=0) + got.idle[n]
        np.testing.assert_allclose(total, cost[n], rtol=1e-12, atol=1e-9)
    # A pod that holds none of a resource is never charged for it, split or unused.
    assert (got.split[qty == 0] == 0).all() and (got.unused[qty == 0] == 0).all()


def test_aws_m5_xlarge_example_exactly() -> None:
    """docs/cost-model.md section 7: $1.00/h, 4 vCPU, 16 GB, weights vCPU 9 / GB 1, one hour."""
    unit = 1.0 / (9 * 4 + 1 * 16)
    reserved = np.array([[1, 4], [1, 4], [1, 2], [1, 2]], dtype=float)
    used = np.array([[0.1, 3], [1.9, 6], [0.5, 2], [0.5, 2]], dtype=float)
    got = scad(np.zeros(4, np.int64), np.maximum(reserved, used), np.array([[4.0, 16.0]]),
               np.array([[9 * unit, unit]]), 3600.0)
    pods = got.split.sum(axis=1) + got.unused.sum(axis=1)
    assert [round(v, 6) for v in pods] == [0.229199, 0.400314, 0.185243, 0.185243]
    assert round(got.unused[:, 1].sum(), 6) == 0.038462  # the 2 GB nobody allocated
    assert got.unused[:, 0].sum() == 0  # vCPU is oversubscribed (4.9 of 4): nothing unused
    ns1, ns2 = pods[0] + pods[2], pods[1] + pods[3]
    assert (round(ns1, 6), round(ns2, 6)) == (0.414443, 0.585557)
    assert round(ns1, 2) == 0.41  # rounding at the end; AWS's page adds rounded pods to 0.42
    assert pods.sum() == pytest.approx(1.0, rel=1e-15)


def test_scad_validates_input() -> None:
    with pytest.raises(ValueError, match="shapes disagree"):
        scad(np.zeros(1, np.int64), np.ones((1, 2)), np.ones((1, 3)), np.ones((1, 3)), 60)
    with pytest.raises(ValueError, match="alloc_qty must be finite"):
        scad(np.zeros(1, np.int64), np.array([[np.nan]]), np.ones((1, 1)), np.ones((1, 1)), 60)
    with pytest.raises(ValueError, match="pod_node must index"):
        scad(np.array([3]), np.ones((1, 1)), np.ones((1, 1)), np.ones((1, 1)), 60)
    with pytest.raises(ValueError, match="alpha"):
        hybrid(np.zeros(1, np.int64), 1, np.ones(1), np.ones(1), np.ones(1, bool), 2.0)
