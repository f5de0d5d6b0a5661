"""The numba `request` kernel against the plain reference, exact hand examples from
docs/cost-model.md section 7, and the input validation of engine.validate()."""

from __future__ import annotations

import math

import numpy as np
import pytest

from otelgpu.attribution.engine import Attribution, UnitRows, attribute_request, validate
from otelgpu.attribution.engine_reference import attribute_request_reference
from otelgpu.core.mig import MigProfiles

OUTPUTS = ("alloc", "effective", "waste", "unmeasured", "held_s", "capacity", "idle")
FRACTIONS = (1.0, 1 / 7, 2 / 7, 3 / 7, 4 / 7, 1 / 2, 1 / 4, 1 / 3, 1 / 8, 0.0)


def random_rows(rng: np.random.Generator) -> UnitRows:
    """A random cluster: 1..16 GPUs, 0..60 rows, some free GPUs, some over-claimed ones."""
    n_gpu = int(rng.integers(1, 17))
    n_row = int(rng.integers(0, 61))
    price = rng.uniform(0.0, 120.0, n_gpu)
    price[rng.random(n_gpu) < 0.2] = 0.0  # free GPUs (e.g. fully committed, or unknown price)
    row_gpu = rng.integers(0, n_gpu, n_row)
    f = np.where(rng.random(n_row) < 0.6, rng.choice(FRACTIONS, n_row), rng.random(n_row))
    share = np.where(rng.random(n_row) < 0.5, 1.0, rng.random(n_row))
    measured = rng.choice([0.0, 1.0, 0.5, -1.0], n_row)  # -1 -> uniform draw below
    measured = np.where(measured < 0, rng.random(n_row), measured)
    activity = rng.random(n_row)
    activity[rng.random(n_row) < 0.2] = np.nan
    activity[rng.random(n_row) < 0.05] = 1.0
    activity[rng.random(n_row) < 0.05] = 0.0
    # Over-claim a few GPUs: whole-GPU rows stacked on one GPU (inconsistent input).
    if n_row and rng.random() < 0.4:
        g = int(rng.integers(0, n_gpu))
        k = int(rng.integers(2, 5))
        row_gpu = np.concatenate([row_gpu, np.full(k, g)])
        f = np.concatenate([f, rng.uniform(0.5, 1.0, k)])
        share = np.concatenate([share, np.ones(k)])
        measured = np.concatenate([measured, rng.random(k)])
        activity = np.concatenate([activity, rng.random(k)])
    return UnitRows(price, row_gpu.astype(np.int64), f, share, measured, activity)


def assert_same(got: Attribution, want: Attribution, rtol: float = 1e-12) -> None:
    scale = max(1.0, float(np.max(want.capacity, initial=0.0)))
    for name in OUTPUTS:
        g, w = getattr(got, name), getattr(want, name)
        assert g.shape == w.shape, name
        np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-12 * scale, err_msg=name)


@pytest.mark.parametrize("seed", range(200))
def test_kernel_matches_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = random_rows(rng)
    dt = float(rng.choice([1.0, 15.0, 30.0, 60.0, 300.0, 900.0, 3600.0, rng.uniform(0.5, 7200.0)]))
    got = attribute_request(rows, dt)
    want = attribute_request_reference(rows, dt)
    assert_same(got, want)


def test_random_cases_exercise_overclaim_nan_and_free_gpus() -> None:
    """Guard on the generator itself: the 200 cases really contain the hard inputs."""
    over = nan = free = empty = 0
    for seed in range(200):
        rows = random_rows(np.random.default_rng(seed))
        claimed = np.bincount(rows.row_gpu, weights=rows.row_f * rows.row_share,
                              minlength=len(rows.gpu_price_hour))
        over += bool(np.any(claimed > 1.0))
        nan += bool(np.any(np.isnan(rows.row_activity)))
        free += bool(np.any(rows.gpu_price_hour == 0.0))
        empty += len(rows.row_gpu) == 0
    assert over > 40 and nan > 100 and free > 50 and empty >= 1


def test_kernel_accepts_other_dtypes() -> None:
    rows = UnitRows(np.array([10.0, 20.0], dtype=np.float32), np.array([1, 0, 1], dtype=np.int32),
                    np.array([0.5, 1.0, 0.25], dtype=np.float32), np.ones(3), np.ones(3),
                    np.array([0.5, np.nan, 1.0]))
    assert_same(attribute_request(rows, 3600.0), attribute_request_reference(rows, 3600.0), rtol=1e-6)


def test_empty_cluster_has_no_output() -> None:
    e = np.zeros(0)
    out = attribute_request(UnitRows(e, np.zeros(0, dtype=np.int64), e, e, e, e), 60.0)
    for name in OUTPUTS:
        assert len(getattr(out, name)) == 0


# --------------------------------------------------------------------------- hand examples

