"""kube-state-metrics rows as the open intervals keep them: a time per row, and the row's content
(metric, value, staleness, scrape target, labels) in a table the intervals share.

Every kube-state-metrics scrape sends the whole state again, and two intervals are open at once
(the newer one takes rows while the older waits for its lateness): each held a copy of nearly
every series, of some 70 bytes a row, though in a steady cluster the newer interval's rows are the
older's but for their times. Here a row is its time and the number of a row of equal content in
the table the last fold of either interval left (`FactTable`), 12 bytes; a row no table holds (a
new pod, a phase that changed) is kept whole beside it (`FactRows.own`). A fold whose rows the
table lacks renews it with its own rows when no other interval reads the table, or when it lacks
more than an eighth of them (then the interval that reads the table before keeps it until its
close, and both are held meanwhile). A table keeps rows no interval reads any more (pods gone)
until it is renewed: it holds at most what the cluster sent at its largest.

`FactRows.batch` gives back the rows as they came, each with its own time, in their order: what
the close and the fold read is the same batch bit for bit as if every row had been kept whole.
A fold of parts that all refer to the table the intervals share (`latest_rows`, as every fold of a
steady cluster) keeps each series' last row without building the parts' rows: a row's content is
read where it stands, in the table or in a part's own rows.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import Iterator, Optional

import numpy as np

from otelgpu.core.jit import kernel
from otelgpu.receiver.decode import PointBatch, empty_batch
from otelgpu.receiver.wire import hash_step

RENEW_OWN = 8  # a fold renews the table another interval reads when more than one row in this many is not in it


@kernel
def _hashes(metric, value_bits, stale, node, pod, off, key, val):  # noqa: ANN001, ANN202
    """uint64 [n]: a hash of each row's content (all but its time)."""
    n = len(metric)
    out = np.zeros(n, np.uint64)
    for r in range(n):
        h = hash_step(np.uint64(0x243F6A8885A308D3), np.uint64(metric[r]))
        h = hash_step(h, np.uint64(value_bits[r]))
        h = hash_step(h, np.uint64(stale[r]))
        h = hash_step(h, np.uint64(node[r]))
        h = hash_step(h, np.uint64(pod[r]))
        for k in range(off[r], off[r + 1]):
            h = hash_step(h, (np.uint64(key[k]) << np.uint64(32)) | np.uint64(val[k]))
        out[r] = h
    return out


@kernel
def _slots(hashes, size):  # noqa: ANN001, ANN202
    """An open-addressing table (`size`, a power of two) of the rows by their hash."""
    mask = np.uint64(size - 1)
    slots = np.full(size, -1, np.int32)
    for r in range(len(hashes)):
        j = hashes[r] & mask
        while slots[j] >= 0:
            j = (j + np.uint64(1)) & mask
        slots[j] = r
    return slots


@kernel
def _find(slots, t_metric, t_bits, t_stale, t_node, t_pod, t_off, t_key, t_val,  # noqa: ANN001, ANN202
          hashes, metric, bits, stale, node, pod, off, key, val):
    """Per row, the first row of the table of equal content, or -1."""
    mask = np.uint64(len(slots) - 1)
    out = np.full(len(hashes), -1, np.int64)
    for r in range(len(hashes)):
        j = hashes[r] & mask
        while slots[j] >= 0:
            t = slots[j]
            if (t_metric[t] == metric[r] and t_bits[t] == bits[r] and t_stale[t] == stale[r] and t_node[t] == node[r]
                    and t_pod[t] == pod[r] and t_off[t + 1] - t_off[t] == off[r + 1] - off[r]):
                same = True
                for k in range(off[r + 1] - off[r]):
                    if t_key[t_off[t] + k] != key[off[r] + k] or t_val[t_off[t] + k] != val[off[r] + k]:
                        same = False
                        break
                if same:
                    out[r] = t
                    break
            j = (j + np.uint64(1)) & mask
    return out


def _columns(batch: PointBatch) -> tuple[np.ndarray, ...]:
    return (batch.metric, batch.value.view(np.int64), batch.stale, batch.resource_node, batch.resource_pod,
            batch.attr_off, batch.attr_key, batch.attr_val)


class FactTable:
    """Rows of distinct content (a fold's), found by content: an open-addressing table of their
    hashes, 8 bytes a row, built on the first `find`."""

    def __init__(self, batch: PointBatch) -> None:
        self.batch = batch
        self._slots: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return len(self.batch)

    def find(self, rows: PointBatch) -> np.ndarray:
        """int64 [len(rows)]: where each row's content stands in the table, -1 where nowhere."""
        if self._slots is None:
            size = 16
            while size < 2 * len(self.batch):
                size *= 2
            self._slots = _slots(_hashes(*_columns(self.batch)), size)
        own = _columns(rows)
        return _find(self._slots, *_columns(self.batch), _hashes(*own), *own)


