"""Durable state: the cumulative series survive a restart without shutdown (kill -9) through the
checkpoint, continue with their start times, and a bad checkpoint is set aside, never reused."""

from __future__ import annotations

import gc
import os
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from cluster import T0, Cluster, Node, Pod, Unit
from otlpsink import MetricsSink, received_rows, serve_sink
from support import feed, make_config, offline_pipeline

from otelgpu.checkpoint import (FILE, V1_FILE, VERSION, Checkpoint, CheckpointRejected, Identity, Pieces, decode,
                                encode, spilled, string_arrays, text_arrays, texts_of)
from otelgpu.enrich.window import NS
from otelgpu.exporter.store import CostStore
from otelgpu.errors import ConfigError
from otelgpu.pipeline import Pipeline
from otelgpu.telemetry import SelfMetrics, by_label, total

A100 = "NVIDIA A100-SXM4-40GB"
INTERVAL_S = 300
PER_INTERVAL = 12.0 * INTERVAL_S / 3600  # one GPU at $12/h for one interval


def cluster() -> Cluster:
    node = Node("gpu-1", "p4d.24xlarge", 96, 1152, units=[Unit("GPU-0", A100), Unit("GPU-1", A100)],
                capacity={"nvidia_com_gpu": 2})
    pods = [Pod("ml", "train", "gpu-1", labels={"team": "vision"}, gpu=("nvidia_com_gpu", 1), holds=("GPU-0",)),
            Pod("ml", "serve", "gpu-1", labels={"team": "nlp"}, gpu=("nvidia_com_gpu", 1), holds=("GPU-1",),
                end_s=1500)]
    return Cluster([node], pods)


def pipeline(directory: Path | None, cluster_name: str = "prod", **extra: Any) -> Pipeline:
    config = make_config(attribution__interval_seconds=INTERVAL_S, attribution__lateness_seconds=30,
                         attribution__prices__gpu_hour_by_gpu_model={A100: 12.0}, cluster__name=cluster_name,
                         **({"checkpoint__directory": str(directory)} if directory else {}), **extra)
    return offline_pipeline(config)


def allocated(p: Pipeline) -> dict[tuple[str, ...], float]:
    return {k: round(v, 9) for k, v in p.store.totals("allocated", ("team",), {"cost_model": "request"}).items()}


def starts(p: Pipeline) -> dict[tuple, int]:
    return {(pt.metric, pt.attrs): pt.start_ns for pt in p.store.points() if p.store.specs[pt.metric].kind == "sum"}


def test_kill_and_restart_continues_every_series(tmp_path: Path) -> None:
    c = cluster()
    whole = pipeline(None)
    feed(whole, *c.scrapes(60, 3600))
    whole.close_due()  # what closed on data time alone, as a running sidecar would have

    first = pipeline(tmp_path)
    feed(first, *c.scrapes(60, 1740))  # up to 29 minutes; [25, 30) is still open
    assert (tmp_path / FILE).exists() and total(first.metrics.checkpoints_written) > 0
    before = starts(first)
    first.checkpoint.close()  # killed: no shutdown, no flush; its lock goes with the process

    second = pipeline(tmp_path)
    assert second.store.last_time_ns == T0 + 25 * 60 * NS
    # The Collector resends what it had queued since 20 minutes: [20, 25) was counted before the
    # kill (late now, not counted twice), [25, 30) was lost with the process and is counted now.
    feed(second, *c.scrapes(60, 3600, from_s=1200))
    second.close_due()
    assert total(second.metrics.points_late) > 0
    assert allocated(second) == allocated(whole)
    assert allocated(second) == {("vision",): pytest.approx(11 * PER_INTERVAL),
                                 ("nlp",): pytest.approx(5 * PER_INTERVAL)}
    after = starts(second)
    assert all(after[k] == v for k, v in before.items() if k in after)  # original start times
    assert after and all(v == T0 for k, v in after.items() if dict(k[1]).get("pod") == "train")


def test_restart_without_resend_loses_nothing_that_was_acknowledged(tmp_path: Path) -> None:
    c = cluster()
    first = pipeline(tmp_path)
    feed(first, *c.scrapes(60, 1740))
    first.checkpoint.close()  # killed
    second = pipeline(tmp_path)
    assert total(second.metrics.wal_records_replayed) > 0  # the open interval [25, 30) came back from the log
    feed(second, *c.scrapes(60, 3600, from_s=1800))
    second.close_due()
    assert total(second.metrics.points_late) == 0
    assert allocated(second) == {("vision",): pytest.approx(11 * PER_INTERVAL),
                                 ("nlp",): pytest.approx(5 * PER_INTERVAL)}



