"""Attribute sets: `with_attrs` is `attrs_of` of the merged mapping, and shares the pairs it keeps;
a label of sets named by their parts is read from the parts as from the sets built."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from otelgpu.attribution.models import Packed
from otelgpu.core.attrs import Extended, attrs_of, with_attrs
from otelgpu.pipeline import interval_summary, label_of_each

keys = st.sampled_from(["a", "b", "team", "pod", "cost_model", "ü", ""])
mappings = st.dictionaries(keys, st.text(max_size=3), max_size=6)


@given(mappings, mappings)
def test_with_attrs_is_the_merged_mapping(base, extra) -> None:
    attrs = attrs_of(base)
    assert with_attrs(attrs, extra) == attrs_of({**dict(attrs), **extra})


def test_the_pairs_kept_are_the_same_objects() -> None:
    attrs = attrs_of({"namespace": "ml", "pod": "train-0", "team": "vision", "unit_kind": "gpu"})
    extended = with_attrs(attrs, {"cost_model": "request", "unit_kind": "mig"})
    assert dict(extended) == {"namespace": "ml", "pod": "train-0", "team": "vision", "unit_kind": "mig",
                              "cost_model": "request"}
    kept = {kv for kv in extended if kv in attrs}
    assert len(kept) == 3 and all(any(kv is mine for mine in attrs) for kv in kept)


@given(st.lists(mappings, min_size=1, max_size=4), st.lists(mappings, min_size=1, max_size=4),
       st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=12), keys)
def test_a_label_of_sets_named_by_parts_is_the_built_sets(bases, extras, parts, key) -> None:
    bases, extras = [attrs_of(b) for b in bases], [attrs_of(e) for e in extras]
    parts = [(b % len(bases), e % len(extras)) for b, e in parts]
    named = Extended(bases, extras, np.array([b for b, _ in parts], np.int64),
                     np.array([e for _, e in parts], np.int64))
    assert list(named.label(key)) == [dict(attrs).get(key, "") for attrs in named]
    assert list(label_of_each(Packed.columns(named, np.ones(len(parts))), key)) == list(named.label(key))


def test_the_summary_reads_the_models_of_named_sets_as_of_built_ones() -> None:
    """The interval's log line: each cost model's capacity and idle cost, and with the platform
    policy the unused cost booked idle, the same whether the sets are named by parts or built."""
    bases = [attrs_of({"node": "n1", "attribution": "idle"}), attrs_of({"node": "n2", "cost_model": "scad"})]
    extras = [attrs_of({"cost_model": "request"}), attrs_of({}), attrs_of({"attribution": "tagged"})]
    named = Extended(bases, extras, np.array([0, 1, 0, 1, 0]), np.array([0, 0, 1, 1, 2]))
    values = np.array([1.5, 2.25, 4.0, 8.0, 16.0])
    sums = {"provisioned": {(): 120.0}, "capacity": Packed.columns(named, values),
            "idle": Packed.columns(named, values / 2), "unused": Packed.columns(named, values / 4)}
    built = {metric: dict(zip(series, series.values())) for metric, series in sums.items()}
    for platform in (False, True):
        assert interval_summary(sums, 60.0, platform) == interval_summary(built, 60.0, platform)
    # the extra's cost model replaces the base's; unused counts where booked idle (sets 0 and 2)
    assert interval_summary(sums, 60.0, True) == (2.0, {"request": (1.5 + 2.25, 0.75 + 1.125 + 0.375),
                                                        "": (4.0 + 16.0, 2.0 + 8.0 + 1.0), "scad": (8.0, 4.0)})
