"""The recent versions of one resource's objects, so facts can be read as they were at an earlier time.

An interval is computed only once the watermark has passed its end plus the lateness; a change
observed meanwhile must not reach back into it. Each version is effective from `since_ns` until the
next; `None` marks the object absent (deleted). A version supersedes every version effective at or
after its own start: a pod recreated under its name, effective from its creation, replaces what was
seen of its predecessor after that.

Versions are kept for `retention_ns`: those older than the newest one effective at or before
`now - retention` are dropped, and the oldest kept then stands for all earlier times. Only keys that
changed within the retention hold more than one version, and only they are visited when a view is
taken as of an earlier time, so a view costs a dict copy plus the recent changes.
"""

from __future__ import annotations

import operator
from typing import Callable, Generic, Hashable, Iterator, Optional, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def _at(versions: list[tuple[int, Optional[V]]], as_of_ns: int) -> Optional[V]:
    """The value of the newest version effective before `as_of_ns`; None when there is none."""
    for since, value in reversed(versions):
        if since < as_of_ns:
            return value
    return None


def _trim(versions: list[tuple[int, Optional[V]]], cut_ns: int) -> None:
    """Drop the versions older than the newest one effective at or before `cut_ns`."""
    keep = next((i for i in range(len(versions) - 1, -1, -1) if versions[i][0] <= cut_ns), 0)
    if keep:
        del versions[:keep]
        versions[0] = (0, versions[0][1])  # what came before it is no longer known: it stands for all of it


class Timeline(Generic[K, V]):
    """Not thread-safe: the owner holds its lock around every call."""

    def __init__(self, retention_ns: int, same: Callable[[V, V], bool] = operator.eq) -> None:
        self.retention_ns, self.same = retention_ns, same
        self.latest: dict[K, V] = {}  # the objects present now, as last seen
        self._versions: dict[K, list[tuple[int, Optional[V]]]] = {}  # ascending since_ns
        # Keys outside _recent hold exactly one version, present and effective at or before _horizon.
        self._recent: dict[K, None] = {}
        self._horizon = -1

    def __contains__(self, key: K) -> bool:
        """Whether anything is known of `key`, present or recently deleted."""
        return key in self._versions

    def put(self, key: K, value: Optional[V], since_ns: int, now_ns: int) -> bool:
        """`value` (None: absent) is `key`'s state from `since_ns`; False when that changes nothing."""
        versions = self._versions.get(key)
        if versions is None:
            if value is None:
                return False
            self._versions[key] = [(since_ns, value)]
        else:
            last = versions[-1][1]
            if last is value or (last is not None and value is not None and self.same(last, value)):
                return False
            while versions and versions[-1][0] >= since_ns:
                versions.pop()
            versions.append((since_ns, value))
            _trim(versions, now_ns - self.retention_ns)
        if value is None:
            self.latest.pop(key, None)
        else:
            self.latest[key] = value
        self._recent[key] = None
        return True

    def forget(self, key: K) -> None:
        self.latest.pop(key, None)
        self._versions.pop(key, None)
        self._recent.pop(key, None)

    def prune(self, now_ns: int) -> None:
        """Drop versions past the retention, and keys whose last version (absent) is past it."""
        cut = now_ns - self.retention_ns
        for key in list(self._recent):
            versions = self._versions[key]
            _trim(versions, cut)
            if len(versions) == 1 and versions[0][0] <= cut:
                del self._recent[key]
                if versions[0][1] is None:
                    del self._versions[key]
        self._horizon = max(self._horizon, cut)

    def at(self, as_of_ns: Optional[int] = None) -> dict[K, V]:
        """Every present object as it was just before `as_of_ns` (None: as it is now)."""
        if as_of_ns is None:
            return dict(self.latest)
        if as_of_ns <= self._horizon:  # older than the retention: every key may differ
            return {k: version for k, vs in self._versions.items() if (version := _at(vs, as_of_ns)) is not None}
        out = dict(self.latest)
        for key in self._recent:
            value = _at(self._versions[key], as_of_ns)
            if value is None:
                out.pop(key, None)
            else:
                out[key] = value
        return out

    def earlier(self) -> Iterator[tuple[K, V]]:
        """(key, value) of every kept version but the latest."""
        for key in self._recent:
            for _, value in self._versions[key][:-1]:
                if value is not None:
                    yield key, value

    def count(self) -> int:
        """Versions kept, absent marks included."""
        return len(self._versions) - len(self._recent) + sum(len(self._versions[k]) for k in self._recent)
