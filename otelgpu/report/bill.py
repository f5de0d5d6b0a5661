"""What a cloud bill says each instance cost: a FOCUS 1.x billing dataset (every large cloud
exports one) or an AWS Cost and Usage Report 2.0, read in record batches so that a month of a
large fleet's bill is never held whole, and summed per instance and charge period.

Each line's cost is its amortised, discounted cost:
- FOCUS: `EffectiveCost`, which the specification defines as amortised and net of negotiated
  discounts. A commitment's purchase rows carry 0 where they prepay later usage; usage a
  commitment covers names the instance (BilledCost 0, EffectiveCost its share); an hour covered in
  part is two rows, summed here.
- CUR 2.0: as AWS's Cloud Intelligence Dashboards amortise it: `SavingsPlanCoveredUsage` costs
  `savings_plan_savings_plan_effective_cost`, `DiscountedUsage` (a Reserved Instance) costs
  `reservation_effective_cost`, `SavingsPlanNegation` and `SavingsPlanUpfrontFee` cost nothing
  (the covered usage carries them), `SavingsPlanRecurringFee` and `RIFee` what the commitment
  left unused (where the export has the columns that say so; else the fee as billed), anything
  else its `line_item_unblended_cost`. Split cost
  allocation rows (`EKSPod-EC2`, `ECSTask-EC2`) repeat their instance's cost and are left out.

A line belongs to an instance when its resource id is an EC2 instance id, bare (`i-0abc...`) or
ending an ARN (`...:instance/i-0abc...`). An instance's lines priced by the hour are its compute
(`compute`), and so are the credits and discounts that name it (FOCUS ChargeCategory `Credit`;
CUR `Credit`, `EdpDiscount`, `PrivateRateDiscount`, `BundledDiscount`, `Discount`); its others
(data transfer, say) are kept apart (`other`). Lines of no instance
(credits, taxes, unused commitments, other services) are totalled by their category and counted:
none is dropped unseen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.compute as pc
import pyarrow.parquet as pq

from otelgpu.core.catalog import INSTANCE_ID
from otelgpu.core.grouping import group_ids

KEYS = ("instance", "start", "end")
NO_PERIOD = "(an instance's line without a charge period)"  # counted with the lines of no instance
COSTS = ("compute", "other", "billed", "list", "hours")  # summed per instance and period

FOCUS_COLUMNS = ("ResourceId", "ChargePeriodStart", "ChargePeriodEnd", "ChargeCategory", "EffectiveCost",
                 "BilledCost", "ListCost", "PricingUnit", "PricingQuantity")
CUR_COLUMNS = ("line_item_resource_id", "line_item_usage_start_date", "line_item_usage_end_date",
               "line_item_line_item_type", "line_item_unblended_cost", "line_item_operation", "line_item_usage_type",
               "savings_plan_savings_plan_effective_cost", "reservation_effective_cost",
               "pricing_public_on_demand_cost", "line_item_usage_amount")
# Read where the bill has them: what tells an instance's type and purchase (FOCUS only describes
# them in words: AWS writes "$0.34 per On Demand Linux c5.2xlarge Instance Hour")
FOCUS_OPTIONAL = ("PricingCategory", "ChargeDescription")
# A commitment's fees at their amortised cost, as AWS's dashboards take it: what the commitment
# left unused (the covered usage carries the rest); without these columns, the fee as billed.
_CUR_FEES = {  # fee -> (columns added, columns taken away)
    "SavingsPlanRecurringFee": (("savings_plan_total_commitment_to_date",), ("savings_plan_used_commitment",)),
    "RIFee": (("reservation_unused_amortized_upfront_fee_for_billing_period", "reservation_unused_recurring_fee"), ()),
}
CUR_OPTIONAL = ("product_instance_type", "savings_plan_total_commitment_to_date", "savings_plan_used_commitment",
                "reservation_unused_amortized_upfront_fee_for_billing_period", "reservation_unused_recurring_fee")
_CUR_FREE = ("SavingsPlanNegation", "SavingsPlanUpfrontFee")  # carried by the usage they cover
_CUR_SPLIT = ("EKSPod-EC2", "ECSTask-EC2")  # split cost allocation: their instance's cost again
_CUR_HOURLY = r"(BoxUsage|SpotUsage|DedicatedUsage|HostUsage|CapacityBlock)"
_CUR_USAGE = ("Usage", "SavingsPlanCoveredUsage", "DiscountedUsage")  # lines whose amount is instance-hours
# Lines that adjust an instance's usage: where they name the instance, part of its compute whatever
# their usage type says (a private pricing discount, a credit applied to it)
_CUR_ADJUSTMENTS = ("EdpDiscount", "PrivateRateDiscount", "BundledDiscount", "Discount", "Credit")
_CUR_TYPE = r":(?P<type>[a-z][a-z0-9-]*\.[a-z0-9]+)$"  # USE1-BoxUsage:p5.48xlarge
_FOCUS_TYPE = r"(?P<type>\b[a-z][a-z0-9-]*\.[a-z0-9]+) (?:Instance|Dedicated Host|Capacity Block)"
_TYPE = {"focus": _FOCUS_TYPE, "cur2": _CUR_TYPE}  # where a usage line's text names its instance type


@dataclass
class Bill:
    """Per instance and charge period (unix seconds, end exclusive): its compute's effective cost,
    its other lines' effective cost, what was billed for its compute and the compute's list cost;
    and the lines of no instance by category. `hours`: the instance-hours its usage lines charge
    for (FOCUS: PricingQuantity of usage priced by the hour; CUR: line_item_usage_amount of its
    usage, covered usage and discounted usage lines). `kinds`: where the bill says them, each
    instance's type and capacity type (`spot` for spot, `reserved` for a capacity block,
    `on-demand` otherwise: Savings Plans and Reserved Instances discount on-demand instances)."""

    format: str  # "focus" or "cur2"
    instances: pa.Table  # instance, start, end, compute, other, billed, list, hours
    kinds: dict[str, tuple[str, str]] = field(default_factory=dict)  # instance -> (instance type, capacity type)
    unmatched: dict[str, tuple[int, float]] = field(default_factory=dict)  # category -> (lines, cost)
    lines: int = 0
    split_lines: int = 0  # CUR's split cost allocation rows, left out: they repeat their instance's cost

    def total(self, column: str = "compute") -> float:
        return float(pc.sum(self.instances[column]).as_py() or 0.0)


def bill_format(names: list[str]) -> str:
    """"focus" or "cur2" from a dataset's column names; ValueError naming what is missing."""
    have = set(names)
    for name, wanted in (("focus", FOCUS_COLUMNS), ("cur2", CUR_COLUMNS)):
        if have >= set(wanted):
            return name
    focus = sorted(set(FOCUS_COLUMNS) - have)
    cur = sorted(set(CUR_COLUMNS) - have)
    raise ValueError(f"neither a FOCUS dataset (missing {', '.join(focus)}) nor a CUR 2.0 one "
                     f"(missing {', '.join(cur)})")


