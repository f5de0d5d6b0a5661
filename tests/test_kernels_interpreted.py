"""Kernels run as plain Python (`kernels: interpreted`, k8s/node's setting): the same money bit for
bit, numba and LLVM never loaded, the mode chosen once per process; and the kernels a
configuration warms up are the ones it calls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from otelgpu.attribution import engine
from otelgpu.config import parse_config
from otelgpu.core import jit
from otelgpu.demo.run import scrape_requests
from otelgpu.kernels import cost_kernels
from otelgpu.receiver import wire

from capture import DEMO_START_NS, captured, merged
from sidecar import Sidecar
from support import eventually

REPO = Path(__file__).resolve().parents[1]

# In a fresh interpreter: the demo's first hour under two variants (every cost model side by side;
# the idle policy `share`), each interval's digests against those recorded (tests/data/capture).
_CAPTURE_INTERPRETED = """
import json, sys, warnings
warnings.simplefilter("error")  # a kernel's warning in interpreted mode would reach the log
from otelgpu.core import jit
jit.choose("interpreted")
sys.path[:0] = [sys.argv[1]]
import capture
from importlib import resources
import yaml
base = yaml.safe_load(resources.files("otelgpu.demo").joinpath("config.yaml").read_text())
want = json.loads(capture.path_of(False).read_text())
out = {}
for variant in ("demo", "idle-share-node"):
    doc = capture.merged(base, capture.VARIANTS[variant])
    got = capture.captured(doc, capture.scrape_requests(capture.DEMO_START_NS, 3600))
    out[variant] = [g == w for g, w in zip(got, want[variant])]
out["numba"] = sorted(m for m in sys.modules if m.split(".")[0] in ("numba", "llvmlite"))
print(json.dumps(out))
"""


def test_interpreted_kernels_give_the_recorded_money_bit_for_bit_and_never_load_numba():
    run = subprocess.run([sys.executable, "-c", _CAPTURE_INTERPRETED, str(REPO / "tests")],
                         capture_output=True, text=True, cwd=REPO, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out.pop("numba") == []
    assert out == {"demo": [True] * 4, "idle-share-node": [True] * 4}


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=8, max_size=40), st.data())
def test_fixed64_for_python_reads_what_the_kernel_reads(raw, data):
    buf = np.frombuffer(raw, np.uint8)
    i = data.draw(st.integers(0, len(raw) - 8))
    want = np.uint64(int.from_bytes(raw[i:i + 8], "little"))
    assert wire._fixed64(buf, i) == want  # compiled: one unaligned load
    assert wire.fixed64_as_written(buf, i) == want  # the bytes one by one, run by Python
    got = wire._fixed64_interpreted(buf, i)
    assert got == want and isinstance(got, np.uint64)


def test_the_mode_is_chosen_once_before_the_first_kernel():
    assert jit.mode() == "compiled"  # this process has defined its kernels (otelgpu.receiver.wire)
    with pytest.raises(RuntimeError, match="already compiled"):
        jit.choose("interpreted")
    jit.choose("compiled")  # the mode in force: nothing to do
    with pytest.raises(ValueError, match="compiled, interpreted"):
        jit.choose("jit")
    assert jit.mode() == "compiled"


def _node_config(tmp_path: Path, kernels: str) -> dict:
    config = yaml.safe_load((REPO / "k8s" / "node" / "otelgpu.yaml").read_text())
    config["cluster"]["name"] = "node-test"
    config["kernels"] = kernels
    config["kubernetes"] = {"enabled": False}  # facts from kube-state-metrics: no API server here
    config["checkpoint"]["directory"] = str(tmp_path / f"checkpoint-{kernels}")
    config["receiver"]["max_point_age_seconds"] = 0  # the demo's scrapes are stamped in the past
    return config


@pytest.mark.parametrize("kernels", ["interpreted", "compiled"])
def test_serve_maps_llvm_only_when_its_kernels_are_compiled(tmp_path, kernels):
    """k8s/node's otelgpu.yaml as `otelgpu serve` runs it, then with compiled kernels: LLVM's library
    is mapped into the process only in the second, and both take a real scrape."""
    serve = Sidecar(tmp_path, _node_config(tmp_path, kernels), kernels).start()
    try:
        maps = Path(f"/proc/{serve.proc.pid}/maps").read_text()
        assert ("libllvmlite" in maps) == (kernels == "compiled")
        log = serve.log.read_text()
        how = "interpreted" if kernels == "interpreted" else ("cached", "compiled")
        assert "kernels ready: " in log
        ready = log.split("kernels ready: ")[1].splitlines()[0]
        # only what the node's models (request and scad), its write-ahead log and its OTLP exporter call
        assert [part.split()[0] for part in ready.split(", ")] == [
            "request", "scad", "share", "decode", "facts", "timeline", "steps", "wal", "otlp"]
        assert all(part.split()[1] in how for part in ready.split(", "))
        serve.export(next(iter(scrape_requests(DEMO_START_NS, 60))))
        eventually(lambda: serve.metric("otelgpu_receiver_accepted_metric_points_total") > 0, 30)
        assert serve.metric("otelgpu_points_rejected_total") == 0
    finally:
        serve.stop()


@pytest.mark.parametrize("attribution", [
    {"cost_models": ["request"]},
    {"cost_models": ["scad"]},
    {"cost_models": ["opencost"]},
    {"cost_models": ["hybrid"]},
    {"cost_models": ["request"], "idle": {"policy": "share"}},
    {"cost_models": ["request", "scad", "opencost", "hybrid"], "idle": {"policy": "share", "share_scope": "cluster"}},
])
def test_the_kernels_warmed_up_are_the_ones_the_models_call(monkeypatch, attribution):
    """The demo's first hour under each set of models: every attribution kernel called is one that
    `cost_kernels` names for the configuration, so none waits for the JIT at the first close."""
    from importlib import resources

    base = yaml.safe_load(resources.files("otelgpu.demo").joinpath("config.yaml").read_text())
    doc = merged(base, {"attribution": attribution})
    doc["attribution"]["cost_models"] = attribution["cost_models"]
    called: set[str] = set()
    for name, compiled in engine.KERNELS.items():
        def counted(*args, _name=name, _compiled=compiled):  # noqa: ANN002, ANN202
            called.add(_name)
            return _compiled(*args)
        monkeypatch.setattr(engine, f"{name}_kernel", counted)
    assert captured(doc, scrape_requests(DEMO_START_NS, 3600))
    named = set(cost_kernels(parse_config(doc)))
    assert called <= named, f"called {sorted(called - named)}, not warmed up"
    assert "request" in called