def test_an_exports_directory_refusing_writes_holds_the_checkpoint_back_and_a_kill_loses_no_cost(
        tmp_path: Path) -> None:
    """The exporter's directory refuses writes for a while (a full or read-only volume), then the
    sidecar is killed: the intervals closed meanwhile wait in the exporter's queue, in memory and
    unsent, the checkpoint does not move past them, and after the restart (the write-ahead log
    replayed) every series' total the backend received is what an uninterrupted run counts."""
    c = cluster()
    whole = pipeline(None)
    feed(whole, *c.scrapes(60, 3600))
    whole.close_due()
    sink = MetricsSink()
    with serve_sink(sink) as port:
        otlp = {"endpoint": f"127.0.0.1:{port}", "tls": {"insecure": True}, "timeout_seconds": 5,
                "delivery": {"backoff_initial_seconds": 0.05, "backoff_max_seconds": 0.2}}
        first = pipeline(tmp_path, exporter__otlp=otlp)
        feed(first, *c.scrapes(60, 900))
        checkpointed = total(first.metrics.interval_checkpointed)
        exports, aside = tmp_path / "exports" / "otlp", tmp_path / "exports-aside"
        exports.rename(aside)
        exports.write_bytes(b"")  # a file where the directory was: every write there fails
        feed(first, *c.scrapes(60, 1740, from_s=900))
        assert by_label(first.metrics.checkpoint_errors)["stage"] > 0
        assert total(first.metrics.interval_checkpointed) == checkpointed > 0
        for d in first.deliveries:  # killed: its sender stops where it is
            d.finish_by(time.monotonic())
        first.checkpoint.close()
        exports.unlink()
        aside.rename(exports)

        second = pipeline(tmp_path, exporter__otlp=otlp)
        feed(second, *c.scrapes(60, 3600, from_s=1740))
        second.close_due()
        assert second.deliveries[0].wait_idle(30)
        assert delivered_allocated(sink, second) == allocated(whole)
        second.shutdown()


def delivered_allocated(sink: MetricsSink, p: Pipeline) -> dict[tuple[str, ...], float]:
    """The request model's allocated cost by team, from each series' last total the backend got."""
    last: dict[tuple, tuple[int, float]] = {}
    for rows in received_rows(sink, p.store.specs):
        for metric, attrs, _, t, value in rows:
            if metric == "allocated" and dict(attrs).get("cost_model") == "request" and value is not None:
                if t >= last.get(attrs, (0, 0.0))[0]:
                    last[attrs] = (t, value)
    out: dict[tuple[str, ...], float] = {}
    for attrs, (_, value) in last.items():
        team = (dict(attrs).get("team", ""),)
        out[team] = out.get(team, 0.0) + value
    return {k: round(v, 9) for k, v in out.items()}

def test_ended_series_are_not_in_the_checkpoint(tmp_path: Path) -> None:
    c = cluster()
    first = pipeline(tmp_path)
    feed(first, *c.scrapes(60, 3600))
    first.close_due()
    assert total(first.metrics.series_ended) > 0  # nlp's pod ended at 25 minutes
    saved = CostStore()
    saved.restore(decode((tmp_path / FILE).read_bytes(), Identity("prod", "USD"))["store"])
    pods = {dict(p.attrs).get("pod") for p in saved.points()}
    assert "train" in pods and "serve" not in pods


def _written(tmp_path: Path) -> None:
    p = pipeline(tmp_path)
    feed(p, *cluster().scrapes(60, 900))
    p.checkpoint.close()


def test_what_a_close_and_its_checkpoint_build_is_freed_without_the_cyclic_collector(tmp_path: Path) -> None:
    """The cyclic collector is off while an interval closes and its checkpoint is written: an array
    that only it could free (one held in a reference cycle) would stay until it runs again, on top of
    what the next step builds (every array of a checkpoint: 100 MiB and more at 100,000 GPUs)."""
    p = pipeline(tmp_path)
    c = cluster()
    gc.collect()
    gc.disable()
    flags = gc.get_debug()
    try:
        feed(p, *c.scrapes(60, 1740))
        assert total(p.metrics.checkpoints_written) >= 4
        p.checkpoint.close()  # its lock: the same directory is read again below
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        held = [r for o in gc.garbage for r in gc.get_referents(o) if isinstance(r, np.ndarray)]
        loaded = pipeline(tmp_path)  # the restore's arrays too
        gc.garbage.clear()
        gc.collect()
        held += [r for o in gc.garbage for r in gc.get_referents(o) if isinstance(r, np.ndarray)]
        assert loaded.store.last_time_ns == p.store.last_time_ns
        loaded.checkpoint.close()
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
        gc.enable()
    assert held == []


