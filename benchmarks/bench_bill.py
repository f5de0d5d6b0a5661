"""Reading a month of a GPU fleet's bill (otelgpu/report/bill.py) in bounded memory.

Writes a FOCUS bill in Parquet, row groups of 100,000 lines: for each of `--instances` EC2
instances and each hour of `--days`, its compute line (on demand, or split in two where a Savings
Plan covers part of the hour) and `--transfer-lines` data-transfer lines, plus the account's credit
and tax lines.
Then reads it in a child process (so its peak memory is the reader's alone) and prints lines per
second, the child's peak resident memory, the file's size, and the size of the lines held whole
as an Arrow table, as a ratio to the reader's peak.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHUNK = 100_000


def write_bill(path: Path, instances: int, days: int, transfer_lines: int = 1) -> int:
    """The bill's lines, written a row group at a time; returns how many."""
    hours = days * 24
    start = 1_790_812_800  # 2026-10-01T00:00:00Z
    ids = np.array([f"i-{n:017x}" for n in range(instances)], dtype=object)
    covered = np.arange(instances) % 3 == 0  # a third of the fleet partly under a Savings Plan
    writer, lines = None, 0
    try:
        for hour in range(hours):
            at = start + 3600 * hour
            parts = [
                (ids, "Usage", "Standard", "Hours", np.where(covered, 19.664, 98.32), np.where(covered, 0.2, 1.0)),
                (ids[covered], "Usage", "Committed", "Hours", np.full(covered.sum(), 44.0), np.full(covered.sum(), 0.8)),
                *[(ids, "Usage", "Standard", "GB", np.full(instances, 0.09), np.full(instances, 4.5))] * transfer_lines,
                (np.array([None, None], dtype=object), "Credit", None, None, np.array([-10.0, 3.5]), np.zeros(2)),
            ]
            table = pa.concat_tables([_lines(*part, at) for part in parts])
            if writer is None:
                writer = pq.ParquetWriter(path, table.schema)
            writer.write_table(table, row_group_size=CHUNK)
            lines += table.num_rows
    finally:
        if writer is not None:
            writer.close()
    return lines


def _lines(resource_ids: np.ndarray, category: str, pricing: str | None, unit: str | None, cost: np.ndarray,
           quantity: np.ndarray, at: int) -> pa.Table:
    count = len(resource_ids)
    described = "$98.32 per On Demand Linux p5.48xlarge Instance Hour" if unit == "Hours" else "data transfer"
    return pa.table({
        "ResourceId": pa.array(resource_ids, pa.string()),
        "ChargePeriodStart": pa.array(np.full(count, at * 1000), pa.timestamp("ms", "UTC")),
        "ChargePeriodEnd": pa.array(np.full(count, (at + 3600) * 1000), pa.timestamp("ms", "UTC")),
        "ChargeCategory": pa.array([category] * count, pa.string()),
        "PricingCategory": pa.array([pricing] * count, pa.string()),
        "PricingUnit": pa.array([unit] * count, pa.string()),
        "BilledCost": pa.array(cost, pa.float64()),
        "EffectiveCost": pa.array(cost, pa.float64()),
        "ListCost": pa.array(cost, pa.float64()),
        "PricingQuantity": pa.array(quantity, pa.float64()),
        "ChargeDescription": pa.array([described if category == "Usage" else None] * count, pa.string()),
    })


def read_child(path: str) -> None:
    from otelgpu.report.bill import read_bill

    began = time.process_time()
    bill = read_bill(path)
    spent = time.process_time() - began
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"lines": bill.lines, "periods": bill.instances.num_rows, "cpu_s": spent, "peak": peak,
                      "compute": bill.total("compute"), "unmatched": len(bill.unmatched)}))


def main(argv: list[str] = sys.argv[1:]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", type=int, default=1250, help="GPU instances (1,250 p5s hold 10,000 GPUs)")
    ap.add_argument("--days", type=int, default=30)
    ap.add_argument("--transfer-lines", type=int, default=1, help="data-transfer lines per instance-hour")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        read_child(args.child)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bill.parquet"
        lines = write_bill(path, args.instances, args.days, args.transfer_lines)
        out = subprocess.run([sys.executable, __file__, "--child", str(path)], check=True, capture_output=True,
                             text=True)
        got = json.loads(out.stdout)
        held = pq.read_table(path).nbytes
        assert got["lines"] == lines, (got, lines)
        print(f"bill: {lines:,} lines ({args.instances:,} instances x {args.days * 24} hours), "
              f"{path.stat().st_size / 2**20:.1f} MiB of Parquet")
        print(f"read: {lines / got['cpu_s']:,.0f} lines per CPU second, {got['periods']:,} instance-hours, "
              f"{got['unmatched']} categories of lines of no instance")
        print(f"peak resident memory of the reader: {got['peak'] / 2**20:.0f} MiB; the lines held whole as an "
              f"Arrow table: {held / 2**20:.0f} MiB (x{held / got['peak']:.2f} the reader's peak)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
