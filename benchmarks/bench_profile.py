"""Where the memory and the CPU go, by owner, at 10,000 GPUs (or any size): one pipeline with the
gateway's otelgpu.yaml in this process, fed the benchmark fleet (bench_scale.py's: whole, MIG and
time-sliced GPUs; dcgm-exporter's default counters and kube-state-metrics every 30 s, the kubelet
every 60 s) in requests of the Collector's batch size, as decoded protobuf (no gRPC, no export).

    python benchmarks/bench_profile.py [--gpus 10000] [--minutes 6] [--mode memory|stages|owners|cpu] [--top 25]

- `--mode memory` (tracemalloc, `--frames` 12): what the process holds, by owner, at two moments of
  the last interval: just before it closes (the open interval's points buffered, the state) and
  just after. The owner of an allocation is the innermost frame in otelgpu/ (module and
  function); allocations by no otelgpu frame (the request protobufs this process builds, the
  interpreter) are left out. tracemalloc sees Python objects and numpy's buffers, not numba's or
  gRPC's native heaps: the RSS beside it says how much it does not see.
- `--mode stages`: what each interval's computation holds, stage by stage: tracemalloc runs only
  inside `Pipeline._compute`, and a profile hook notes each stage's start and peak (MiB above the
  computation's start; a hook holds no argument, where a wrapper would keep a stage's inputs).
- `--mode owners`: what each owner of the pipeline's state holds at the end, its objects walked
  (each counted once, in the first owner that reaches it; numpy's buffers by their bytes), beside
  the process's resident size.
- `--mode cpu`: CPU seconds by stage, from the process clock around each step (decoding the
  requests, applying the points, closing intervals), the pipeline's own `otelgpu_work_seconds_total`
  per step, and, with `--py-spy`, py-spy's samples of the whole run by owner (innermost otelgpu
  frame, and the function that frame called when it is a library's). `--warm-minutes N` feeds N
  minutes of data first, unmeasured: the figures are then those of a cluster whose label sets
  and series are all known, not of the first minutes that learn them.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_footprint as bf  # noqa: E402 - the fleet, its scrapes
from bench_scale import Scrapes, nodes_for, physical_gpus  # noqa: E402

from otelgpu.config import parse_config  # noqa: E402
from otelgpu.enrich.window import NS  # noqa: E402
from otelgpu.pipeline import Pipeline  # noqa: E402
from otelgpu.telemetry import by_label, total  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
START_NS = 1_790_000_000 // 3600 * 3600 * NS
SCRAPE_S = bf.SCRAPE_S


def gateway_pipeline() -> Pipeline:
    """The gateway's otelgpu.yaml in this process: facts from kube-state-metrics (no API server
    here), no receivers, exporters or checkpoint (what they cost is bench_scale.py's to measure)."""
    doc = yaml.safe_load((ROOT / "k8s" / "gateway" / "otelgpu.yaml").read_text())
    doc["cluster"]["name"] = "fleet"
    doc["kubernetes"] = {"enabled": False}
    doc["receiver"] = {**doc.get("receiver", {}), "grpc": {"endpoint": "127.0.0.1:0"}, "http": {"enabled": False},
                       "max_point_age_seconds": 0}
    doc["exporter"] = {"prometheus": {"enabled": False}}
    doc.pop("checkpoint", None)
    return Pipeline(parse_config(doc), serve_receivers=False)


def rounds(fleet: Scrapes, minutes: int) -> Iterator[tuple[float, list[tuple[bytes, int]]]]:
    """Each scrape round's data time and its requests (bytes, points): the fleet's one round,
    built once and re-stamped, so that building them costs next to nothing per round."""
    for k in range(minutes * 60 // SCRAPE_S):
        elapsed = SCRAPE_S * (k + 1)
        yield elapsed, list(fleet.at(START_NS + elapsed * NS, with_kubelet=bool(k % 2)))


class Stages:
    """CPU seconds (process clock) per stage."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()

    def timed(self, stage: str, work: Any) -> Any:
        began = time.process_time()
        try:
            return work()
        finally:
            self.seconds[stage] += time.process_time() - began


def feed(pipeline: Pipeline, requests: list, stages: Stages) -> None:
    """One round: decode each request (the receiver's work), then apply the batches and close what
    is due (the processing thread's)."""
    for request, _ in requests:
        stages.timed("decode", lambda: pipeline.ingest.consume(request))
        while (batch := pipeline.ingest.get(timeout=0)) is not None:
            stages.timed("apply and close", lambda: pipeline.process(batch))
            pipeline.ingest.task_done()


def feed_all(pipeline: Pipeline, args: argparse.Namespace) -> None:
    """Every round of `args.minutes` of the fleet of `args.gpus`."""
    stages = Stages()
    for _, requests in rounds(Scrapes(*bf.fleet(nodes_for(args.gpus), 0)), args.minutes):
        feed(pipeline, requests, stages)


OURS, DEMO = str(ROOT / "otelgpu") + os.sep, str(ROOT / "otelgpu" / "demo") + os.sep


def owner(traceback: tracemalloc.Traceback) -> Optional[str]:
    """The innermost frame of an allocation in otelgpu's own files, as `path:line`."""
    for frame in reversed(traceback):
        name = frame.filename
        if name.startswith(OURS) and not name.startswith(DEMO):
            return f"{name[len(str(ROOT)) + 1:]}:{frame.lineno}"
    return None


def by_owner(snapshot: tracemalloc.Snapshot) -> dict[str, int]:
    sizes: dict[str, int] = defaultdict(int)
    ours = snapshot.filter_traces([tracemalloc.Filter(True, OURS + "*", all_frames=True)])
    for stat in ours.statistics("traceback"):
        where = owner(stat.traceback)
        if where is not None:
            sizes[where] += stat.size
    return sizes


def by_module(sizes: dict[str, int]) -> dict[str, int]:
    modules: dict[str, int] = defaultdict(int)
    for where, size in sizes.items():
        modules[where.rsplit(":", 1)[0]] += size
    return modules


def rss_mib() -> float:
    return bf.proc_status(os.getpid())["VmRSS"] / 1024


def print_sizes(title: str, sizes: dict[str, int], top: int) -> None:
    total = sum(sizes.values())
    print(f"\n{title}: {total / 2**20:,.1f} MiB traced in otelgpu's frames")
    for where, size in sorted(sizes.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {size / 2**20:9.2f} MiB  {size / total:6.1%}  {where}")


def memory(args: argparse.Namespace) -> None:
    tracemalloc.start(args.frames)
    pipeline = gateway_pipeline()
    print(f"ready: RSS {rss_mib():.0f} MiB, traced {tracemalloc.get_traced_memory()[0] / 2**20:.1f} MiB")
    stages = Stages()
    all_rounds = list(range(args.minutes * 60 // SCRAPE_S))
    snapshots = {}
    fleet = Scrapes(*bf.fleet(nodes_for(args.gpus), 0))
    for k, (elapsed, requests) in zip(all_rounds, rounds(fleet, args.minutes)):
        closes = (elapsed + SCRAPE_S) % 60 == 30 and elapsed >= 60  # this round's data closes an interval
        if k == len(all_rounds) - 1:
            gc.collect()
            snapshots["before the last round (an interval open, its points buffered)"] = tracemalloc.take_snapshot()
            before_rss = rss_mib()
        feed(pipeline, requests, stages)
        del requests
        if k == len(all_rounds) - 1:
            gc.collect()
            snapshots["after it (the interval closed)" if closes else "after it"] = tracemalloc.take_snapshot()
    print(f"RSS before the last round {before_rss:.0f} MiB, after {rss_mib():.0f} MiB; tracemalloc peak "
          f"{tracemalloc.get_traced_memory()[1] / 2**20:.0f} MiB (all frames)")
    for title, snapshot in snapshots.items():
        sizes = by_owner(snapshot)
        print_sizes(f"{title}, by module", by_module(sizes), args.top)
        print_sizes(f"{title}, by line", sizes, args.top)
    pipeline.shutdown()


# The interval's computation's stages, as the profile hook finds them by function name in otelgpu's files.
STAGES = frozenset({"_samples", "reported", "dedupe", "_held_by_several", "tenures", "holder_rows", "unheld_rows",
                    "without_device_data", "_row_sets", "pod_rows", "priced", "attribute"})


class StagePeaks:
    """Each stage's start and peak of traced memory, in the order the stages began, nested."""

    def __init__(self) -> None:
        self.stages: list[list] = []  # [depth, stage, start, peak] (bytes)
        self._open: list[list] = []  # those of the stages running

    def hook(self, frame: Any, event: str, _: Any) -> None:
        code = frame.f_code
        if event not in ("call", "return") or code.co_name not in STAGES or not code.co_filename.startswith(OURS):
            return
        current, peak = tracemalloc.get_traced_memory()
        for stage in self._open:  # what ran since the last event counts in every stage still open
            stage[3] = max(stage[3], peak)
        tracemalloc.reset_peak()
        if event == "call":
            where = f"{code.co_name} ({Path(code.co_filename).stem})"
            self._open.append([len(self._open), where, current, current])
            self.stages.append(self._open[-1])
        elif self._open:
            self._open.pop()


def stages(args: argparse.Namespace) -> None:
    pipeline = gateway_pipeline()
    compute = pipeline._compute

    def traced(interval: Any) -> Any:
        peaks = StagePeaks()
        tracemalloc.start()
        start = tracemalloc.get_traced_memory()[0]
        sys.setprofile(peaks.hook)
        try:
            return compute(interval)
        finally:
            sys.setprofile(None)
            held, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            top = max([peak] + [p for *_, p in peaks.stages])
            print(f"interval ending {interval.end_ns}: peak {(top - start) / 2**20:.1f} MiB above the computation's "
                  f"start, {(held - start) / 2**20:.1f} MiB held once computed")
            for depth, name, began, high in peaks.stages:
                print(f"  {'  ' * depth}{name:<32} start {(began - start) / 2**20:7.1f}  "
                      f"peak {(high - start) / 2**20:7.1f}")

    pipeline._compute = traced
    feed_all(pipeline, args)
    pipeline.shutdown()


def walked(root: Any, seen: set[int]) -> tuple[int, int]:
    """(bytes of Python objects, bytes of numpy buffers) reachable from `root` and not in `seen`
    (which it extends); modules, classes and functions are not followed. An array a numba kernel
    returned owns no data (its memory is numba's) and an array over a bytes object neither: their
    buffer is counted once, by the array that refers to it."""
    python = buffers = 0
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, type(sys), type(len), type(walked))):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            base = obj
            while isinstance(base.base, np.ndarray):
                base = base.base
            if base.flags.owndata and (base is obj or id(base) not in seen):
                seen.add(id(base))
                buffers += base.nbytes
            elif not base.flags.owndata and base.base is not None and id(base.base) not in seen:
                seen.add(id(base.base))  # numba's memory, or a bytes object's
                buffers += base.nbytes
            python += sys.getsizeof(obj) - (obj.nbytes if obj.flags.owndata else 0)
            if obj.dtype == object:
                stack.extend(obj.ravel().tolist())
            continue
        python += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return python, buffers


def owners(args: argparse.Namespace) -> None:
    pipeline = gateway_pipeline()
    feed_all(pipeline, args)
    gc.collect()
    seen = {id(pipeline.metrics), id(pipeline.config)}
    parts = [("the interner", pipeline.strings), ("the decoder", pipeline.ingest), ("the open intervals",
             pipeline.windows), ("the store", pipeline.store), ("kube-state-metrics facts", pipeline.facts),
             ("device memory", pipeline.devices), ("CPU counters", pipeline.usage), ("everything else", pipeline)]
    total = 0
    for name, owner_of in parts:
        python, buffers = walked(owner_of, seen)
        total += python + buffers
        print(f"  {name:<26} {(python + buffers) / 2**20:8.1f} MiB (Python objects {python / 2**20:.1f}, "
              f"numpy {buffers / 2**20:.1f})")
    print(f"walked: {total / 2**20:.1f} MiB; the process (the load's requests among it): RSS {rss_mib():.0f} MiB")
    for index, slot in sorted(pipeline.windows._open.items()):
        print(f"  open interval {index}: {sum(map(len, slot.samples.parts)):,} DCGM steps, "
              f"{sum(map(len, slot.facts.parts)):,} kube-state-metrics rows, {sum(map(len, slot.pods)):,} pod samples")
    pipeline.shutdown()


def cpu(args: argparse.Namespace) -> None:
    fleet = Scrapes(*bf.fleet(nodes_for(args.gpus), 0))
    pipeline = gateway_pipeline()
    every = rounds(fleet, args.warm_minutes + args.minutes)
    for _ in range(args.warm_minutes * 60 // SCRAPE_S):  # fed, not measured: every label set and series met
        feed(pipeline, next(every)[1], Stages())
    stages = Stages()
    spy = None
    if args.py_spy:
        spy = subprocess.Popen([args.py_spy, "record", "--pid", str(os.getpid()), "--format", "raw", "--rate", "200",
                                "--nonblocking", "--output", args.py_spy_out], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        # Not waited for: py-spy says nothing it has attached until it exits, and the first tenth of
        # a second it may miss is none of a round's work worth counting.
    points = 0
    began = time.process_time()
    for _, requests in every:
        points += sum(n for _, n in requests)
        feed(pipeline, requests, stages)
    spent = time.process_time() - began
    if spy is not None:
        spy.send_signal(2)
        spy.wait(timeout=60)
    intervals = total(pipeline.metrics.intervals_computed)
    print(f"{points:,} points, {intervals:.0f} intervals computed, {spent:.1f} CPU-s in this process "
          f"(building the requests: {spent - sum(stages.seconds.values()):.1f} CPU-s of it)")
    for stage, seconds in stages.seconds.most_common():
        print(f"  {stage:>16}: {seconds:7.2f} CPU-s  {seconds / points * 1e6:6.2f} us a point")
    work = by_label(pipeline.metrics.work_seconds)
    print("the pipeline's otelgpu_work_seconds_total (wall) per interval computed:")
    for step, seconds in sorted(work.items(), key=lambda kv: -kv[1]):
        print(f"  {step!s:>16}: {seconds / max(intervals, 1):7.3f} s")
    decoder = pipeline.ingest.columnar
    print(f"the decoder's label-set table: {len(decoder):,} sets, {decoder.table_bytes() / 2**20:.1f} MiB; "
          f"the store: {pipeline.store.active_series():,} series")
    pipeline.shutdown()
    if spy is not None:
        summarize_py_spy(args.py_spy_out, args.top)


def summarize_py_spy(path: str, top: int) -> None:
    """py-spy's collapsed stacks by owner: the innermost otelgpu frame, and what it called."""
    mine: Counter[str] = Counter()
    total = 0
    # split on newlines alone: a frame py-spy read torn can hold bytes str.splitlines takes for one
    for line in Path(path).read_bytes().decode(errors="replace").split("\n"):
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue  # empty, or a stack torn into two lines: its samples are left out
        frames = stack.split(";")
        samples = int(count)
        total += samples
        inner = [i for i, f in enumerate(frames) if _ours(f.partition(" (")[2])]
        if not inner:
            mine["(no otelgpu frame: building the requests, the interpreter)"] += samples
            continue
        i = inner[-1]
        callee = frames[i + 1].split(" (")[0] if i + 1 < len(frames) else "(itself)"
        mine[f"{_short(frames[i])} -> {callee}"] += samples
    print(f"\npy-spy: {total:,} samples, by the innermost otelgpu frame and what it called")
    for where, samples in mine.most_common(top):
        print(f"  {samples / total:6.1%}  {where}")


def _ours(path: str) -> bool:
    """A file of otelgpu's own (not the demo's scrapes, which only build this load)."""
    return path.startswith("otelgpu/") and not path.startswith("otelgpu/demo/")


def _short(frame: str) -> str:
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rstrip(')').split(':')[0]})"


def main(argv: list[str] = sys.argv[1:]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=10_000)
    ap.add_argument("--minutes", type=int, default=6)
    ap.add_argument("--mode", choices=("memory", "stages", "owners", "cpu"), default="memory")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--warm-minutes", type=int, default=0,
                    help="minutes of data fed before what is measured (--mode cpu): the state once every set is met")
    ap.add_argument("--frames", type=int, default=12, help="frames tracemalloc keeps of each allocation")
    ap.add_argument("--py-spy", help="py-spy's path: sample the run with it (--mode cpu)")
    ap.add_argument("--py-spy-out", default=os.path.join(tempfile.gettempdir(), "otelgpu-py-spy.txt"))
    args = ap.parse_args(argv)
    nodes, _ = bf.fleet(nodes_for(args.gpus), 0)
    print(f"{sum(physical_gpus(n) for n in nodes):,} GPUs on {len(nodes):,} nodes "
          f"({sum(len(n.devices) for n in nodes):,} units), {args.minutes} minutes of data")
    {"memory": memory, "stages": stages, "owners": owners, "cpu": cpu}[args.mode](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
