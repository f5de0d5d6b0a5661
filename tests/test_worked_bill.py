"""The worked examples of docs/cost-model.md section 13, figure by figure: the hour's bill as an
AWS CUR 2.0 export and as a FOCUS dataset (tests/data/bill/worked_hour_*.csv) read to the same
instance costs, and the hour run through a real otelgpu into a real Prometheus, then tied out to
that bill by `otelgpu report --bill`: a p5.48xlarge under a Compute Savings Plan with a private
pricing discount, cut into MIG slices; a p4d.24xlarge under a Reserved Instance; a spot g5.2xlarge
shared by time-slicing; a p5.48xlarge replaced inside the hour; an m5 that is no GPU node; the
plan's and the reservation's fees, a credit and tax."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from cluster import Cluster, Node, Pod, Unit
from support import feed

from otelgpu.config import parse_config
from otelgpu.enrich.window import NS
from otelgpu.pipeline import Pipeline
from otelgpu.report import focus
from otelgpu.report.bill import read_bill
from otelgpu.report.reconcile import reconcile

if TYPE_CHECKING:
    from promserver import PrometheusServer

pytest_plugins = ["promserver"]  # the `prometheus` fixture
BILLS = Path(__file__).parent / "data" / "bill"
HOUR = ("2026-11-02T10:00:00Z", "2026-11-02T11:00:00Z")
H100, A100, A10G = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "NVIDIA A10G"
P5, P4D, G5 = "i-0f3a9c5e2b1d40871", "i-07b2e4d1c9a3f6052", "i-0c8d1e7f3a2b59604"
OLD, NEW, M5 = "i-0d4e5f6a7b8c9d0e1", "i-0e1f2a3b4c5d6e7f8", "i-0123abc456def7890"

# The doc's figures, worked by hand (USD for the hour).
BILLED = {P5: 38.528 - 1.9264, P4D: 13.174585, G5: 0.4848, OLD: 18.346667 - 0.917333, NEW: 32.106667 - 1.605333,
          M5: 0.192}
GPU_P5, GPU_G5 = 55.04 / 8, 1.212  # gpu_only: the catalog's instance price over its GPUs
FACTOR = {P5: BILLED[P5] / 55.04, P4D: BILLED[P4D] / 21.957642, G5: BILLED[G5] / 1.212}
REPORTED = {  # pod (or idle per node) -> (list cost, cost on the bill)
    "train": (4 * GPU_P5, 4 * GPU_P5 * FACTOR[P5]),
    "embed-0": (GPU_P5 / 7, GPU_P5 / 7 * FACTOR[P5]),  # a 1g.10gb slice: 1 of an H100's 7
    "embed-1": (GPU_P5 / 7, GPU_P5 / 7 * FACTOR[P5]),
    "embed-2": (GPU_P5 / 7, GPU_P5 / 7 * FACTOR[P5]),
    ("idle", P5): (3 * GPU_P5 + 4 * GPU_P5 / 7, (3 * GPU_P5 + 4 * GPU_P5 / 7) * FACTOR[P5]),
    "pretrain": (21.957642, BILLED[P4D]),
    "chat-a": (GPU_G5 / 4, GPU_G5 / 4 * FACTOR[G5]),  # one of four time-slicing replicas
    "chat-b": (GPU_G5 / 4, GPU_G5 / 4 * FACTOR[G5]),
    ("idle", G5): (GPU_G5 / 2, GPU_G5 / 2 * FACTOR[G5]),
}


@pytest.mark.parametrize("name", ["worked_hour_cur2.csv", "worked_hour_focus.csv"])
def test_the_worked_bill_reads_to_the_figures_worked_by_hand(name: str) -> None:
    bill = read_bill(BILLS / name)
    assert {r["instance"]: r["compute"] for r in bill.instances.to_pylist()} == pytest.approx(BILLED, abs=1e-9)
    assert {r["instance"]: r["other"] for r in bill.instances.to_pylist() if r["other"]} == pytest.approx({P5: 0.45})
    fees = {"SavingsPlanRecurringFee": (1, 0.0), "RIFee": (1, 0.0)} if bill.format == "cur2" else {"Purchase": (2, 0.0)}
    assert bill.unmatched == {**fees, "Credit": (1, -25.0), "Tax": (1, pytest.approx(4.1))}
    assert bill.kinds[G5] == ("g5.2xlarge", "spot") and bill.kinds[P4D] == ("p4d.24xlarge", "on-demand")


def test_the_instance_replaced_inside_the_hour_is_two_partial_hours() -> None:
    """i-0d4e... ran the first 20 minutes, i-0e1f... the last 35: each node's 20 or 35 minutes at
    the catalog's price take their own instance's lines, 95 % of it (the private pricing discount)."""
    start, end = (datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp() for t in HOUR)
    old = focus.Origin(start, end, "c", "ip-10-0-4-40", {"instance_id": OLD})
    new = focus.Origin(start, end, "c", "ip-10-0-4-41", {"instance_id": NEW})
    for origin, minutes in ((old, 20), (new, 35)):
        origin.charge("holder", {"pod": "train-2"}).parts[("gpu", "held")] += 55.04 * minutes / 60
        origin.capacity = 55.04 * minutes / 60
    result = reconcile(focus.Dataset("request", [old, new], []), read_bill(BILLS / "worked_hour_cur2.csv"), [start, end])
    assert old.factor == pytest.approx(0.95, abs=1e-6) and new.factor == pytest.approx(0.95, abs=1e-6)
    assert {s.instance_id for s in result.strays} == {P5, P4D, G5, M5}  # no node of this dataset is them


def worked_cluster(t0_ns: int) -> Cluster:
    mig = [Unit("GPU-p5-0", H100, "1g.10gb", str(gi)) for gi in range(7, 14)]
    nodes = [
        Node("ip-10-0-1-10.ec2.internal", "p5.48xlarge", 192, 2048,
             {"nvidia.com/gpu.count": "8", "nvidia.com/mig.strategy": "mixed", "eks.amazonaws.com/capacityType":
              "ON_DEMAND"}, [*mig, *(Unit(f"GPU-p5-{i}", H100) for i in range(1, 8))],
             provider_id=f"aws:///us-east-1a/{P5}"),
        Node("ip-10-0-2-20.ec2.internal", "p4d.24xlarge", 96, 1152,
             {"nvidia.com/gpu.count": "8", "eks.amazonaws.com/capacityType": "ON_DEMAND"},
             [Unit(f"GPU-p4-{i}", A100) for i in range(8)], provider_id=f"aws:///us-east-1b/{P4D}"),
        Node("ip-10-0-3-30.ec2.internal", "g5.2xlarge", 8, 32,
             {"nvidia.com/gpu.count": "1", "nvidia.com/gpu.replicas": "4", "nvidia.com/gpu.sharing-strategy":
              "time-slicing", "karpenter.sh/capacity-type": "spot"}, [Unit("GPU-g5", A10G)],
             provider_id=f"aws:///us-east-1c/{G5}"),
    ]
    p5, p4d, g5 = (n.name for n in nodes)
    slice_ = ("nvidia_com_mig_1g_10gb", 1)
    pods = [Pod("ml", "train", p5, {"team": "research"}, gpu=("nvidia_com_gpu", 4),
                holds=tuple(f"GPU-p5-{i}" for i in range(1, 5)), activity=0.8),
            *(Pod("search", f"embed-{k}", p5, {"team": "search"}, gpu=slice_, holds=(f"GPU-p5-0/{7 + k}",))
              for k in range(3)),
            Pod("ml", "pretrain", p4d, {"team": "research"}, gpu=("nvidia_com_gpu", 8),
                holds=tuple(f"GPU-p4-{i}" for i in range(8))),
            *(Pod("apps", f"chat-{k}", g5, {"team": "apps"}, gpu=("nvidia_com_gpu", 1), holds=("GPU-g5",))
              for k in "ab")]
    return Cluster(nodes, pods, t0=t0_ns)


def shifted(path: Path, out: Path, start: str, end: str) -> Path:
    """The bill with its hour moved to the run's."""
    text = path.read_text().replace(HOUR[0], start).replace(HOUR[1], end)
    out.write_text(text)
    return out