@pytest.mark.parametrize("damage, reason, words", [
    (lambda b: b[: len(b) // 2], "corrupt", "checksum mismatch"),
    (lambda b: b"garbage\n" + b, "corrupt", "bad header"),
    (lambda b: b.replace(f" v{VERSION} ".encode(), b" v9 ", 1), "incompatible", "format v9 is not readable"),
    (lambda b: b"", "corrupt", "bad header"),
])
def test_bad_checkpoint_is_set_aside_and_reported(tmp_path: Path, caplog, damage, reason: str, words: str) -> None:
    _written(tmp_path)
    path = tmp_path / FILE
    path.write_bytes(damage(path.read_bytes()))
    p = pipeline(tmp_path)
    assert by_label(p.metrics.checkpoint_errors)[reason] == 1
    assert p.store.points() == [] and p.store.last_time_ns == 0  # starts afresh
    assert not path.exists() and len(list(tmp_path.glob(f"{FILE}.rejected-*"))) == 1
    assert words in caplog.text and "start afresh" in caplog.text


def test_checkpoint_of_another_cluster_is_not_reused(tmp_path: Path, caplog) -> None:
    _written(tmp_path)
    p = pipeline(tmp_path, cluster_name="staging")
    assert by_label(p.metrics.checkpoint_errors)["incompatible"] == 1 and p.store.points() == []
    assert "written for cluster 'prod', this run is cluster 'staging'" in caplog.text


def test_valid_file_with_content_that_does_not_restore(tmp_path: Path, caplog) -> None:
    identity = Identity("prod", "USD")
    (tmp_path / FILE).write_bytes(encode(identity, {"store": {"last_time_ns": 5, "attrs": [], "sums": [
        ["no_such_metric", 0, 0, 5, 1.0, 0]]}}, 0))
    p = pipeline(tmp_path)
    assert by_label(p.metrics.checkpoint_errors)["corrupt"] == 1 and p.store.points() == []
    assert "does not restore" in caplog.text


def sums(p: Pipeline) -> list:
    return [pt for pt in p.store.points() if p.store.specs[pt.metric].kind == "sum"]


def earlier_layouts(store: CostStore) -> dict[str, dict]:
    """The store's state as earlier versions wrote it in JSON: attribute sets as lists of pairs,
    then either columns as lists with metric names or one row per series."""
    table: dict = {}
    points = [p for p in store.points() if store.specs[p.metric].kind == "sum"]
    aset = [table.setdefault(p.attrs, len(table)) for p in points]
    attrs = [[list(pair) for pair in a] for a in table]
    columns = {"metric": [p.metric for p in points], "attrs": aset, "start_ns": [p.start_ns for p in points],
               "value": [p.value for p in points], "quiet": [0] * len(points)}
    rows = [[p.metric, a, p.start_ns, p.time_ns, p.value, 0] for p, a in zip(points, aset)]
    return {"columns": {"last_time_ns": store.last_time_ns, "attrs": attrs, "columns": columns},
            "sums": {"last_time_ns": store.last_time_ns, "attrs": attrs, "sums": rows}}


def with_string_ids(state: dict) -> dict:
    """The store's state as the versions before pair ids wrote its table: each set's key and
    value string ids end to end, cut at `set_ends` (in strings)."""
    table = state["table"]
    kinds = np.asarray(table["pair_strings"]).reshape(-1, 2)
    return {**state, "table": {"pairs": kinds[np.asarray(table["set_pairs"])].reshape(-1).astype(np.uint32),
                               "set_ends": table["pair_ends"] * 2, "strings": table["strings"],
                               "string_ends": table["string_ends"]}}


@pytest.mark.parametrize("layout", ["columns", "sums", "string ids"])
def test_the_layouts_of_earlier_versions_restore(tmp_path: Path, layout: str) -> None:
    """A checkpoint written before the store kept its state as arrays, or before its table of
    attribute sets held pair ids, continues the same series."""
    c = cluster()
    first = pipeline(tmp_path)
    feed(first, *c.scrapes(60, 1800))
    first.close_due()
    old = CostStore()
    layouts = {**earlier_layouts(first.store), "string ids": with_string_ids(first.store.state())}
    old.restore(through(layouts[layout]) if layout == "string ids" else layouts[layout])
    assert len(sums(first)) > 10 and list(old.points()) == sums(first)


def through(state: dict) -> dict:
    """`state` as a checkpoint file gives it back."""
    identity = Identity("prod", "USD")
    return decode(encode(identity, {"store": state}, 0), identity)["store"]


def test_a_table_whose_arrays_do_not_fit_together_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    c = cluster()
    first = pipeline(tmp_path)
    feed(first, *c.scrapes(60, 1800))
    first.close_due()
    state = first.store.state()
    table = state["table"]
    broken = [{**table, "set_pairs": np.asarray(table["set_pairs"]) + np.uint32(len(table["pair_strings"]))},
              {**table, "pair_strings": table["pair_strings"] + np.uint32(len(table["string_ends"]))},
              {**table, "pair_ends": table["pair_ends"][:-1]},
              {**table, "pair_ends": table["pair_ends"][::-1].copy()}]
    kept = list(first.store.points())
    for bad in broken:
        with pytest.raises(ValueError, match="attribute set table"):
            first.store.restore({**state, "table": bad})
        assert list(first.store.points()) == kept


def test_a_version_1_file_is_continued_and_then_replaced(tmp_path: Path) -> None:
    """An upgrade: the directory holds the JSON checkpoint of version 1; the run continues its
    series, and its first checkpoint is version 2 in the new file, the old one removed."""
    import hashlib
    import json
    c = cluster()
    first = pipeline(None)
    feed(first, *c.scrapes(60, 1800))
    first.close_due()
    body = json.dumps({"cluster": "prod", "currency": "USD", "written_ns": 0,
                       "store": earlier_layouts(first.store)["columns"]}).encode()
    (tmp_path / V1_FILE).write_bytes(b"otelgpu-checkpoint v1 sha256=" + hashlib.sha256(body).hexdigest().encode()
                                     + b"\n" + body)
    second = pipeline(tmp_path)
    assert second.store.last_time_ns == first.store.last_time_ns and list(second.store.points()) == sums(first)
    feed(second, *c.scrapes(60, 2400, from_s=1800))
    second.close_due()
    assert (tmp_path / FILE).exists() and not (tmp_path / V1_FILE).exists()
    assert all(p.start_ns == T0 for p in sums(second) if dict(p.attrs).get("pod") == "train")


def test_arrays_round_trip_in_place() -> None:
    identity = Identity("prod", "USD")
    arrays = {"u16": np.arange(5, dtype=np.uint16), "f64": np.array([0.1, -2.5, 1e300]),
              "empty": np.zeros(0, np.int64), "flags": np.array([True, False, True]),
              "grid": np.arange(12, dtype=np.int32).reshape(3, 4)}
    state = decode(encode(identity, {"x": {"nested": arrays, "plain": [1, "two"]}}, 7), identity)
    assert state["x"]["plain"] == [1, "two"] and state["written_ns"] == 7
    for name, a in arrays.items():
        got = state["x"]["nested"][name]
        assert got.dtype == a.dtype and got.shape == a.shape and np.array_equal(got, a)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**32 - 1), max_size=6), max_size=40),
       st.lists(st.integers(-2**63, 2**63 - 1), max_size=300), st.integers(1, 70))
