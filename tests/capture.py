"""Every interval's cost sums and gauges, as digests: the demo cluster under each configuration
variant, and a fleet of 10,000 GPUs. A change meant to leave every figure as it was (a refactor)
is checked against the digests recorded before it, bit for bit: `tests/test_capture.py` for the
demo's variants, `python tests/capture.py --fleet` for the fleet (a minute or two).

A digest covers one interval's sums (the increments handed to the cost store) or its gauges, per
metric: each series' attributes and the exact bits of its value (`float.hex`), in a sorted order.
`python tests/capture.py --write [--fleet]` records them in tests/data/capture/; `--check` (the
default) compares and names the first interval, metric and variant that differ."""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from otelgpu.config import parse_config  # noqa: E402
from otelgpu.demo import scrapes  # noqa: E402
from otelgpu.demo.run import scrape_requests  # noqa: E402
from otelgpu.enrich.window import NS  # noqa: E402
from otelgpu.pipeline import Pipeline  # noqa: E402

DATA = ROOT / "tests" / "data" / "capture"
Digests = dict[str, list[dict[str, str]]]  # variant: per interval, {"sums:<metric>" or "gauges:<metric>": sha256}

# Overrides of the demo's configuration (otelgpu/demo/config.yaml: request, scad, opencost and
# hybrid side by side, 15-minute intervals): each setting that changes how money is worked out.
VARIANTS: dict[str, dict[str, Any]] = {
    "demo": {},
    "split-opencost": {"attribution": {"prices": {"instance_price_split": "opencost"}}},
    "split-gpu_only": {"attribution": {"prices": {"instance_price_split": "gpu_only"}}},
    "idle-share-node": {"attribution": {"idle": {"policy": "share"}}},
    "idle-share-cluster": {"attribution": {"idle": {"policy": "share", "share_scope": "cluster"}}},
    "idle-platform": {"attribution": {"idle": {"policy": "platform"}}},
    "hybrid-activity": {"attribution": {"hybrid_weight": "activity"}},
    "mig-max": {"attribution": {"mig_fraction_rule": "max"}},
    "detail-workload": {"series": {"detail": "workload"}},
    "detail-namespace": {"series": {"detail": "namespace"}},
    "no-tenants": {"tenants": {"enabled": False}},
}
DEMO_HOURS = 2  # the demo's pods start, end and change activity within the hour; the second hour repeats it


def merged(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, Mapping) else value
    return out


def digest(series: Mapping[Any, float]) -> str:
    lines = sorted(f"{attrs!r}\t{float(value).hex()}" for attrs, value in series.items())
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def capturing(pipeline: Pipeline, into: list[dict[str, str]]) -> None:
    """Record each interval's sums and gauges as the pipeline hands them to its cost store."""
    record = pipeline.store.record

    def recorded(start_ns: int, end_ns: int, sums: Mapping, gauges: Mapping, plan: Any = None) -> Any:
        into.append({**{f"sums:{m}": digest(s) for m, s in sorted(sums.items())},
                     **{f"gauges:{m}": digest(g) for m, g in sorted(gauges.items())}})
        return record(start_ns, end_ns, sums, gauges, plan)

    pipeline.store.record = recorded  # type: ignore[method-assign]


def in_process(doc: dict[str, Any]) -> Pipeline:
    """A pipeline of `doc` fed in this process: no receivers, exporters or checkpoint."""
    doc = merged(doc, {"receiver": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": {"enabled": False},
                                    "max_point_age_seconds": 0},  # data of a fixed time: a replay
                       "exporter": {"prometheus": {"enabled": False}}})
    doc["exporter"] = {k: v for k, v in doc["exporter"].items() if k == "prometheus"}
    doc.pop("checkpoint", None)
    return Pipeline(parse_config(doc), serve_receivers=False, keep_ended=True)


def feed(pipeline: Pipeline, requests: Any) -> None:
    for req in requests:
        pipeline.ingest.consume(req)
        while (batch := pipeline.ingest.get(timeout=0)) is not None:
            pipeline.process(batch)
            pipeline.ingest.task_done()
    pipeline.close_due(flush=True)


