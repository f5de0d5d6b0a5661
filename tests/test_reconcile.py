"""A past period tied out to the bill (otelgpu/report/reconcile.py), on node-periods built by hand
and bills whose effective rates are known: each node-period scaled to its instance's lines, an
instance replaced inside an hour, a node re-registered on the same instance, a merged period, a
node the bill does not know and an instance no node is, a daily bill under hourly periods; every
figure of the bill is somewhere in the result."""

from __future__ import annotations

import csv
import io
import json
import math
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from costrun import run, scenario
from test_focus import focus_validate

from otelgpu.enrich.window import NS
from otelgpu.report import focus
from otelgpu.report.bill import Bill
from otelgpu.report.reconcile import FREE, NO_PERIOD_OF_NODE, BillPeriodError, reconcile, showback_of, write_csv

if TYPE_CHECKING:
    from promserver import PrometheusServer

pytest_plugins = ["promserver"]  # the `prometheus` fixture

T0 = 1_790_000_000 // 3600 * 3600
HOUR = 3600


def origin(node: str, instance: str, start: float, end: float, held: dict[str, float], idle: float,
           team_used: float = 0.0) -> focus.Origin:
    """A node-period whose charges are `held` (team -> GPU cost held) and `idle`."""
    made = focus.Origin(start, end, "c1", node, {"instance_id": instance, "instance_type": "p5.48xlarge",
                                                 "capacity_type": "on-demand", "idle_policy": "keep"} if instance
                        else {"instance_type": "p5.48xlarge"})
    for team, cost in held.items():
        charge = made.charge("holder", {"team": team, "namespace": team, "pod": f"{team}-0"})
        charge.parts[("gpu", "held")] += cost
        charge.used = team_used * cost
        charge.waste = cost - charge.used
        charge.gpu_seconds = (end - start) * cost / 10.0
    if idle:
        made.charge("idle", {}).parts[("gpu", "idle")] += idle
    made.capacity = sum(held.values()) + idle
    return made


def bill(*rows: tuple[str, float, float, float, float, float]) -> Bill:
    """(instance, start, end, compute, other, billed) per instance-period; list = compute."""
    columns = list(zip(*rows)) if rows else [[]] * 6
    return Bill("cur2", pa.table({
        "instance": pa.array(columns[0], pa.string()), "start": pa.array(columns[1], pa.int64()),
        "end": pa.array(columns[2], pa.int64()), "compute": pa.array(columns[3], pa.float64()),
        "other": pa.array(columns[4], pa.float64()), "billed": pa.array(columns[5], pa.float64()),
        "list": pa.array(columns[3], pa.float64())}),
        unmatched={"Credit": (1, -7.0), "Tax": (2, 3.5)}, lines=len(rows) + 3)


def data(*origins: focus.Origin) -> focus.Dataset:
    return focus.Dataset("request", list(origins), [])


