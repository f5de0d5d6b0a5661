"""One lifecycle for the state the worker keeps (core/state.py): every part the pipeline registers
keeps the protocol, comes back whole through a checkpoint, starts afresh from nothing, and the
checkpoint document is exactly the parts' entries; a document of the layout written before the
lifecycle (token counters beside the CPU ones, no closed time for the windows) continues."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from capture import DEMO_START_NS, merged

from otelgpu.checkpoint import FILE, Identity, Pieces, decode, encode
from otelgpu.config import parse_config
from otelgpu.core.state import States, Stateful
from otelgpu.demo.run import scrape_requests
from otelgpu.pipeline import Pipeline


def demo(directory: Path | None = None) -> Pipeline:
    """The demo's configuration (scad, tenants: every part has state), fed in this process, with a
    checkpoint in `directory` if given."""
    doc = yaml.safe_load(resources.files("otelgpu.demo").joinpath("config.yaml").read_text())
    doc = merged(doc, {"receiver": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": {"enabled": False},
                                    "max_point_age_seconds": 0}, "exporter": {"prometheus": {"enabled": False}}})
    doc["exporter"] = {"prometheus": doc["exporter"]["prometheus"]}
    doc["checkpoint"] = {"directory": str(directory)} if directory else {}
    return Pipeline(parse_config(doc), serve_receivers=False, keep_ended=True)


def fed(pipeline: Pipeline, seconds: int = 1800) -> Pipeline:
    """Fed the demo's scrapes until its watermark passes `seconds` into the hour."""
    for req in scrape_requests(DEMO_START_NS, 3600):
        pipeline.ingest.consume(req)
        while (batch := pipeline.ingest.get(timeout=0)) is not None:
            pipeline.process(batch)
            pipeline.ingest.task_done()
        if pipeline.windows.watermark_ns >= DEMO_START_NS + seconds * 10**9:
            break
    return pipeline


IDENTITY = Identity("demo", "USD")


