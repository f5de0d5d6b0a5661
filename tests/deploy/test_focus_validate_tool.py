"""tools/focus-validate, the FOCUS dataset checker the FOCUS exporter's tests use: a valid FOCUS 1.3
file passes as CSV and as Parquet; a missing mandatory column, a malformed AllocatedMethodDetails
and one bad ChargeCategory among good rows each fail with the rule named; a missing file cannot
be judged. It runs focus-validator from its own virtual environment, which `make test` prepares
(`tools/focus-validate --install`)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "focus-validate"

# A FOCUS 1.3 cost and usage dataset with split cost allocation: the 23 mandatory columns, the
# RECOMMENDED ChargeFrequency, InvoiceId and ServiceSubcategory, and the Allocated* columns. A node's
# 48.00 is split 0.75 / 0.25 between two namespaces; one unallocated usage row and a tax row.
# Decimals are written like 25.0: read from CSV, 25 would be an integer column and fail its type.
COLUMNS = [
    "BillingAccountId", "BillingAccountName", "BillingCurrency", "BillingPeriodStart", "BillingPeriodEnd",
    "ChargePeriodStart", "ChargePeriodEnd", "ChargeCategory", "ChargeClass", "ChargeDescription",
    "ChargeFrequency", "PricingUnit", "ProviderName", "PublisherName", "ServiceProviderName",
    "HostProviderName", "InvoiceIssuerName", "InvoiceId", "ServiceCategory", "ServiceName", "ServiceSubcategory",
    "AllocatedMethodId", "AllocatedMethodDetails", "AllocatedResourceId", "AllocatedResourceName", "AllocatedTags",
    "BilledCost", "EffectiveCost", "ListCost", "ContractedCost", "PricingQuantity",
]
DECIMALS = ["BilledCost", "EffectiveCost", "ListCost", "ContractedCost", "PricingQuantity"]
DATETIMES = ["BillingPeriodStart", "BillingPeriodEnd", "ChargePeriodStart", "ChargePeriodEnd"]


def details(ratio: float, quantity: float) -> str:
    return json.dumps({"Elements": [{"AllocatedRatio": ratio, "UsageUnit": "vCPU-Hours", "UsageQuantity": quantity}]})


def valid_rows() -> list[dict[str, str]]:
    common = {
        "BillingAccountId": "acct-001", "BillingAccountName": "Example Account", "BillingCurrency": "USD",
        "BillingPeriodStart": "2025-01-01T00:00:00Z", "BillingPeriodEnd": "2025-02-01T00:00:00Z",
        "ChargePeriodStart": "2025-01-01T00:00:00Z", "ChargePeriodEnd": "2025-01-02T00:00:00Z",
        "ChargeCategory": "Usage", "ChargeClass": "", "ChargeFrequency": "Usage-Based",
        "ProviderName": "ExampleCloud", "PublisherName": "ExampleCloud", "ServiceProviderName": "ExampleCloud",
        "HostProviderName": "ExampleCloud", "InvoiceIssuerName": "ExampleCloud", "InvoiceId": "INV-1",
        "AllocatedMethodId": "", "AllocatedMethodDetails": "", "AllocatedResourceId": "",
        "AllocatedResourceName": "", "AllocatedTags": "",
    }
    node = {**common, "ChargeDescription": "Kubernetes node hours", "PricingUnit": "Hours",
            "ServiceCategory": "Compute", "ServiceName": "Example Kubernetes", "ServiceSubcategory": "Containers",
            "AllocatedMethodId": "cpu-request-share-v1"}
    return [
        {**node, "AllocatedMethodDetails": details(0.75, 72.0), "AllocatedResourceId": "ns/payments",
         "AllocatedResourceName": "payments", "AllocatedTags": json.dumps({"team": "payments"}),
         "BilledCost": "36.00", "EffectiveCost": "36.00", "ListCost": "36.00", "ContractedCost": "36.00",
         "PricingQuantity": "18.0"},
        {**node, "AllocatedMethodDetails": details(0.25, 24.0), "AllocatedResourceId": "ns/search",
         "AllocatedResourceName": "search", "AllocatedTags": json.dumps({"team": "search"}),
         "BilledCost": "12.00", "EffectiveCost": "12.00", "ListCost": "12.00", "ContractedCost": "12.00",
         "PricingQuantity": "6.0"},
        {**common, "ChargeDescription": "Object storage GB-month", "PricingUnit": "GB-Months",
         "ServiceCategory": "Storage", "ServiceName": "Example Storage", "ServiceSubcategory": "Object Storage",
         "BilledCost": "3.10", "EffectiveCost": "3.10", "ListCost": "3.10", "ContractedCost": "3.10",
         "PricingQuantity": "100.0"},
        {**common, "ChargePeriodEnd": "2025-02-01T00:00:00Z", "ChargeCategory": "Tax", "ChargeDescription": "Sales tax",
         "ChargeFrequency": "One-Time", "PricingUnit": "", "ServiceCategory": "Other", "ServiceName": "Example Tax",
         "ServiceSubcategory": "Other (Other)", "BilledCost": "1.00", "EffectiveCost": "1.00", "ListCost": "0.0",
         "ContractedCost": "0.0", "PricingQuantity": ""},
    ]


def validator_venv() -> Path:
    """The validator's venv, found as tools/focus-validate finds it."""
    venv = Path(os.environ.get("OTELGPU_FOCUS_VENV") or REPO / ".venv-focus")
    venv = venv if venv.is_absolute() else REPO / venv
    if not (venv / ".otelgpu-focus-installed").is_file():
        pytest.fail(f"focus-validator's venv {venv} is not installed: run `make test`, or "
                    "`tools/focus-validate --install` first")
    return venv