def test_whole_gpu_hand_example() -> None:
    # One $3.60/h GPU, one pod holding it for the whole minute at 25 % activity, measured for half of it.
    rows = UnitRows(np.array([3.6, 3.6]), np.array([0]), np.array([1.0]), np.array([1.0]),
                    np.array([0.5]), np.array([0.25]))
    out = attribute_request(rows, 60.0)
    assert out.capacity.tolist() == pytest.approx([0.06, 0.06])
    assert out.alloc[0] == pytest.approx(0.06)
    assert out.effective[0] == pytest.approx(0.0075)  # 0.03 measured * 0.25
    assert out.waste[0] == pytest.approx(0.0225)
    assert out.unmeasured[0] == pytest.approx(0.03)
    assert out.held_s[0] == pytest.approx(60.0)
    assert out.idle.tolist() == pytest.approx([0.0, 0.06])


def test_nan_activity_is_unmeasured_not_invented() -> None:
    rows = UnitRows(np.array([12.0]), np.array([0]), np.array([2 / 7]), np.array([1.0]),
                    np.array([1.0]), np.array([np.nan]))
    out = attribute_request(rows, 3600.0)
    assert out.alloc[0] == pytest.approx(12 * 2 / 7)
    assert out.effective[0] == 0.0 and out.waste[0] == 0.0
    assert out.unmeasured[0] == pytest.approx(12 * 2 / 7)


def test_overclaimed_gpu_is_never_sold_twice() -> None:
    # Two pods each "hold" the whole GPU for the whole hour: each is billed half, idle is 0.
    rows = UnitRows(np.array([8.0, 8.0]), np.array([0, 0]), np.ones(2), np.ones(2), np.ones(2),
                    np.array([1.0, 0.0]))
    out = attribute_request(rows, 3600.0)
    assert out.alloc.tolist() == pytest.approx([4.0, 4.0])
    assert out.held_s.tolist() == pytest.approx([1800.0, 1800.0])
    assert out.idle.tolist() == pytest.approx([0.0, 8.0])
    assert out.effective.tolist() == pytest.approx([4.0, 0.0])
    assert out.waste.tolist() == pytest.approx([0.0, 4.0])


RECIPE_ACTIVITY = (0.10, 0.20, 0.30, 0.40)  # four 15-minute intervals
RECIPE_SLICES = {"BU-A": 3, "BU-B": 2, "BU-C": 2}


def _recipe_hour(price: np.ndarray, row_gpu: list[int], row_f: list[float], row_bu: list[str]):
    """Attribute the recipe's hour as four 15-minute intervals; sum per BU, round only at the end."""
    n_gpu = len(price)
    alloc = dict.fromkeys(RECIPE_SLICES, 0.0)
    eff = dict.fromkeys(RECIPE_SLICES, 0.0)
    waste = dict.fromkeys(RECIPE_SLICES, 0.0)
    idle = capacity = 0.0
    n = len(row_gpu)
    for act in RECIPE_ACTIVITY:
        rows = UnitRows(price, np.array(row_gpu), np.array(row_f), np.ones(n), np.ones(n), np.full(n, act))
        out = attribute_request(rows, 900.0)
        assert len(out.idle) == n_gpu
        for i, bu in enumerate(row_bu):
            alloc[bu] += out.alloc[i]
            eff[bu] += out.effective[i]
            waste[bu] += out.waste[i]
            assert out.unmeasured[i] == pytest.approx(0.0, abs=1e-15)
        idle += out.idle.sum()
        capacity += out.capacity.sum()
    return alloc, eff, waste, idle, capacity


def test_aws_recipe_mig_scenario_seven_slices() -> None:
    """cost-model.md section 7: $12/GPU-h, 7 slices; BU-A 3, BU-B 2, BU-C 2 slices for one hour."""
    mig = MigProfiles.load()
    model = "NVIDIA H100 80GB HBM3"
    profile = {3: "3g.40gb", 2: "2g.20gb"}
    f = {bu: mig.fraction(model, profile[c], "compute")[0] for bu, c in RECIPE_SLICES.items()}
    assert f == pytest.approx({"BU-A": 3 / 7, "BU-B": 2 / 7, "BU-C": 2 / 7})
    alloc, eff, waste, idle, capacity = _recipe_hour(
        np.array([12.0]), [0, 0, 0], [f["BU-A"], f["BU-B"], f["BU-C"]], ["BU-A", "BU-B", "BU-C"])
    assert {k: round(v, 6) for k, v in alloc.items()} == {"BU-A": 5.142857, "BU-B": 3.428571, "BU-C": 3.428571}
    # Activity is a 0..1 ratio: never divided by 100 (the recipe's mistake would give 0.012857).
    assert {k: round(v, 6) for k, v in eff.items()} == {"BU-A": 1.285714, "BU-B": 0.857143, "BU-C": 0.857143}
    for bu in RECIPE_SLICES:
        assert waste[bu] == pytest.approx(alloc[bu] - eff[bu], rel=1e-12)
    assert round(idle, 6) == 0.0
    assert capacity == pytest.approx(12.0)


