"""What requests may cost in memory before they are decoded: the receivers' memory limiter.

Two bounds, checked before a request's bytes are decoded (and, where the transport allows, before
they are read), in the spirit of the Collector's `memory_limiter` processor:

- The process's resident size against a soft and a hard limit. At or above the soft limit a new
  request is refused with "retry later" (gRPC UNAVAILABLE with RetryInfo, HTTP 503 with
  Retry-After) while anything else is in flight: `memory_limit`. Alone it is taken: refusing
  cannot shrink the state itself, so a state grown past the limit slows ingestion to one request
  at a time rather than stopping it. At or above the hard limit the garbage collector runs and
  freed heap memory goes back to the kernel as well, at most once a second. The limits default to
  percentages of the container's memory limit (cgroup v2 `memory.max`, or v1's
  `memory.limit_in_bytes`), else of the machine's memory.
- Bytes in flight: each request reserves what it will cost (its bytes as received, their
  decompressed size and the decoder's columns, see `cost`) from the moment its size is known
  until it is answered, and its decoded batch keeps its size reserved until the pipeline takes it
  from the queue. A request whose reservation does not fit in `max_inflight_bytes` is refused
  (`bytes_in_flight`), unless nothing else is in flight: then it is admitted alone, so that a
  request larger than the budget (but within the receivers' size limits) still gets through.

Refusals are counted by the receivers, by reason. The pipeline's own work (intervals, export) is
never refused: what it holds is the state the limit is sized for (docs/memory.md).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Optional

from otelgpu import heap
from otelgpu.errors import Refusal, RetryableError

if TYPE_CHECKING:
    from otelgpu.core.settings import MemoryLimiterConfig

log = logging.getLogger(__name__)

MEMORY_LIMIT, BYTES_IN_FLIGHT = Refusal.MEMORY_LIMIT, Refusal.BYTES_IN_FLIGHT  # refusal reasons
DECODE_FACTOR = 0.5  # the columnar decoder's columns, per decompressed byte (at most; see receiver/columnar.py)
GC_EVERY_S = 1.0
_CGROUP_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63
NO_BUDGET = 1 << 62  # a budget of bytes in flight no request reaches


def container_memory() -> Optional[int]:
    """The container's memory limit in bytes (cgroup v2, then v1), or None where it has none."""
    for path in _CGROUP_FILES:
        try:
            text = open(path, encoding="ascii").read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < _NO_LIMIT:
            return int(text)
        return None
    return None


def machine_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident set size (/proc/self/statm: a few microseconds)."""
    with open("/proc/self/statm", "rb") as file:
        return int(file.read().split()[1]) * _PAGE


def cost(received: int, decompressed: Optional[int] = None) -> int:
    """Bytes a request reserves: what arrived, its decompressed size if it was compressed, and the
    decoder's columns."""
    inflated = received if decompressed is None else decompressed
    return received + (0 if decompressed is None else decompressed) + int(DECODE_FACTOR * inflated)


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB" if nbytes >= 1 << 20 else f"{nbytes} bytes"


class Ticket:
    """Bytes reserved by one request; `release()` gives them back (once)."""

    __slots__ = ("_limiter", "nbytes")

    def __init__(self, limiter: "MemoryLimiter", nbytes: int) -> None:
        self._limiter, self.nbytes = limiter, nbytes

    def grow(self, nbytes: int) -> None:
        """Reserve `nbytes` more (RetryableError, and nothing more reserved, if they do not fit and
        other requests are in flight)."""
        self._limiter._reserve(nbytes, own=self.nbytes)
        self.nbytes += nbytes

    def resize(self, nbytes: int) -> None:
        """Hold `nbytes` in all: more reserved (as `grow`) or the difference given back."""
        if nbytes > self.nbytes:
            self.grow(nbytes - self.nbytes)
        elif nbytes < self.nbytes:
            self._limiter._give_back(self.nbytes - nbytes)
            self.nbytes = nbytes

    def release(self) -> None:
        if self.nbytes:
            self._limiter._give_back(self.nbytes)
            self.nbytes = 0


