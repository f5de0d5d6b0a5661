"""No module imports a layer above its own (tests/layering.py: ground, receiver, enrich,
attribution, exporter, readers, assembly), and no modules import each other round."""

from __future__ import annotations

from layering import LAYERS, PACKAGE, cycles, graph, layer_of, modules, upward


def test_every_module_has_a_layer():
    for module in modules():
        assert 0 <= layer_of(module) < len(LAYERS), module


def test_no_import_goes_up_a_layer():
    assert upward(graph()) == set(), "imports up a layer (move what they share down to the ground floor)"


def test_no_modules_import_each_other():
    assert cycles(graph()) == []


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


def test_the_readme_layout_names_every_top_level_module():
    """README's Layout names each module and package directly under otelgpu/."""
    readme = (PACKAGE.parent / "README.md").read_text()
    layout = readme[readme.index("- Layout:"):]
    layout = layout[:layout.index("\n- ") if "\n- " in layout else len(layout)]
    top = sorted(p.name + ("/" if p.is_dir() else "") for p in PACKAGE.iterdir()
                 if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists()))
    assert [name for name in top if f"`{name}`" not in layout] == []


def test_no_function_outside_the_numba_kernels_is_over_fifty_lines():
    """A function says one thing: past 50 lines it is split along its jobs. The numba kernels
    (`@kernel`) keep their loops whole, as the compiler wants them."""
    import ast

    long = []
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                kernel = any(ast.unparse(d).split("(")[0].endswith("kernel") for d in node.decorator_list)
                if not kernel and node.end_lineno - node.lineno + 1 > 50:
                    long.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []


def test_no_one_letter_names_outside_short_loops_and_the_numba_kernels():
    """A parameter or a variable is read away from where it is given, so it says what it is
    (`samples`, not `s`). A loop's own variables (`for i, x in ...`, comprehensions), lambdas one
    expression long, and the numba kernels' index arithmetic keep short names."""
    import ast

    short = []
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or any(
                    ast.unparse(d).split("(")[0].endswith("kernel") for d in node.decorator_list):
                continue
            args = node.args
            short += [f"{module}.{node.name}({a.arg})" for a in args.posonlyargs + args.args + args.kwonlyargs
                      if len(a.arg) == 1 and a.arg != "_"]
            loops = {id(t) for n in ast.walk(node) if isinstance(n, (ast.For, ast.comprehension))
                     for t in ast.walk(n.target)}
            short += [f"{module}.{node.name}: {n.id} (line {n.lineno})" for n in ast.walk(node)
                      if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and len(n.id) == 1
                      and n.id != "_" and id(n) not in loops]
    assert short == []
