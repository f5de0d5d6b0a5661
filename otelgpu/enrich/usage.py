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
from typing import Callable, ClassVar, Iterator, Mapping, Optional, Sequence

import numpy as np

from otelgpu.core.grouping import group_ids
from otelgpu.enrich.samples import Columns
from otelgpu.receiver.decode import PointBatch
from otelgpu.receiver.interner import Interner
from otelgpu.receiver.schema import Metric

RUNNING, CPU, MEMORY, PROMPT, GENERATION = 0, 1, 2, 3, 4
COUNTERS = (CPU, PROMPT, GENERATION)
MAX_RATE_GAP_NS = 600 * 1_000_000_000  # two points further apart than this make no rate
# A token series is kept this long without a point: what a server served while its scrapes (or
# otelgpu) were away for less than a day is counted when they come back.
TOKEN_KEEP_NS = 86400 * 1_000_000_000
_FIRST_ROWS = 1024  # counter series' rows at first, and at the least


@dataclass
class PodSamples(Columns):
    CODES: ClassVar[tuple[str, ...]] = ("namespace", "pod", "container", "series", "engine")
    kind: np.ndarray  # int8: RUNNING (value 0/1), CPU (cores over span_s), MEMORY (bytes), PROMPT / GENERATION (tokens)
    time_ns: np.ndarray  # int64
    namespace: np.ndarray  # int32 codes
    pod: np.ndarray
    container: np.ndarray  # the container; of token series, the model served (vLLM's model_name)
    series: np.ndarray  # int32: cAdvisor's `id` (the cgroup) of CPU series, the tenant of token series, else -1
    value: np.ndarray  # float64: 0/1 Running; counters (CPU: a rate in cores, tokens: the increase, once differenced); bytes
    span_s: np.ndarray  # float64: seconds a CPU rate covers; 0 before differencing and otherwise
    engine: np.ndarray  # int32: vLLM's `engine` of token series (one series per engine of a pod), else -1

    @staticmethod
    def empty() -> "PodSamples":
        ints = np.zeros(0, np.int32)
        return PodSamples(np.zeros(0, np.int8), np.zeros(0, np.int64), ints, ints, ints, ints, np.zeros(0),
                          np.zeros(0), ints)