class MemoryLimiter:
    """`soft_bytes`, `hard_bytes`: the resident-size limits (None: no resident-size check);
    `max_inflight_bytes`: the budget of requests in flight."""

    def __init__(self, soft_bytes: Optional[int], hard_bytes: Optional[int], max_inflight_bytes: int,
                 retry_after_s: float = 1.0) -> None:
        self.soft_bytes, self.hard_bytes = soft_bytes, hard_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self.inflight = 0  # bytes reserved
        self._last_gc = 0.0
        self._over = False  # above the soft limit at the last check (logged once per episode)

    @classmethod
    def unlimited(cls, retry_after_s: float = 1.0) -> "MemoryLimiter":
        """No resident-size check and a budget no request reaches (the receivers' own size and
        count limits still hold)."""
        return cls(None, None, NO_BUDGET, retry_after_s)

    def check(self) -> None:
        """RetryableError (reason `memory_limit`) when the resident size is at or above the soft
        limit and something is in flight: what is in flight frees memory as the pipeline takes it."""
        rss = self._over_soft()
        if rss is not None and self.inflight > 0:
            raise self._memory_error(rss)

    def admit(self, nbytes: int) -> Ticket:
        """Check the resident size, then reserve `nbytes`: a Ticket, or RetryableError (with the
        refusal's reason) and nothing reserved. At or above the soft limit a request is taken only
        alone (nothing else in flight): refusing cannot shrink the state itself, so a state that
        outgrew the limit slows ingestion to one request at a time instead of stopping it."""
        rss = self._over_soft()
        with self._lock:
            if rss is not None and self.inflight > 0:
                raise self._memory_error(rss)
            self._reserve_locked(nbytes, own=0)
        return Ticket(self, nbytes)

    def _over_soft(self) -> Optional[int]:
        """The resident size when at or above the soft limit, else None; above the hard limit,
        garbage is collected too. Each episode is logged once."""
        if self.soft_bytes is None:
            return None
        rss = resident_bytes()
        if rss >= (self.hard_bytes or rss + 1):
            self._collect()
        if rss < self.soft_bytes:
            if self._over:
                self._over = False
                log.info("resident memory %d MiB, below the soft limit again: taking requests", rss >> 20)
            return None
        if not self._over:
            self._over = True
            log.warning("resident memory %d MiB at or above the soft limit (%d MiB): taking one request at a time "
                        "until it is below (if it stays above with nothing in flight, the state itself needs more "
                        "memory: raise the container's limit)", rss >> 20, self.soft_bytes >> 20)
        return rss

    def _memory_error(self, rss: int) -> RetryableError:
        return RetryableError(f"memory limit: {_size(rss)} resident, soft limit {_size(self.soft_bytes or 0)}; "
                              "retry later", self.retry_after_s, reason=MEMORY_LIMIT)

    def hold(self, nbytes: int) -> None:
        """Reserve `nbytes` whatever the budget: what was admitted already, in another form (a
        decoded batch in the queue); `unhold` gives them back."""
        with self._lock:
            self.inflight += nbytes

    def unhold(self, nbytes: int) -> None:
        self._give_back(nbytes)

    def _reserve(self, nbytes: int, own: int) -> None:
        with self._lock:
            self._reserve_locked(nbytes, own)

    def _reserve_locked(self, nbytes: int, own: int) -> None:
        """Under the lock: reserve `nbytes` for a request that holds `own` already; past the budget
        only if it is alone."""
        if self.inflight + nbytes > self.max_inflight_bytes and self.inflight > own:
            raise RetryableError(
                f"{_size(self.inflight + nbytes)} of requests would be in flight, more than "
                f"{_size(self.max_inflight_bytes)}; retry later", self.retry_after_s, reason=BYTES_IN_FLIGHT)
        self.inflight += nbytes

    def _give_back(self, nbytes: int) -> None:
        with self._lock:
            self.inflight -= nbytes

    def _collect(self) -> None:
        """Above the hard limit: collect garbage and hand freed heap memory back, at most once a second."""
        now = time.monotonic()
        if now - self._last_gc < GC_EVERY_S:
            return
        self._last_gc = now
        gc.collect()
        heap.give_back()


def limiter_of(config: "MemoryLimiterConfig", retry_after_s: float = 1.0) -> MemoryLimiter:
    """The limiter a configuration asks for; disabled, `MemoryLimiter.unlimited`."""
    if not config.enabled:
        return MemoryLimiter.unlimited(retry_after_s)
    total = container_memory() or machine_memory()
    mib = 1 << 20
    hard = config.limit_mib * mib if config.limit_mib else total * config.limit_percentage // 100
    spike = (config.spike_limit_mib * mib if config.spike_limit_mib
             else (hard if config.limit_mib else total) * config.spike_limit_percentage // 100)
    spike = min(spike, hard // 2)
    inflight = config.max_inflight_mib * mib if config.max_inflight_mib else spike
    return MemoryLimiter(hard - spike, hard, inflight, retry_after_s)