DEMO_START_NS = 1_790_000_000 * NS // (3600 * NS) * 3600 * NS  # a fixed hour: the digests do not move with the clock


def captured(doc: dict[str, Any], requests: Any) -> list[dict[str, str]]:
    """Each interval's digests of a pipeline of `doc` fed `requests`."""
    pipeline = in_process(doc)
    out: list[dict[str, str]] = []
    capturing(pipeline, out)
    try:
        feed(pipeline, requests)
    finally:
        pipeline.shutdown()
    return out


def demo(variant: str, over: Mapping[str, Any] = {}) -> list[dict[str, str]]:  # noqa: B006 - read only
    """The demo cluster (`otelgpu demo`'s scrapes) under one variant of its configuration (and
    `over` on top of it)."""
    base = yaml.safe_load(resources.files("otelgpu.demo").joinpath("config.yaml").read_text())
    return captured(merged(merged(base, VARIANTS[variant]), over), scrape_requests(DEMO_START_NS, DEMO_HOURS * 3600))


def fleet_config() -> dict[str, Any]:
    """The gateway's otelgpu.yaml, without the Kubernetes API (facts from kube-state-metrics)."""
    config = yaml.safe_load((ROOT / "k8s" / "gateway" / "otelgpu.yaml").read_text())
    config["cluster"]["name"] = "fleet"  # ${env:CLUSTER_NAME} in the pod
    config["kubernetes"] = {"enabled": False}
    return config


def fleet_requests(gpus: int, minutes: int) -> Any:
    """`gpus` GPUs of the benchmark fleet (benchmarks/bench_scale.py's: whole, MIG and time-sliced;
    dcgm-exporter's default counters every 30 s, kube-state-metrics, the kubelet every 60 s), for
    `minutes` of data, in requests of the Collector's batch size."""
    import bench_footprint as bf
    from bench_scale import nodes_for

    nodes, ns_labels = bf.fleet(nodes_for(gpus), 0)
    for k in range(minutes * 2):
        elapsed = 30 * k + 30
        t = DEMO_START_NS + elapsed * NS
        targets = [scrapes.ksm(nodes, ns_labels, t)] + [bf.dcgm(n, t, (elapsed % 3600) / 3600) for n in nodes]
        if k % 2:
            targets += [scrapes.cadvisor(n, t, elapsed) for n in nodes]
        yield from bf.batches(targets)


def fleet(gpus: int = 10_000, minutes: int = 5) -> list[dict[str, str]]:
    """The fleet's intervals with the gateway's otelgpu.yaml."""
    return captured(fleet_config(), fleet_requests(gpus, minutes))


def differences(want: list[dict[str, str]], got: list[dict[str, str]]) -> list[str]:
    if len(want) != len(got):
        return [f"{len(got)} intervals, {len(want)} recorded"]
    return [f"interval {i}: {key} {'differs' if key in have else 'missing'}"
            for i, (wanted, have) in enumerate(zip(want, got))
            for key in sorted(set(wanted) | set(have)) if wanted.get(key) != have.get(key)]


def path_of(fleet_too: bool) -> Path:
    return DATA / ("fleet.json" if fleet_too else "demo.json")


def main(argv: list[str] = sys.argv[1:]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="record the digests instead of checking them")
    ap.add_argument("--fleet", action="store_true", help="the 10,000-GPU fleet instead of the demo's variants")
    args = ap.parse_args(argv)
    run: Callable[[], Digests] = (lambda: {"fleet-10000": fleet()}) if args.fleet else (
        lambda: {variant: demo(variant) for variant in VARIANTS})
    got, path = run(), path_of(args.fleet)
    if args.write:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"recorded {sum(map(len, got.values()))} intervals of {len(got)} runs in {path.relative_to(ROOT)}")
        return 0
    want = json.loads(path.read_text())
    problems = [f"{name}: {d}" for name in sorted(set(want) | set(got))
                for d in differences(want.get(name, []), got.get(name, []))]
    print("\n".join(problems[:40]) or f"identical: {sum(map(len, got.values()))} intervals of {len(got)} runs")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
