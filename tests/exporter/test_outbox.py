"""The persisted export queue: the snapshot file format, stage and release, recovery after a crash
(a Delivery abandoned without close(), its files left as they were), merging on disk, corrupt
files, and shutdown, against a real in-process OTLP/gRPC server."""

from __future__ import annotations

import gc
import math
import shutil
import socket
import struct
import time
import tracemalloc
import weakref
from pathlib import Path

import numpy as np
import pytest
from otlpsink import MetricsSink, as_sent, received_rows, serve_sink
from support import eventually

from otelgpu.exporter.attrtable import AttrTable
from otelgpu.exporter.columns import Points, merge
from otelgpu.exporter.config import DeliveryConfig, OtlpExporterConfig
from otelgpu.exporter.delivery import Delivery
from otelgpu.exporter.otlp import OtlpSender
from otelgpu.exporter.outbox import OnDisk, Outbox
from otelgpu.exporter.snapshot import SnapshotFormatError, decode, encode
from otelgpu.exporter.store import CostStore, Point
from otelgpu.telemetry import SelfMetrics, by_label

GONE = (("namespace", "ml"), ("pod", "short-job"))


def _dead_endpoint() -> str:
    with socket.socket() as s:  # a port nobody listens on: every attempt is refused, retryable
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _delivery(endpoint: str, store: CostStore, metrics: SelfMetrics, directory: Path | None, **kw) -> Delivery:
    config = DeliveryConfig(**{"backoff_initial_seconds": 0.05, "backoff_max_seconds": 0.2, **kw})
    sender = OtlpSender(OtlpExporterConfig(endpoint=endpoint, timeout_seconds=5.0), store.specs, metrics, "c1")
    return Delivery(sender, config, metrics, directory=directory, interval_s=60)


def _crash(delivery: Delivery) -> None:
    """The process dies: no close(), the files stay as they are. Its thread, which could only fail
    against the dead endpoint, is stopped so that it stays out of the next run's way: it ends its
    last attempt (refused, to be retried: no file touched) before its channel is closed, since a
    call cut by the close would fail for good and delete the snapshot a dead process never could."""
    delivery.finish_by(time.monotonic())
    if delivery._started:
        delivery._thread.join(60)
        assert not delivery._thread.is_alive()
    delivery.sender.close()


def _staged(delivery: Delivery, intervals, n: int) -> tuple[list, list[int]]:  # noqa: ANN001 - the fixture
    """The snapshots of intervals 0..n-1 staged (persisted, not released), and their ends."""
    snaps = [intervals.record(i) for i in range(n)]
    ends = [intervals.T0 + (i + 1) * intervals.MIN for i in range(n)]
    for points, end in zip(snaps, ends):
        delivery.stage(points, end)
    return snaps, ends


def _snaps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.snap"))


def _left(directory: Path) -> list[str]:
    """What the queue's directory holds besides its attribute log."""
    return sorted(p.name for p in directory.iterdir() if p.name != "attrs.log")


# -- the file format -----------------------------------------------------------------------------

