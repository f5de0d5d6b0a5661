"""Attribute sets: `with_attrs` is `attrs_of` of the merged mapping, and shares the pairs it keeps."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from otelgpu.core.attrs import attrs_of, with_attrs

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
