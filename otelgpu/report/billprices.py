"""`otelgpu prices --from-bill`: a price file of the effective rates a bill charged, which the
running sidecar reloads (`prices.file`), so that live showback tracks the invoice between closes.

An instance's rate is its compute's effective cost over the instance-hours its usage lines charge
for (report/bill.py): Savings Plan and Reserved Instance rates, private pricing discounts on its
lines, spot prices, capacity blocks. Per instance type and capacity type, the rate is the hours'
weighted mean: all the type's cost over all its hours. The file carries:
- `instance_hour_by_instance_type`: the on-demand instances' rates (Savings Plans and Reserved
  Instances discount on-demand instances);
- `capacity_types.spot` and `.reserved` (capacity blocks): their own `instance_hour_by_instance_type`;
- with `per_instance`, `instance_hour_by_instance_id`: each instance's own rate, which beats
  every other price of the node it is (the node's `instance_id`).

A price file's keys replace the same keys of the configuration: given the configuration
(`base`), the file keeps its prices for the types the bill does not price and its capacity types'
discounts, so writing it loses nothing the configuration had.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow.compute as pc
import yaml

from otelgpu.attribution.config import PricesConfig, load_prices_file
from otelgpu.core.files import write_whole
from otelgpu.report.bill import Bill

OWN_RATES = ("spot", "reserved")  # capacity types whose rates are their own capacity_types key


@dataclass
class Rate:
    instance_type: str
    capacity_type: str  # on-demand, spot, reserved
    cost: float
    hours: float
    instances: int

    @property
    def per_hour(self) -> float:
        return self.cost / self.hours


@dataclass
class BillRates:
    rates: list[Rate]  # per instance type and capacity type
    instances: dict[str, float]  # instance -> its own rate
    unknown: dict[str, float]  # instances whose type the bill does not name -> their cost (not priced)
    no_hours: dict[str, float]  # instances with a cost and no usage hours (a discount alone) -> cost
    free: dict[str, float]  # instances whose usage cost nothing (a Capacity Block's: paid by its fee) -> hours
    start: float
    end: float


def bill_rates(bill: Bill, start: Optional[float] = None, end: Optional[float] = None) -> BillRates:
    """The rates of `bill`'s instance-periods inside [start, end) (default: all of them)."""
    table = bill.instances
    begins, ends = table["start"].to_numpy(), table["end"].to_numpy()
    inside = np.ones(table.num_rows, bool)
    if start is not None:
        inside &= begins >= start
    if end is not None:
        inside &= ends <= end
    table = table.filter(inside)
    if not table.num_rows:
        raise ValueError("the bill has no instance's lines in the period asked for")
    summed = table.group_by("instance").aggregate([("compute", "sum"), ("hours", "sum")])
    per_type: dict[tuple[str, str], Rate] = {}
    out = BillRates([], {}, {}, {}, {}, float(pc.min(table["start"]).as_py()), float(pc.max(table["end"]).as_py()))
    for instance, cost, hours in zip(*(summed[c].to_pylist() for c in ("instance", "compute_sum", "hours_sum"))):
        if not hours > 0:
            if cost:
                out.no_hours[instance] = cost
            continue
        if cost == 0:  # no rate: the capacity was paid for elsewhere (a Capacity Block's upfront fee)
            out.free[instance] = hours
            continue
        kind = bill.kinds.get(instance)
        if kind is None:
            out.unknown[instance] = cost
            continue
        out.instances[instance] = cost / hours
        rate = per_type.setdefault(kind, Rate(kind[0], kind[1], 0.0, 0.0, 0))
        rate.cost, rate.hours, rate.instances = rate.cost + cost, rate.hours + hours, rate.instances + 1
    out.rates = sorted(per_type.values(), key=lambda r: (r.capacity_type, r.instance_type))
    return out


def price_file(rates: BillRates, base: PricesConfig, per_instance: bool = False) -> dict:
    """The price file's mapping: `rates` over what `base` (the configuration's prices) has."""
    on_demand = dict(base.instance_hour_by_instance_type)
    capacity_types = {"on_demand": {"discount": base.capacity_types.on_demand.discount}}
    own = {key: dict(getattr(base.capacity_types, key).instance_hour_by_instance_type) for key in OWN_RATES}
    for rate in rates.rates:
        (own[rate.capacity_type] if rate.capacity_type in OWN_RATES else on_demand)[rate.instance_type] = \
            round(rate.per_hour, 6)
    for key in OWN_RATES:
        given = getattr(base.capacity_types, key)
        capacity_types[key] = {"gpu_hour_by_gpu_model": dict(given.gpu_hour_by_gpu_model),
                               "gpu_hour_by_instance_type": dict(given.gpu_hour_by_instance_type),
                               "instance_hour_by_instance_type": dict(sorted(own[key].items())),
                               "discount": given.discount}
    out: dict = {"instance_hour_by_instance_type": dict(sorted(on_demand.items())), "capacity_types": capacity_types}
    if per_instance:
        instances = {**base.instance_hour_by_instance_id,
                     **{name: round(rate, 6) for name, rate in sorted(rates.instances.items())}}
        out["instance_hour_by_instance_id"] = instances
    return out


def shadowed(rates: BillRates, base: PricesConfig) -> list[str]:
    """The bill's types whose nodes a per-GPU price of the configuration would still price (a
    per-GPU price beats an instance price, docs/cost-model.md section 3): their rate is not used
    unless per instance."""
    from otelgpu.core.catalog import gpu_model_key, load_catalog

    catalog = load_catalog(base.catalog)
    out = []
    for rate in rates.rates:
        # a capacity type's own instance price beats the on-demand per-GPU prices, not its own ones
        own = getattr(base.capacity_types, rate.capacity_type) if rate.capacity_type in OWN_RATES else base
        known = catalog.get(rate.instance_type)
        models = {gpu_model_key(model) for model in own.gpu_hour_by_gpu_model}
        if rate.instance_type in own.gpu_hour_by_instance_type or \
                (known is not None and gpu_model_key(known.gpu_model) in models):
            out.append(f"{rate.instance_type} ({rate.capacity_type})")
    return out


def write_price_file(path: str | Path, mapping: dict, header: str) -> None:
    """Write the file whole or not at all (a sidecar reloads it when it changes: it must never
    see half of it), after checking the sidecar would take it."""
    text = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()) + \
        yaml.safe_dump(mapping, sort_keys=False, default_flow_style=False)
    # checked as the sidecar reads it: a ConfigError naming every problem
    write_whole(path, [text.encode("utf-8")], check=lambda written: load_prices_file(written, PricesConfig()))


def header(source: str, rates: BillRates, command: str) -> str:
    def day(time_s: float) -> str:
        return datetime.fromtimestamp(time_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

    lines = [f"Effective rates of {source}, {day(rates.start)} to {day(rates.end)}: each instance type's compute cost",
             "over its instance-hours, per capacity type (USD per instance-hour).", f"Written by: {command}", ""]
    for rate in rates.rates:
        lines.append(f"{rate.instance_type} {rate.capacity_type}: {round(rate.per_hour, 6)} "
                     f"({rate.hours:,.2f} instance-hours of {rate.instances} instances)")
    return "\n".join(lines)

