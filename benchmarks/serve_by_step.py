"""`otelgpu serve` with its resident memory sampled every 50 ms and labelled by the step the
pipeline's thread is in (a batch, and within it the folds of an open interval's DCGM steps and
kube-state-metrics rows; computing ahead, the close, staging the snapshot, the checkpoint's state,
the commit) and whether an exporter is sending, so that a run's highest RSS is told apart by
what made it. bench_scale.py's `--rss-by-step` runs the sidecar so.

usage: python benchmarks/serve_by_step.py LOG serve --config otelgpu.yaml
LOG gets a line per sample: the system's monotonic clock in seconds (time.monotonic(), one clock
for every process of the machine), RSS in MiB, the step, and "send" or "-"."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable

from otelgpu.cli import main
from otelgpu.commit import Committer
from otelgpu.enrich.steps import Steps
from otelgpu.enrich.window import Windows
from otelgpu.exporter.delivery import Delivery
from otelgpu.pipeline import Pipeline

# Within a batch, the folds of an open interval: its DCGM steps (and a batch's own, one part), its
# kube-state-metrics rows.
STEPS = ((Pipeline, "process", "process"), (Steps, "merge", "fold-steps"), (Windows, "_fold_facts", "fold-facts"),
         (Pipeline, "compute_ahead", "ahead"), (Pipeline, "_close", "close"), (Committer, "add", "stage"),
         (Pipeline, "_checkpoint_state", "state"), (Committer, "commit", "commit"))
SAMPLE_S = 0.05


def labelled(real: Callable[..., Any], slot: str, step: str, now: dict[str, str]) -> Callable[..., Any]:
    def step_of(*args: Any, **kwargs: Any) -> Any:
        before, now[slot] = now[slot], step
        try:
            return real(*args, **kwargs)
        finally:
            now[slot] = before
    return step_of


def sample(path: str, now: dict[str, str]) -> None:
    page = os.sysconf("SC_PAGE_SIZE")
    with open(path, "w", buffering=1) as log:
        while True:
            with open("/proc/self/statm") as statm:
                rss = int(statm.read().split()[1]) * page / 2**20
            log.write(f"{time.monotonic():.2f} {rss:.0f} {now['pipeline']} {now['send']}\n")
            time.sleep(SAMPLE_S)


def summary(path: str, after_s: float = 0.0, before_s: float = float("inf")) -> dict[str, float]:
    """The highest RSS sampled in each step (joined with "+send" while an exporter sent), from
    `after_s` on and before `before_s` (time.monotonic() of any process)."""
    highest: dict[str, float] = {}
    with open(path) as log:
        for line in log:
            fields = line.split()
            if len(fields) != 4 or not after_s <= float(fields[0]) < before_s:
                continue
            step = fields[2] if fields[3] == "-" else f"{fields[2]}+send"
            highest[step] = max(highest.get(step, 0.0), float(fields[1]))
    return highest


if __name__ == "__main__":
    current = {"pipeline": "-", "send": "-"}
    for owner, name, step in STEPS:
        setattr(owner, name, labelled(getattr(owner, name), "pipeline", step, current))
    Delivery._send = labelled(Delivery._send, "send", "send", current)
    threading.Thread(target=sample, args=(sys.argv[1], current), daemon=True).start()
    sys.exit(main(sys.argv[2:]))
