"""One lifecycle for the state the worker keeps from one interval to the next (the facts, the
counters' last points, the device memory, the admitted tag values, the interval windows, the
cost store): each part implements `Stateful`, is registered once (`States`), and the checkpoint,
its restore, the undo of an interval computed ahead and each close's expiry are one loop each.

A checkpoint document is composed of each part's entry under its key; a part restores from its
entry, or starts afresh where the document has none (`None`). A malformed entry raises KeyError,
TypeError or ValueError."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

Undo = Callable[[], None]


@runtime_checkable
class Stateful(Protocol):
    key: str  # its entry in the checkpoint document

    def state(self) -> Any:
        """Its entry: JSON-able, or numpy arrays (checkpoint.py writes both)."""

    def restore(self, state: Any) -> None:
        """Continue from an entry of `state()` (None: start afresh)."""

    def mark(self) -> Undo:
        """What puts it back as it is now (an interval computed ahead of its close is undone when
        what it read changes)."""

    def expire(self, end_ns: int) -> None:
        """An interval ending at `end_ns` closed: forget what is too old to matter."""


def nothing_to_undo() -> None:
    return None


class States:
    """The parts, in the order they restore (a later one may read an earlier one's)."""

    def __init__(self, parts: Sequence[Stateful]) -> None:
        keys = [p.key for p in parts]
        if len(set(keys)) != len(keys):
            raise ValueError(f"two parts share a checkpoint key: {keys}")
        self.parts = list(parts)

    def state(self) -> dict[str, Any]:
        return {p.key: p.state() for p in self.parts}

    def restore(self, document: Mapping[str, Any]) -> None:
        for p in self.parts:
            p.restore(document.get(p.key))

    def mark(self) -> Undo:
        undos = [p.mark() for p in self.parts]

        def undo() -> None:
            for u in reversed(undos):  # last part first
                u()

        return undo

    def expire(self, end_ns: int) -> None:
        for p in self.parts:
            p.expire(end_ns)
