"""A sidecar imports only what its configuration uses: the Kubernetes client (some 20 MiB) only
with `kubernetes.enabled`, botocore (some 8 MiB) only with remote write signed by SigV4."""

from __future__ import annotations

import json
import subprocess
import sys

from support import REPO

PROBE = """
import json, sys
sys.path.insert(0, "tests")
from support import make_config
from otelgpu.pipeline import Pipeline
overrides = json.loads(sys.argv[1])
Pipeline(make_config(**overrides), serve_receivers=False)
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & {"botocore", "kubernetes"})))
"""


def loaded(**overrides: object) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(overrides)], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y",
                                                      "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_remote_write_without_sigv4_and_no_kubernetes_import_neither():
    assert loaded(exporter__remote_write__url="http://127.0.0.1:9/api/v1/write") == []


def test_sigv4_imports_botocore():
    assert loaded(exporter__remote_write__url="https://aps.example/api/v1/remote_write",
                  exporter__remote_write__sigv4__region="eu-west-1") == ["botocore"]


def test_every_declared_dependency_is_imported_by_otelgpu():
    """The runtime dependencies in pyproject.toml are the ones otelgpu's code imports (by their
    top-level modules, as installed); the test tools live in the `test` extra."""
    import ast
    import importlib.metadata
    import re
    import tomllib

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    imported = set()
    for path in (REPO / "otelgpu").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module)
    unused = []
    for requirement in declared:
        name = re.split(r"[<>=!~ ;\[]", requirement, maxsplit=1)[0]
        # The modules the distribution installs, by file: namespace packages (opentelemetry,
        # google) are shared by several distributions, so their top-level name says nothing.
        modules = {str(f.with_suffix("")).replace("/", ".").removesuffix(".__init__")
                   for f in importlib.metadata.files(name) or () if f.suffix in (".py", ".so")}
        modules = {m.split(".cpython-")[0] for m in modules}
        if not imported & modules:
            unused.append(name)
    assert not unused, f"declared but never imported by otelgpu: {unused}"