def through_checkpoint(state: Any) -> Any:
    return decode(encode(IDENTITY, {"x": state}, 0), IDENTITY)["x"]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, (np.ndarray, Pieces)) or isinstance(b, (np.ndarray, Pieces)):
        return np.array_equal(np.asarray(a), np.asarray(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def running() -> Pipeline:
    return fed(demo())


def test_every_part_keeps_the_protocol_and_the_document_is_their_entries(running: Pipeline) -> None:
    parts = running.states.parts
    assert [p.key for p in parts] == ["store", "tag_values", "facts", "usage", "devices", "windows"]
    assert all(isinstance(p, Stateful) for p in parts)
    assert set(running._checkpoint_state()) == {p.key for p in parts} | {"wal"}


@pytest.mark.parametrize("key", ["store", "tag_values", "facts", "usage", "devices", "windows"])
def test_each_part_comes_back_whole_through_a_checkpoint_and_afresh_from_nothing(running: Pipeline,
                                                                                  key: str) -> None:
    part = next(p for p in running.states.parts if p.key == key)
    state = part.state()
    fresh = next(p for p in demo().states.parts if p.key == key)
    empty = fresh.state()
    assert not same(state, empty), f"{key}: the fed pipeline should have something to keep"
    fresh.restore(through_checkpoint(state))
    assert same(fresh.state(), state)
    fresh.restore(None)
    assert same(fresh.state(), empty)


def test_undo_puts_every_part_back_and_expiry_reaches_every_part() -> None:
    order: list[str] = []

    class Part:
        def __init__(self, key: str) -> None:
            self.key, self.value = key, 0

        def state(self) -> int:
            return self.value

        def restore(self, state: int | None) -> None:
            self.value = state or 0

        def mark(self):  # noqa: ANN201
            kept = self.value

            def undo() -> None:
                order.append(self.key)
                self.value = kept

            return undo

        def expire(self, end_ns: int) -> None:
            self.value = -end_ns

    a, b = Part("a"), Part("b")
    states = States([a, b])
    states.restore({"a": 3})
    assert states.state() == {"a": 3, "b": 0}
    undo = states.mark()
    a.value, b.value = 7, 8
    undo()
    assert states.state() == {"a": 3, "b": 0} and order == ["b", "a"]  # last part first
    states.expire(5)
    assert states.state() == {"a": -5, "b": -5}
    with pytest.raises(ValueError, match="share a checkpoint key"):
        States([a, Part("a")])


def test_a_checkpoint_of_the_layout_before_the_lifecycle_continues(tmp_path: Path) -> None:
    first = fed(demo(tmp_path))
    now = first._checkpoint_state()
    assert now["usage"]["cpu"] and now["usage"]["tokens"], "the demo has both kinds of counters"
    old = {**now, "usage": now["usage"]["cpu"], "tokens": now["usage"]["tokens"],
           "windows": {"watermark_ns": now["windows"]["watermark_ns"]}}
    first.shutdown()
    (tmp_path / FILE).write_bytes(encode(IDENTITY, old, 0))
    second = demo(tmp_path)
    assert second.checkpoint is not None and not list(tmp_path.glob("*.rejected*"))
    assert same(second.usage.state(), now["usage"])
    assert second.windows.closed_ns == now["store"]["last_time_ns"] == now["windows"]["closed_ns"]
    assert second.store.last_time_ns == now["store"]["last_time_ns"]
    second.shutdown()


def test_device_memory_reads_the_lists_of_earlier_versions_and_refuses_what_does_not_fit() -> None:
    from otelgpu.enrich.devices import DeviceMemory
    from otelgpu.receiver.interner import Interner

    memory = DeviceMemory(Interner(), memory_ns=1)
    whole = [["gpu-1", 5, [["GPU-0", "", "", "A100"], ["GPU-1", "3", "1g.10gb", "A100"]]], ["gpu-2", 7, []]]
    memory.restore(whole)  # as the versions before the arrays wrote it
    arrays = memory.state()
    assert arrays["entity_ends"].tolist() == [2, 2] and len(arrays["fields"]) == 8
    again = DeviceMemory(Interner(), memory_ns=1)
    again.restore(through_checkpoint(arrays))
    listed = [[name, node.seen_ns, [list(e) for e in node.each()]] for name, node in again._nodes.items()]
    assert listed == whole and same(again.state(), arrays)
    with pytest.raises(ValueError, match="without its four fields"):  # fields would otherwise shift to the next
        memory.restore([["gpu-1", 5, [["GPU-0", "", "", "A100"], ["GPU-1", "", "A100"]]]])
    assert same(memory.state(), arrays)  # what it had is kept
    for bad in ({**arrays, "fields": arrays["fields"][:-1]}, {**arrays, "names": arrays["names"] + 100},
                {**arrays, "seen_ns": arrays["seen_ns"][:1]}, {**arrays, "entity_ends": np.array([3, 2])}):
        with pytest.raises(ValueError, match="do not fit together"):
            memory.restore(bad)
        assert same(memory.state(), arrays)


def test_device_memory_keeps_one_tuple_of_a_nodes_gpus_while_they_stay_the_same() -> None:
    """Each interval remembers every node's GPUs anew, and the mark of an interval computed ahead
    keeps what was remembered before: a node whose GPUs did not change keeps its one tuple of
    them, a node whose MIG layout changed gets its new one, and the mark puts back the old."""
    from otelgpu.enrich.devices import DeviceMemory
    from otelgpu.enrich.samples import Samples
    from otelgpu.receiver.interner import Interner

    strings = Interner()

    def samples(layout: list[tuple[str, str]]) -> Samples:
        n_row = len(layout)
        code = np.vectorize(strings.code, otypes=[np.int32])
        none = np.full(n_row, -1, np.int32)
        return Samples(np.zeros(n_row, np.int16), np.full(n_row, 10, np.int64), np.ones(n_row), np.zeros(n_row, bool),
                       code(["gpu-1"] * n_row), code([u for u, _ in layout]), code([g for _, g in layout]),
                       code(["1g.10gb"] * n_row), code(["A100"] * n_row), none, none, none, none, none)

    memory = DeviceMemory(strings, memory_ns=1)
    memory.fill(samples([("GPU-0", "1"), ("GPU-0", "2")]), 0, 60, {"gpu-1"})
    first = memory._nodes["gpu-1"]
    undo = memory.mark()
    memory.fill(samples([("GPU-0", "1"), ("GPU-0", "2")]), 60, 120, {"gpu-1"})
    again = memory._nodes["gpu-1"]
    assert again.entities is first.entities and again.seen_ns == 120 and first.seen_ns == 60
    memory.fill(samples([("GPU-0", "1")]), 120, 180, {"gpu-1"})
    assert [e[:2] for e in memory._nodes["gpu-1"].each()] == [("GPU-0", "1")]
    undo()
    assert memory._nodes["gpu-1"] is first and len(list(first.each())) == 2


def test_device_memory_keeps_the_tuples_of_a_holder_that_stays() -> None:
    """The mark of an interval computed ahead shares the holders remembered before it: a GPU whose
    pod did not change keeps its tuples (at 100,000 GPUs a second set of them, some 10 MiB, was
    held from the computation ahead to the close), one whose pod changed gets its new holder,
    and the mark puts back the old."""
    from otelgpu.enrich.devices import DeviceMemory
    from otelgpu.enrich.samples import Samples
    from otelgpu.receiver.interner import Interner

    strings = Interner()
    code = np.vectorize(strings.code, otypes=[np.int32])

    def samples(pods: list[str]) -> Samples:
        n_row = len(pods)
        none = np.full(n_row, -1, np.int32)
        return Samples(np.zeros(n_row, np.int16), np.full(n_row, 10, np.int64), np.ones(n_row), np.zeros(n_row, bool),
                       code(["gpu-1"] * n_row), code([f"GPU-{k}" for k in range(n_row)]), none, none,
                       code(["A100"] * n_row), code(["ml"] * n_row), code(pods), none, none, none)

    memory = DeviceMemory(strings, memory_ns=1)
    memory.fill(samples(["a", "b"]), 0, 60, {"gpu-1"})
    before = dict(memory._holders)
    undo = memory.mark()
    memory.fill(samples(["a", "c"]), 60, 120, {"gpu-1"})
    gpu_0 = ("gpu-1", "GPU-0", "")
    same_key = next(k for k in memory._holders if k == gpu_0) is next(k for k in before if k == gpu_0)
    assert same_key and memory._holders[gpu_0] is before[gpu_0]  # still a's: the objects the mark holds
    assert memory.last_holder("gpu-1", "GPU-1", "") == ("ml", "c")
    undo()
    assert memory.last_holder("gpu-1", "GPU-1", "") == ("ml", "b")
