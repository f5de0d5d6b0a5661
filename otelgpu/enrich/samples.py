"""DCGM rows of a PointBatch as named columns of label codes, ready for the interval join."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np

from otelgpu.receiver.decode import PointBatch
from otelgpu.receiver.interner import Coded, Interner
from otelgpu.receiver.schema import is_dcgm


class Columns(Coded):
    """A dataclass of equal-length numpy columns: select rows, join parts, rewrite the columns of
    interned string codes (`CODES`) after the interner is compacted."""

    def __len__(self) -> int:
        return len(getattr(self, fields(self)[0].name))

    def take(self, idx: np.ndarray):  # noqa: ANN201 - same class
        return type(self)(*(getattr(self, f.name)[idx] for f in fields(self)))

    @classmethod
    def concat(cls, parts: list):  # noqa: ANN206 - same class
        return cls(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls)))


@dataclass
class Samples(Columns):
    CODES: ClassVar[tuple[str, ...]] = ("node", "uuid", "gi", "profile", "model", "namespace", "pod", "container",
                                        "pod_uid", "vgpu")
    metric: np.ndarray  # int16
    time_ns: np.ndarray  # int64
    value: np.ndarray  # float64
    stale: np.ndarray  # bool
    node: np.ndarray  # int32 codes below; -1 where absent
    uuid: np.ndarray
    gi: np.ndarray  # GPU_I_ID
    profile: np.ndarray  # GPU_I_PROFILE
    model: np.ndarray  # modelName
    namespace: np.ndarray
    pod: np.ndarray
    container: np.ndarray
    pod_uid: np.ndarray
    vgpu: np.ndarray

    def plain(self) -> "Samples":
        """These samples, each with its label columns (`IndexedSamples.plain`): themselves."""
        return self

    def with_samples(self, more: "Samples") -> "Samples":
        """These samples, then `more`'s."""
        return Samples.concat([self, more])

    def at(self, name: str, rows: np.ndarray) -> np.ndarray:
        """The label column `name` at `rows` (`IndexedSamples.at`)."""
        return getattr(self, name)[rows]

    @staticmethod
    def empty() -> "Samples":
        ints = np.zeros(0, np.int32)
        return Samples(np.zeros(0, np.int16), np.zeros(0, np.int64), np.zeros(0), np.zeros(0, bool),
                       ints, ints, ints, ints, ints, ints, ints, ints, ints, ints)


LABEL_COLUMN = {name: j for j, name in enumerate(Samples.CODES)}  # each label's column in a table of them
_WIDTH = len(Samples.CODES)


class IndexedSamples:
    """Samples whose ten label columns are read through a table of label combinations (the steps'
    own, `Steps.labels`): each sample holds its combination's row, 4 bytes where the columns took
    40. A label column (`node`, `pod`, ... as `Samples` names them) is gathered where it is read
    and let go by its reader: the interval's computation holds its samples at 23 bytes each (at
    100,000 GPUs a million of them) where it held 59. The table may hold a combination twice, and
    combinations no sample has: whoever groups by labels groups by the codes, not by the rows."""

    __slots__ = ("metric", "time_ns", "value", "stale", "label", "labels", "__weakref__")

    def __init__(self, metric: np.ndarray, time_ns: np.ndarray, value: np.ndarray, stale: np.ndarray,
                 label: np.ndarray, labels: np.ndarray) -> None:
        self.metric, self.time_ns, self.value, self.stale = metric, time_ns, value, stale
        self.label = label  # int32 [n]: row of `labels`
        self.labels = labels  # int32 [k, len(Samples.CODES)]

    def __len__(self) -> int:
        return len(self.time_ns)

    def __getattr__(self, name: str) -> np.ndarray:
        """A label column, gathered from the table."""
        column = LABEL_COLUMN.get(name)
        if column is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return self.labels[self.label, column]

    def at(self, name: str, rows: np.ndarray) -> np.ndarray:
        """The label column `name` at `rows`, gathered for those rows alone (not the whole column)."""
        return self.labels[self.label[rows], LABEL_COLUMN[name]]

    def take(self, idx: np.ndarray) -> "IndexedSamples":
        return IndexedSamples(self.metric[idx], self.time_ns[idx], self.value[idx], self.stale[idx], self.label[idx],
                              self.labels)

    def plain(self) -> Samples:
        """The same samples with every label column of their own."""
        return Samples(self.metric, self.time_ns, self.value, self.stale,
                       **{name: self.labels[self.label, j] for j, name in enumerate(Samples.CODES)})

    def with_samples(self, more: Samples) -> "IndexedSamples":
        """These samples, then `more`'s, whose label combinations are added to the table (a row each)."""
        rows = np.stack([getattr(more, name) for name in Samples.CODES], axis=1).astype(np.int32).reshape(-1, _WIDTH)
        return IndexedSamples(np.concatenate([self.metric, more.metric]), np.concatenate([self.time_ns, more.time_ns]),
                              np.concatenate([self.value, more.value]), np.concatenate([self.stale, more.stale]),
                              np.concatenate([self.label, np.arange(len(more), dtype=np.int32) + len(self.labels)]),
                              np.concatenate([self.labels, rows]))


AnySamples = Samples | IndexedSamples  # what the join reads: the columns by the same names, `plain`, `with_samples`


def _first_present(*cols: np.ndarray) -> np.ndarray:
    out = cols[-1].copy()
    for col in reversed(cols[:-1]):
        out = np.where(col >= 0, col, out)
    return out


_LIFTED = ("Hostname", "hostname", "UUID", "GPU_I_ID", "GPU_I_PROFILE", "modelName", "exported_namespace", "namespace",
           "exported_pod", "pod", "exported_container", "container", "pod_uid", "vgpu")  # the labels dcgm_samples reads


def dcgm_samples(batch: PointBatch, strings: Interner) -> Samples:
    """Select the DCGM rows and lift the labels the join needs into columns.

    The workload's pod arrives as `pod` when the Collector scrapes with honor_labels, or as
    `exported_pod` when it does not; `pod` then names the exporter's own pod (the resource's
    `k8s.pod.name`), which holds no GPU. The node is
    the exporter's `Hostname` (releases) or `hostname` (newer builds), else the resource's
    `k8s.node.name`.
    """
    dcgm = batch.select(is_dcgm(batch.metric))
    lifted = dict(zip(_LIFTED, dcgm.columns([strings.find(key) for key in _LIFTED])))
    col = lifted.__getitem__
    return Samples(
        metric=dcgm.metric, time_ns=dcgm.time_ns, value=dcgm.value, stale=dcgm.stale,
        node=_first_present(col("Hostname"), col("hostname"), dcgm.resource_node),
        uuid=col("UUID"), gi=col("GPU_I_ID"), profile=col("GPU_I_PROFILE"), model=col("modelName"),
        namespace=_first_present(col("exported_namespace"), col("namespace")),
        pod=_first_present(col("exported_pod"), np.where(col("pod") == dcgm.resource_pod, -1, col("pod"))),
        container=_first_present(col("exported_container"), col("container")),
        pod_uid=col("pod_uid"), vgpu=col("vgpu"),
    )
