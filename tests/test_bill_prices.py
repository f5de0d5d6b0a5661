"""`otelgpu prices --from-bill`: the effective rates of a bill worked by hand, as a price file the
sidecar takes; the configuration's other prices kept; and a running pipeline pricing its node at
the bill's rate from the interval after the file changes, as live showback between closes."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from cluster import Cluster, Node, Pod, Unit
from support import feed, make_config, offline_pipeline

from otelgpu.attribution.config import PricesConfig, load_prices_file
from otelgpu.attribution.prices import Pricer
from otelgpu.report.bill import read_bill
from otelgpu.report.billprices import bill_rates, price_file, shadowed, write_price_file
from otelgpu.telemetry import total

START = datetime(2026, 10, 1, 5, tzinfo=timezone.utc)
A100 = "NVIDIA A100-SXM4-40GB"


def cur(path: Path, rows: list[tuple]) -> Path:
    """(hour, resource, line type, usage type, unblended, SP effective, RI effective, usage amount)."""
    names = ("hour", "line_item_resource_id", "line_item_line_item_type", "line_item_usage_type",
             "line_item_unblended_cost", "savings_plan_savings_plan_effective_cost", "reservation_effective_cost",
             "line_item_usage_amount")
    columns = {name: [r[k] for r in rows] for k, name in enumerate(names)}
    hours = columns.pop("hour")
    table = {name: pa.array(values, pa.float64() if "cost" in name or "amount" in name else pa.string())
             for name, values in columns.items()}
    table["line_item_operation"] = pa.array(["RunInstances"] * len(rows))
    table["pricing_public_on_demand_cost"] = pa.array([0.0] * len(rows))
    table["line_item_usage_start_date"] = pa.array([START + timedelta(hours=h) for h in hours], pa.timestamp("s", "UTC"))
    table["line_item_usage_end_date"] = pa.array([START + timedelta(hours=h + 1) for h in hours],
                                                 pa.timestamp("s", "UTC"))
    pq.write_table(pa.table(table), path)
    return path


BILL = [
    # A p4d under a Compute Savings Plan two hours (21.30 an hour), and an EDP discount on the second.
    (0, "i-0p4a", "SavingsPlanCoveredUsage", "USE1-BoxUsage:p4d.24xlarge", 32.77, 21.3, None, 1.0),
    (0, "i-0p4a", "SavingsPlanNegation", "USE1-BoxUsage:p4d.24xlarge", -32.77, None, None, 1.0),
    (1, "i-0p4a", "SavingsPlanCoveredUsage", "USE1-BoxUsage:p4d.24xlarge", 32.77, 21.3, None, 1.0),
    (1, "i-0p4a", "EdpDiscount", "USE1-BoxUsage:p4d.24xlarge", -1.0, None, None, 0.0),
    # Another p4d on demand for half an hour: the type's rate is the mean over its 2.5 hours.
    (1, "i-0p4b", "Usage", "USE1-BoxUsage:p4d.24xlarge", 16.385, None, None, 0.5),
    # Spot g5s and a p5 capacity block (reserved).
    (0, "i-0g5", "Usage", "USE1-SpotUsage:g5.xlarge", 0.42, None, None, 1.0),
    (0, "i-0p5", "Usage", "USE1-CapacityBlock:p5.48xlarge", 31.464, None, None, 1.0),
    # An RI-covered g5.12xlarge (amortised 3.40) and a line of an unknown type.
    (0, "i-0g512", "DiscountedUsage", "USE1-BoxUsage:g5.12xlarge", 0.0, None, 3.4, 1.0),
    (0, "i-0odd", "Usage", "USE1-BoxUsage", 1.0, None, None, 1.0),
    (0, None, "Credit", None, -7.0, None, None, 0.0),
    # A Capacity Block's instance: its usage costs nothing (the block's upfront fee is elsewhere).
    (0, "i-0cb", "Usage", "USE1-CapacityBlock:p5.48xlarge", 0.0, None, None, 1.0),
]


def test_the_rates_of_a_bill_worked_by_hand(tmp_path: Path) -> None:
    rates = bill_rates(read_bill(cur(tmp_path / "cur.parquet", BILL)))
    got = {(r.instance_type, r.capacity_type): (round(r.per_hour, 9), r.hours, r.instances) for r in rates.rates}
    assert got == {("p4d.24xlarge", "on-demand"): (round((21.3 + 21.3 - 1.0 + 16.385) / 2.5, 9), 2.5, 2),
                   ("g5.12xlarge", "on-demand"): (3.4, 1.0, 1), ("g5.xlarge", "spot"): (0.42, 1.0, 1),
                   ("p5.48xlarge", "reserved"): (31.464, 1.0, 1)}
    assert rates.instances["i-0p4a"] == pytest.approx((21.3 * 2 - 1.0) / 2) and rates.instances["i-0p4b"] == 32.77
    assert rates.unknown == {"i-0odd": 1.0} and rates.free == {"i-0cb": 1.0}  # no rate of 0 for a Capacity Block
    only_second = bill_rates(read_bill(tmp_path / "cur.parquet"), START.timestamp() + 3600)
    assert {r.instance_type for r in only_second.rates} == {"p4d.24xlarge"}


def test_the_file_keeps_the_configurations_other_prices_and_the_sidecar_takes_it(tmp_path: Path) -> None:
    rates = bill_rates(read_bill(cur(tmp_path / "cur.parquet", BILL)))
    base = PricesConfig(instance_hour_by_instance_type={"p4d.24xlarge": 30.0, "g6.xlarge": 0.8},
                        capacity_types={"spot": {"discount": 0.6}, "on_demand": {"discount": 0.1}})
    path = tmp_path / "prices.yaml"
    write_price_file(path, price_file(rates, base, per_instance=True), "from a bill\n\nsecond paragraph")
    loaded = load_prices_file(path, PricesConfig())
    assert loaded.instance_hour_by_instance_type == {"g5.12xlarge": 3.4, "g6.xlarge": 0.8,
                                                     "p4d.24xlarge": round((21.3 * 2 - 1.0 + 16.385) / 2.5, 6)}
    assert loaded.capacity_types.spot.discount == 0.6 and loaded.capacity_types.on_demand.discount == 0.1
    assert loaded.capacity_types.spot.instance_hour_by_instance_type == {"g5.xlarge": 0.42}
    assert loaded.capacity_types.reserved.instance_hour_by_instance_type == {"p5.48xlarge": 31.464}
    assert loaded.instance_hour_by_instance_id["i-0p4b"] == 32.77
    pricer = Pricer(loaded)
    assert pricer.node_price("p5.48xlarge", (), "reserved", 8).instance_hour == 31.464
    # An on-demand node's instance price is the bill's rate less the configured discount: a Savings
    # Plan's discount is in the rate already, and the file keeps what the configuration says.
    assert pricer.node_price("g5.12xlarge", (), "on-demand", 4).instance_hour == pytest.approx(3.4 * 0.9)
    assert path.read_text().startswith("# from a bill\n#\n# second paragraph\n")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no scratch file left


def test_a_file_the_sidecar_would_refuse_is_never_written(tmp_path: Path) -> None:
    path = tmp_path / "prices.yaml"
    path.write_text("instance_hour_by_instance_type: {p4d.24xlarge: 20.0}\n")
    with pytest.raises(Exception, match="prices must be >= 0"):
        write_price_file(path, {"instance_hour_by_instance_type": {"p4d.24xlarge": -1.0}}, "bad")
    assert path.read_text() == "instance_hour_by_instance_type: {p4d.24xlarge: 20.0}\n"  # the old one, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prices.yaml"]


def test_per_gpu_prices_that_would_hide_a_bill_rate_are_named(tmp_path: Path) -> None:
    rates = bill_rates(read_bill(cur(tmp_path / "cur.parquet", BILL)))
    base = PricesConfig(gpu_hour_by_gpu_model={A100: 4.0}, capacity_types={"spot": {"gpu_hour_by_instance_type":
                                                                                   {"g5.xlarge": 0.1}}})
    assert shadowed(rates, base) == ["p4d.24xlarge (on-demand)", "g5.xlarge (spot)"]


def test_a_running_sidecar_prices_its_node_at_the_bills_rate_once_the_file_changes(tmp_path: Path) -> None:
    """The node is priced from the configuration, then `otelgpu prices` writes the bill's rate for
    its own instance; the intervals that close after it take it, those before keep theirs."""
    instance = "i-0abcdef0123456789"
    prices = tmp_path / "prices.yaml"
    prices.write_text("instance_hour_by_instance_type: {p4d.24xlarge: 24.0}\n")
    node = Node("gpu-1", "p4d.24xlarge", 96, 1152, units=[Unit(f"GPU-{i}", A100) for i in range(8)],
                capacity={"nvidia_com_gpu": 8}, provider_id=f"aws:///us-east-1a/{instance}")
    cluster = Cluster([node], [Pod("ml", "train", "gpu-1", {"team": "vision"}, gpu=("nvidia_com_gpu", 8),
                                   holds=tuple(f"GPU-{i}" for i in range(8)))])
    pipeline = offline_pipeline(make_config(attribution__interval_seconds=300, attribution__cost_models=["scad"],
                                            attribution__prices__file=str(prices)))
    feed(pipeline, *cluster.scrapes(60, 900))
    before = pipeline.store.totals("capacity", ("instance_id",), {"cost_model": "scad"})
    closed = total(pipeline.metrics.intervals_computed)
    assert before == {(instance,): pytest.approx(24.0 * closed * 300 / 3600)}  # the intervals closed so far
    bill = cur(tmp_path / "cur.parquet", [(0, instance, "SavingsPlanCoveredUsage", "USE1-BoxUsage:p4d.24xlarge",
                                           32.77, 12.6, None, 1.0)])
    done = subprocess.run([sys.executable, "-m", "otelgpu", "prices", "--from-bill", str(bill), "--output", str(prices),
                           "--per-instance"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(prices.read_text())["instance_hour_by_instance_id"] == {instance: 12.6}
    feed(pipeline, *cluster.scrapes(60, 1800 + 60, from_s=900))
    pipeline.close_due(flush=True)
    after = sum(pipeline.store.totals("capacity", ("instance_id",), {"cost_model": "scad"}).values())
    later = total(pipeline.metrics.intervals_computed) - closed
    assert later >= 3 and after == pytest.approx(24.0 * closed * 300 / 3600 + 12.6 * later * 300 / 3600)
    sources = pipeline.store.totals("capacity", ("price_source",), {"cost_model": "scad"})
    assert set(sources) == {("config:scad",), ("config:instance_id:scad",)}
