"""The persisted queue's attribute log: each set written once, fsynced before the snapshot that
refers to it, a torn end cut at start, a lost set refusing only the snapshots that need it, and the
log rewritten as series come and go so that it follows the live ones."""

from __future__ import annotations

import numpy as np
from otlpsink import as_sent, received_rows

from otelgpu.exporter.attrtable import COMPACT_FROM, AttrTable, _parse
from otelgpu.exporter.columns import Points
from otelgpu.exporter.config import DeliveryConfig, OtlpExporterConfig
from otelgpu.exporter.delivery import Delivery
from otelgpu.exporter.otlp import OtlpSender
from otelgpu.exporter.outbox import Outbox
from otelgpu.exporter.snapshot import decode, encode
from otelgpu.exporter.store import Point
from otelgpu.telemetry import SelfMetrics, by_label

T0 = 1_700_000_000 * 10**9
MIN = 60 * 10**9


def _points(end: int, pods: range) -> list[Point]:
    return [Point("allocated", (("namespace", "ml"), ("pod", f"p-{i}"), ("team", "é" if i % 7 == 0 else "a")),
                  T0, end, float(i)) for i in pods]


def test_each_set_is_written_once_and_ids_last_across_restarts(tmp_path) -> None:
    log = tmp_path / "attrs.log"
    table = AttrTable(log)
    a, b, c = (("pod", "a"),), (("pod", "b"),), (("pod", "c"), ("team", "x"))
    assert table.ids([a, b, a]).tolist() == [0, 1, 0]
    size = log.stat().st_size
    assert table.ids([b, a]).tolist() == [1, 0] and log.stat().st_size == size  # nothing new, nothing written
    again = AttrTable(log)
    sets, cut = again.load()
    assert sets == {0: a, 1: b} and cut == 0
    live_a = tuple(list(a))  # the store's own tuple, equal to the one read from the log
    assert again.ids([c, live_a]).tolist() == [2, 0]
    assert any(k is live_a for k in again._ids)  # the log's copy is let go: no second set of tuples after a restart
    assert _parse(log.read_bytes())[0] == {0: a, 1: b, 2: c}


def test_an_append_cut_short_is_removed_and_the_next_goes_after_the_last_whole_record(tmp_path) -> None:
    outbox = Outbox(tmp_path, "otlp", SelfMetrics())
    first = _points(T0 + MIN, range(3))
    outbox.write(T0 + MIN, first)
    whole = (tmp_path / "attrs.log").read_bytes()
    (tmp_path / "attrs.log").write_bytes(whole + whole[:11])  # a crash in the middle of the next append

    metrics = SelfMetrics()
    again = Outbox(tmp_path, "otlp", metrics)
    (found,), uncommitted = again.recover(T0 + MIN)
    assert found.points == first and uncommitted == 0
    assert by_label(metrics.export_outbox_errors) == {("otlp", "attribute_log_cut"): 1}
    assert (tmp_path / "attrs.log").read_bytes() == whole
    second = _points(T0 + 2 * MIN, range(2, 5))
    again.write(T0 + 2 * MIN, second)
    sets, cut = AttrTable(tmp_path / "attrs.log").load()
    assert cut == 0 and len(sets) == 5
    assert decode((tmp_path / f"{T0 + 2 * MIN:020d}.snap").read_bytes(), sets).points == second


def test_the_rest_of_a_failed_append_is_overwritten(tmp_path) -> None:
    table = AttrTable(tmp_path / "attrs.log")
    table.ids([(("pod", "a"),)])
    good = (tmp_path / "attrs.log").read_bytes()
    with open(tmp_path / "attrs.log", "ab") as f:
        f.write(b"\x07\x00\x00")  # what a write that then failed (disk full) left
    table.ids([(("pod", "b"),)])
    sets, good_bytes, _ = _parse((tmp_path / "attrs.log").read_bytes())
    assert sets == {0: (("pod", "a"),), 1: (("pod", "b"),)}
    assert good_bytes == (tmp_path / "attrs.log").stat().st_size > len(good)