def test_each_node_period_takes_its_instance_lines_in_otelgpus_proportions():
    first = origin("n1", "i-01", T0, T0 + HOUR, {"vision": 60.0, "nlp": 20.0}, idle=18.0, team_used=0.5)
    second = origin("n1", "i-01", T0 + HOUR, T0 + 2 * HOUR, {"vision": 98.0}, idle=0.0)
    dataset = data(first, second)
    # The first hour under a Savings Plan (its effective rate, 58.8), the second on demand less a
    # private pricing discount line (98.0 - 4.9); data transfer beside it.
    result = reconcile(dataset, bill(("i-01", T0, T0 + HOUR, 58.8, 0.02, 0.0),
                                     ("i-01", T0 + HOUR, T0 + 2 * HOUR, 98.0 - 4.9, 0.0, 98.0 - 4.9)),
                       [T0, T0 + HOUR, T0 + 2 * HOUR])
    assert first.effective_cost == pytest.approx(58.8) and first.factor == pytest.approx(0.6)
    assert second.factor == pytest.approx(0.95)
    [tie] = result.nodes
    assert (tie.listed, tie.periods, tie.unbilled_periods) == (196.0, 2, 0)
    assert tie.billed == pytest.approx(58.8 + 93.1) and tie.reconciled == pytest.approx(tie.billed)
    assert tie.other == pytest.approx(0.02) and tie.rate == pytest.approx((58.8 + 93.1) / 196.0)
    assert result.strays == [] and result.outside == 0
    rows = list(focus.rows(dataset, focus.Provider()))
    assert sum(r["EffectiveCost"] for r in rows) == pytest.approx(58.8 + 93.1, abs=1e-9)
    assert sum(r["ListCost"] for r in rows) == pytest.approx(196.0, abs=1e-9)
    assert sum(r["BilledCost"] for r in rows) == pytest.approx(93.1, abs=1e-9)
    vision = next(r for r in rows if r["ChargePeriodStart"] == T0 and r["AllocatedResourceName"] == "vision-0")
    assert vision["EffectiveCost"] == pytest.approx(60.0 * 0.6) and vision["ListCost"] == 60.0
    assert vision["x_UsedCost"] == pytest.approx(30.0 * 0.6) and vision["x_WasteCost"] == pytest.approx(30.0 * 0.6)
    assert {r["AllocatedMethodId"] for r in rows} == {"otelgpu-request-idle-keep-bill"}
    assert {r["x_CostBasis"] for r in rows} == {"bill"} and {r["x_InstanceId"] for r in rows} == {"i-01"}
    shown = showback_of(dataset, ("team",), {}, T0, T0 + 2 * HOUR)
    assert {r.key: r.charged for r in shown.rows} == pytest.approx({("vision",): 36.0 + 93.1, ("nlp",): 12.0})
    assert shown.idle == pytest.approx(18.0 * 0.6) and shown.capacity == pytest.approx(58.8 + 93.1)
    assert abs(shown.gap) < 1e-9


def test_an_instance_replaced_inside_an_hour_and_a_node_re_registered_on_one_instance():
    # i-old ran the first 20 minutes as n1, i-new the last 40 as n2: each bills its part of the hour.
    old = origin("n1", "i-old", T0, T0 + HOUR, {"vision": 32.0}, idle=0.0)
    new = origin("n2", "i-new", T0, T0 + HOUR, {"vision": 40.0}, idle=24.0)
    # i-two was one node under two names in the hour (3:1 by cost): its lines are shared so.
    named = origin("n3", "i-two", T0, T0 + HOUR, {"nlp": 30.0}, idle=0.0)
    renamed = origin("n3b", "i-two", T0, T0 + HOUR, {"nlp": 10.0}, idle=0.0)
    result = reconcile(data(old, new, named, renamed), bill(("i-old", T0, T0 + HOUR, 16.0, 0.0, 16.0),
                                                            ("i-new", T0, T0 + HOUR, 48.0, 0.0, 48.0),
                                                            ("i-two", T0, T0 + HOUR, 20.0, 0.0, 20.0)),
                       [T0, T0 + HOUR])
    assert (old.factor, new.factor) == (pytest.approx(0.5), pytest.approx(0.75))
    assert named.effective_cost == pytest.approx(15.0) and renamed.effective_cost == pytest.approx(5.0)
    assert result.billed == pytest.approx(16.0 + 48.0 + 20.0) and result.reconciled == pytest.approx(result.billed)


