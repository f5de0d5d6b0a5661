"""The timeline's compiled pass over the holders' rows against the plain numpy way it replaced:
each (holding, step) pair's activity and whether its own series gave one, to the bit."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from otelgpu.core.jit import how_loaded
from otelgpu.enrich.samples import Samples
from otelgpu.enrich.timeline import _pair_activities, _pair_activities_reference
from otelgpu.receiver.schema import Metric

METRICS = (int(Metric.GR_ENGINE_ACTIVE), int(Metric.GPU_UTIL), int(Metric.FB_USED), int(Metric.POWER_USAGE))


def _samples(metric: np.ndarray, pod_uid: np.ndarray, value: np.ndarray) -> Samples:
    none = np.full(len(metric), -1, np.int32)
    return Samples(metric.astype(np.int16), np.zeros(len(metric), np.int64), value, np.zeros(len(metric), bool),
                   none, none, none, none, none, none, none, none, pod_uid.astype(np.int32), none)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal to the bit where numbers, NaN in the same places."""
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan].view(np.int64), b[~nan].view(np.int64)))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 60), st.integers(1, 6), st.integers(1, 12), st.integers(1, 15), st.randoms(use_true_random=False))
def test_the_compiled_pass_gives_the_plain_ways_figures(n_sample: int, n_ent: int, n_step: int, n_pair: int,
                                                          rnd) -> None:  # noqa: ANN001
    assert how_loaded(_pair_activities) != "interpreted"  # the compiled pass itself, not its stand-in
    """Rows of every kind (the activity fields, a field read for presence, per-process series of a
    pod, entities with and without the engine's activity, a NaN value now and then), in any order
    of steps and pairs: the same figures, to the bit."""
    r = np.random.default_rng(rnd.getrandbits(32))
    metric = r.choice(METRICS, n_sample)
    pod_uid = np.where(r.random(n_sample) < 0.3, r.integers(0, 3, n_sample), -1)
    value = r.random(n_sample) * r.choice([1.0, 100.0], n_sample)
    value[r.random(n_sample) < 0.05] = np.nan
    samples = _samples(metric, pod_uid, value)
    rows = np.sort(r.choice(n_sample, r.integers(0, n_sample + 1), replace=False)).astype(np.int32)
    n_row = len(rows)
    r_ent, r_step = r.integers(0, n_ent, n_row).astype(np.int32), r.integers(0, n_step, n_row).astype(np.int32)
    pair = r.integers(0, n_pair, n_row).astype(np.int32)
    pair_step = r.integers(0, n_step, n_pair).astype(np.int32)
    pair_is_pod, pair_shared = r.random(n_pair) < 0.6, r.random(n_pair) < 0.5
    act, own = _pair_activities(samples.metric, samples.pod_uid, samples.value, rows, r_ent, r_step, pair, pair_step,
                                pair_is_pod, pair_shared, n_step, int(Metric.GR_ENGINE_ACTIVE), int(Metric.GPU_UTIL))
    want_act, want_own = _pair_activities_reference(samples.metric, samples.pod_uid, samples.value, rows, r_ent, r_step,
                                                    pair, pair_step, pair_is_pod, pair_shared, n_step,
                                                    int(Metric.GR_ENGINE_ACTIVE), int(Metric.GPU_UTIL))
    assert _same(act, want_act)
    assert own.tolist() == want_own.tolist()


def test_a_pod_s_own_series_and_the_device_s_activity_split_among_its_holders() -> None:
    """One device, one step, two pods on it (shared): the first with its own per-process series,
    the second without (the engine's activity split between the two); a third pair on a device
    not shared reads the device's GPU_UTIL where it has no engine activity."""
    gr, util = int(Metric.GR_ENGINE_ACTIVE), int(Metric.GPU_UTIL)
    samples = _samples(np.array([gr, util, util]), np.array([-1, 7, -1]), np.array([0.8, 30.0, 50.0]))
    rows = np.arange(3, dtype=np.int32)
    r_ent, r_step = np.array([0, 0, 1], np.int32), np.array([0, 0, 1], np.int32)
    pair, pair_step = np.array([0, 0, 2], np.int32), np.array([0, 0, 1], np.int32)
    act, own = _pair_activities(samples.metric, samples.pod_uid, samples.value, rows, r_ent, r_step, pair, pair_step,
                                np.array([True, True, True]), np.array([True, True, False]), 2, gr, util)
    assert act.tolist() == [0.3, 0.4, 0.5]
    assert own.tolist() == [True, False, False]
