"""The write-ahead log on its own: records back in order, group commit from many threads, torn
and corrupt records, segments removed after a checkpoint; and the batch record codec."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import otlp_fixture

from otelgpu.receiver.decode import PointBatch, decode_reference
from otelgpu.receiver.interner import Interner
from otelgpu.receiver.record import RecordError, decode_batch, encode_batch
from otelgpu.telemetry import SelfMetrics, by_label, total
from otelgpu.wal import Wal


def reopen(directory: Path, metrics: SelfMetrics | None = None) -> Wal:
    return Wal(directory, metrics or SelfMetrics(), segment_bytes=4096)


def test_records_come_back_in_order_across_segments_and_restarts(tmp_path: Path) -> None:
    wal = reopen(tmp_path)
    payloads = [bytes([i % 256]) * (100 + i) for i in range(120)]  # several 4 KiB segments
    ends = [wal.append(p)[1] for p in payloads]
    wal.sync(ends[-1])
    wal.close()
    again = reopen(tmp_path)  # a new process appends to a new segment, never after the old tail
    assert [p for _, _, p in again.replay((0, 0))] == payloads
    assert again.position[0] > ends[-1][0]
    start, _, _ = list(again.replay((0, 0)))[60]
    assert [p for _, _, p in again.replay(start)] == payloads[60:]


def test_group_commit_covers_every_waiting_writer(tmp_path: Path) -> None:
    metrics = SelfMetrics()
    wal = Wal(tmp_path, metrics)
    done: list[int] = []

    def writer(i: int) -> None:
        for k in range(50):
            _, end = wal.append(f"{i}-{k}".encode())
            wal.sync(end)
        done.append(i)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(done) == list(range(8))
    assert total(metrics.wal_fsyncs) <= 400  # never more than one per record; shared when they overlap
    wal.close()
    assert len(list(reopen(tmp_path).replay((0, 0)))) == 400


def five_records(directory: Path) -> Path:
    """A closed log of five 59-byte records (8 bytes of header each); its segment file."""
    wal = reopen(directory)
    for i in range(5):
        wal.append(b"x" * 50 + bytes([i]))
    wal.close()
    return directory / f"{wal.segments()[-1]:08d}"


def test_a_torn_tail_is_dropped_and_counted_the_records_before_it_kept(tmp_path: Path) -> None:
    segment = five_records(tmp_path)
    data = segment.read_bytes()
    segment.write_bytes(data[:-20])  # the crash cut the last record short
    metrics = SelfMetrics()
    again = reopen(tmp_path, metrics)
    assert len(list(again.replay((0, 0)))) == 4
    assert by_label(metrics.wal_corruptions)["tail"] == 1


def test_a_flipped_bit_stops_replay_at_that_record(tmp_path: Path) -> None:
    segment = five_records(tmp_path)
    data = bytearray(segment.read_bytes())
    data[3 * 59 + 20] ^= 0x10  # inside the fourth record's payload
    segment.write_bytes(bytes(data))
    assert len(list(reopen(tmp_path).replay((0, 0)))) == 3


def test_segments_before_the_checkpoint_position_are_removed(tmp_path: Path) -> None:
    wal = reopen(tmp_path)
    for _ in range(3):
        wal.append(b"z" * 10)
        wal.rotate()
    keep = wal.append(b"kept")[0]
    assert wal.truncate_before(keep) == 3
    assert [p for _, _, p in wal.replay((0, 0))] == []  # the current segment is not replayed while open
    wal.close()
    assert [p for _, _, p in reopen(tmp_path).replay((0, 0))] == [b"kept"]


@pytest.mark.parametrize("fixture", ["otlp_dcgm_scrape1_collector_v0.142.json",
                                     "otlp_dcgm_scrape2_stale_collector_v0.142.json",
                                     "otlp_ksm_scrape_collector_v0.142.json"])
def test_a_batch_record_replays_to_the_same_rows_in_another_process(fixture: str) -> None:
    here, there = Interner(), Interner()
    there.code("something else first")  # another process's codes differ
    batch = decode_reference(otlp_fixture(fixture), here)
    back = decode_batch(encode_batch(batch, here), there)
    for name in ("metric", "time_ns", "stale", "attr_off"):
        assert np.array_equal(getattr(back, name), getattr(batch, name)), name
    assert np.array_equal(back.value, batch.value, equal_nan=True)
    for name in ("attr_key", "attr_val", "resource_node", "resource_pod"):
        assert [there.string(int(c)) for c in getattr(back, name)] == [here.string(int(c)) for c in getattr(batch, name)]
    assert back.sources == batch.sources and batch.sources


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=6), min_size=1, max_size=6, unique=True), st.text(max_size=6))
def test_labels_and_sources_of_any_text_come_back_as_they_were(texts: list[str], source: str) -> None:
    """A record's strings are encoded all at once when they are ASCII, one by one when not:
    either way each comes back whole (a label value of accents, a pod named in another script)."""
    here, there = Interner(), Interner()
    codes = np.array([here.code(t) for t in texts], np.int32)
    n_point = len(texts)
    batch = PointBatch(np.zeros(n_point, np.int16), np.arange(n_point, dtype=np.int64), np.zeros(n_point),
                       np.zeros(n_point, bool), codes, codes[::-1].copy(), np.arange(n_point + 1, dtype=np.int64),
                       codes[::-1].copy(), codes, sources={source: 7})
    back = decode_batch(encode_batch(batch, here), there)
    for name in ("attr_key", "attr_val", "resource_node", "resource_pod"):
        assert [there.string(int(c)) for c in getattr(back, name)] == [here.string(int(c))
                                                                         for c in getattr(batch, name)]
    assert back.sources == {source: 7}


def test_a_damaged_record_is_refused_not_misread() -> None:
    strings = Interner()
    data = encode_batch(decode_reference(otlp_fixture("otlp_ksm_scrape_collector_v0.142.json"), strings), strings)
    for bad in (data[:-1], data + b"\0", b"\x09" + data[1:], data[:40]):
        with pytest.raises(RecordError):
            decode_batch(bad, Interner())