def test_a_merged_period_takes_the_lines_of_every_hour_it_spans():
    merged = origin("n1", "i-01", T0, T0 + 3 * HOUR, {"vision": 300.0}, idle=0.0)
    result = reconcile(data(merged), bill(*[("i-01", T0 + k * HOUR, T0 + (k + 1) * HOUR, 50.0, 0.0, 50.0)
                                            for k in range(3)]), [T0 + k * HOUR for k in range(4)])
    assert merged.effective_cost == pytest.approx(150.0) and result.strays == []
    # With one of its hours missing from the bill, the merged period keeps otelgpu's prices and the
    # lines of the other two are listed: two hours of the bill are not the three hours' cost.
    partly = origin("n1", "i-01", T0, T0 + 3 * HOUR, {"vision": 300.0}, idle=0.0)
    result = reconcile(data(partly), bill(*[("i-01", T0 + k * HOUR, T0 + (k + 1) * HOUR, 50.0, 0.0, 50.0)
                                            for k in (0, 2)]), [T0 + k * HOUR for k in range(4)])
    assert partly.effective_cost is None and result.nodes[0].unbilled_periods == 1
    assert [(s.instance_id, s.periods, s.cost) for s in result.strays] == [("i-01", 2, 100.0)]


def test_what_does_not_match_is_listed_and_nothing_is_lost():
    known = origin("n1", "i-01", T0, T0 + HOUR, {"vision": 98.0}, idle=0.0)
    no_id = origin("n2", "", T0, T0 + HOUR, {"nlp": 12.0}, idle=0.0)  # its series carry no instance id
    not_billed = origin("n1", "i-01", T0 + HOUR, T0 + 2 * HOUR, {"vision": 98.0}, idle=0.0)
    the_bill = bill(("i-01", T0, T0 + HOUR, 60.0, 0.0, 60.0),
                    ("i-cpu", T0, T0 + HOUR, 3.0, 0.1, 3.0),  # an instance no node is
                    ("i-01", T0 + 2 * HOUR, T0 + 3 * HOUR, 60.0, 0.0, 60.0),  # an hour its node has no series
                    ("i-01", T0 - HOUR, T0, 60.0, 0.0, 60.0))  # before the period
    dataset = data(known, no_id, not_billed)
    result = reconcile(dataset, the_bill, [T0 + k * HOUR for k in range(4)])
    assert result.outside == 1
    assert [(s.instance_id, s.periods, s.cost, s.reason) for s in result.strays] == [
        ("i-01", 1, 60.0, NO_PERIOD_OF_NODE), ("i-cpu", 1, 3.0, "no node")]
    ties = {t.node: t for t in result.nodes}
    assert (ties["n2"].unbilled_periods, ties["n2"].reconciled) == (1, 12.0)
    assert (ties["n1"].unbilled_periods, ties["n1"].reconciled) == (1, 60.0 + 98.0)
    assert not_billed.effective_cost is None and not_billed.factor == 1.0
    # Every instance-period of the bill: matched, stray or outside the period.
    assert result.billed + sum(s.cost for s in result.strays) + 60.0 == pytest.approx(the_bill.total("compute"))
    assert result.reconciled == pytest.approx(result.billed + result.unbilled)
    out = io.StringIO()
    write_csv(result, out)
    written = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert [r["kind"] for r in written] == ["node", "node", "stray", "stray", "no_instance", "no_instance", "total"]
    total = written[-1]
    assert float(total["bill_cost"]) == pytest.approx(60.0)
    assert float(total["reported_minus_bill"]) == pytest.approx(98.0 + 12.0)  # the unbilled periods, at prices
    assert {r["note"] for r in written if r["kind"] == "no_instance"} == {
        "Credit: lines of no instance, not allocated", "Tax: lines of no instance, not allocated"}
    rows = list(focus.rows(dataset, focus.Provider()))
    assert {r["x_CostBasis"] for r in rows if r["x_InstanceId"] != "i-01" or r["ChargePeriodStart"] != T0} == {"prices"}


def test_an_instance_whose_usage_cost_nothing_keeps_otelgpus_prices_and_is_listed():
    """A Capacity Block's instances: their usage lines cost nothing, the block's upfront fee is a
    line of no instance. Scaling the node to 0 would make its pods' GPUs free: it keeps its prices."""
    block = origin("n1", "i-0cb", T0, T0 + HOUR, {"vision": 31.464}, idle=0.0)
    result = reconcile(data(block), bill(("i-0cb", T0, T0 + HOUR, 0.0, 0.0, 0.0)), [T0, T0 + HOUR])
    assert block.effective_cost is None and result.nodes[0].unbilled_periods == 1
    assert [(s.instance_id, s.reason) for s in result.strays] == [("i-0cb", FREE)]


