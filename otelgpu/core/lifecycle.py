"""One lifecycle for every component that runs threads or serves sockets (the receivers, the
/metrics server, the Kubernetes API watches, each exporter's delivery): `start()` once, then
`shutdown(deadline)`, done by `deadline` (time.monotonic(); None: the component's own grace).
Both are idempotent (a second call does nothing), a shutdown before any start has nothing to stop
(it does nothing), and a component shut down is not started again."""

from __future__ import annotations

import time
from typing import Optional, Protocol, runtime_checkable


@runtime_checkable
class Component(Protocol):
    def start(self) -> None: ...

    def shutdown(self, deadline: Optional[float] = None) -> None: ...


def grace(deadline: Optional[float], default: float) -> float:
    """Seconds left until `deadline` (none left: 0), or `default` without one."""
    return default if deadline is None else max(0.0, deadline - time.monotonic())