class UsageTracker:
    """Turns kube-state-metrics phases and cAdvisor series into PodSamples, and at each interval's
    close the CPU counters into rates. Counters are differenced only when their interval closes
    (sorted by time, against the series' last point of the previous interval), so neither the
    order nor the batching of input changes a rate."""

    key = "usage"  # its checkpoint entry (core/state.py)

    def __init__(self, strings: Interner, tenant_labels: tuple[str, ...] = (), reserved: frozenset[str] = frozenset()
                 ) -> None:
        self.strings = strings
        self.tenant_labels = tenant_labels  # the labels naming a token series' tenant, first present wins
        self.reserved = reserved  # tenant values a label may not claim (they name otelgpu's own buckets)
        # counter series (`_key`) -> its row of `_time` and `_counter` (its last point), by
        # strings: codes are not kept across intervals (the interner is compacted) nor across
        # restarts (checkpoint). Points as arrays, written in place: a tuple of two numbers each
        # took some 60 bytes, and a mark kept the old ones beside the new (at 100,000 GPUs 76,000
        # series, some 8 MiB from the computation ahead to the close).
        self._rows: dict[tuple, int] = {}
        self._time, self._counter = np.zeros(_FIRST_ROWS, np.int64), np.zeros(_FIRST_ROWS, np.float64)
        self._free: list[int] = []  # rows of forgotten series, the next new series' the last
        self._skip = ("", "POD")  # container "" is the pod's own cgroup, POD the pause container

    def pod_samples(self, batch: PointBatch, use: bool = True, tokens: bool = False,
                    phases: bool = False) -> PodSamples:
        """With `use`, phases and cAdvisor use (scad); with `phases`, the phases alone (how long a
        GPU grant's pod ran); with `tokens`, vLLM's token counters."""
        strings = self.strings
        running = (batch.metric == Metric.POD_PHASE) & ~batch.stale
        if (use or phases) and running.any():
            running &= batch.column(strings.find("phase")) == strings.code("Running")
        usage = ((batch.metric == Metric.CPU_USAGE) | (batch.metric == Metric.MEMORY_WORKING_SET)) & ~batch.stale
        wanted = ((batch.metric == Metric.PROMPT_TOKENS) | (batch.metric == Metric.GENERATION_TOKENS)) & ~batch.stale
        if not tokens:
            wanted[:] = False
        if use:
            wanted |= running | usage
        elif phases:
            wanted |= running
        selected = batch.select(wanted)
        if not len(selected):
            return PodSamples.empty()
        ns, pod = selected.column(strings.find("namespace")), selected.column(strings.find("pod"))
        container = selected.column(strings.find("container"))
        kind = np.select([selected.metric == Metric.POD_PHASE, selected.metric == Metric.CPU_USAGE,
                          selected.metric == Metric.MEMORY_WORKING_SET, selected.metric == Metric.PROMPT_TOKENS],
                         [RUNNING, CPU, MEMORY, PROMPT], GENERATION)
        token = (kind == PROMPT) | (kind == GENERATION)
        series = np.where(kind == CPU, selected.column(strings.find("id")),
                          -1)  # cAdvisor: a restarted container is a new cgroup
        engine = np.full(len(selected), -1, np.int32)
        if token.any():  # token series: the model as container, the tenant as series, and the engine
            container = np.where(token, selected.column(strings.find("model_name")), container)
            tenant = np.full(len(selected), -1, np.int32)
            for label in reversed(self.tenant_labels):  # the first label present wins
                value = selected.column(strings.find(label))
                tenant = np.where(value >= 0, value, tenant)
            series = np.where(token, tenant, series)
            engine = np.where(token, selected.column(strings.find("engine")), -1)
        skip = [-1] + [c for c in map(strings.find, self._skip) if c >= 0]
        keep = (kind == RUNNING) | ((token | ~np.isin(container, skip)) & (ns >= 0) & (pod >= 0))
        idx = np.flatnonzero(keep)
        return PodSamples(kind[idx].astype(np.int8), selected.time_ns[idx], ns[idx], pod[idx],
                          container[idx].astype(np.int32),
                          series[idx].astype(np.int32), selected.value[idx], np.zeros(len(idx)),
                          engine[idx].astype(np.int32))

    def use(self, samples: PodSamples, start_ns: int, end_ns: int) -> "PodUses":
        """Per (namespace code, pod code) of one closing interval: share Running and mean use."""
        return self.use_and_tokens(samples, start_ns, end_ns)[0]

    def use_and_tokens(self, samples: PodSamples, start_ns: int, end_ns: int) -> tuple["PodUses", "Tokens"]:
        """`use`, and the tokens each pod served in the interval, by model and tenant."""
        if len(samples):  # a resent batch repeats points: count each once
            _, first = group_ids(samples.kind, samples.time_ns, samples.namespace, samples.pod, samples.container,
                                 samples.series, samples.engine)
            samples = samples if len(first) == len(samples) else samples.take(np.sort(first))
        samples = self._rates(samples)
        token = (samples.kind == PROMPT) | (samples.kind == GENERATION)
        use = pod_use(samples.take(np.flatnonzero(~token)), start_ns, end_ns)
        return use, self._tokens(samples.take(np.flatnonzero(token)))

    def _tokens(self, samples: PodSamples) -> "Tokens":
        """(namespace, pod) -> (model, tenant) -> [prompt, generation] tokens; a series naming no
        tenant, or one of the reserved values, is its pod's namespace's."""
        out: Tokens = {}
        if not len(samples):
            return out
        sid, first = group_ids(samples.kind, samples.namespace, samples.pod, samples.container,
                               samples.series)  # engines added up
        total = np.bincount(sid, weights=samples.value)
        st = self.strings.string
        for g, i in enumerate(first.tolist()):
            ns, pod = st(int(samples.namespace[i])), st(int(samples.pod[i]))
            tenant = st(int(samples.series[i])) if samples.series[i] >= 0 else ns
            tenant = ns if tenant in self.reserved else tenant
            per = out.setdefault((ns, pod), {}).setdefault((st(int(samples.container[i])), tenant), [0.0, 0.0])
            per[0 if samples.kind[i] == PROMPT else 1] += float(total[g])
        return out

    def _rates(self, samples: PodSamples) -> PodSamples:
        """Counter points -> CPU rates (cores) over the span since the series' previous point, and
        token increases since it, with counter resets handled as Prometheus' rate() does. The
        first point of a series makes none (a CPU point is dropped, a token point counts 0); a
        point no newer than what an earlier interval counted is dropped."""
        cpu = np.flatnonzero(np.isin(samples.kind, COUNTERS))
        if not len(cpu):
            return samples
        sid, first = group_ids(samples.kind[cpu], samples.namespace[cpu], samples.pod[cpu], samples.container[cpu],
                               samples.series[cpu], samples.engine[cpu])
        keys = [self._key(samples, i) for i in cpu[first].tolist()]
        known = np.fromiter((self._rows.get(k, -1) for k in keys), np.int64, len(keys))  # per series, not point
        last_t = np.where(known >= 0, self._time[known], -1)  # (row -1 reads the last, unused)
        last_v = np.where(known >= 0, self._counter[known], 0.0)
        newer = samples.time_ns[cpu] > last_t[sid]  # older points were counted by an earlier interval
        rows, sid = cpu[newer], sid[newer]
        order = np.lexsort((samples.time_ns[rows], sid))
        rows, sid = rows[order], sid[order]
        times, values = samples.time_ns[rows], samples.value[rows]
        starts = np.ones(len(rows), dtype=bool)
        starts[1:] = sid[1:] != sid[:-1]
        prev_t, prev_v = np.roll(times, 1), np.roll(values, 1)
        prev_t[starts] = last_t[sid[starts]]
        prev_v[starts] = last_v[sid[starts]]
        ends = np.flatnonzero(np.append(starts[1:], True) if len(rows) else starts)  # none newer than counted
        at = known[sid[ends]]
        for k in np.flatnonzero(at < 0).tolist():
            key = keys[int(sid[ends[k]])]
            at[k] = self._rows[key] if key in self._rows else self._new_row(key)  # two codes may read alike
        self._time[at], self._counter[at] = times[ends], values[ends]  # of one row twice, the last
        rate = samples.kind[rows] == CPU  # tokens count whatever the gap: what was served was served
        ok = (prev_t >= 0) & ((times - prev_t <= MAX_RATE_GAP_NS) | ~rate)
        span = (times - prev_t) / 1e9
        delta = np.where(values >= prev_v, values - prev_v, values)  # a reset restarts the counter from zero
        value, spans = samples.value.copy(), np.zeros(len(samples))
        spans[rows[ok]] = np.where(rate[ok], span[ok], 0.0)
        value[rows[ok]] = delta[ok] / np.where(rate[ok], span[ok], 1.0)  # tokens: the increase itself
        keep = ~np.isin(samples.kind, COUNTERS)
        keep[rows[ok]] = True
        # A token series' first point counts nothing, but says its pod serves: the interval's cost
        # then goes to the pod's `without_tokens` tenant rather than to no tenant at all.
        first_tokens = rows[~ok & ~rate]
        value[first_tokens] = 0.0
        keep[first_tokens] = True
        out = PodSamples(samples.kind, samples.time_ns, samples.namespace, samples.pod, samples.container,
                         samples.series, value, spans, samples.engine)
        return out.take(np.flatnonzero(keep))

    def _key(self, samples: PodSamples, row: int) -> tuple:
        """A counter series' identity, by strings: (namespace, pod, container, cgroup id) for CPU,
        (kind, namespace, pod, model, tenant, engine) for tokens (-1: "")."""
        st = self.strings.string

        def text(code: int) -> str:
            return st(code) if code >= 0 else ""

        if samples.kind[row] == CPU:
            return (st(int(samples.namespace[row])), st(int(samples.pod[row])), st(int(samples.container[row])),
                    st(int(samples.series[row])))
        return (int(samples.kind[row]), st(int(samples.namespace[row])), st(int(samples.pod[row])),
                text(int(samples.container[row])), text(int(samples.series[row])), text(int(samples.engine[row])))

    def _new_row(self, key: tuple) -> int:
        """A row for a series not met before (its point is written there next)."""
        if self._free:
            row = self._free.pop()
        else:  # every row below it is a series'
            row = len(self._rows)
            if row == len(self._time):
                self._time = np.concatenate([self._time, np.zeros(row, np.int64)])
                self._counter = np.concatenate([self._counter, np.zeros(row, np.float64)])
        self._rows[key] = row
        return row

    def _points(self) -> Iterator[tuple[tuple, int, float]]:
        """Each series' key and last point (time, counter)."""
        rows = np.fromiter(self._rows.values(), np.int64, len(self._rows))
        return zip(self._rows, self._time[rows].tolist(), self._counter[rows].tolist())

    def mark(self) -> Callable[[], None]:
        """What puts the counters' last points back as they are now (`use` moves them on)."""
        rows, time, counter, free = dict(self._rows), self._time.copy(), self._counter.copy(), list(self._free)

        def undo() -> None:
            self._rows, self._time, self._counter, self._free = rows, time, counter, free

        return undo

    def expire(self, now_ns: int) -> None:
        """Forget counter series not seen for a while (their pods are gone): CPU series after
        MAX_RATE_GAP_NS (no rate spans more), token series after TOKEN_KEEP_NS."""
        cpu, tokens = now_ns - MAX_RATE_GAP_NS, now_ns - TOKEN_KEEP_NS
        for key in [k for k, t, _ in self._points() if t < (cpu if len(k) == 4 else tokens)]:
            self._free.append(self._rows.pop(key))

    def state(self) -> dict[str, list[list]]:
        """The last points of the CPU series (`cpu`) and of the token series (`tokens`)."""
        points = list(self._points())
        return {"cpu": [[*key, t, v] for key, t, v in points if len(key) == 4],
                "tokens": [[*key, t, v] for key, t, v in points if len(key) == 6]}

    def restore(self, state: Mapping[str, Sequence[list]] | None) -> None:
        state = state or {}
        points = [((str(a), str(b), str(c), str(d)), int(t), float(v)) for a, b, c, d, t, v in state.get("cpu", ())]
        points += [((int(kind), str(ns), str(pod), str(model), str(tenant), str(engine)), int(t), float(v))
                   for kind, ns, pod, model, tenant, engine, t, v in state.get("tokens", ())]
        last = {key: (t, v) for key, t, v in points}
        self._rows = {key: row for row, key in enumerate(last)}
        size = max(_FIRST_ROWS, len(last))
        self._time, self._counter = np.zeros(size, np.int64), np.zeros(size, np.float64)
        self._time[:len(last)] = [t for t, _ in last.values()]
        self._counter[:len(last)] = [v for _, v in last.values()]
        self._free = []


