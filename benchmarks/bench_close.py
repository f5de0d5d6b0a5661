"""What closing an interval costs in memory: the resident size while each interval closes (join,
cost models, store, snapshot) against the resident size just before it, at 10,000 GPUs.

The pipeline runs in this process with the gateway's otelgpu.yaml (facts from kube-state-metrics,
no exporter: the snapshot is made and dropped), fed the benchmark fleet (tests/capture.py's
`fleet_requests`, bench_scale.py's fleet) every 30 s of data time. The requests are made in a
child process and read from a pipe as bytes, one at a time, so that this process holds only the
pipeline and the request at hand. VmRSS is sampled every 2 ms on a thread. Printed per interval:
the resident size before its close, the peak during it, and the ratio; then the largest ratio and
the largest step in MiB.

Usage: python benchmarks/bench_close.py [--gpus 10000] [--minutes 6]
"""

from __future__ import annotations

import argparse
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from capture import feed, fleet_config, fleet_requests, in_process  # noqa: E402

from otelgpu.pipeline import Pipeline  # noqa: E402


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


class Closes:
    """Wraps the pipeline's interval close: the resident size before each, and the peak during it."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.rows: list[tuple[int, int]] = []  # (before, peak) in KiB
        self._closing = threading.Event()
        self._peak = 0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        close = pipeline._close

        def closing(*args: Any, **kwargs: Any) -> Any:
            before = rss_kib()
            self._peak = before
            self._closing.set()
            try:
                return close(*args, **kwargs)
            finally:
                self._closing.clear()
                self.rows.append((before, max(self._peak, rss_kib())))

        pipeline._close = closing  # type: ignore[method-assign]

    def _sample(self) -> None:
        while not self._stop.is_set():
            if self._closing.wait(0.1):
                self._peak = max(self._peak, rss_kib())
                time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()


def emit(gpus: int, minutes: int) -> None:
    """The fleet's requests on stdout, each as its length (8 bytes, little-endian) and its bytes."""
    out = sys.stdout.buffer
    for req in fleet_requests(gpus, minutes):
        raw = req.SerializeToString()
        out.write(struct.pack("<Q", len(raw)) + raw)
    out.flush()


def requests_from(child: subprocess.Popen) -> Any:
    assert child.stdout is not None
    while head := child.stdout.read(8):
        yield child.stdout.read(struct.unpack("<Q", head)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=10_000)
    ap.add_argument("--minutes", type=int, default=6, help="minutes of data (the gateway closes one interval a minute)")
    ap.add_argument("--emit", action="store_true", help=argparse.SUPPRESS)  # the child that makes the requests
    args = ap.parse_args()
    if args.emit:
        emit(args.gpus, args.minutes)
        return
    child = subprocess.Popen([sys.executable, __file__, "--emit", "--gpus", str(args.gpus), "--minutes",
                              str(args.minutes)], stdout=subprocess.PIPE)
    pipeline = in_process(fleet_config())
    closes = Closes(pipeline)
    began = rss_kib()
    try:
        feed(pipeline, requests_from(child))
    finally:
        closes.stop()
        pipeline.shutdown()
        child.wait()
    print(f"{args.gpus} GPUs, {args.minutes} min of data; {began / 1024:.0f} MiB before the first request")
    for i, (before, peak) in enumerate(closes.rows):
        print(f"interval {i}: {before / 1024:6.0f} MiB before its close, peak {peak / 1024:6.0f} MiB during it, "
              f"x{peak / before:.2f}")
    ratios = [peak / before for before, peak in closes.rows]
    steps = [(peak - before) / 1024 for before, peak in closes.rows]
    print(f"largest ratio x{max(ratios):.2f}, largest step {max(steps):.0f} MiB")


if __name__ == "__main__":
    main()