def find_reference(table: PointBatch, rows: PointBatch) -> np.ndarray:
    """`FactTable(table).find(rows)`, readable: each row's content as a tuple, in a dict."""
    def contents(batch: PointBatch) -> list[tuple]:
        bits = batch.value.view(np.int64)
        return [(int(batch.metric[r]), int(bits[r]), bool(batch.stale[r]), int(batch.resource_node[r]),
                 int(batch.resource_pod[r]), tuple(batch.attr_key[batch.attr_off[r]:batch.attr_off[r + 1]].tolist()),
                 tuple(batch.attr_val[batch.attr_off[r]:batch.attr_off[r + 1]].tolist()))
                for r in range(len(batch))]
    first: dict[tuple, int] = {}
    for r, content in enumerate(contents(table)):
        first.setdefault(content, r)
    return np.array([first.get(c, -1) for c in contents(rows)], np.int64)


_NONE = empty_batch()


@dataclass
class FactRows:
    """Rows as their times and contents: row i is `shared`'s row `row[i]` where that is below
    `len(shared)`, else `own`'s row `row[i] - len(shared)`, at `time_ns[i]`."""

    time_ns: np.ndarray  # int64 [n]
    row: np.ndarray  # int32 [n]
    shared: PointBatch  # a table other parts and intervals may refer to (its times are not read)
    own: PointBatch  # rows no table held when these came

    def __len__(self) -> int:
        return len(self.time_ns)

    @staticmethod
    def whole(batch: PointBatch) -> "FactRows":
        """`batch` as rows of its own."""
        return FactRows(batch.time_ns, np.arange(len(batch), dtype=np.int32), _NONE, batch)

    @staticmethod
    def of(batch: PointBatch, table: FactTable, found: np.ndarray) -> "FactRows":
        """`batch`'s rows referring to `table` where `found` (`table.find(batch)`) says it holds
        their content; the rest kept whole."""
        missing = found < 0
        n_missing = int(missing.sum())
        if n_missing == len(batch):
            return FactRows.whole(batch)  # nothing to share: no copy of `batch`
        row = found.astype(np.int32)
        row[missing] = len(table) + np.arange(n_missing, dtype=np.int32)
        return FactRows(batch.time_ns, row, table.batch, batch.select(missing) if n_missing else _NONE)

    def batch(self) -> PointBatch:
        """The rows as a batch of their own, in order, each at its time."""
        n_shared = len(self.shared)
        mine = self.row >= n_shared
        if not mine.any():
            out = self.shared.select(self.row)
        elif mine.all():
            out = self.own if self._all_own() else self.own.select(self.row - n_shared)
        else:
            n_own = int(mine.sum())
            at = np.empty(len(self.row), np.int64)  # where each row stands in the two selections end to end
            at[~mine] = np.arange(len(self.row) - n_own)
            at[mine] = len(self.row) - n_own + np.arange(n_own)
            out = PointBatch.concat([self.shared.select(self.row[~mine]),
                                     self.own.select(self.row[mine] - n_shared)]).select(at)
        return out if out.time_ns is self.time_ns else replace(out, time_ns=self.time_ns)

    def pieces(self, rows: int) -> Iterator[PointBatch]:
        """`batch()` a piece of at most `rows` rows at a time, in order: what reads them in turn
        holds one piece of them, not every row (some 45 MiB at 100,000 GPUs)."""
        for first in range(0, len(self), rows):
            last = first + rows
            yield FactRows(self.time_ns[first:last], self.row[first:last], self.shared, self.own).batch()

    def _all_own(self) -> bool:
        """Whether the rows are `own`'s, each once and in order (`whole`)."""
        return len(self.own) == len(self.row) and self.own.time_ns is self.time_ns

    def tables(self) -> list[PointBatch]:
        """The batches whose codes these rows read: `shared` (which others may read too) and `own`."""
        return [self.shared, self.own]


def share(batch: PointBatch, table: Optional[FactTable], fold: bool = False,
          alone: bool = False) -> tuple[FactRows, Optional[FactTable]]:
    """`batch`'s rows referring to `table`, and the table later rows are to refer to. A `fold`'s
    rows (each of distinct content) renew it, becoming the table, when it lacks any of them and no
    other open interval reads it (`alone`), or when it lacks more than one in RENEW_OWN."""
    if not len(batch):
        return FactRows.whole(batch), table
    found = table.find(batch) if table is not None else None
    if fold:
        missing = len(batch) if found is None else int((found < 0).sum())
        if missing and (alone or found is None or missing * RENEW_OWN > len(batch)):
            renewed = FactTable(_untimed(batch))
            if table is not None:
                _renewed(table.batch, renewed)
            return FactRows(batch.time_ns, np.arange(len(batch), dtype=np.int32), renewed.batch, _NONE), renewed
    return (FactRows.whole(batch) if found is None else FactRows.of(batch, table, found)), table


