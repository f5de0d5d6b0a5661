"""No module imports a layer above its own (tests/layering.py: ground, receiver, enrich,
attribution, exporter, readers, assembly), and no modules import each other round. The imports
that still do are listed here, each to be taken out; the list may only shrink: a new one fails,
and so does one listed that is gone (take it off the list)."""

from __future__ import annotations

from layering import LAYERS, PACKAGE, cycles, graph, layer_of, modules, upward

STILL_UPWARD = {  # shared vocabulary still in a stage package; moved to the ground floor one by one
    ("otelgpu.enrich.join", "otelgpu.attribution.engine"),
    ("otelgpu.enrich.join", "otelgpu.attribution.prices"),
}
STILL_CYCLES: list[list[str]] = []


def test_every_module_has_a_layer():
    for module in modules():
        assert 0 <= layer_of(module) < len(LAYERS), module


def test_no_import_goes_up_a_layer_but_those_still_listed():
    up = upward(graph())
    assert up - STILL_UPWARD == set(), "imports up a layer (move what they need down to the ground floor)"
    assert STILL_UPWARD - up == set(), "gone: take them off STILL_UPWARD"


def test_no_modules_import_each_other_but_those_still_listed():
    assert cycles(graph()) == STILL_CYCLES


def test_the_reading_sees_an_upward_import_and_a_cycle():
    edges = {"otelgpu.receiver.columnar": {"otelgpu.exporter.store"}, "otelgpu.exporter.store": {"otelgpu.errors"},
             "otelgpu.enrich.a": {"otelgpu.enrich.b"}, "otelgpu.enrich.b": {"otelgpu.enrich.a"}}
    assert upward(edges) == {("otelgpu.receiver.columnar", "otelgpu.exporter.store")}
    assert cycles(edges) == [["otelgpu.enrich.a", "otelgpu.enrich.b"]]


def test_the_module_map_names_every_module():
    """docs/pipeline.md says what each module is for, under its layer's heading: a module added or
    moved is added there too."""
    text = (PACKAGE.parent / "docs" / "pipeline.md").read_text()
    sections = {part.split("\n", 1)[0].strip(): part for part in text.split("\n### ")[1:]}
    unnamed = [m for m, path in modules().items() if path.name != "__init__.py"
               and not any(f"{before}{path.name}{after}" in sections.get(LAYERS[layer_of(m)][0], "")
                           for before, after in (("`", "`"), ("/", "`"), ("(", "`")))]
    assert unnamed == []