def test_a_daily_bill_under_hourly_periods_is_refused_and_fits_daily_ones():
    day = 86_400
    start = T0 // day * day
    daily = bill(("i-01", start, start + day, 2000.0, 0.0, 2000.0))
    with pytest.raises(BillPeriodError, match="--granularity day"):
        reconcile(data(origin("n1", "i-01", start, start + HOUR, {"vision": 98.0}, 0.0)), daily,
                  [start + k * HOUR for k in range(25)])
    whole = origin("n1", "i-01", start, start + day, {"vision": 2352.0}, 0.0)
    reconcile(data(whole), daily, [start, start + day])
    assert whole.effective_cost == pytest.approx(2000.0) and math.isclose(whole.factor, 2000.0 / 2352.0)


INSTANCE = "i-0123456789abcdef0"


def cur_bill(path: Path, t0: float) -> None:
    """An AWS CUR 2.0 hour: the node's p4d under a Savings Plan (its effective rate 27.00, and its
    negation), a private pricing discount line on it (-1.35), its data transfer; an m5 that is no
    node; a credit and a tax of no instance."""
    rows = [  # resource, line type, usage type, operation, unblended, SP effective
        (INSTANCE, "SavingsPlanCoveredUsage", "USE1-BoxUsage:p4d.24xlarge", "RunInstances", 32.77, 27.0),
        (INSTANCE, "SavingsPlanNegation", "USE1-BoxUsage:p4d.24xlarge", "RunInstances", -32.77, None),
        (INSTANCE, "EdpDiscount", "USE1-BoxUsage:p4d.24xlarge", "RunInstances", -1.35, None),
        (INSTANCE, "Usage", "USE1-DataTransfer-Regional-Bytes", "InterZone-Out", 0.05, None),
        ("i-0cpu", "Usage", "USE1-BoxUsage:m5.large", "RunInstances", 0.096, None),
        (None, "Credit", None, None, -7.0, None),
        (None, "Tax", None, None, 2.0, None),
    ]
    start = datetime.fromtimestamp(t0, timezone.utc)
    names = ("line_item_resource_id", "line_item_line_item_type", "line_item_usage_type", "line_item_operation",
             "line_item_unblended_cost", "savings_plan_savings_plan_effective_cost")
    table = {name: pa.array([r[k] for r in rows]) for k, name in enumerate(names)}
    table["savings_plan_savings_plan_effective_cost"] = pa.array([r[5] for r in rows], pa.float64())
    table["reservation_effective_cost"] = pa.array([None] * len(rows), pa.float64())
    table["pricing_public_on_demand_cost"] = pa.array([max(r[4], 0.0) for r in rows])
    table["line_item_usage_amount"] = pa.array([1.0] * len(rows))
    table["line_item_usage_start_date"] = pa.array([start] * len(rows), pa.timestamp("ms", "UTC"))
    table["line_item_usage_end_date"] = pa.array([start + timedelta(hours=1)] * len(rows), pa.timestamp("ms", "UTC"))
    pq.write_table(pa.table(table), path)