def _bits(value: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", value))[0]


def test_a_snapshot_file_decodes_to_the_same_points() -> None:
    pod = (("k8s.pod.name", "träin-0"), ("team", "a"))
    points = [Point("allocated", pod, 10, 20, 1e-300), Point("held", pod, 10, 20, -0.0),
              Point("idle", (), 5, 20, 12.5), Point("activity", pod, 20, 20, math.nan, ended=True),
              Point("allocated", (("pod", "x"),), 3, 20, math.nan, ended=True)]
    end_ns, back, absorbed = decode(encode(points, 20, absorbed=[10]))
    assert end_ns == 20 and absorbed == (10,) and len(back) == len(points)
    for a, b in zip(points, back):  # same order, same bits (NaN and -0.0 compare badly)
        assert (a.metric, a.attrs, a.start_ns, a.time_ns, a.ended, _bits(a.value)) == \
            (b.metric, b.attrs, b.start_ns, b.time_ns, b.ended, _bits(b.value))
    assert decode(encode([], 7)) == (7, [], ())


def _peak_writing(outbox: Outbox, end_ns: int, points: Points) -> int:
    """The most memory traced while `outbox` writes the snapshot."""
    tracemalloc.start()
    try:
        outbox.write(end_ns, points)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_snapshot_is_written_without_a_copy_of_it_whole(tmp_path: Path) -> None:
    """The outbox writes a snapshot's columns as they are, a run of points at a time: what it
    builds for the write (the file's set ids and flags, run by run, and which sets the points
    use) stays under a tenth of the columns' bytes, where the whole column of set ids and a sort
    of the points' sets took a sixth, and joining the pieces and appending the checksum held
    the snapshot two and three times over."""
    n = 400_000
    sets = [(("pod", f"p{i}"),) for i in range(1000)]
    points = Points(["allocated", "idle"], sets, np.arange(n) % 2, np.arange(n) % len(sets),
                    np.full(n, 10), np.full(n, 20), np.arange(n, dtype=np.float64), np.zeros(n, bool))
    columns = sum(c.nbytes for c in (points.metric, points.aset, points.start_ns, points.time_ns, points.value,
                                     points.ended))
    outbox = Outbox(tmp_path, "otlp", SelfMetrics())
    outbox.write(10, points[:10])  # the attribute log's sets, met before
    assert _peak_writing(outbox, 20, points) < columns / 10
    assert outbox.recover(20)[0][-1].points == points


def test_a_snapshot_written_after_others_names_the_sets_on_disk_without_a_number_object_each(tmp_path: Path) -> None:
    """Each write tells the attribute log which sets the snapshots on disk still use (so that it
    can drop the others): as one array of ids, where a list of them held a Python int each (at
    100,000 GPUs some 20 MiB a snapshot, at every write). Writing a store's snapshot of 100,000
    sets after another one stays under 120 bytes a set traced; the list took 180."""
    n_set = 100_000
    store = CostStore()
    sums = {"allocated": {(("k8s.pod.name", f"p{i}"), ("team", "a")): 1.0 for i in range(n_set)}}
    first, second = store.record(0, 60, sums, {}), store.record(60, 120, sums, {})
    outbox = Outbox(tmp_path, "otlp", SelfMetrics())
    outbox.write(60, first)
    assert _peak_writing(outbox, 120, second) < 120 * n_set
    assert outbox.recover(120)[0][-1].points == second


@pytest.mark.parametrize("odd", [None, "time", "ended"])
def test_a_snapshot_read_back_to_be_sent_holds_a_time_and_a_flag_its_points_share_as_one_value(
        tmp_path: Path, odd) -> None:
    """Read back to be sent, a snapshot whose points are all at its end and none ended (an
    interval's) holds its times and flags as one value each, not a column; one whose last point
    is at another time, or ends, reads them back as columns. Either reads back as it was written,
    and a byte changed in the column read a piece at a time is refused as a checksum mismatch."""
    n = 300_000  # more than a piece of either column
    sets = [(("pod", f"p{i}"),) for i in range(100)]
    time_ns, ended = np.full(n, 20), np.zeros(n, bool)
    if odd == "time":
        time_ns[-1] = 19
    elif odd == "ended":
        ended[-1] = True
    points = Points(["allocated"], sets, np.zeros(n), np.arange(n) % len(sets), np.full(n, 10), time_ns,
                    np.arange(n, dtype=np.float64), ended)
    outbox = Outbox(tmp_path, "otlp", SelfMetrics())
    kept = outbox.write(20, points)
    back = outbox.read_back(20, kept)
    assert back.time_ns.strides == ((8,) if odd == "time" else (0,))
    assert back.ended.strides == ((1,) if odd == "ended" else (0,)) and back.ended.dtype == bool
    assert back == points
    data = bytearray(outbox.path(20).read_bytes())
    time_at = len(data) - 4 - n * (8 + 8 + 1)  # the time column: before the values, the flags and the checksum
    data[time_at + 8 * (n - 2)] ^= 1
    outbox.path(20).write_bytes(bytes(data))
    with pytest.raises(SnapshotFormatError, match="checksum"):
        outbox.read_back(20, kept)


@pytest.mark.parametrize("damage, reason", [
    (lambda d: d[:-1], "corrupt"),  # truncated
    (lambda d: d[:40] + bytes([d[40] ^ 1]) + d[41:], "corrupt"),  # one bit flipped
    (lambda d: b"garbage", "corrupt"),
    (lambda d: d[:8] + struct.pack("<H", 99) + d[10:], "incompatible"),  # a later format
], ids=["truncated", "bit-flip", "garbage", "version"])
def test_a_damaged_snapshot_file_is_refused(damage, reason) -> None:
    data = encode([Point("allocated", (("pod", "a"),), 1, 2, 3.0)], 2)
    with pytest.raises(SnapshotFormatError) as error:
        decode(damage(data))
    assert error.value.reason == reason


# -- stage, release, recover ---------------------------------------------------------------------

def test_staged_snapshots_are_on_disk_and_sent_only_once_released(otlp_sink, store, intervals, tmp_path) -> None:
    delivery = _delivery(otlp_sink.endpoint, store, SelfMetrics(), tmp_path)
    snaps, ends = _staged(delivery, intervals, 2)
    assert _snaps(tmp_path) == [f"{end:020d}.snap" for end in ends]  # persisted before sendable
    assert delivery.wait_idle(5) and otlp_sink.calls == 0 and delivery.depth == 2

    delivery.release(ends[0])
    assert delivery.wait_idle(10)
    assert received_rows(otlp_sink, store.specs) == [as_sent(snaps[0], store.specs)]
    assert _snaps(tmp_path) == [f"{ends[1]:020d}.snap"]  # the delivered one's file is gone
    delivery.release(ends[1])
    assert delivery.wait_idle(10) and _snaps(tmp_path) == []
    assert [p.name for p in tmp_path.iterdir()] == ["attrs.log"]  # the sets, for the next snapshots
    assert delivery.close() == 0


def test_a_persisted_snapshot_waits_in_its_file_and_is_sent_as_it_was(otlp_sink, store, intervals,
                                                                     tmp_path) -> None:
    """Once written, a snapshot's columns are not held in memory (the close's checkpoint and an
    outage's queue would hold them, some 60 MiB a snapshot at 100,000 GPUs): the queue keeps its
    tables and each point's set, and its file gives the points back to be sent."""
    n, end = 5_000, intervals.T0 + intervals.MIN
    sets = [(("namespace", "ml"), ("pod", f"p{i}")) for i in range(n)]
    points = Points(list(store.specs)[:2], sets, np.arange(n) % 2, np.arange(n), np.full(n, intervals.T0),
                    np.full(n, end), np.arange(n, dtype=np.float64) / 7, np.zeros(n, bool))
    expected = as_sent(points, store.specs)
    columns = [weakref.ref(c) for c in (points.metric, points.start_ns, points.time_ns, points.value, points.ended)]
    delivery = _delivery(otlp_sink.endpoint, store, SelfMetrics(), tmp_path)
    delivery.stage(points, end)
    del points
    gc.collect()
    assert [ref() for ref in columns] == [None] * len(columns)
    (entry,) = delivery.queue._entries
    assert isinstance(entry.snapshot, OnDisk) and len(entry.snapshot) == n
    delivery.release(end)
    assert delivery.wait_idle(10) and delivery.close() == 0
    assert sorted(row for request in received_rows(otlp_sink, store.specs) for row in request) == sorted(expected)


@pytest.mark.parametrize("damage", ["bit-flip", "truncated", "deleted", "another snapshot"])
def test_a_snapshot_whose_file_does_not_read_back_is_set_aside_and_counted(otlp_sink, store, intervals, tmp_path,
                                                                          damage) -> None:
    """The first of two staged snapshots' file is damaged before it is sent: it is set aside and
    counted as undeliverable, and the second, which holds every series' cumulative value again,
    is delivered."""
    metrics = SelfMetrics()
    delivery = _delivery(otlp_sink.endpoint, store, metrics, tmp_path)
    snaps, ends = _staged(delivery, intervals, 2)
    first = tmp_path / f"{ends[0]:020d}.snap"
    data = first.read_bytes()
    if damage == "bit-flip":
        first.write_bytes(data[:-20] + bytes([data[-20] ^ 1]) + data[-19:])
    elif damage == "truncated":
        first.write_bytes(data[:-9])
    elif damage == "deleted":
        first.unlink()
    else:
        shutil.copy(tmp_path / f"{ends[1]:020d}.snap", first)
    delivery.release(ends[1])
    assert delivery.wait_idle(10) and delivery.close() == 0
    assert received_rows(otlp_sink, store.specs) == [as_sent(snaps[1], store.specs)]
    assert by_label(metrics.export_snapshots_dropped) == {("otlp", "unreadable"): 1}
    assert by_label(metrics.export_points_undeliverable) == {("otlp", "unreadable"): len(snaps[0])}
    assert by_label(metrics.export_outbox_errors) == {("otlp", "corrupt"): 1}
    assert _left(tmp_path) == ([] if damage == "deleted" else [first.name + ".rejected"])


def test_a_merge_whose_older_file_does_not_read_back_drops_it_and_keeps_the_bound(store, intervals,
                                                                                 tmp_path) -> None:
    """The backend is down and the queue holds 2: the third snapshot released makes the two oldest
    merge, but the oldest's file is damaged; it is dropped and counted, the other two stay."""
    metrics = SelfMetrics()
    delivery = _delivery(_dead_endpoint(), store, metrics, tmp_path, queue_size=2)
    snaps, ends = _staged(delivery, intervals, 3)
    (tmp_path / f"{ends[0]:020d}.snap").write_bytes(b"OGPUSNAP")
    delivery.release(ends[2])
    assert delivery.depth == 2 and not by_label(metrics.export_snapshots_merged)
    assert by_label(metrics.export_snapshots_dropped) == {("otlp", "unreadable"): 1}
    assert _snaps(tmp_path) == [f"{e:020d}.snap" for e in ends[1:]]
    _crash(delivery)


def test_released_snapshots_survive_a_crash_and_unreleased_ones_are_deleted(otlp_sink, store, intervals,
                                                                            tmp_path) -> None:
    T0, MIN = intervals.T0, intervals.MIN
    metrics = SelfMetrics()
    old = _delivery(_dead_endpoint(), store, metrics, tmp_path)
    store.record(T0 - MIN, T0, sums={"allocated": {GONE: 2.0}}, gauges={})
    snaps = [intervals.record(i) for i in range(3)]  # short-job ends in the second: value and marker
    assert [p.attrs for p in snaps[1] if p.ended] == [GONE]
    ends = [T0 + (i + 1) * MIN for i in range(3)]
    for points, end in zip(snaps, ends):
        old.stage(points, end)
    old.release(ends[1])  # the third was staged, but its interval never committed
    eventually(lambda: by_label(metrics.export_failures)[("otlp", "unavailable")] >= 2, timeout=30)  # tried, not delivered
    _crash(old)

    metrics = SelfMetrics()
    new = _delivery(otlp_sink.endpoint, store, metrics, tmp_path)
    assert new.recover(ends[1]) == 2
    assert by_label(metrics.export_snapshots_recovered)["otlp"] == 2
    assert f"{ends[2]:020d}.snap" not in _snaps(tmp_path)
    assert new.wait_idle(10)
    # Same timestamps, start times and values, and short-job's last value with its end marker.
    assert received_rows(otlp_sink, store.specs) == [as_sent(s, store.specs) for s in snaps[:2]]
    assert ("allocated", GONE, T0 - MIN, ends[1], None) in received_rows(otlp_sink, store.specs)[1]
    assert not _left(tmp_path)
    assert new.close() == 0 and not by_label(metrics.export_snapshots_dropped)


def test_merging_on_overflow_bounds_the_files_and_keeps_every_total(store, intervals, tmp_path) -> None:
    """The Collector is down for many intervals, then the process dies: the directory never holds
    more than queue_size snapshots, and after the restart the totals and the end of a series that
    ended meanwhile arrive."""
    T0, MIN = intervals.T0, intervals.MIN
    metrics = SelfMetrics()
    old = _delivery(_dead_endpoint(), store, metrics, tmp_path, queue_size=3)
    store.record(T0 - MIN, T0, sums={"allocated": {GONE: 2.0}}, gauges={})
    old.put(store.points())
    for i in range(8):
        old.put(intervals.record(i))  # short-job ends after the second of these
        assert len(_snaps(tmp_path)) == old.depth <= 3
    assert by_label(metrics.export_snapshots_merged)["otlp"] == 9 - old.depth >= 6
    _crash(old)

    sink = MetricsSink()
    metrics = SelfMetrics()
    with serve_sink(sink):
        new = _delivery(sink.endpoint, store, metrics, tmp_path, queue_size=3)
        assert new.recover(T0 + 8 * MIN) == len(_snaps(tmp_path))
        assert new.wait_idle(10)
        new.close()
    latest, ended = {}, set()
    for request in received_rows(sink, store.specs):
        for metric, attrs, _, _, value in request:
            if metric == "allocated":
                pod = dict(attrs)["pod"]
                if value is None:
                    ended.add(pod)
                else:
                    latest[pod] = value
    assert latest == {"train-0": 12.0, "short-job": 2.0} and ended == {"short-job"}
    assert not by_label(metrics.export_snapshots_dropped) and not _left(tmp_path)


def test_a_merge_cut_short_by_a_crash_sends_the_merged_snapshot_only(otlp_sink, store, intervals,
                                                                     tmp_path) -> None:
    """The merged snapshot was renamed over the newer file, the older one not yet deleted: the
    older one is redundant (for remote write, its samples resent after the merged ones would be
    refused as out of order), so recovery deletes it."""
    metrics = SelfMetrics()
    old = _delivery(_dead_endpoint(), store, metrics, tmp_path, queue_size=2)
    snaps, ends = _staged(old, intervals, 3)
    old.release(ends[2])  # three sendable, two allowed: the first two are merged, nothing in flight yet
    assert by_label(metrics.export_snapshots_merged)["otlp"] == 1
    assert _snaps(tmp_path) == [f"{e:020d}.snap" for e in ends[1:]]
    _crash(old)
    merged = decode((tmp_path / f"{ends[1]:020d}.snap").read_bytes(), AttrTable(tmp_path / "attrs.log").load()[0])
    assert merged.absorbed == (ends[0],)
    Outbox(tmp_path, "otlp", SelfMetrics()).write(ends[0], snaps[0])  # as if its delete never happened

    new = _delivery(otlp_sink.endpoint, store, SelfMetrics(), tmp_path)
    assert new.recover(ends[2]) == 2
    assert new.wait_idle(10) and new.close() == 0
    assert received_rows(otlp_sink, store.specs) == [as_sent(merged.points, store.specs),
                                                     as_sent(snaps[2], store.specs)]
    assert not _left(tmp_path)


def test_a_corrupt_file_is_set_aside_and_counted_the_others_delivered(otlp_sink, store, intervals,
                                                                       tmp_path) -> None:
    old = _delivery(_dead_endpoint(), store, SelfMetrics(), tmp_path)
    snaps = [intervals.record(i) for i in range(3)]
    for points in snaps:
        old.put(points)
    _crash(old)
    middle = tmp_path / _snaps(tmp_path)[1]
    data = bytearray(middle.read_bytes())
    data[len(data) // 2] ^= 0xFF
    middle.write_bytes(bytes(data))
    (tmp_path / f"{1:020d}.snap").write_bytes(b"\x00" * 3)  # cut short in a way no rename allows
    last = tmp_path / _snaps(tmp_path)[-1]
    last.with_suffix(".progress").write_bytes(b"\x01")  # unreadable: the snapshot goes from its start
    (tmp_path / f"{2:020d}.progress").write_bytes(b"")  # the progress of a snapshot long gone
    (tmp_path / f".{last.name}.tmp").write_bytes(b"half")  # a write cut short

    metrics = SelfMetrics()
    new = _delivery(otlp_sink.endpoint, store, metrics, tmp_path)
    assert new.recover(intervals.T0 + 3 * intervals.MIN) == 2
    assert by_label(metrics.export_outbox_errors) == {("otlp", "corrupt"): 2, ("otlp", "corrupt_progress"): 1}
    assert [name for name in _left(tmp_path) if not name.endswith(".rejected")] == \
        [_snaps(tmp_path)[0], last.with_suffix(".progress").name, last.name]
    assert sorted(p.name for p in tmp_path.glob("*.rejected")) == [f"{1:020d}.snap.rejected",
                                                                   middle.name + ".rejected"]
    assert new.wait_idle(10)
    assert received_rows(otlp_sink, store.specs) == [as_sent(snaps[0], store.specs), as_sent(snaps[2], store.specs)]
    new.close()


def test_shutdown_leaves_undelivered_snapshots_for_the_next_start(otlp_sink, store, intervals, tmp_path) -> None:
    metrics = SelfMetrics()
    old = _delivery(_dead_endpoint(), store, metrics, tmp_path, shutdown_timeout_seconds=0.2)
    snaps = [intervals.record(i) for i in range(2)]
    for points in snaps:
        old.put(points)
    assert old.close() == 2
    assert by_label(metrics.export_snapshots_persisted)["otlp"] == 2 and not by_label(metrics.export_snapshots_dropped)
    assert len(_snaps(tmp_path)) == 2

    new = _delivery(otlp_sink.endpoint, store, SelfMetrics(), tmp_path)
    assert new.recover(intervals.T0 + 2 * intervals.MIN) == 2
    assert new.wait_idle(10) and new.close() == 0
    assert received_rows(otlp_sink, store.specs) == [as_sent(s, store.specs) for s in snaps]


def test_a_snapshot_the_disk_refuses_waits_in_memory_unsendable_until_it_is_written(otlp_sink, store, intervals,
                                                                                      tmp_path) -> None:
    """The one queue keeps a snapshot the disk refused, unpersisted: it cannot be released (its
    interval is not committed), it is written at the next try once the disk takes writes, and
    staged again (the pipeline recomputes an uncommitted interval) it replaces itself."""
    directory = tmp_path / "otlp"
    metrics = SelfMetrics()
    delivery = _delivery(otlp_sink.endpoint, store, metrics, directory)
    shutil.rmtree(directory)
    directory.write_bytes(b"")  # a file where the directory was: every write fails
    first = intervals.record(0)
    end = intervals.T0 + intervals.MIN
    with pytest.raises(OSError):
        delivery.stage(first, end)
    assert delivery.depth == 1 and by_label(metrics.export_outbox_errors)[("otlp", "write")] == 1
    delivery.release(end)  # not persisted: not released
    assert not delivery.persist() and delivery.wait_idle(1) and not otlp_sink.received

    directory.unlink()
    directory.mkdir()
    assert delivery.persist() and _snaps(directory) == [f"{end:020d}.snap"]
    delivery.stage(first, end)  # the pipeline stages the uncommitted interval again
    delivery.stage(first, end)  # and again: the same end replaces what was staged
    assert delivery.depth == 1 and _snaps(directory) == [f"{end:020d}.snap"]
    delivery.release(end)
    with pytest.raises(ValueError, match="not after the last one released"):
        delivery.stage(first, end)
    assert delivery.wait_idle(10) and delivery.close() == 0
    assert received_rows(otlp_sink, store.specs) == [as_sent(first, store.specs)]


def test_a_refused_snapshot_stays_on_disk_until_the_next_one_carries_it(otlp_sink, store, intervals,
                                                                        tmp_path) -> None:
    """Refused for good with nothing queued after it: the file stays (a crash then sends it again
    at the next start); once the next snapshot is released, the carried points are written into
    its file before the refused one is deleted, and a crash in between sends them once."""
    import grpc
    from otlpsink import Answer

    otlp_sink.script = [Answer(grpc.StatusCode.INVALID_ARGUMENT)] * 2
    metrics = SelfMetrics()
    delivery = _delivery(otlp_sink.endpoint, store, metrics, tmp_path)
    first = intervals.record(0)
    delivery.put(first)
    eventually(lambda: by_label(metrics.export_snapshots_carried)["otlp"] == 1)
    assert _snaps(tmp_path) == [f"{intervals.T0 + intervals.MIN:020d}.snap"]  # kept: nothing to carry it yet
    _crash(delivery)

    restarted = _delivery(otlp_sink.endpoint, store, SelfMetrics(), tmp_path)
    assert restarted.recover(intervals.T0 + intervals.MIN) == 1
    assert restarted.wait_idle(10)  # refused again (the script's second answer): kept again
    second = intervals.record(1)
    end = intervals.T0 + 2 * intervals.MIN
    restarted.stage(second, end)
    restarted.release(end)  # the carry goes into its file; the refused file is deleted
    assert restarted.wait_idle(10) and _left(tmp_path) == []
    (delivered,) = received_rows(otlp_sink, store.specs)
    assert delivered == as_sent(second, store.specs)  # every series in both: the newer values win
    assert restarted.close() == 0


def test_a_disk_that_stays_broken_bounds_the_one_queue_and_loses_no_cost(otlp_sink, store, intervals,
                                                                        tmp_path) -> None:
    """Snapshots the disk refuses wait in the exporter's one queue, in memory, merged past its
    bound like the rest (newest value per series): a disk that stays broken does not grow memory,
    and once it takes writes again every series' total arrives."""
    directory = tmp_path / "otlp"
    metrics = SelfMetrics()
    delivery = _delivery(otlp_sink.endpoint, store, metrics, directory, queue_size=2)
    shutil.rmtree(directory)
    directory.write_bytes(b"")  # a file where the directory was: every write fails
    snaps = [intervals.record(i) for i in range(4)]
    ends = [intervals.T0 + (i + 1) * intervals.MIN for i in range(4)]
    for points, end in zip(snaps, ends):
        with pytest.raises(OSError):
            delivery.stage(points, end)
    assert delivery.depth == 2 and by_label(metrics.export_snapshots_merged)["otlp"] == 2

    directory.unlink()
    directory.mkdir()
    assert delivery.persist() and _snaps(directory) == [f"{e:020d}.snap" for e in ends[2:]]
    delivery.release(ends[3])
    assert delivery.wait_idle(10) and delivery.close() == 0
    first = merge(merge(Points.of(snaps[0]), Points.of(snaps[1])), Points.of(snaps[2]))
    assert received_rows(otlp_sink, store.specs) == [as_sent(first, store.specs), as_sent(snaps[3], store.specs)]


def test_a_stop_shuts_the_retry_down_first_and_flushes_the_queue_once(store, intervals, tmp_path) -> None:
    """The Collector's order: at a stop no backoff is waited out; the queue is sent once, the
    snapshot whose retry was waiting included, stopping at the first failure, and what is left
    stays on disk for the next start."""
    metrics = SelfMetrics()
    delivery = _delivery(_dead_endpoint(), store, metrics, tmp_path, backoff_initial_seconds=120,
                         backoff_max_seconds=120, shutdown_timeout_seconds=300)
    for i in range(2):
        delivery.put(intervals.record(i))
    eventually(lambda: sum(by_label(metrics.export_failures).values()) == 1, 30)  # waiting 120 s to retry
    assert delivery.close() == 2
    # the stop ends the wait, the flush sends the head once more and stops at its failure
    assert sum(by_label(metrics.export_failures).values()) == 2
    assert by_label(metrics.export_snapshots_persisted)["otlp"] == 2 and len(_snaps(tmp_path)) == 2
