"""Per-pod samples the scad model needs: when a pod was Running, and how much CPU and memory it
used, on data time like the DCGM samples.

CPU arrives as the cumulative counter `container_cpu_usage_seconds_total`; each new point of a
series becomes a rate (cores) over the span since the series' previous point, with counter
resets handled as Prometheus' `rate()` does. Memory is `container_memory_working_set_bytes`.
Only container series count: cAdvisor's pod-level series (`container=""`, which arrives without a
`container` label at all), the pause container (`container="POD"`) and cgroups outside pods
would count the same use twice or belong to nobody.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from otelgpu.enrich.samples import Columns
from otelgpu.enrich.timeline import group_ids
from otelgpu.receiver.decode import PointBatch
from otelgpu.receiver.interner import Interner
from otelgpu.receiver.schema import Metric

RUNNING, CPU, MEMORY = 0, 1, 2
MAX_RATE_GAP_NS = 600 * 1_000_000_000  # two points further apart than this make no rate


@dataclass
class PodSamples(Columns):
    kind: np.ndarray  # int8: RUNNING (value 0/1), CPU (cores over span_s), MEMORY (bytes)
    time_ns: np.ndarray  # int64
    namespace: np.ndarray  # int32 codes
    pod: np.ndarray
    container: np.ndarray
    series: np.ndarray  # int32: cAdvisor's `id` (the cgroup) of CPU series, -1 otherwise
    value: np.ndarray  # float64: 0/1 Running; CPU counter (a rate in cores once differenced); bytes
    span_s: np.ndarray  # float64: seconds a CPU rate covers; 0 before differencing and otherwise

    @staticmethod
    def empty() -> "PodSamples":
        i = np.zeros(0, np.int32)
        return PodSamples(np.zeros(0, np.int8), np.zeros(0, np.int64), i, i, i, i, np.zeros(0), np.zeros(0))


class UsageTracker:
    """Turns kube-state-metrics phases and cAdvisor series into PodSamples, and at each interval's
    close the CPU counters into rates. Counters are differenced only when their interval closes
    (sorted by time, against the series' last point of the previous interval), so neither the
    order nor the batching of input changes a rate."""

    def __init__(self, strings: Interner) -> None:
        self.s = strings
        self._last: dict[tuple[int, int, int, int], tuple[int, float]] = {}  # series -> (time_ns, counter)
        self._skip = {-1, strings.code(""), strings.code("POD")}

    def pod_samples(self, batch: PointBatch) -> PodSamples:
        s = self.s
        running = (batch.metric == Metric.POD_PHASE) & ~batch.stale
        if running.any():
            running &= batch.column(s.find("phase")) == s.code("Running")
        usage = ((batch.metric == Metric.CPU_USAGE) | (batch.metric == Metric.MEMORY_WORKING_SET)) & ~batch.stale
        b = batch.select(running | usage)
        if not len(b):
            return PodSamples.empty()
        ns, pod, container = b.column(s.find("namespace")), b.column(s.find("pod")), b.column(s.find("container"))
        kind = np.where(b.metric == Metric.POD_PHASE, RUNNING, np.where(b.metric == Metric.CPU_USAGE, CPU, MEMORY))
        keep = (kind == RUNNING) | (~np.isin(container, list(self._skip)) & (ns >= 0) & (pod >= 0))
        series = b.column(s.find("id"))  # cAdvisor: a restarted container is a new cgroup, a new series
        idx = np.flatnonzero(keep)
        return PodSamples(kind[idx].astype(np.int8), b.time_ns[idx], ns[idx], pod[idx], container[idx],
                          np.where(kind[idx] == CPU, series[idx], -1).astype(np.int32), b.value[idx],
                          np.zeros(len(idx)))

    def use(self, p: PodSamples, start_ns: int, end_ns: int) -> dict[tuple[int, int], "PodUse"]:
        """Per (namespace code, pod code) of one closing interval: share Running and mean use."""
        if len(p):  # a resent batch repeats points: count each once
            _, first = group_ids(p.kind, p.time_ns, p.namespace, p.pod, p.container, p.series)
            p = p.take(np.sort(first))
        return pod_use(self._rates(p), start_ns, end_ns)

    def _rates(self, p: PodSamples) -> PodSamples:
        """CPU counter points -> rates (cores) over the span since the series' previous point,
        with counter resets handled as Prometheus' rate() does. The first point of a series
        makes no rate; duplicates are dropped."""
        cpu = np.flatnonzero(p.kind == CPU)
        if not len(cpu):
            return p
        order = cpu[np.lexsort((p.time_ns[cpu], p.series[cpu], p.container[cpu], p.pod[cpu], p.namespace[cpu]))]
        keep = np.ones(len(p), dtype=bool)
        value, span = p.value.copy(), np.zeros(len(p))
        for i in order:
            key = (int(p.namespace[i]), int(p.pod[i]), int(p.container[i]), int(p.series[i]))
            t, v = int(p.time_ns[i]), float(p.value[i])
            prev = self._last.get(key)
            if prev is not None and t <= prev[0]:
                keep[i] = False  # resent, or older than what an earlier interval counted
                continue
            self._last[key] = (t, v)
            if prev is None or t - prev[0] > MAX_RATE_GAP_NS:
                keep[i] = False
                continue
            delta = v - prev[1] if v >= prev[1] else v  # a reset restarts the counter from zero
            span[i] = (t - prev[0]) / 1e9
            value[i] = delta / span[i]
        out = PodSamples(p.kind, p.time_ns, p.namespace, p.pod, p.container, p.series, value, span)
        return out.take(np.flatnonzero(keep))

    def expire(self, now_ns: int) -> None:
        """Forget counter series not seen for a while (their pods are gone)."""
        cutoff = now_ns - MAX_RATE_GAP_NS
        for key in [k for k, (t, _) in self._last.items() if t < cutoff]:
            del self._last[key]


@dataclass(frozen=True)
class PodUse:
    running_share: float  # NaN where no phase was scraped in the interval
    cpu_cores: float  # mean cores used while running; NaN where not measured
    memory_bytes: float  # mean working set; NaN where not measured


def pod_use(p: PodSamples, start_ns: int, end_ns: int) -> dict[tuple[int, int], PodUse]:
    """Per (namespace code, pod code): share of the interval Running (to the resolution of the
    kube-state-metrics scrapes: a phase seen at a scrape holds until the next one) and mean use."""
    dt = end_ns - start_ns
    out: dict[tuple[int, int], list[float]] = {}
    run = p.kind == RUNNING
    if run.any():
        times = np.unique(p.time_ns[run])
        nxt = np.append(times[1:], end_ns)
        begin = times.copy()
        begin[0] = start_ns
        dur = (nxt - begin) / dt
        step = np.searchsorted(times, p.time_ns[run])
        for n, q, v, k in zip(p.namespace[run], p.pod[run], p.value[run], step):
            entry = out.setdefault((int(n), int(q)), [0.0, np.nan, np.nan])
            if v == 1.0:
                entry[0] += dur[k]
    for kind, col in ((CPU, 1), (MEMORY, 2)):
        sel = p.kind == kind
        if not sel.any():
            continue
        weight = p.span_s[sel] if kind == CPU else np.ones(int(sel.sum()))
        per_container: dict[tuple[int, int, int], list[float]] = {}
        for n, q, c, v, w in zip(p.namespace[sel], p.pod[sel], p.container[sel], p.value[sel], weight):
            acc = per_container.setdefault((int(n), int(q), int(c)), [0.0, 0.0])
            acc[0] += v * w
            acc[1] += w
        for (n, q, _), (total, w) in per_container.items():
            entry = out.setdefault((n, q), [np.nan, np.nan, np.nan])
            if w > 0:
                entry[col] = (0.0 if np.isnan(entry[col]) else entry[col]) + total / w
    return {k: PodUse(*v) for k, v in out.items()}