# Tables whose rows something reads by their places from one interval to the next (`follow`:
# enrich/repeats.py), as weak references (the same objects as any other to them, alive or not);
# and for each table renewed since one of them, where each row of that one stands in it (-1:
# nowhere), kept while the new table lives. A fold may renew the table several times between two
# reads (each fold's rows renew a table that lacks more than an eighth of them): each renewal
# carries the places over from the one before.
_FOLLOWED: list[weakref.ref] = []
FOLLOWED_KEPT = 4
_RENEWALS: dict[int, tuple[weakref.ref, list[tuple[weakref.ref, np.ndarray]]]] = {}


def follow(table: PointBatch) -> weakref.ref:
    """Carry the places of `table`'s rows over the renewals that come after it (`renewals_of`);
    returns its weak reference."""
    known = weakref.ref(table)
    if not any(t is known for t in _FOLLOWED):  # by identity: a weak reference's == compares its table
        _FOLLOWED[:] = [t for t in _FOLLOWED if t() is not None][-(FOLLOWED_KEPT - 1):] + [known]
    return known


def _renewed(old: PointBatch, new: FactTable) -> None:
    """Where the rows of each followed table stand in `new`, which renews `old`: found in it while
    the followed table is there to read, else carried over from where `old` had them."""
    for key in [k for k, (table, _) in _RENEWALS.items() if table() is None]:
        del _RENEWALS[key]
    carried = {id(followed): places for followed, places in renewals_of(old)}
    moved: list[tuple[weakref.ref, np.ndarray]] = []
    from_old: Optional[np.ndarray] = None
    for followed in _FOLLOWED:
        table = followed()
        if table is not None:
            moved.append((followed, new.find(table).astype(np.int32)))
        elif id(followed) in carried:
            from_old = new.find(old) if from_old is None else from_old
            moved.append((followed, carry(carried[id(followed)], from_old)))
    if moved:
        _RENEWALS[id(new.batch)] = (weakref.ref(new.batch), moved)


def carry(places: np.ndarray, moved: np.ndarray) -> np.ndarray:
    """int32: each of `places` (rows of a table) where `moved` (that table's rows' places in
    another) puts it; -1 for a place -1 or beyond `moved` (a row no table held)."""
    held = (places >= 0) & (places < len(moved))
    out = np.full(len(places), -1, np.int32)
    out[held] = moved[places[held]]
    return out


def renewals_of(table: PointBatch) -> list[tuple[weakref.ref, np.ndarray]]:
    """The followed tables `table` renewed (directly or through renewals between), each with where
    each of its rows stands in `table`: empty when it renewed none."""
    known = _RENEWALS.get(id(table))
    return known[1] if known is not None and known[0]() is table else []


def _untimed(batch: PointBatch) -> PointBatch:
    """`batch` as a table holds it: a row's time is the one its `FactRows` gives, never the
    table's, so the table keeps none (a column of zeros that takes no memory, where the fold's
    times stayed held once its rows had been folded again: some 5 MiB at 100,000 GPUs)."""
    return replace(batch, time_ns=np.broadcast_to(np.zeros(1, np.int64), len(batch)))


def latest_rows(parts: list[FactRows], table: Optional[FactTable]) -> Optional[FactRows]:
    """The parts' rows in time order, each series' last alone (enrich/facts.py `latest` of their
    rows end to end), referring to `table` as `share` would with no renewal: the kept rows the
    table holds by their place in it, the others as own rows. Built from the rows' places, not
    from the rows (a fold of 1.25 times the cluster's series held them twice over, then the kept
    ones again). None unless every part refers to `table`: fold those the readable way, rows
    built (enrich/window.py `_latest`). A part with no table (`FactRows.whole`: rows no table
    held when they came, as a new pod's) refers to any: its rows are all its own."""
    if table is None or not parts or any(part.shared is not table.batch and len(part.shared) for part in parts):
        return None
    n_table = len(table)
    place = np.empty(sum(map(len, parts)), np.int64)
    owns, at, offset = [], 0, 0
    for part in parts:  # each part's own rows come after the table, one part's after another's
        span = place[at:at + len(part)]
        span[:] = part.row
        if part.shared is table.batch:
            span[span >= n_table] += offset
        else:  # no table: each row's place in `own` is its number
            span += n_table + offset
        at += len(part)
        if len(part.own):
            owns.append(part.own)
            offset += len(part.own)
    own = PointBatch.concat(owns) if owns else _NONE
    time_ns = np.concatenate([part.time_ns for part in parts])
    if len(time_ns) > 1 and not np.all(time_ns[1:] >= time_ns[:-1]):
        order = np.argsort(time_ns, kind="stable")
        time_ns, place = time_ns[order], place[order]
    keep = last_of_each_in(place, n_table, *_series(table.batch), *_series(own))
    time_ns, place = time_ns[keep], place[keep]
    mine = place >= n_table
    n_own = int(mine.sum())
    kept = own.select(place[mine] - n_table) if n_own else _NONE
    place[mine] = n_table + np.arange(n_own)
    return FactRows(time_ns, place.astype(np.int32), table.batch, kept)