def test_a_snapshot_whose_sets_the_log_lost_is_set_aside_and_the_others_delivered(otlp_sink, store, tmp_path) -> None:
    outbox = Outbox(tmp_path, "otlp", SelfMetrics())
    outbox.write(T0 + MIN, _points(T0 + MIN, range(3)))
    (tmp_path / "attrs.log").unlink()  # lost (an operator's cleanup, a damaged volume)
    older = _points(T0 + 2 * MIN, range(2))  # a file of format 1, which carries its sets
    (tmp_path / f"{T0 + 2 * MIN:020d}.snap").write_bytes(encode(older, T0 + 2 * MIN))

    metrics = SelfMetrics()
    config = DeliveryConfig(backoff_initial_seconds=0.05, backoff_max_seconds=0.2)
    sender = OtlpSender(OtlpExporterConfig(endpoint=otlp_sink.endpoint, timeout_seconds=5.0), store.specs, metrics, "c1")
    delivery = Delivery(sender, config, metrics, directory=tmp_path, interval_s=60)
    assert delivery.recover(T0 + 2 * MIN) == 1
    assert by_label(metrics.export_outbox_errors) == {("otlp", "corrupt"): 1}
    assert (tmp_path / f"{T0 + MIN:020d}.snap.rejected").exists()
    assert delivery.wait_idle(10) and delivery.close() == 0
    assert received_rows(otlp_sink, store.specs) == [as_sent(older, store.specs)]


def test_the_log_follows_the_live_series(tmp_path) -> None:
    """Pods come and go: the snapshots delivered are deleted, and the log is rewritten with the
    sets of those on disk, so it stays within twice what is live (or the floor)."""
    outbox = Outbox(tmp_path, "otlp", SelfMetrics())
    per, kept = 500, {}
    for k in range(4 * COMPACT_FROM // per):
        end = T0 + (k + 1) * MIN
        kept[end] = _points(end, range(k * per // 2, k * per // 2 + per))  # half of the pods new each time
        outbox.write(end, kept[end])
        if len(kept) > 2:
            outbox.delete(min(kept))
            del kept[min(kept)]
        sets, _, _ = _parse((tmp_path / "attrs.log").read_bytes())
        assert len(sets) <= max(COMPACT_FROM, 2 * 3 * per) + per
    assert len(sets) < (4 * COMPACT_FROM // per) * per // 2  # it was rewritten
    found, _ = Outbox(tmp_path, "otlp", SelfMetrics()).recover(max(kept))
    assert {r.end_ns: list(r.points) for r in found} == kept


def test_a_log_rewritten_again_after_more_sets_keeps_each_kept_set(tmp_path) -> None:
    """A rewrite places each kept record right after the one before; the next rewrite, after
    more appends, copies each record from where it now is."""
    table = AttrTable(tmp_path / "attrs.log")
    first = [(("pod", f"first-{i}"), ("team", "t" * (i % 7))) for i in range(COMPACT_FROM + 10)]
    ids = table.ids(first)
    keep = ids[1::3]
    assert table.compact(keep)
    second = [(("pod", f"second-{i}"),) for i in range(2 * COMPACT_FROM)]
    more = table.ids(second)
    kept_after = np.concatenate([keep[::2], more[-7:]])
    assert table.compact(kept_after)
    every = {int(i): attrs for i, attrs in zip(ids, first)} | {int(i): attrs for i, attrs in zip(more, second)}
    assert AttrTable(tmp_path / "attrs.log").load()[0] == {int(i): every[int(i)] for i in kept_after}


def test_columns_point_to_the_same_sets_after_a_rewrite(tmp_path) -> None:
    table = AttrTable(tmp_path / "attrs.log")
    sets = [(("pod", str(i)),) for i in range(COMPACT_FROM + 10)]
    ids = table.ids(sets)
    keep = ids[-5:]
    assert table.compact(keep.tolist())
    again, _ = AttrTable(tmp_path / "attrs.log").load()
    assert again == {int(i): sets[int(i)] for i in keep}
    assert table.ids([sets[0], sets[-1]]).tolist() == [int(ids.max()) + 1, int(ids[-1])]  # ids never reused
    p = Points.of(_points(T0 + MIN, range(2)))
    set_ids = np.array([7, 9], np.uint32)
    assert decode(encode(p, T0 + MIN, (), set_ids), {7: p.attrs[0], 9: p.attrs[1]}).points == p
