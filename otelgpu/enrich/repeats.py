"""The kube-state-metrics objects whose rows in an update repeat, row for row, the rows the last
update applied to them: applying them again writes what is there already, and only their times
move (`KsmFacts.update`, enrich/facts.py).

Every scrape sends the whole state again, so in a steady cluster nearly every pod, node and
namespace comes back each interval with the very rows of the interval before: the same places in
the table the open intervals share (enrich/factrows.py), at newer times. At 10,000 GPUs that is
some 59,000 rows an interval, which took 0.2-0.3 CPU-s to apply one by one, each building its
labels as a dict. Here the repeats are found from the rows' places and the codes of the names in
the table, as arrays: no row is built. A pod that changed (a phase, a label, a new request) or is
new has its rows applied as before; so do ReplicaSet and Job owners, whatever they repeat.

Why moving the times alone is exact, object by object:
- a row writes only its own object's fields (a pod row its pod, a node row its node), so objects
  are independent of each other;
- the rows of one object, applied again in the same order to the state they left, leave it as it
  is: each field ends as the last row that writes it wrote it (a request is set, not added), and
  a staleness marker, the one row whose effect depends on time alone, is never a repeat;
- every row of both updates was applied: they are all at or after the newest time any row had
  been applied at before them (`Repeats.newest_ns`), else nothing is a repeat;
- the places compared are of one table: where a fold renewed the table since the last update,
  that update's places are carried into the new one (enrich/factrows.py `renewals_of`), a row it
  does not hold matching none;
- nothing else changed the facts since the last update: whatever else writes them (a mark put
  back, a checkpoint restored, late rows applied directly) forgets what the last update applied
  (`forget`), or puts back what was known at the mark; an object forgotten since (its grace period
  over) is looked up, not found, and applied in full.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy as np

from otelgpu.enrich.factrows import FactRows, carry, follow, renewals_of
from otelgpu.receiver.decode import PointBatch
from otelgpu.receiver.schema import Metric

# An object's kind, in a key's top two bits: its other bits are the codes of its namespace and
# name (a pod), or of its name (a node, a namespace). 0: a row of no object here (an owner's).
POD, NODE, NAMESPACE = 1, 2, 3
_KIND = np.zeros(max(Metric) + 1, np.uint64)
_KIND[[Metric.POD_LABELS, Metric.POD_REQUESTS, Metric.POD_INFO, Metric.POD_PHASE, Metric.POD_ANNOTATIONS]] = POD
_KIND[[Metric.NODE_INFO, Metric.NODE_LABELS, Metric.NODE_CAPACITY]] = NODE
_KIND[Metric.NAMESPACE_LABELS] = NAMESPACE
FIRST_KEY = np.uint64(POD) << np.uint64(62)  # keys below: no object
_CODE_BITS = np.uint64(31)  # an interned string's code is below 2**31
_CODE_MASK = (1 << 31) - 1


def key_parts(key: int) -> tuple[int, int, int]:
    """An object's key (`object_keys`) as its kind and the codes of its two names (the second 0
    but for a pod's)."""
    return key >> 62, (key >> 31) & _CODE_MASK, key & _CODE_MASK


def object_keys(batch: PointBatch, names: tuple[int, int, int]) -> np.ndarray:
    """uint64 per row: its object's key, or 0 for a row of none or one missing its name (a row
    that names its namespace, pod or node twice too). `names`: the codes of `namespace`, `pod`
    and `node` (-1: never interned, so no row names it)."""
    rows = len(batch)
    row_of = np.repeat(np.arange(rows), np.diff(batch.attr_off))
    found = []
    for code in names:
        value = np.full(rows, -1, np.int64)
        at = np.flatnonzero(batch.attr_key == code) if code >= 0 else np.zeros(0, np.int64)
        value[row_of[at]] = batch.attr_val[at]
        value[np.bincount(row_of[at], minlength=rows) > 1] = -1
        found.append(value)
    namespace, pod, node = found
    kind = _KIND[batch.metric]
    first = np.where(kind == NODE, node, namespace)
    second = np.where(kind == POD, pod, 0)
    keys = (kind << np.uint64(62)) | (np.maximum(first, 0).astype(np.uint64) << _CODE_BITS) \
        | np.maximum(second, 0).astype(np.uint64)
    keys[(first < 0) | (second < 0)] = 0
    return keys


@dataclass
class Applied:
    """What an update applied, object by object: the rows (places in `table`, or beyond it the
    update's own rows, never repeats) of each object in `keys` (sorted) from `start[i]` to
    `start[i + 1]` in `places`, in the order they were applied."""

    table: weakref.ref  # the table the places are in: a table dropped since is no table of now
    epoch: int  # the interner's, when applied: its codes are rewritten by a compaction
    keys: np.ndarray  # uint64 [objects]
    start: np.ndarray  # int64 [objects + 1]
    places: np.ndarray  # int32 [rows]