def read_bill(path: str | Path, batch_rows: int = 65_536, regroup_rows: int = 1 << 20) -> Bill:
    """Stream `path` (a CSV or Parquet file, or a directory of them) `batch_rows` lines at a time.
    The per-batch sums are merged whenever they pass `regroup_rows` rows, so memory follows the
    distinct instance periods, not the lines. A file that cannot be read whole (a cost that is no
    number, a time that is no time, a truncated file) is refused: ValueError naming it and the
    problem, since a bill with lines left out cannot tie out."""
    try:
        return _read(path, batch_rows, regroup_rows)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: not read as a bill: {exc}") from None


def _read(path: str | Path, batch_rows: int, regroup_rows: int) -> Bill:
    files = _files(Path(path))
    names = _names(files[0])
    kind = bill_format(names)
    columns = list(FOCUS_COLUMNS if kind == "focus" else CUR_COLUMNS)
    columns += [c for c in (FOCUS_OPTIONAL if kind == "focus" else CUR_OPTIONAL) if c in names]
    bill = Bill(kind, _empty())
    codes: dict[str, int] = {}  # instance id -> its number: the sums are kept by number, not by string
    parts: list[pa.Table] = []
    held = 0
    for batch in _batches(files, columns, batch_rows):
        lines = _focus_lines(batch) if kind == "focus" else _cur_lines(batch)
        bill.lines += batch.num_rows
        bill.split_lines += batch.num_rows - lines.num_rows
        dated = pc.and_(pc.is_valid(lines["start"]), pc.is_valid(lines["end"]))
        undated = pc.and_(pc.is_valid(lines["instance"]), pc.invert(dated))
        lines = lines.set_column(lines.schema.get_field_index("category"), "category",
                                 pc.if_else(undated, NO_PERIOD, lines["category"]))
        mine = pc.and_(pc.is_valid(lines["instance"]), dated)
        _tally(bill.unmatched, lines.filter(pc.invert(mine)))
        _kinds(bill.kinds, lines.filter(mine), kind)
        part = _summed(_numbered(lines.filter(mine), codes))
        parts.append(part)
        held += part.num_rows
        if held > regroup_rows:
            parts = [_summed(pa.concat_tables(parts))]
            held = parts[0].num_rows
    if parts:
        summed = _summed(pa.concat_tables(parts))
        named = summed.set_column(0, "instance", pa.array(list(codes), pa.string()).take(summed["instance"]))
        bill.instances = named.sort_by([(k, "ascending") for k in KEYS])
    return bill


