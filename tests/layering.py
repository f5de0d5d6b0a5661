"""otelgpu's import graph, read from the source with `ast` (function-local imports included): which
module imports which, the layer each module belongs to, the imports that go up a layer and the
cycles. tests/test_layering.py holds the code to it."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

PACKAGE = Path(__file__).resolve().parents[1] / "otelgpu"

# Lowest first: a module may import its own layer and those below it, never one above.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ground", ("otelgpu", "otelgpu.core", "otelgpu.errors", "otelgpu.heap", "otelgpu.telemetry", "otelgpu.tls",
                "otelgpu.httpserver", "otelgpu.wal", "otelgpu.checkpoint", "otelgpu.memory")),
    ("receiver", ("otelgpu.receiver",)),
    ("enrich", ("otelgpu.enrich",)),
    ("attribution", ("otelgpu.attribution",)),
    ("exporter", ("otelgpu.exporter",)),
    ("readers", ("otelgpu.report", "otelgpu.alerts", "otelgpu.nvml")),
    ("assembly", ("otelgpu.config", "otelgpu.pipeline", "otelgpu.compute", "otelgpu.commit", "otelgpu.kernels", "otelgpu.cli",
                  "otelgpu.demo", "otelgpu.__main__")),
)


def module_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_of(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest prefix that names `module` or a package above it."""
    best, found = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), i
    if found < 0:
        raise KeyError(f"{module} is in no layer of tests/layering.py")
    return found


def imports_of(path: Path, known: set[str]) -> Iterator[str]:
    """The otelgpu modules `path` imports: `from a.b import c` is a.b.c where that is a module."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "otelgpu")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "otelgpu":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                yield sub if sub in known else node.module


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {m: {i for i in imports_of(p, known) if i != m} for m, p in found.items()}


def upward(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, bs in edges.items() for b in bs if layer_of(b) > layer_of(a)}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


if __name__ == "__main__":
    edges = graph()
    up = upward(edges)
    print(f"{len(edges)} modules, {sum(map(len, edges.values()))} imports, {len(up)} upward, "
          f"{len(cycles(edges))} cycles")
    for a, b in sorted(up):
        print(f"  up: {a} -> {b}")
    for c in cycles(edges):
        print("  cycle:", " <-> ".join(c))