@pytest.mark.slow
def test_the_worked_hour_tied_out_to_its_bill_on_a_real_run(prometheus: PrometheusServer, tmp_path: Path) -> None:
    t0 = (int(datetime.now(timezone.utc).timestamp()) // 3600 - 1) * 3600
    config = parse_config({
        "cluster": {"name": "one"}, "receiver": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": {"enabled": False}},
        "attribution": {"interval_seconds": 300, "lateness_seconds": 30, "cost_models": ["request"],
                        "prices": {"instance_price_split": "gpu_only"}},
        "exporter": {"prometheus": {"enabled": False},
                     "remote_write": {"url": prometheus.write_url, "timeout_seconds": 5,
                                      "delivery": {"backoff_initial_seconds": 0.05, "shutdown_timeout_seconds": 20}}}})
    pipeline = Pipeline(config, serve_receivers=False, keep_ended=True)
    feed(pipeline, *worked_cluster(t0 * NS).scrapes(60, 3600))
    pipeline.shutdown()

    def iso(t: float) -> str:
        return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

    for name in ("worked_hour_cur2.csv", "worked_hour_focus.csv"):
        bill = shifted(BILLS / name, tmp_path / name, iso(t0), iso(t0 + 3600))
        done = subprocess.run([sys.executable, "-m", "otelgpu", "report", "--prometheus", prometheus.url, "--start",
                               iso(t0), "--end", iso(t0 + 3600), "--cluster", "one", "--granularity", "hour",
                               "--bill", str(bill), "--format", "focus-csv", "--output", str(tmp_path / "out.csv"),
                               "--reconciliation", str(tmp_path / "tie.csv")], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        rows = list(csv.DictReader(io.StringIO((tmp_path / "out.csv").read_text())))
        got = {}
        for r in rows:
            key = r["AllocatedResourceName"] or (r["x_AllocationKind"], r["x_InstanceId"])
            got[key] = (float(r["ListCost"]), float(r["EffectiveCost"]))
        assert got.keys() == REPORTED.keys(), name
        for key, (listed, billed) in REPORTED.items():
            assert got[key] == (pytest.approx(listed, abs=1e-6), pytest.approx(billed, abs=1e-6)), (name, key)
        tie = list(csv.DictReader(io.StringIO((tmp_path / "tie.csv").read_text())))
        strays = {r["instance_id"]: float(r["bill_cost"]) for r in tie if r["kind"] == "stray"}
        assert strays == pytest.approx({OLD: BILLED[OLD], NEW: BILLED[NEW], M5: BILLED[M5]}, abs=1e-9)
        (total,) = [r for r in tie if r["kind"] == "total"]
        assert float(total["bill_cost"]) == pytest.approx(BILLED[P5] + BILLED[P4D] + BILLED[G5], abs=1e-9)
        assert float(total["reported_minus_bill"]) == pytest.approx(0.0, abs=1e-9)