def _numbered(lines: pa.Table, codes: dict[str, int]) -> pa.Table:
    """`lines` with each instance id replaced by its number in `codes` (new ones numbered)."""
    for name in pc.unique(lines["instance"]).to_pylist():
        codes.setdefault(name, len(codes))
    number = pc.index_in(lines["instance"], value_set=pa.array(list(codes), pa.string()))
    return lines.set_column(0, "instance", pc.cast(number, pa.int32()))


def _files(path: Path) -> list[Path]:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"{path}: no files")
    if len({_is_parquet(p) for p in files}) > 1:
        raise ValueError(f"{path}: mixes Parquet and CSV files")
    return files


def _is_parquet(path: Path) -> bool:
    return path.suffix == ".parquet"


# CSV columns typed as the bill defines them, not guessed from the first block: a column empty
# there must not become untyped, and times are read as written (with or without a zone).
_NUMBERS = {"EffectiveCost", "BilledCost", "ListCost", "PricingQuantity", "line_item_unblended_cost",
            "reservation_effective_cost", "savings_plan_savings_plan_effective_cost", "pricing_public_on_demand_cost",
            "line_item_usage_amount"}
_CSV_TYPES = {name: pa.float64() if name in _NUMBERS else pa.string()
              for name in FOCUS_COLUMNS + CUR_COLUMNS + FOCUS_OPTIONAL + CUR_OPTIONAL}


def _names(path: Path) -> list[str]:
    if _is_parquet(path):
        return pq.ParquetFile(path).schema_arrow.names
    return pa_csv.open_csv(path, convert_options=pa_csv.ConvertOptions(column_types=_CSV_TYPES)).schema.names


