"""The bill reader (otelgpu/report/bill.py): FOCUS and CUR 2.0 lines summed per EC2 instance and
charge period, in batches, against the real FOCUS sample (read again here with the csv module) and
against small bills whose every figure is worked by hand."""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest

from otelgpu.core.catalog import instance_of
from otelgpu.report.bill import NO_PERIOD, bill_format, read_bill

SAMPLE = Path(__file__).parent / "data" / "bill" / "focus_1_0_sample_aws.csv"


def seconds(text: str) -> int:
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).replace(tzinfo=timezone.utc).timestamp())


def reference(path: Path) -> tuple[dict, dict]:
    """The FOCUS file summed row by row with the csv module: per (instance, start, end) the
    hourly and other EffectiveCost, the hourly BilledCost and ListCost, the hours of hourly usage; per ChargeCategory of the rows of no
    instance, (rows, EffectiveCost)."""
    def number(value: str) -> float:
        return 0.0 if value in ("", "NULL") else float(value)

    sums: dict = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0, 0.0])
    unmatched: dict = defaultdict(lambda: [0, 0.0])
    with open(path, newline="") as file:
        for row in csv.DictReader(file):
            instance = instance_of(row["ResourceId"]) if row["ResourceId"] != "NULL" else None
            effective = number(row["EffectiveCost"])
            if instance is None:
                unmatched[row["ChargeCategory"]][0] += 1
                unmatched[row["ChargeCategory"]][1] += effective
                continue
            key = (instance, seconds(row["ChargePeriodStart"]), seconds(row["ChargePeriodEnd"]))
            hourly = row["PricingUnit"].lower() == "hours" or row["ChargeCategory"] == "Credit"
            sums[key][0 if hourly else 1] += effective
            if hourly:
                sums[key][2] += number(row["BilledCost"])
                sums[key][3] += number(row["ListCost"])
                sums[key][4] += number(row["PricingQuantity"]) if row["ChargeCategory"] == "Usage" else 0.0
    return dict(sums), {k: tuple(v) for k, v in unmatched.items()}


def summed(bill) -> dict:  # noqa: ANN001
    return {(r["instance"], r["start"], r["end"]): [r["compute"], r["other"], r["billed"], r["list"], r["hours"]]
            for r in bill.instances.to_pylist()}


def close(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(
        all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12) for a, b in zip(got[k], want[k])) for k in want)


def test_the_real_focus_sample_is_read_as_the_file_says() -> None:
    bill = read_bill(SAMPLE)
    want, unmatched = reference(SAMPLE)
    assert bill.format == "focus" and bill.lines == 340 and len(want) > 250
    assert close(summed(bill), want)
    assert bill.unmatched.keys() == unmatched.keys()
    for category, (lines, cost) in unmatched.items():
        assert bill.unmatched[category][0] == lines and math.isclose(bill.unmatched[category][1], cost, abs_tol=1e-9)
    with open(SAMPLE, newline="") as file:
        of_instances = sum(1 for row in csv.DictReader(file) if instance_of(row["ResourceId"]))
    assert sum(lines for lines, _ in bill.unmatched.values()) + of_instances == bill.lines  # every line is somewhere


def test_small_batches_merged_often_give_the_sums_of_one_batch() -> None:
    whole, streamed = read_bill(SAMPLE), read_bill(SAMPLE, batch_rows=7, regroup_rows=16)
    assert close(summed(streamed), summed(whole))
    assert close({k: list(v) for k, v in streamed.unmatched.items()}, {k: list(v) for k, v in whole.unmatched.items()})


def test_an_instance_id_is_a_bare_id_or_the_end_of_an_arn_never_a_name_that_ends_in_one() -> None:
    assert instance_of("aws:///us-east-1a/i-0abc123def4567890") == "i-0abc123def4567890"
    assert instance_of("arn:aws:ec2:us-east-1:123456789012:instance/i-0abc") == "i-0abc"
    assert instance_of("i-0abc") == "i-0abc"
    assert instance_of("arn:aws:sqs:us-west-2:347410479675:queue-i-032l64f2065481b12") is None
    assert instance_of("vol-0abc") is None and instance_of("") is None


FOCUS_HEADER = ["ResourceId", "ChargePeriodStart", "ChargePeriodEnd", "ChargeCategory", "PricingCategory",
                "CommitmentDiscountStatus", "PricingUnit", "BilledCost", "EffectiveCost", "ListCost", "PricingQuantity",
                "ChargeDescription"]