def test_aws_recipe_on_p4d_all_1g5gb_idle_is_84() -> None:
    """Same holders on a p4d.24xlarge partitioned all-1g.5gb: 8 GPUs x 7 slices = 56 slices,
    $96/h at $12/GPU-h; the 49 unheld slices are $84.00 of idle for the hour."""
    mig = MigProfiles.load()
    f1, found = mig.fraction("NVIDIA A100-SXM4-40GB", "1g.5gb", "compute")
    assert found and f1 == pytest.approx(1 / 7)
    # One row per held 1g.5gb instance, spread over the GPUs.
    placement = {"BU-A": [0, 0, 5], "BU-B": [3, 7], "BU-C": [7, 7]}
    row_gpu = [g for bu in placement for g in placement[bu]]
    row_bu = [bu for bu in placement for _ in placement[bu]]
    assert len(row_gpu) == 7
    alloc, eff, _, idle, capacity = _recipe_hour(np.full(8, 12.0), row_gpu, [f1] * 7, row_bu)
    assert {k: round(v, 6) for k, v in alloc.items()} == {"BU-A": 5.142857, "BU-B": 3.428571, "BU-C": 3.428571}
    assert {k: round(v, 6) for k, v in eff.items()} == {"BU-A": 1.285714, "BU-B": 0.857143, "BU-C": 0.857143}
    assert round(idle, 2) == 84.00
    assert round(capacity, 2) == 96.00
    assert sum(alloc.values()) + idle == pytest.approx(96.0, rel=1e-12)


# --------------------------------------------------------------------------- validate()

def _ok(**over) -> UnitRows:
    base = dict(gpu_price_hour=np.array([10.0, 20.0]), row_gpu=np.array([0, 1, 1]),
                row_f=np.array([1.0, 0.5, 0.25]), row_share=np.array([1.0, 0.5, 1.0]),
                row_measured=np.array([1.0, 1.0, 0.0]), row_activity=np.array([0.3, np.nan, 0.1]))
    base.update(over)
    return UnitRows(**base)


def test_validate_accepts_good_input() -> None:
    validate(_ok())
    validate(_ok(gpu_price_hour=np.array([0.0, 0.0])))  # free GPUs are fine
    validate(_ok(row_f=np.array([1.0, 1.0 + 1e-12, 0.0])))  # rounding slack


@pytest.mark.parametrize("name", ["row_f", "row_share", "row_measured", "row_activity"])
def test_validate_mismatched_lengths(name: str) -> None:
    with pytest.raises(ValueError, match=rf"{name} has 2 entries, row_gpu has 3"):
        validate(_ok(**{name: np.array([0.5, 0.5])}))


@pytest.mark.parametrize("price", [[-1.0, 2.0], [1.0, np.nan], [np.inf, 1.0]])
def test_validate_bad_price(price) -> None:
    with pytest.raises(ValueError, match=r"GPU prices must be finite and >= 0"):
        validate(_ok(gpu_price_hour=np.array(price)))


@pytest.mark.parametrize("row_gpu", [[0, 1, 2], [-1, 0, 1]])
def test_validate_row_gpu_out_of_range(row_gpu) -> None:
    with pytest.raises(ValueError, match=r"row_gpu must index gpu_price_hour"):
        validate(_ok(row_gpu=np.array(row_gpu)))


def test_validate_rows_without_gpus() -> None:
    with pytest.raises(ValueError, match=r"row_gpu must index gpu_price_hour"):
        validate(_ok(gpu_price_hour=np.zeros(0)))


@pytest.mark.parametrize("name,values", [
    ("row_f", [1.0, 1.5, 0.5]),
    ("row_f", [1.0, -0.1, 0.5]),
    ("row_f", [1.0, np.nan, 0.5]),
    ("row_share", [1.0, 1.01, 0.5]),
    ("row_share", [-0.5, 1.0, 0.5]),
    ("row_measured", [1.0, 2.0, 0.5]),
    ("row_measured", [1.0, np.nan, 0.5]),
])
def test_validate_out_of_unit_interval(name, values) -> None:
    with pytest.raises(ValueError, match=rf"{name} must lie in \[0, 1\]"):
        validate(_ok(**{name: np.array(values)}))


def test_attribute_request_validates_before_running_the_kernel() -> None:
    with pytest.raises(ValueError, match=r"row_f must lie in \[0, 1\]"):
        attribute_request(_ok(row_f=np.array([1.0, 2.0, 0.5])), 60.0)


def test_activity_outside_unit_interval_is_clamped() -> None:
    # Activity is not validated (NaN means "no figure"); out-of-range values are clamped to [0, 1].
    rows = _ok(row_activity=np.array([1.7, -0.2, 0.1]), row_measured=np.ones(3))
    out = attribute_request(rows, 3600.0)
    assert out.effective[0] == pytest.approx(out.alloc[0]) and out.waste[0] == 0.0
    assert out.effective[1] == 0.0 and out.waste[1] == pytest.approx(out.alloc[1])
    assert math.isclose(out.effective[2], 0.1 * out.alloc[2])


@pytest.mark.parametrize("dt", [0.0, -60.0, float("nan"), float("inf")])
def test_interval_length_must_be_positive(dt: float) -> None:
    rows = UnitRows(np.array([10.0]), np.array([0]), np.array([0.5]), np.array([1.0]), np.array([1.0]), np.array([0.5]))
    with pytest.raises(ValueError, match="interval length"):
        attribute_request(rows, dt)