def _batches(files: list[Path], columns: list[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
    """Each file's lines, pulled `batch_rows` at a time: nothing is read ahead of the reader (a
    scanner reading ahead would hold the file while the sums are made)."""
    for path in files:
        if _is_parquet(path):
            yield from pq.ParquetFile(path).iter_batches(batch_size=batch_rows, columns=columns)
        else:
            options = pa_csv.ConvertOptions(column_types=_CSV_TYPES, include_columns=columns,
                                            strings_can_be_null=True)
            yield from pa_csv.open_csv(path, read_options=pa_csv.ReadOptions(block_size=1 << 22),
                                       convert_options=options)


def _seconds(column: pa.Array) -> pa.Array:
    """Unix seconds of a timestamp column, or of one written as text with or without a zone (a
    time without one is UTC, as FOCUS and CUR write them)."""
    if pa.types.is_timestamp(column.type):
        return pc.cast(pc.cast(column, pa.timestamp("s", column.type.tz), safe=False), pa.int64())  # truncated
    text = pc.utf8_trim_whitespace(pc.cast(column, pa.string()))
    zoned = pc.fill_null(pc.match_substring_regex(text, r"(Z|[+-]\d\d:?\d\d)$"), False)
    with_zone = pc.cast(pc.cast(pc.if_else(zoned, text, None), pa.timestamp("s", "UTC")), pa.int64())
    without = pc.cast(pc.cast(pc.if_else(zoned, None, text), pa.timestamp("s")), pa.int64())
    return pc.if_else(zoned, with_zone, without)


def _instance(resource: pa.Array) -> pa.Array:
    return pc.struct_field(pc.extract_regex(pc.cast(resource, pa.string()), INSTANCE_ID.pattern), [0])


def _number(column: pa.Array) -> pa.Array:
    return pc.fill_null(pc.cast(column, pa.float64()), 0.0)


def _focus_lines(batch: pa.RecordBatch) -> pa.Table:
    effective = _number(batch["EffectiveCost"])
    hourly = pc.fill_null(pc.equal(pc.utf8_lower(pc.cast(batch["PricingUnit"], pa.string())), "hours"), False)
    category = pc.fill_null(pc.cast(batch["ChargeCategory"], pa.string()), "(none)")
    usage = pc.and_(hourly, pc.equal(category, "Usage"))
    hourly = pc.or_(hourly, pc.equal(category, "Credit"))  # a credit that names the instance: its compute's
    hours = pc.if_else(usage, _number(batch["PricingQuantity"]), 0.0)
    described = _text(batch, "ChargeDescription")
    spot = pc.equal(_text(batch, "PricingCategory"), "Dynamic")
    block = pc.match_substring(described, "Capacity Block")
    capacity = pc.if_else(spot, "spot", pc.if_else(block, "reserved", "on-demand"))
    return _lines(batch["ResourceId"], batch["ChargePeriodStart"], batch["ChargePeriodEnd"], effective, hourly,
                  _number(batch["BilledCost"]), _number(batch["ListCost"]), category,
                  (hours, pc.if_else(usage, described, pa.scalar(None, pa.string())), capacity))


def _text(batch: pa.RecordBatch | pa.Table, name: str) -> pa.Array:
    """A text column, "" where the bill leaves it empty or lacks it."""
    if name not in batch.schema.names:
        return pa.array([""] * batch.num_rows, pa.string())
    return pc.fill_null(pc.cast(batch[name], pa.string()), "")


def _cur_lines(batch: pa.RecordBatch) -> pa.Table:
    split = pc.fill_null(pc.is_in(pc.cast(batch["line_item_operation"], pa.string()),
                                  value_set=pa.array(_CUR_SPLIT)), False)
    batch = pa.Table.from_batches([batch]).filter(pc.invert(split))
    kind = pc.fill_null(pc.cast(batch["line_item_line_item_type"], pa.string()), "(none)")
    unblended = _number(batch["line_item_unblended_cost"])
    effective = pc.if_else(pc.equal(kind, "SavingsPlanCoveredUsage"),
                           _number(batch["savings_plan_savings_plan_effective_cost"]),
                           pc.if_else(pc.equal(kind, "DiscountedUsage"), _number(batch["reservation_effective_cost"]),
                                      pc.if_else(pc.is_in(kind, value_set=pa.array(_CUR_FREE)), 0.0, unblended)))
    for fee, (added, taken) in _CUR_FEES.items():
        if set(added + taken) <= set(batch.schema.names):
            unused = pa.array(np.zeros(batch.num_rows))
            for name in added:
                unused = pc.add(unused, _number(batch[name]))
            for name in taken:
                unused = pc.subtract(unused, _number(batch[name]))
            effective = pc.if_else(pc.equal(kind, fee), unused, effective)
    usage_type = _text(batch, "line_item_usage_type")
    hourly = pc.match_substring_regex(usage_type, _CUR_HOURLY)
    usage = pc.and_(hourly, pc.is_in(kind, value_set=pa.array(_CUR_USAGE)))
    hourly = pc.or_(hourly, pc.is_in(kind, value_set=pa.array(_CUR_ADJUSTMENTS)))
    hours = pc.if_else(usage, _number(batch["line_item_usage_amount"]), 0.0)
    named = usage_type  # the type follows its last `:`; product_instance_type, where given, names it alone
    if "product_instance_type" in batch.schema.names:
        product = _text(batch, "product_instance_type")
        named = pc.if_else(pc.greater(pc.utf8_length(product), 0), pc.binary_join_element_wise(":", product, ""),
                           usage_type)
    capacity = pc.if_else(pc.match_substring(usage_type, "SpotUsage"), "spot",
                          pc.if_else(pc.match_substring(usage_type, "CapacityBlock"), "reserved", "on-demand"))
    return _lines(batch["line_item_resource_id"], batch["line_item_usage_start_date"],
                  batch["line_item_usage_end_date"], effective, hourly, unblended,
                  _number(batch["pricing_public_on_demand_cost"]), kind,
                  (hours, pc.if_else(usage, named, pa.scalar(None, pa.string())), capacity))


def _lines(resource: pa.Array, start: pa.Array, end: pa.Array, effective: pa.Array, hourly: pa.Array,
           billed: pa.Array, listed: pa.Array, category: pa.Array, usage: tuple[pa.Array, pa.Array, pa.Array]) -> pa.Table:
    """One row per line: its instance (null: none), period, costs and category; `usage`: the
    instance-hours it charges for, the text that names its instance type (null: none; `_TYPE` finds
    it there) and its capacity type."""
    zero = pa.scalar(0.0)
    hours, instance_type, capacity_type = usage
    return pa.table({
        "instance": _instance(resource), "start": _seconds(start), "end": _seconds(end),
        "compute": pc.if_else(hourly, effective, zero), "other": pc.if_else(hourly, zero, effective),
        "billed": pc.if_else(hourly, billed, zero), "list": pc.if_else(hourly, listed, zero), "hours": hours,
        "category": category, "effective": effective, "instance_type": instance_type,
        "capacity_type": capacity_type})


def _summed(lines: pa.Table) -> pa.Table:
    """Sums per (instance number, start, end), one sort (a month of a fleet is some 900,000 of
    them: an Arrow hash aggregation would take four times the memory of the sums)."""
    if not lines.num_rows:
        return _empty(pa.int32())
    keys = [lines[k].to_numpy() for k in KEYS]
    ids, first = group_ids(*keys)
    sums = {c: np.bincount(ids, weights=lines[c].to_numpy(), minlength=len(first)) for c in COSTS}
    return pa.table({**{k: column[first] for k, column in zip(KEYS, keys)}, **sums})


def _tally(unmatched: dict[str, tuple[int, float]], lines: pa.Table) -> None:
    if not lines.num_rows:
        return
    counted = lines.group_by("category").aggregate([("effective", "sum"), ("effective", "count")])
    for category, cost, n_line in zip(counted["category"].to_pylist(), counted["effective_sum"].to_pylist(),
                                      counted["effective_count"].to_pylist()):
        lines_before, cost_before = unmatched.get(category, (0, 0.0))
        unmatched[category] = (lines_before + n_line, cost_before + cost)


def _kinds(kinds: dict[str, tuple[str, str]], lines: pa.Table, kind: str) -> None:
    """The type and capacity type of each instance its usage lines name (the first seen): only the
    lines of instances not known yet are looked at."""
    new = pc.and_(pc.is_valid(lines["instance_type"]),
                  pc.invert(pc.is_in(lines["instance"], value_set=pa.array(list(kinds), pa.string()))))
    named = lines.filter(new)
    if not named.num_rows:
        return
    found = pc.struct_field(pc.extract_regex(named["instance_type"], _TYPE[kind]), [0])
    named = named.set_column(named.schema.get_field_index("instance_type"), "instance_type", found)
    named = named.filter(pc.is_valid(named["instance_type"]))
    seen = named.group_by(["instance", "instance_type", "capacity_type"]).aggregate([])
    for instance, instance_type, capacity_type in zip(*(seen[c].to_pylist() for c in
                                                        ("instance", "instance_type", "capacity_type"))):
        kinds.setdefault(instance, (instance_type, capacity_type))


def _empty(instance: pa.DataType = pa.string()) -> pa.Table:
    return pa.table({"instance": pa.array([], instance), "start": pa.array([], pa.int64()),
                     "end": pa.array([], pa.int64()), **{c: pa.array([], pa.float64()) for c in COSTS}})