def test_an_array_written_a_piece_at_a_time_is_the_file_of_the_whole_array(parts, column, piece_rows) -> None:
    """`Pieces`, joined from parts or gathered from a column's rows, some rows at a time, gives the
    very file the whole arrays give, and reads back as them."""
    identity = Identity("prod", "USD")
    codes = [np.array(p, np.uint32).tobytes() for p in parts]
    values = np.array(column, np.int64)
    rows = np.arange(len(values))[::-1].copy()
    whole = {"pairs": np.frombuffer(b"".join(codes), np.uint32), "column": values[rows]}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("otelgpu.checkpoint.PIECE_ROWS", piece_rows)
        pieces = {"pairs": Pieces.joined(codes, np.uint32), "column": Pieces.gathered(values, rows)}
        data = encode(identity, {"x": pieces}, 7)
        assert np.array_equal(np.asarray(pieces["pairs"]), whole["pairs"]) and list(pieces["column"]) == column[::-1]
    assert data == encode(identity, {"x": whole}, 7)
    for name, array in decode(data, identity)["x"].items():
        assert array.dtype == whole[name].dtype and np.array_equal(array, whole[name])


def test_a_checkpoint_of_pieces_is_written_without_a_copy_of_them_whole(tmp_path: Path) -> None:
    """The store's sets' pair ids, 200,000 sets of 17 pairs (13.6 MB), written as `Pieces`: what
    the write builds stays under a tenth of them."""
    codes = [np.arange(i, i + 17, dtype=np.uint32).tobytes() for i in range(200_000)]
    column = np.arange(1_000_000, dtype=np.float64)
    state = {"store": {"set_pairs": Pieces.joined(codes, np.uint32),
                       "value": Pieces.gathered(column, np.arange(len(column))[::-1].copy())}}
    checkpoint = Checkpoint(tmp_path, Identity("prod", "USD"), SelfMetrics())
    tracemalloc.start()
    try:
        assert checkpoint.save(state)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < (sum(map(len, codes)) + column.nbytes) / 10
    assert np.array_equal(checkpoint.load()["store"]["value"], column[::-1])
    checkpoint.close()