SP = "arn:aws:savingsplans::111122223333:savingsplan/sp-1"
HOUR = ("2026-10-01T05:00:00Z", "2026-10-01T06:00:00Z")
FOCUS_ROWS = [
    # A p5.48xlarge hour, 80 % under a Compute Savings Plan (its effective rate) and 20 % on demand.
    ["i-0p5", *HOUR, "Usage", "Committed", "Used", "Hours", 0.0, 44.0, 78.656, 0.8,
     "$98.32 per On Demand Linux p5.48xlarge Instance Hour"],
    ["i-0p5", *HOUR, "Usage", "Standard", "", "Hours", 19.664, 19.664, 19.664, 0.2,
     "$98.32 per On Demand Linux p5.48xlarge Instance Hour"],
    # Its data transfer: the instance's, not its compute.
    ["i-0p5", *HOUR, "Usage", "Standard", "", "GB", 0.09, 0.09, 0.09, 4.5, "$0.02 per GB - regional data transfer"],
    # A spot g5.xlarge named by its ARN.
    ["arn:aws:ec2:us-east-1:111122223333:instance/i-0g5", *HOUR, "Usage", "Dynamic", "", "Hours", 0.42, 0.42, 1.006,
     1.0, "$0.42 per Spot Linux g5.xlarge Instance Hour"],
    # The plan's purchase (prepays the covered usage: no effective cost) and its unused part.
    [SP, *HOUR, "Purchase", "", "", "Hours", 50.0, 0.0, 50.0, 1.0, ""],
    [SP, *HOUR, "Usage", "Committed", "Unused", "Hours", 0.0, 6.0, 0.0, 1.0, ""],
    # A credit and tax, of no instance.
    ["", *HOUR, "Credit", "", "", "", -10.0, -10.0, 0.0, "", ""],
    # A credit applied to the g5: part of its compute.
    ["i-0g5", *HOUR, "Credit", "", "", "", -0.1, -0.1, 0.0, "", "Service credit"],
    # An instance's line without its period (FOCUS forbids it): counted, not guessed at.
    ["i-0p5", "", "", "Usage", "Standard", "", "Hours", 1.25, 1.25, 1.25, 1.0, ""],
    ["", *HOUR, "Tax", "", "", "", 3.5, 3.5, 0.0, "", ""],
]
START, END = seconds(HOUR[0]), seconds(HOUR[1])
FOCUS_WANT = {("i-0g5", START, END): [0.42 - 0.1, 0.0, 0.42 - 0.1, 1.006, 1.0],
              ("i-0p5", START, END): [44.0 + 19.664, 0.09, 19.664, 78.656 + 19.664, 1.0]}
FOCUS_UNMATCHED = {"Purchase": (1, 0.0), "Usage": (1, 6.0), "Credit": (1, -10.0), "Tax": (1, 3.5), NO_PERIOD: (1, 1.25)}


def focus_table() -> pa.Table:
    columns = list(zip(*FOCUS_ROWS))
    return pa.table({name: pa.array([v if v != "" else None for v in values])
                     for name, values in zip(FOCUS_HEADER, columns)})


@pytest.mark.parametrize("written", ["csv", "csv.gz", "parquet", "directory"])
def test_a_focus_bill_worked_by_hand(tmp_path: Path, written: str) -> None:
    table = focus_table()
    if written.startswith("csv"):
        path = tmp_path / f"bill.{written}"
        with pa.output_stream(path, compression="detect") as out:
            pa_csv.write_csv(table, out)
    else:
        path = tmp_path / ("parts" if written == "directory" else "bill.parquet")
        if written == "directory":
            path.mkdir()
            pq.write_table(table.slice(0, 3), path / "part-0.parquet")
            pq.write_table(table.slice(3), path / "part-1.parquet")
        else:
            pq.write_table(table, path)
    bill = read_bill(path, batch_rows=2, regroup_rows=1)
    assert close(summed(bill), FOCUS_WANT)
    assert bill.kinds == {"i-0p5": ("p5.48xlarge", "on-demand"), "i-0g5": ("g5.xlarge", "spot")}
    assert {k: (n, round(c, 9)) for k, (n, c) in bill.unmatched.items()} == FOCUS_UNMATCHED
    # Everything the bill charged is here: the instances' effective cost and the lines of none.
    assert math.isclose(bill.total("compute") + bill.total("other") + sum(c for _, c in bill.unmatched.values()),
                        sum(r[8] for r in FOCUS_ROWS))