def write_csv(path: Path, rows: list[dict[str, str]], columns: list[str] = COLUMNS) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


# Written with pyarrow from the validator's venv (the project's venv has none): decimals as
# decimal128, date/times as timestamp[us, tz=UTC], empty strings as nulls.
PARQUET_WRITER = """
import datetime, decimal, json, sys
import pyarrow as pa, pyarrow.parquet as pq
spec = json.load(sys.stdin)
def column(name):
    values = [row[name] if row[name] != "" else None for row in spec["rows"]]
    if name in spec["decimals"]:
        return pa.array([None if v is None else decimal.Decimal(v) for v in values], pa.decimal128(38, 10))
    if name in spec["datetimes"]:
        return pa.array([None if v is None else datetime.datetime.fromisoformat(v.replace("Z", "+00:00"))
                         for v in values], pa.timestamp("us", tz="UTC"))
    return pa.array(values, pa.string())
pq.write_table(pa.table({name: column(name) for name in spec["columns"]}), sys.argv[1])
"""


def write_parquet(path: Path, rows: list[dict[str, str]]) -> Path:
    spec = {"rows": rows, "columns": COLUMNS, "decimals": DECIMALS, "datetimes": DATETIMES}
    subprocess.run([str(validator_venv() / "bin" / "python"), "-c", PARQUET_WRITER, str(path)],
                   input=json.dumps(spec), text=True, check=True, timeout=120)
    return path


def focus_validate(*files: Path | str) -> subprocess.CompletedProcess:
    validator_venv()
    return subprocess.run([sys.executable, str(TOOL), *map(str, files)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_valid_focus_1_3_file_passes_as_csv_and_as_parquet(tmp_path: Path) -> None:
    rows = valid_rows()
    run = focus_validate(write_csv(tmp_path / "valid.csv", rows), write_parquet(tmp_path / "valid.parquet", rows))
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    for name in ("valid.csv", "valid.parquet"):
        (summary,) = [line for line in lines if name + ":" in line]
        assert summary.startswith("PASS ") and " 0 failed" in summary and "4 rows" in summary, summary
        assert "model FOCUS 1.3 overlay" in summary, summary
    assert "FAIL" not in run.stdout


@pytest.mark.slow
def test_a_file_without_hostprovidername_fails(tmp_path: Path) -> None:
    columns = [c for c in COLUMNS if c != "HostProviderName"]
    run = focus_validate(write_csv(tmp_path / "no_host.csv", valid_rows(), columns))
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stdout.startswith("FAIL ")
    assert "CostAndUsage-D-075-M (MUST): Column 'HostProviderName' MUST be present" in run.stdout


@pytest.mark.slow
def test_allocated_method_details_without_allocated_ratio_fails(tmp_path: Path) -> None:
    rows = valid_rows()
    rows[1]["AllocatedMethodDetails"] = json.dumps({"Elements": [{"UsageUnit": "vCPU-Hours", "UsageQuantity": 24.0}]})
    run = focus_validate(write_csv(tmp_path / "no_ratio.csv", rows))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "AllocatedMethodDetailsObject-O-012-M" in run.stdout
    assert "'AllocatedRatio' MUST exist" in run.stdout


@pytest.mark.slow
def test_one_bad_charge_category_among_good_rows_fails(tmp_path: Path) -> None:
    rows = valid_rows()
    rows[2]["ChargeCategory"] = "Bogus"
    run = focus_validate(write_csv(tmp_path / "bogus.csv", rows))
    assert run.returncode == 1, run.stdout + run.stderr
    # focus-validator itself passes the column (some rows are allowed); the row check does not.
    (line,) = [line for line in run.stdout.splitlines() if "ChargeCategory-C-003-M" in line]
    assert "(row by row)" in line and "'Bogus' in 1 row(s) (data row 3)" in line, line


def test_a_missing_file_cannot_be_judged(tmp_path: Path) -> None:
    run = focus_validate(write_csv(tmp_path / "valid.csv", valid_rows()), tmp_path / "missing.csv")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "no such file" in run.stderr and "missing.csv" in run.stderr