def focus_bill(path: Path, t0: float) -> None:
    """The same hour as a FOCUS dataset: EffectiveCost is net of the discount."""
    start, end = iso(t0), iso(t0 + HOUR)
    header = ("ResourceId,ChargePeriodStart,ChargePeriodEnd,ChargeCategory,PricingUnit,BilledCost,EffectiveCost,"
              "ListCost,PricingQuantity")
    path.write_text("\n".join([
        header, f"{INSTANCE},{start},{end},Usage,Hours,0,25.65,32.77,1", f"{INSTANCE},{start},{end},Usage,GB,0.05,0.05,0.05,2",
        f"i-0cpu,{start},{end},Usage,Hours,0.096,0.096,0.096,1", f",{start},{end},Credit,,-7.0,-7.0,0,"]) + "\n")


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.slow
def test_the_report_command_ties_a_known_run_out_to_a_cur_and_a_focus_bill(prometheus: PrometheusServer,
                                                                           tmp_path: Path) -> None:
    c = scenario(align_s=HOUR, provider_id=f"aws:///us-east-1a/{INSTANCE}")
    run(c, prometheus.write_url)  # $12 per A100-hour: the node's 4 GPUs cost 48.00 in the hour
    t0 = c.t0 / NS
    cur_bill(tmp_path / "cur.parquet", t0)
    focus_bill(tmp_path / "focus.csv", t0)
    base = [sys.executable, "-m", "otelgpu", "report", "--prometheus", prometheus.url, "--start", iso(t0),
            "--end", iso(t0 + HOUR), "--cluster", "one", "--granularity", "hour"]
    factor = 25.65 / 48.0
    done = subprocess.run([*base, "--bill", str(tmp_path / "cur.parquet"), "--format", "focus-csv", "--output",
                           str(tmp_path / "out.csv"), "--reconciliation", str(tmp_path / "tie.csv")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(io.StringIO((tmp_path / "out.csv").read_text())))
    assert sum(float(r["EffectiveCost"]) for r in rows) == pytest.approx(25.65, abs=1e-6)
    assert sum(float(r["ListCost"]) for r in rows) == pytest.approx(48.0, abs=1e-6)
    assert sum(float(r["BilledCost"]) for r in rows) == pytest.approx(-1.35, abs=1e-6)  # the plan's fee is billed apart
    eval_row = next(r for r in rows if r["AllocatedResourceName"] == "eval")
    assert float(eval_row["EffectiveCost"]) == pytest.approx(5.0 * factor, abs=1e-9)
    assert {r["x_InstanceId"] for r in rows} == {INSTANCE} and {r["x_CostBasis"] for r in rows} == {"bill"}
    elements = [e for r in rows for e in json.loads(r["AllocatedMethodDetails"])["Elements"]]
    assert {(e["x_CostBasis"], round(e["x_BillFactor"], 12)) for e in elements} == {("bill", round(factor, 12))}
    tie = {f"{r['kind']}:{r['instance_id']}": r for r in csv.DictReader(io.StringIO(
        (tmp_path / "tie.csv").read_text())) if r["kind"] != "no_instance"}
    node = tie[f"node:{INSTANCE}"]
    assert (float(node["list_cost"]), float(node["bill_cost"]), float(node["other_cost"])) == pytest.approx(
        (48.0, 25.65, 0.05))
    assert float(tie["stray:i-0cpu"]["bill_cost"]) == pytest.approx(0.096)
    assert float(tie["total:"]["reported_minus_bill"]) == pytest.approx(0.0, abs=1e-9)
    assert "i-0cpu" not in done.stderr and "1 instances' compute in the bill is no node's" in done.stderr
    assert "Credit: 1 lines, -7.000000 USD" in done.stderr
    checked = focus_validate(str(tmp_path / "out.csv"))
    assert checked.returncode == 0, checked.stdout + checked.stderr

    done = subprocess.run([*base, "--bill", str(tmp_path / "focus.csv"), "--by", "team", "--output",
                           str(tmp_path / "teams.csv")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    teams = {r["team"]: float(r["charged"]) for r in csv.DictReader(io.StringIO((tmp_path / "teams.csv").read_text()))}
    assert teams == pytest.approx({"vision": 28.0 * factor, "nlp": 5.0 * factor, "research": 5.0 * factor,
                                   "(idle)": 10.0 * factor, "(total)": 25.65}, abs=1e-9)
    done = subprocess.run([*base, "--bill", str(tmp_path / "focus.csv"), "--format", "html", "--output",
                           str(tmp_path / "teams.html")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "teams.html").read_text()
    assert f"{25.65:,.2f}" in page and "costs tied out to the bill focus.csv" in page  # not the list price's 48.00