def cur_table() -> pa.Table:
    hour = (datetime(2026, 10, 1, 5, tzinfo=timezone.utc), datetime(2026, 10, 1, 6, tzinfo=timezone.utc))
    rows = [
        # (resource, type, usage type, operation, unblended, SP effective, RI effective, on demand, amount)
        ("i-0p5", "Usage", "USE1-BoxUsage:p5.48xlarge", "RunInstances", 98.32, None, None, 98.32, 1.0),
        ("i-0p4", "SavingsPlanCoveredUsage", "USE1-BoxUsage:p4d.24xlarge", "RunInstances", 32.77, 21.3, None, 32.77,
         1.0),
        ("i-0p4", "SavingsPlanNegation", "USE1-BoxUsage:p4d.24xlarge", "RunInstances", -32.77, None, None, 0.0, 1.0),
        ("i-0g5", "DiscountedUsage", "USE1-BoxUsage:g5.12xlarge", "RunInstances", 0.0, None, 3.4, 5.672, 1.0),
        ("i-0g4", "Usage", "USE1-SpotUsage:g4dn.xlarge", "RunInstances:SV001", 0.19, None, None, 0.526, 0.5),
        ("i-0p5", "Usage", "USE1-DataTransfer-Regional-Bytes", "InterZone-Out", 0.05, None, None, 0.05, 2.5),
        # Split cost allocation: the p5's cost again, per pod; left out.
        ("arn:aws:eks:us-east-1:111122223333:pod/gpu/train/abc", "Usage", "USE1-BoxUsage:p5.48xlarge", "EKSPod-EC2",
         49.16, None, None, 49.16, 0.5),
        ("", "RIFee", "USE1-HeavyUsage:g5.12xlarge", "RunInstances", 1.2, None, None, 0.0, 720.0),
        ("", "SavingsPlanRecurringFee", "ComputeSP:1yrNoUpfront", "", 2.5, None, None, 0.0, 1.0),
        ("", "Credit", "", "", -7.0, None, None, 0.0, 0.0),
        ("i-0g4", "Credit", "", "", -0.04, None, None, 0.0, 0.0),  # a credit applied to the g4dn: its compute's
    ]
    names = ["line_item_resource_id", "line_item_line_item_type", "line_item_usage_type", "line_item_operation",
             "line_item_unblended_cost", "savings_plan_savings_plan_effective_cost", "reservation_effective_cost",
             "pricing_public_on_demand_cost", "line_item_usage_amount"]
    columns = {name: pa.array([r[i] or None if isinstance(r[i], str) else r[i] for r in rows])
               for i, name in enumerate(names)}
    return pa.table({**columns,
                     "line_item_usage_start_date": pa.array([hour[0]] * len(rows), pa.timestamp("ms", "UTC")),
                     "line_item_usage_end_date": pa.array([hour[1]] * len(rows), pa.timestamp("ms", "UTC")),
                     "product": pa.array([[("instance_type_family", "p5")]] * len(rows),
                                         pa.map_(pa.string(), pa.string()))})


def test_a_cur_2_0_bill_worked_by_hand(tmp_path: Path) -> None:
    pq.write_table(cur_table(), tmp_path / "cur.parquet")
    bill = read_bill(tmp_path / "cur.parquet", batch_rows=3, regroup_rows=2)
    start, end = START, END
    assert bill.format == "cur2" and bill.lines == 11 and bill.split_lines == 1
    assert close(summed(bill), {
        ("i-0g4", start, end): [0.19 - 0.04, 0.0, 0.19 - 0.04, 0.526, 0.5],  # spot, half an hour, less a credit
        ("i-0g5", start, end): [3.4, 0.0, 0.0, 5.672, 1.0],  # a Reserved Instance's amortised rate
        ("i-0p4", start, end): [21.3, 0.0, 0.0, 32.77, 1.0],  # the plan's effective rate; its negation nothing
        ("i-0p5", start, end): [98.32, 0.05, 98.32, 98.32, 1.0],  # on demand, and its data transfer apart
    })
    assert bill.kinds == {"i-0p5": ("p5.48xlarge", "on-demand"), "i-0p4": ("p4d.24xlarge", "on-demand"),
                          "i-0g5": ("g5.12xlarge", "on-demand"), "i-0g4": ("g4dn.xlarge", "spot")}
    assert {k: (n, round(c, 9)) for k, (n, c) in bill.unmatched.items()} == {
        "RIFee": (1, 1.2), "SavingsPlanRecurringFee": (1, 2.5), "Credit": (1, -7.0)}


def test_a_file_that_is_no_bill_is_refused_naming_what_it_lacks(tmp_path: Path) -> None:
    assert bill_format(list(FOCUS_HEADER) + ["x"]) == "focus"
    (tmp_path / "prices.csv").write_text("instance_type,price\np5.48xlarge,98.32\n")
    with pytest.raises(ValueError, match="neither a FOCUS dataset .*EffectiveCost.* nor a CUR 2.0 one"):
        read_bill(tmp_path / "prices.csv")


@pytest.mark.parametrize("broken", ["cost", "time", "truncated"])
def test_a_bill_that_cannot_be_read_whole_is_refused_naming_the_file(tmp_path: Path, broken: str) -> None:
    """Summing the lines that parse would leave the rest out of a tie-out: the file is refused."""
    table = focus_table()
    if broken == "truncated":
        path = tmp_path / "bill.parquet"
        pq.write_table(table, path)
        path.write_bytes(path.read_bytes()[:-100])
    else:
        path = tmp_path / "bill.csv"
        pa_csv.write_csv(table, path)
        lines = path.read_text().splitlines()
        damaged = lines[1].replace('"2026-10-01T05:00:00Z"', '"yesterday"', 1) if broken == "time" else \
            lines[1].replace(",44,", ",forty-four,", 1)
        assert damaged != lines[1]
        path.write_text("\n".join([lines[0], damaged, *lines[2:]]) + "\n")
    with pytest.raises(ValueError, match=f"{path.name}: not read as a bill"):
        read_bill(path)
