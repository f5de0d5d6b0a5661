"""Source trust: each kind of fact comes only from the scrape targets `sources` names.

A point of a consumed metric whose resource (its scrape target, as the Collector's prometheus
receiver describes it) does not match its kind's source is rejected with a fixed reason per
kind, counted and reported to the sender as a partial success like any other rejection. The
first refusal of each target is logged, naming it, so that a misnamed scrape job is found
quickly; later ones are only counted.
"""

from __future__ import annotations

import logging
import threading
from typing import Mapping, Optional

import numpy as np

from otelgpu.receiver.config import Matcher, SourcesConfig
from otelgpu.receiver.rejection import Rejection, rejection
from otelgpu.receiver.schema import CADVISOR_METRICS, DCGM_METRICS, KSM_METRICS, VLLM_METRICS

log = logging.getLogger(__name__)

KINDS = {"dcgm": DCGM_METRICS, "kube_state_metrics": KSM_METRICS, "cadvisor": CADVISOR_METRICS, "vllm": VLLM_METRICS}
BIT = {kind: 1 << i for i, kind in enumerate(KINDS)}
EVERY = sum(BIT.values())
# The kinds whose targets' clocks close intervals: the cost facts'. vLLM's token counters only
# split a pod's cost, and any target may send them: they neither move nor hold the watermark.
CLOCK = BIT["dcgm"] | BIT["kube_state_metrics"] | BIT["cadvisor"]
# The kind bit of each metric code (codes are small integers).
KIND_OF_METRIC = np.zeros(max(int(c) for m in KINDS.values() for c in m.values()) + 1, np.int64)
for _kind, _metrics in KINDS.items():
    for _code in _metrics.values():
        KIND_OF_METRIC[int(_code)] = BIT[_kind]
_KIND_NAME = {BIT[k]: k for k in KINDS}
_MAX_LOGGED = 64  # targets whose first refusal is logged


def untrusted_reason(bit: int) -> Rejection:
    kind = _KIND_NAME[bit]
    return rejection("", f"untrusted_{kind}", f"{kind} series from a scrape target not in sources.{kind}")


class SourceTrust:
    """Which kinds of series a resource may send, from its attributes."""

    def __init__(self, config: SourcesConfig) -> None:
        self._matchers = {kind: [self._compile(m) for m in getattr(config, kind)] for kind in KINDS}
        self.keys = frozenset(k for matchers in self._matchers.values() for m in matchers for k in m)
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    @staticmethod
    def _compile(matcher: Matcher) -> dict[str, frozenset[str]]:
        return {k: frozenset((v,) if isinstance(v, str) else v) for k, v in matcher.items()}

    def bits(self, resource: Mapping[str, str]) -> int:
        """The kinds (BIT) a resource with these attributes may send."""
        out = 0
        for kind, matchers in self._matchers.items():
            if any(all(resource.get(k) in values for k, values in m.items()) for m in matchers):
                out |= BIT[kind]
        return out

    def refused(self, bits: int, kind_bits: int, source: str) -> None:
        """Log the first refusal of a target (bounded), naming it and what it sent."""
        if source in self._logged:
            return
        with self._lock:
            if source in self._logged or len(self._logged) >= _MAX_LOGGED:
                return
            self._logged.add(source)
        kinds = [k for k, b in BIT.items() if kind_bits & b and not bits & b]
        log.warning("refusing %s series from scrape target %r: it is not in sources.%s (see docs/security.md)",
                    ", ".join(kinds), source, " / sources.".join(kinds))


def trust_of(config: Optional[SourcesConfig]) -> Optional[SourceTrust]:
    return SourceTrust(config) if config is not None else None
