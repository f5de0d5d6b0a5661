"""One interval of the join as every job of it sees it: the facts as of its end, which pods ran
on their nodes in it and for how long, and the holders and profiles numbered as they are met."""

from __future__ import annotations

from typing import Container, Iterator, Mapping

import numpy as np

from otelgpu.core.grouping import Numbering
from otelgpu.enrich.model import FactsView, PodFacts
from otelgpu.enrich.usage import PodUse
from otelgpu.receiver.interner import Interner
from otelgpu.receiver.schema import GPU_RESOURCES, MIG_PREFIX

PodKey = tuple[str, str]  # (namespace, pod)


class Scope:
    def __init__(self, strings: Interner, facts: FactsView, start_ns: int, end_ns: int,
                 use: Mapping[tuple[int, int], PodUse]) -> None:
        self.strings, self.facts, self.start_ns, self.end_ns, self.use = strings, facts, start_ns, end_ns, use
        self.seconds = (end_ns - start_ns) / 1e9
        # kube-state-metrics drops a finished or deleted pod's series while its facts linger (TTL).
        # When it reported pods during this interval (the API's pods included), a pod it did not
        # report is gone: it holds and pays nothing. When it reported none (down, not scraped),
        # the last facts stand.
        self.ksm_reporting = facts.ksm_reported_ns >= start_ns
        self.holders: Numbering[PodKey] = Numbering(("", ""))  # NOBODY first
        self.profiles: Numbering[str] = Numbering("")  # MIG profiles, and the bases of fractions

    def string(self, code: int) -> str:
        return self.strings.string(code)

    def indices(self, numbering: Numbering[str], codes: np.ndarray) -> np.ndarray:
        """Interned codes -> indices into `numbering` (each distinct code looked up once)."""
        distinct, inverse = np.unique(codes, return_inverse=True)
        table = np.array([numbering.index(self.string(c)) for c in distinct.tolist()], np.int64)
        return table[inverse.reshape(-1)] if len(codes) else np.zeros(0, np.int64)

    def pod(self, key: PodKey) -> PodFacts | None:
        """The pod of that name alive at the interval's start."""
        return self.facts.pod(key, self.start_ns)

    def pod_use(self, key: PodKey) -> PodUse | None:
        return self.use.get((self.strings.find(key[0]), self.strings.find(key[1])))

    def held(self, key: PodKey, pod: PodFacts) -> bool:
        """Whether a pod ran on its node in the interval: its kube-state-metrics phases say so
        where they were scraped, else whether it is Running at the interval's end."""
        share = self.running_share(key)
        return bool(pod.node) and share > 0 if share is not None else self.running(pod)

    def running_share(self, key: PodKey) -> float | None:
        """The share of the interval the pod was Running, where its phase was scraped."""
        use = self.pod_use(key)
        return None if use is None or np.isnan(use.running_share) else float(use.running_share)

    def held_share(self, key: PodKey, gpu_share: float) -> float:
        """A grant's or claim's share of the interval: the GPU's, no longer than its pod ran."""
        share = self.running_share(key)
        return gpu_share if share is None else min(gpu_share, share)

    def gone(self, pod: PodFacts) -> bool:
        """A pod whose kube-state-metrics series ended with staleness markers before the interval
        began, in a scrape that reported other pods (a failed scrape marks every series stale),
        whatever the API says of it; or a pod known from kube-state-metrics only (API facts, which
        carry the creation time, say for themselves) that it no longer reports while it reports
        others."""
        if 0 < pod.ended_ns <= self.start_ns and pod.ended_ns <= self.facts.ksm_reported_ns:
            return True
        return self.ksm_reporting and not pod.created_ns and pod.seen_ns < self.start_ns

    def running(self, pod: PodFacts) -> bool:
        """Running on a node, and neither deleted nor gone from kube-state-metrics."""
        return pod.phase == "Running" and bool(pod.node) and not pod.deleted and not self.gone(pod)

    def gpu_requests(self, sharing: Container[PodKey]) -> Iterator[tuple[str, PodKey, str, int]]:
        """(node, pod key, resource, quantity) of every GPU request of a Running, scheduled pod
        that holds whole units (not one of `sharing`: HAMi or KAI shares a GPU with it, or it
        reserves one for them)."""
        for key, pod in self.facts.pods.items():
            if not self.running(pod) or key in sharing:
                continue
            for (_, resource), qty in sorted(pod.requests.items()):
                if resource in GPU_RESOURCES or resource.startswith(MIG_PREFIX):
                    yield pod.node, key, resource, int(qty)