# (namespace, pod) -> (model, tenant) -> [prompt tokens, generation tokens] of one interval
Tokens = dict[tuple[str, str], dict[tuple[str, str], list[float]]]


@dataclass(frozen=True, slots=True)  # one per pod an interval: no dict each
class PodUse:
    running_share: float  # NaN where no phase was scraped in the interval
    cpu_cores: float  # mean cores used while running; NaN where not measured
    memory_bytes: float  # mean working set; NaN where not measured


def pod_use(samples: PodSamples, start_ns: int, end_ns: int) -> "PodUses":
    """Per (namespace code, pod code): share of the interval Running (to the resolution of the
    kube-state-metrics scrapes: a phase seen at a scrape holds until the next one) and mean use
    (per container, time-weighted for CPU rates, then summed over the pod's containers)."""
    if not len(samples):
        return PodUses(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros((0, 3)))
    pod_id, first = group_ids(samples.namespace, samples.pod)
    n_pod = len(first)
    out = np.full((n_pod, 3), np.nan)
    run = samples.kind == RUNNING
    if run.any():
        times = np.unique(samples.time_ns[run])
        begin = times.copy()
        begin[0] = start_ns
        dur = (np.append(times[1:], end_ns) - begin) / (end_ns - start_ns)
        step = np.searchsorted(times, samples.time_ns[run])
        seen = np.bincount(pod_id[run], minlength=n_pod) > 0
        share = np.bincount(pod_id[run], weights=np.where(samples.value[run] == 1.0, dur[step], 0.0), minlength=n_pod)
        out[seen, 0] = share[seen]
    for kind, col in ((CPU, 1), (MEMORY, 2)):
        sel = samples.kind == kind
        if not sel.any():
            continue
        weight = samples.span_s[sel] if kind == CPU else np.ones(int(sel.sum()))
        cid, cfirst = group_ids(pod_id[sel], samples.container[sel])
        total = np.bincount(cid, weights=samples.value[sel] * weight)
        weights = np.bincount(cid, weights=weight)
        mean = np.divide(total, weights, out=np.zeros_like(total), where=weights > 0)
        owner = pod_id[sel][cfirst]
        has = np.bincount(owner, weights=weights > 0, minlength=n_pod) > 0
        summed = np.bincount(owner, weights=mean, minlength=n_pod)
        out[has, col] = summed[has]
    return PodUses(samples.namespace[first], samples.pod[first], out)


