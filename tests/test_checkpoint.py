"""Durable state: the cumulative series survive a restart without shutdown (kill -9) through the
checkpoint, continue with their start times, and a bad checkpoint is set aside, never reused."""

from __future__ import annotations

from pathlib import Path

import pytest
from cluster import T0, Cluster, Node, Pod, Unit
from support import feed, make_config, offline_pipeline

from otelgpu.checkpoint import FILE, Checkpoint, Identity, decode, encode
from otelgpu.enrich.window import NS
from otelgpu.exporter.store import CostStore
from otelgpu.errors import ConfigError
from otelgpu.pipeline import Pipeline
from otelgpu.telemetry import SelfMetrics

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


def pipeline(directory: Path | None, cluster_name: str = "prod") -> Pipeline:
    config = make_config(attribution__interval_seconds=INTERVAL_S, attribution__lateness_seconds=30,
                         attribution__prices__gpu_hour_by_gpu_model={A100: 12.0}, cluster__name=cluster_name,
                         **({"checkpoint__directory": str(directory)} if directory else {}))
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
    assert (tmp_path / FILE).exists() and first.metrics.checkpoints_written > 0
    before = starts(first)
    first.checkpoint.close()  # killed: no shutdown, no flush; its lock goes with the process

    second = pipeline(tmp_path)
    assert second.store.last_time_ns == T0 + 25 * 60 * NS
    # The Collector resends what it had queued since 20 minutes: [20, 25) was counted before the
    # kill (late now, not counted twice), [25, 30) was lost with the process and is counted now.
    feed(second, *c.scrapes(60, 3600, from_s=1200))
    second.close_due()
    assert second.metrics.points_late > 0
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
    assert second.metrics.wal_records_replayed > 0  # the open interval [25, 30) came back from the log
    feed(second, *c.scrapes(60, 3600, from_s=1800))
    second.close_due()
    assert second.metrics.points_late == 0
    assert allocated(second) == {("vision",): pytest.approx(11 * PER_INTERVAL),
                                 ("nlp",): pytest.approx(5 * PER_INTERVAL)}


def test_ended_series_are_not_in_the_checkpoint(tmp_path: Path) -> None:
    c = cluster()
    first = pipeline(tmp_path)
    feed(first, *c.scrapes(60, 3600))
    first.close_due()
    assert first.metrics.series_ended > 0  # nlp's pod ended at 25 minutes
    saved = decode((tmp_path / FILE).read_bytes(), Identity("prod", "USD"))["store"]
    pods = {dict(map(tuple, saved["attrs"][a])).get("pod") for a in saved["columns"]["attrs"]}
    assert "train" in pods and "serve" not in pods


def _written(tmp_path: Path) -> None:
    p = pipeline(tmp_path)
    feed(p, *cluster().scrapes(60, 900))
    p.checkpoint.close()


@pytest.mark.parametrize("damage, reason, words", [
    (lambda b: b[: len(b) // 2], "corrupt", "checksum mismatch"),
    (lambda b: b"garbage\n" + b, "corrupt", "bad header"),
    (lambda b: b.replace(b" v1 ", b" v9 ", 1), "incompatible", "format v9 is not readable"),
    (lambda b: b"", "corrupt", "bad header"),
])
def test_bad_checkpoint_is_set_aside_and_reported(tmp_path: Path, caplog, damage, reason: str, words: str) -> None:
    _written(tmp_path)
    path = tmp_path / FILE
    path.write_bytes(damage(path.read_bytes()))
    p = pipeline(tmp_path)
    assert p.metrics.checkpoint_errors[reason] == 1
    assert p.store.points() == [] and p.store.last_time_ns == 0  # starts afresh
    assert not path.exists() and len(list(tmp_path.glob(f"{FILE}.rejected-*"))) == 1
    assert words in caplog.text and "start afresh" in caplog.text


def test_checkpoint_of_another_cluster_is_not_reused(tmp_path: Path, caplog) -> None:
    _written(tmp_path)
    p = pipeline(tmp_path, cluster_name="staging")
    assert p.metrics.checkpoint_errors["incompatible"] == 1 and p.store.points() == []
    assert "written for cluster 'prod', this run is cluster 'staging'" in caplog.text


def test_valid_file_with_content_that_does_not_restore(tmp_path: Path, caplog) -> None:
    identity = Identity("prod", "USD")
    (tmp_path / FILE).write_bytes(encode(identity, {"store": {"last_time_ns": 5, "attrs": [], "sums": [
        ["no_such_metric", 0, 0, 5, 1.0, 0]]}}, 0))
    p = pipeline(tmp_path)
    assert p.metrics.checkpoint_errors["corrupt"] == 1 and p.store.points() == []
    assert "does not restore" in caplog.text


def test_the_row_per_series_layout_of_earlier_versions_restores(tmp_path: Path) -> None:
    """A checkpoint written before the store kept columns continues the same series."""
    c = cluster()
    first = pipeline(tmp_path)
    feed(first, *c.scrapes(60, 1800))
    first.close_due()
    state = first.store.state()
    cols = state["columns"]
    rows = [[m, a, s, state["last_time_ns"], v, q] for m, a, s, v, q in
            zip(cols["metric"], cols["attrs"], cols["start_ns"], cols["value"], cols["quiet"])]
    old = CostStore()
    old.restore({"last_time_ns": state["last_time_ns"], "attrs": state["attrs"], "sums": rows})
    assert len(rows) > 10 and old.state() == state
    assert list(old.points()) == [p for p in first.store.points() if old.specs[p.metric].kind == "sum"]


def test_content_that_fails_late_in_the_restore_leaves_nothing_half_restored(tmp_path: Path, caplog) -> None:
    """The store restores, then the tag values do not: the run starts afresh, store included."""
    identity = Identity("prod", "USD")
    (tmp_path / FILE).write_bytes(encode(identity, {
        "store": {"last_time_ns": 5, "attrs": [[["team", "a"]]], "sums": [["allocated", 0, 0, 5, 1.0, 0]]},
        "tag_values": {"generation": 3, "uses": {"team": ["not", "a", "mapping"]}}}, 0))
    p = pipeline(tmp_path)
    assert p.metrics.checkpoint_errors["corrupt"] == 1
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
    cp = Checkpoint(tmp_path, Identity("prod", "USD"), SelfMetrics())
    (tmp_path / f".{FILE}.tmp").mkdir()  # the temporary file cannot be created
    assert cp.save({"store": {"last_time_ns": 1, "attrs": [], "sums": []}}) is False
    assert cp.metrics.checkpoint_errors["write"] == 1 and "previous one stays" in caplog.text
    assert (tmp_path / FILE).read_bytes() == before
    cp.close()