def _open_in(directory: Path) -> list[str]:
    """The files of `directory` this process has open (a file without a name included)."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed meanwhile
            continue
    return [link for link in links if link.startswith(str(directory) + os.sep)]


@pytest.mark.parametrize("piece_rows", [1, 7, 1 << 16])
def test_a_state_spilled_to_a_file_writes_the_checkpoint_the_state_would(tmp_path: Path, piece_rows: int) -> None:
    """Arrays of every kind and shape the state has, nested, beside lists and numbers: spilled,
    they write the very file the arrays in memory write, read back as them, and the state holds
    none of them. The file has no name in the directory, and it is closed as soon as nothing
    refers to the state, without the cyclic collector."""
    identity = Identity("prod", "USD")
    rng = np.random.default_rng(piece_rows)
    state = {"facts": {"pods": {"keys": rng.integers(0, 2**40, (1000, 2)), "ended": rng.random(1000) < 0.5,
                                "quantity": np.append(rng.random(99), np.nan), "none": np.zeros((0, 3), np.int32)},
                       "strings": {"utf8": rng.integers(0, 255, 70_001).astype(np.uint8),
                                   "ends": np.arange(17, dtype=np.uint16)},
                       "version": 2, "names": ["a", "b"]}}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("otelgpu.checkpoint.PIECE_ROWS", piece_rows)
        kept = spilled(state, tmp_path)
        assert list(tmp_path.iterdir()) == []
        leaves = [*kept["facts"]["pods"].values(), *kept["facts"]["strings"].values()]
        assert leaves and all(isinstance(leaf, Pieces) for leaf in leaves)
        assert kept["facts"]["version"] == 2 and kept["facts"]["names"] == ["a", "b"]
        assert encode(identity, kept, 7) == encode(identity, state, 7)
        pods = kept["facts"]["pods"]
        assert all(np.array_equal(np.asarray(pods[k]), a, equal_nan=True) and np.asarray(pods[k]).shape == a.shape
                   for k, a in state["facts"]["pods"].items())
    assert len(_open_in(tmp_path)) == 1  # open, with no name in the directory
    gc.disable()
    try:
        del kept, leaves, pods
        assert _open_in(tmp_path) == []
    finally:
        gc.enable()


def test_state_that_cannot_be_spilled_stays_in_memory(tmp_path: Path, caplog) -> None:
    checkpoint = Checkpoint(tmp_path / "c", Identity("prod", "USD"), SelfMetrics())
    (tmp_path / "c" / ".lock").unlink()
    (tmp_path / "c").rmdir()  # the volume went away
    state = {"facts": {"pods": np.arange(5)}}
    assert checkpoint.spill(state) is state and "kept in memory" in caplog.text
    checkpoint.close()


def test_pieces_that_give_less_than_they_said_leave_the_previous_checkpoint(tmp_path: Path, caplog) -> None:
    _written(tmp_path)
    before = (tmp_path / FILE).read_bytes()
    metrics = SelfMetrics()
    checkpoint = Checkpoint(tmp_path, Identity("prod", "USD"), metrics)
    short = Pieces(np.uint32, 10, lambda: iter([np.zeros(9, np.uint32)]))
    assert checkpoint.save({"store": {"set_pairs": short}}) is False
    assert by_label(metrics.checkpoint_errors)["write"] == 1 and "36 bytes of the 40" in caplog.text
    assert (tmp_path / FILE).read_bytes() == before
    checkpoint.close()


def test_an_array_that_cannot_be_written_is_refused() -> None:
    with pytest.raises(ValueError, match="dtype object"):
        encode(Identity("prod", "USD"), {"x": np.array(["a", None], object)}, 0)


def _resigned(data: bytes, body: bytes) -> bytes:
    import hashlib
    header = data.partition(b"\n")[0].rsplit(b"=", 1)[0]
    return header + b"=" + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


@pytest.mark.parametrize("edit, words", [
    (lambda meta: meta.replace(b'"arrays":[["<u2",[3],0]]', b'"arrays":[["<u2",[3000],0]]'), "not in the file"),
    (lambda meta: meta.replace(b'"arrays":[["<u2",[3],0]]', b'"arrays":[["|O",[3],0]]'), "bad array directory"),
    (lambda meta: meta.replace(b'{"$array":0}', b'{"$array":5}'), "not in the file"),
])
def test_a_checksummed_file_with_a_bad_array_directory_is_corrupt(edit, words: str) -> None:
    """Arrays are only read from where the file has them, of the kinds the writer writes."""
    identity = Identity("prod", "USD")
    data = encode(identity, {"x": {"a": np.arange(3, dtype=np.uint16)}}, 0)
    body = data.partition(b"\n")[2]
    meta, _, rest = body.partition(b"\n")
    edited = edit(meta)
    assert edited != meta
    with pytest.raises(CheckpointRejected, match=words) as caught:
        decode(_resigned(data, edited + b"\n" + rest), identity)
    assert caught.value.reason == "corrupt"


def test_content_that_fails_late_in_the_restore_leaves_nothing_half_restored(tmp_path: Path, caplog) -> None:
    """The store restores, then the tag values do not: the run starts afresh, store included."""
    identity = Identity("prod", "USD")
    (tmp_path / FILE).write_bytes(encode(identity, {
        "store": {"last_time_ns": 5, "attrs": [[["team", "a"]]], "sums": [["allocated", 0, 0, 5, 1.0, 0]]},
        "tag_values": {"generation": 3, "uses": {"team": ["not", "a", "mapping"]}}}, 0))
    p = pipeline(tmp_path)
    assert by_label(p.metrics.checkpoint_errors)["corrupt"] == 1
    assert p.store.points() == [] and p.store.last_time_ns == 0
    assert p.tag_values.generation == 0 and p.tag_values.state()["uses"]["team"] == {}
    assert "does not restore" in caplog.text


def test_one_directory_one_process(tmp_path: Path) -> None:
    held = Checkpoint(tmp_path, Identity("prod", "USD"), SelfMetrics())
    with pytest.raises(ConfigError, match="in use by another otelgpu process"):
        Checkpoint(tmp_path, Identity("prod", "USD"), SelfMetrics())
    held.close()
    Checkpoint(tmp_path, Identity("prod", "USD"), SelfMetrics()).close()


def test_directory_that_is_a_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="checkpoint.directory: .* is not usable"):
        Checkpoint(tmp_path / "f", Identity("prod", "USD"), SelfMetrics())


def test_failed_write_keeps_the_previous_checkpoint(tmp_path: Path, caplog) -> None:
    _written(tmp_path)
    before = (tmp_path / FILE).read_bytes()
    metrics = SelfMetrics()
    cp = Checkpoint(tmp_path, Identity("prod", "USD"), metrics)
    (tmp_path / f".{FILE}.tmp").mkdir()  # the temporary file cannot be created
    assert cp.save({"store": {"last_time_ns": 1, "attrs": [], "sums": []}}) is False
    assert by_label(metrics.checkpoint_errors)["write"] == 1 and "previous one stays" in caplog.text
    assert (tmp_path / FILE).read_bytes() == before
    cp.close()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.text(alphabet=st.characters(max_codepoint=127)), st.text()), max_size=20))
def test_a_string_table_is_the_same_whichever_way_it_is_built(strings: list[str]) -> None:
    """ASCII strings are joined once, the others encoded one by one: the same arrays, the same
    strings back."""
    blob, ends = string_arrays(strings)
    want_blob, want_ends = text_arrays([s.encode("utf-8", "surrogatepass") for s in strings])
    assert blob.tobytes() == want_blob.tobytes() and ends.tolist() == want_ends.tolist()
    assert texts_of(blob, ends) == strings