@dataclass
class Found:
    """An update's rows by object: `keys` (sorted), each one's rows `rows[start[i]:start[i + 1]]`
    (indices into the update's rows, in its order), whether each object repeats what was
    applied to it last (`repeat`), and each one's newest row's time (`newest_ns`)."""

    keys: np.ndarray  # uint64 [objects]
    start: np.ndarray  # int64 [objects + 1]
    rows: np.ndarray  # int64 [rows with an object]
    repeat: np.ndarray  # bool [objects]
    newest_ns: np.ndarray  # int64 [objects]


class Repeats:
    """What the last update applied (`Applied`), and the newest time any row was applied at."""

    def __init__(self) -> None:
        self.last: Optional[Applied] = None
        self.newest_ns = 0
        self._keys: Optional[tuple[weakref.ref, int, np.ndarray]] = None  # the last table's object keys

    def forget(self, newest_ns: int) -> None:
        """Something else wrote the facts (rows up to `newest_ns`): the next update applies all."""
        self.last = None
        self.newest_ns = max(self.newest_ns, newest_ns)

    def mark(self) -> Callable[[], None]:
        """What puts back what the last update applied, with the facts a mark puts back."""
        last, newest = self.last, self.newest_ns

        def undo() -> None:
            self.last, self.newest_ns = last, newest

        return undo

    def find(self, rows: FactRows, names: tuple[int, int, int], epoch: int) -> Found:
        """The objects of `rows` and whether each one repeats. Remembers `rows` as the last
        update's: call once per update, and apply what it says."""
        n_table, place = len(rows.shared), rows.row.astype(np.int64)
        row_keys = _by_place(place, n_table, self._table_keys(rows.shared, names, epoch), object_keys(rows.own, names))
        stale = _by_place(place, n_table, rows.shared.stale, rows.own.stale)
        keyed = np.flatnonzero(row_keys >= FIRST_KEY)
        order = keyed[np.argsort(row_keys[keyed], kind="stable")]  # by object, each one's rows in their order
        object_of, first = np.unique(row_keys[order], return_index=True)
        start = np.append(first, len(order)).astype(np.int64)
        places = place[order].astype(np.int32)
        every_row_applied = not len(rows) or int(rows.time_ns.min()) >= self.newest_ns
        repeat = np.zeros(len(object_of), bool)
        last = _in_table(self.last, rows.shared)
        if every_row_applied and last is not None and last.epoch == epoch:
            repeat = _same_rows(object_of, start, places, last) & ~_any(stale[order] | (places >= n_table), start)
        newest = np.maximum.reduceat(rows.time_ns[order], first) if len(order) else np.zeros(0, np.int64)
        self.last = Applied(follow(rows.shared), epoch, object_of, start, places) if every_row_applied else None
        if len(rows):
            self.newest_ns = max(self.newest_ns, int(rows.time_ns.max()))
        return Found(object_of, start, order, repeat, newest)

    def _table_keys(self, table: PointBatch, names: tuple[int, int, int], epoch: int) -> np.ndarray:
        """The object keys of `table`'s rows, kept while the table and the codes stay (a steady
        cluster's folds keep one table for many intervals)."""
        known = self._keys
        if known is not None and known[0]() is table and known[1] == epoch:
            return known[2]
        keys = object_keys(table, names)
        self._keys = (weakref.ref(table), epoch, keys)
        return keys


def _in_table(last: Optional[Applied], table: PointBatch) -> Optional[Applied]:
    """`last` with its places in `table`: as they are when they are that table's; where `table`
    renewed the table they are in (enrich/factrows.py), each row's place in it (-1 for a row it
    does not hold, or one beyond the table then: a row its update held apart); else None."""
    if last is None or last.table() is table:
        return last
    moved = next((places for old, places in renewals_of(table) if old is last.table), None)  # the same table
    if moved is None:
        return None
    return replace(last, table=weakref.ref(table), places=carry(last.places, moved))


def _by_place(place: np.ndarray, n_table: int, of_table: np.ndarray, of_own: np.ndarray) -> np.ndarray:
    """Per row, its value in `of_table` (a place in the table) or in `of_own` (a place beyond it:
    the rows' own rows)."""
    out = np.zeros(len(place), of_table.dtype)
    mine = place >= n_table
    out[~mine] = of_table[place[~mine]]
    out[mine] = of_own[place[mine] - n_table]
    return out


def _any(flags: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Per object (rows `start[i]:start[i + 1]` of `flags`), whether any of its rows is flagged."""
    if len(start) < 2:
        return np.zeros(0, bool)
    return np.logical_or.reduceat(flags, start[:-1])


def _same_rows(keys: np.ndarray, start: np.ndarray, places: np.ndarray, last: Applied) -> np.ndarray:
    """Per object, whether `last` applied to it the same places in the same order."""
    if not len(last.keys) or not len(keys):
        return np.zeros(len(keys), bool)
    at = np.minimum(np.searchsorted(last.keys, keys), len(last.keys) - 1)
    count, last_count = np.diff(start), np.diff(last.start)[at]
    same = (last.keys[at] == keys) & (count == last_count)
    object_of_row = np.repeat(np.arange(len(keys)), count)
    where_last = np.where(same[object_of_row], last.start[at][object_of_row] + np.arange(len(places))
                          - start[object_of_row], 0)
    return same & ~_any(places != last.places[where_last], start)