class PodUses(Mapping[tuple[int, int], PodUse]):
    """Per (namespace code, pod code), in the order of the codes: its use, as columns, a
    `PodUse` built where one is read (at 100,000 GPUs some 76,000 pods an interval, for which an
    object, a key and three numbers each held some 16 MiB while the interval was computed)."""

    def __init__(self, namespace: np.ndarray, pod: np.ndarray, uses: np.ndarray) -> None:
        """`uses`: float [pod, 3], running share, CPU cores and memory bytes."""
        self._namespace, self._pod, self._uses = namespace, pod, uses
        self._at = {_pod_key(n, p): i for i, (n, p) in enumerate(zip(namespace.tolist(), pod.tolist()))}

    def get(self, key: tuple[int, int], default: Optional[PodUse] = None) -> Optional[PodUse]:  # type: ignore[override]
        at = self._at.get(_pod_key(*key))
        return default if at is None else PodUse(*self._uses[at].tolist())

    def __getitem__(self, key: tuple[int, int]) -> PodUse:
        found = self.get(key)
        if found is None:
            raise KeyError(key)
        return found

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return zip(self._namespace.tolist(), self._pod.tolist())

    def __len__(self) -> int:
        return len(self._at)


def _pod_key(namespace: int, pod: int) -> int:
    """A pod's codes as one Python int (codes are below 2**31, -1 for none; a numpy code would
    wrap when shifted)."""
    return (int(namespace) << 32) + int(pod)