def _series(batch: PointBatch) -> tuple[np.ndarray, ...]:
    """What makes a row its series' (facts.py `last_of_each`): all but its time and its target."""
    return batch.metric, batch.value.view(np.int64), batch.stale, batch.attr_off, batch.attr_key, batch.attr_val


@kernel
def last_of_each_in(places, n_first, metric, bits, stale, off, key, val,  # noqa: ANN001, ANN202
                    o_metric, o_bits, o_stale, o_off, o_key, o_val):
    """Per entry of `places`, whether no later entry is the same row but for its time (facts.py
    `last_of_each`), of rows in two batches: a place below `n_first` is that row of the first, any
    other the row `place - n_first` of the second. An open-addressing table of the rows' hashes,
    filled from the end; equal hashes are compared in full."""
    n = len(places)
    size = 16
    while size < 2 * n:
        size *= 2
    mask = np.uint64(size - 1)
    slots = np.full(size, -1, np.int32)  # entries of `places`: a fold is far below 2**31 rows
    hashes = np.zeros(n, np.uint64)
    keep = np.zeros(n, np.bool_)
    for i in range(n - 1, -1, -1):
        p = places[i]
        if p < n_first:
            h = series_hash(p, metric, bits, stale, off, key, val)
        else:
            h = series_hash(p - n_first, o_metric, o_bits, o_stale, o_off, o_key, o_val)
        hashes[i] = h
        j = h & mask
        while True:
            other = slots[j]
            if other < 0:
                slots[j] = i
                keep[i] = True
                break
            q = places[other]
            if hashes[other] == h:
                if p < n_first and q < n_first:
                    same = same_series(p, metric, bits, stale, off, key, val, q, metric, bits, stale, off, key, val)
                elif p < n_first:
                    same = same_series(p, metric, bits, stale, off, key, val,
                                       q - n_first, o_metric, o_bits, o_stale, o_off, o_key, o_val)
                elif q < n_first:
                    same = same_series(p - n_first, o_metric, o_bits, o_stale, o_off, o_key, o_val,
                                       q, metric, bits, stale, off, key, val)
                else:
                    same = same_series(p - n_first, o_metric, o_bits, o_stale, o_off, o_key, o_val,
                                       q - n_first, o_metric, o_bits, o_stale, o_off, o_key, o_val)
                if same:
                    break
            j = (j + np.uint64(1)) & mask
    return keep


@kernel
def series_hash(r, metric, bits, stale, off, key, val):  # noqa: ANN001, ANN202
    """A hash of row `r`'s series: its metric, value bits, staleness and labels."""
    h = hash_step(np.uint64(0x243F6A8885A308D3), np.uint64(metric[r]))
    h = hash_step(h, np.uint64(bits[r]))
    h = hash_step(h, np.uint64(stale[r]))
    for k in range(off[r], off[r + 1]):
        h = hash_step(h, (np.uint64(key[k]) << np.uint64(32)) | np.uint64(val[k]))
    return h


@kernel
def same_series(a, metric, bits, stale, off, key, val,  # noqa: ANN001, ANN202
                b, b_metric, b_bits, b_stale, b_off, b_key, b_val):
    """Whether row `a` of the first columns and row `b` of the second are one series' rows."""
    if metric[a] != b_metric[b] or bits[a] != b_bits[b] or stale[a] != b_stale[b]:
        return False
    n = off[a + 1] - off[a]
    if b_off[b + 1] - b_off[b] != n:
        return False
    for k in range(n):
        if key[off[a] + k] != b_key[b_off[b] + k] or val[off[a] + k] != b_val[b_off[b] + k]:
            return False
    return True


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels of `FactTable.find` and `latest_rows`."""
    one = np.zeros(1, np.int32)
    rows = PointBatch(np.zeros(1, np.int16), np.zeros(1, np.int64), np.zeros(1), np.zeros(1, bool), one, one,
                      np.array([0, 1], np.int64), one, one)
    FactTable(rows).find(rows)
    last_of_each_in(np.zeros(1, np.int64), 1, *_series(rows), *_series(rows))
