"""The FOCUS 1.3 dataset of `otelgpu report` against a real Prometheus holding what a real otelgpu
run remote-wrote (costrun's known hour): each node-period's capacity split into allocated charges
to the cent, the ratios of each origin adding up to 1 and every summable column to the origin;
a counter that restarts inside a charge period; series missing from the workspace; scad's three
resources; and the files the command writes (CSV, Parquet) passing the FinOps Foundation's
focus-validator (tools/focus-validate)."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from collections import defaultdict
from datetime import datetime, timezone
from typing import TYPE_CHECKING

import pytest
from costrun import remote_write, run, scenario
from focuscheck import assert_adds_up
from support import REPO

from otelgpu.enrich.window import NS
from otelgpu.report import focus
from otelgpu.report.promql import PromClient

if TYPE_CHECKING:
    from promserver import PrometheusServer

pytest_plugins = ["promserver"]  # the `prometheus` fixture
QUARTER = 900


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def dataset_rows(data: focus.Dataset) -> list[dict]:
    return list(focus.rows(data, focus.Provider()))


def test_each_node_period_is_split_to_the_cent(prometheus: PrometheusServer) -> None:
    c = scenario(align_s=3600)
    run(c, prometheus.write_url)
    t0 = c.t0 / NS
    data = focus.collect(PromClient(prometheus.url), t0, t0 + 3600, QUARTER, matchers={"cluster": "one"})
    assert not data.warnings
    rows = dataset_rows(data)
    # $12 per A100-hour, 4 GPUs: each quarter hour costs $12 and provides one GPU-hour.
    quarters = [t0 + QUARTER * k for k in range(4)]
    assert_adds_up(rows, {(q, "gpu-1"): (12.0, 1.0) for q in quarters})
    got = defaultdict(dict)
    for r in rows:
        got[r["ChargePeriodStart"] - t0][r["AllocatedResourceId"] or r["x_AllocationKind"]] = r["BilledCost"]
    # train holds two GPUs all hour; nlp's serve one until 25 min; batch 30-40 and again 50-60 min
    # (its series ended and started again: a counter reset inside the last quarter); eval from 35 min.
    expected = {0: {"one/ml/train": 6, "one/web/serve": 3, "idle": 3},
                900: {"one/ml/train": 6, "one/web/serve": 2, "idle": 4},
                1800: {"one/ml/train": 6, "one/ml/batch": 2, "one/lab/eval": 2, "idle": 2},
                2700: {"one/ml/train": 6, "one/ml/batch": 2, "one/lab/eval": 3, "idle": 1}}
    assert {q: pytest.approx(v, rel=1e-12) for q, v in expected.items()} == dict(got)
    train = next(r for r in rows if r["AllocatedResourceId"] == "one/ml/train")
    (element,) = json.loads(train["AllocatedMethodDetails"])["Elements"]
    assert element == {"AllocatedRatio": pytest.approx(0.5), "UsageUnit": "GPU-Hours", "UsageQuantity": pytest.approx(0.5),
                       "x_Resource": "gpu", "x_Part": "held"}
    assert train["PricingQuantity"] == pytest.approx(0.5) and train["PricingUnit"] == "GPU-Hours"
    assert train["AllocatedResourceName"] == "train" and train["AllocatedMethodId"] == "otelgpu-request-idle-keep"
    assert json.loads(train["AllocatedTags"])["team"] == "vision" and json.loads(train["AllocatedTags"])["namespace"] == "ml"
    assert train["x_UsedCost"] + train["x_WasteCost"] + train["x_UnmeasuredCost"] == pytest.approx(train["BilledCost"])
    idle = next(r for r in rows if r["x_AllocationKind"] == "idle")
    assert idle["AllocatedResourceId"] is None and idle["AllocatedResourceName"] is None and idle["AllocatedTags"] is None
    assert {r["BillingAccountId"] for r in rows} == {"one"} and {r["ResourceType"] for r in rows} == {"Kubernetes node"}


def test_series_missing_from_the_workspace_show_as_unaccounted(prometheus: PrometheusServer) -> None:
    """A node-hour whose holders' series never reached the workspace: the capacity is still split
    whole, the part no series accounts for written as `unaccounted` with no resource."""
    t0 = __import__("time").time() // 3600 * 3600 - 3600
    labels = {"cluster": "c", "node": "n1", "instance_type": "g5.xlarge", "gpu_model": "A10G",
              "cost_model": "request", "idle_policy": "keep", "resource": "gpu", "price_source": "config:gpu_model"}

    def series(name: str, extra: dict, values: list[float]) -> tuple:
        key = tuple(sorted({"__name__": name, **labels, **extra}.items()))
        return key, [(t0 + 600 * (k + 1), v) for k, v in enumerate(values)]

    written = dict([series("gpu_cost_capacity_total", {}, [1, 2, 3, 4, 5, 6]),
                    series("gpu_cost_allocated_total", {"team": "a", "namespace": "x", "pod": "p"}, [1, 2, 3, 3, 3, 3]),
                    series("gpu_cost_idle_total", {}, [0, 0, 0, 0, 0, 1])])
    remote_write(prometheus.write_url, written)
    data = focus.collect(PromClient(prometheus.url), t0, t0 + 3600, 3600, matchers={"cluster": "c"})
    assert any("unaccounted" in w for w in data.warnings)
    rows = dataset_rows(data)
    assert_adds_up(rows, {(t0, "n1"): (6.0, 0.0)})  # no gpu_provisioned_seconds_total: no GPU-hours known
    got = {r["x_AllocationKind"]: (r["BilledCost"], r["AllocatedResourceId"]) for r in rows}
    assert got == {"holder": (pytest.approx(3.0), "c/x/p"), "idle": (pytest.approx(1.0), None),
                   "unaccounted": (pytest.approx(2.0), None)}


def test_scad_splits_the_whole_instance_resource_by_resource(prometheus: PrometheusServer) -> None:
    c = scenario(align_s=3600)
    p = run(c, prometheus.write_url, cost_models=("scad",), idle_policy="share")
    t0 = c.t0 / NS
    data = focus.collect(PromClient(prometheus.url), t0, t0 + 3600, 3600, "scad", {"cluster": "one"})
    rows = dataset_rows(data)
    capacity = data.origins[0].capacity  # the instance's GPUs, vCPUs and memory, as the run costed them
    by_resource = p.store.totals("capacity", ("resource",), {"cost_model": "scad"})
    assert set(by_resource) == {("gpu",), ("cpu",), ("memory",)}
    assert capacity == pytest.approx(sum(by_resource.values()), rel=1e-12)
    assert_adds_up(rows, {(t0, "gpu-1"): (capacity, 4.0)})
    assert {r["AllocatedMethodId"] for r in rows} == {"otelgpu-scad-idle-share"}
    parts = {(e["x_Resource"], e["x_Part"], e["UsageUnit"]) for r in rows
             for e in json.loads(r["AllocatedMethodDetails"])["Elements"]}
    assert {("gpu", "held", "GPU-Hours"), ("gpu", "unused", "GPU-Hours")} <= parts
    assert {resource for resource, _, _ in parts} == {"gpu", "cpu", "memory"}


def focus_validate(*files: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "focus-validate"), *files],
                          capture_output=True, text=True, cwd=REPO)


@pytest.mark.slow
def test_the_report_command_writes_focus_csv_and_parquet_that_pass_focus_validator(
        prometheus: PrometheusServer, tmp_path) -> None:
    c = scenario(align_s=3600)
    run(c, prometheus.write_url)
    t0 = c.t0 / NS
    base = [sys.executable, "-m", "otelgpu", "report", "--prometheus", prometheus.url, "--start", iso(t0),
            "--end", iso(t0 + 3600), "--cluster", "one", "--granularity", "hour"]
    written = {}
    for form, name in (("focus-csv", "focus.csv"), ("focus-parquet", "focus.parquet")):
        done = subprocess.run([*base, "--format", form, "--output", str(tmp_path / name)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        written[form] = tmp_path / name
    rows = list(csv.DictReader(io.StringIO(written["focus-csv"].read_text())))
    assert list(rows[0]) == list(focus.COLUMNS)
    assert sum(float(r["BilledCost"]) for r in rows) == pytest.approx(48.0, rel=1e-12)
    assert {r["AllocatedResourceId"] for r in rows} == {"one/ml/train", "one/web/serve", "one/ml/batch", "one/lab/eval", ""}
    assert {r["ChargePeriodStart"] for r in rows} == {iso(t0)} and {r["ChargePeriodEnd"] for r in rows} == {iso(t0 + 3600)}
    import pyarrow.parquet as pq

    table = pq.read_table(written["focus-parquet"]).to_pylist()
    assert [r["BilledCost"] for r in table] == pytest.approx([float(r["BilledCost"]) for r in rows], rel=1e-15)
    checked = focus_validate(str(written["focus-csv"]), str(written["focus-parquet"]))
    assert checked.returncode == 0, checked.stdout + checked.stderr

    # Arguments the dataset cannot take fail before any query.
    off_edge = subprocess.run([*base[:7], iso(t0 + 60), *base[8:], "--format", "focus-csv"], capture_output=True, text=True)
    assert off_edge.returncode == 2 and "edge" in off_edge.stderr
    no_output = subprocess.run([*base, "--format", "focus-parquet"], capture_output=True, text=True)
    assert no_output.returncode == 2 and "--output" in no_output.stderr


def test_hostile_label_values_stay_inside_their_cells(prometheus: PrometheusServer) -> None:
    """Pod and tag values come from users: quotes, commas, newlines and JSON in them come back
    unchanged from the CSV, and AllocatedTags stays one JSON object."""
    t0 = __import__("time").time() // 3600 * 3600 - 3600
    hostile = {"namespace": 'ns,"x"', "pod": "p\nq", "team": '{"team":"other"}\\'}
    node = {"cluster": "h", "node": "n", "cost_model": "request", "idle_policy": "keep", "resource": "gpu"}

    def series(name: str, extra: dict) -> tuple:
        return tuple(sorted({"__name__": name, **node, **extra}.items())), [(t0 + 1800, 1.0), (t0 + 3600, 2.0)]

    remote_write(prometheus.write_url, dict([series("gpu_cost_capacity_total", {}),
                                             series("gpu_cost_allocated_total", hostile)]))
    data = focus.collect(PromClient(prometheus.url), t0, t0 + 3600, 3600, matchers={"cluster": "h"})
    out = io.StringIO()
    assert focus.write_csv(data, out, focus.Provider()) == 1
    (row,) = csv.DictReader(io.StringIO(out.getvalue()))
    assert row["AllocatedResourceId"] == 'h/ns,"x"/p\nq' and row["AllocatedResourceName"] == "p\nq"
    assert json.loads(row["AllocatedTags"]) == hostile
    assert float(row["BilledCost"]) == 2.0 and json.loads(row["AllocatedMethodDetails"])["Elements"][0]["AllocatedRatio"] == 1.0


def test_periods_cut_inside_a_delivery_outage_are_merged_until_they_add_up(prometheus: PrometheusServer) -> None:
    """Merged snapshots carry a series' outage cost at one time of its own: here the pod's charge
    arrives in the second quarter and the capacity it belongs to in the third. Those quarters
    are one charge period in the dataset, exact; the others stay apart."""
    t0 = __import__("time").time() // 3600 * 3600 - 3600
    node = {"cluster": "o", "node": "n1", "cost_model": "request", "idle_policy": "keep", "resource": "gpu"}

    def series(name: str, extra: dict, values: list[float]) -> tuple:
        key = tuple(sorted({"__name__": name, **node, **extra}.items()))
        return key, [(t0 + 900 * (k + 1) - 60, v) for k, v in enumerate(values)]

    remote_write(prometheus.write_url, dict([
        series("gpu_cost_capacity_total", {}, [3, 3, 9, 12]),
        series("gpu_cost_allocated_total", {"team": "a", "namespace": "x", "pod": "p"}, [2, 6, 6, 8]),
        series("gpu_cost_idle_total", {}, [1, 3, 3, 4])]))
    data = focus.collect(PromClient(prometheus.url), t0, t0 + 3600, QUARTER, matchers={"cluster": "o"})
    assert any("merged" in w for w in data.warnings) and not any("unaccounted" in w for w in data.warnings)
    spans = [(o.start - t0, o.end - t0, o.capacity) for o in data.origins]
    assert spans == [(0, 900, 3.0), (900, 2700, 6.0), (2700, 3600, 3.0)]
    rows = dataset_rows(data)
    assert_adds_up(rows, {(o.start, o.node): (o.cost, 0.0) for o in data.origins})
    assert sum(r["BilledCost"] for r in rows) == pytest.approx(12.0)
    merged = {r["x_AllocationKind"]: r["BilledCost"] for r in rows if r["ChargePeriodStart"] == t0 + 900}
    assert merged == {"holder": pytest.approx(4.0), "idle": pytest.approx(2.0)}


def test_merges_stay_within_a_month_and_a_node_with_held_hours_but_no_cost_series_still_splits() -> None:
    """On origins built here (no server): a capacity that arrives a period late across the end
    of a month is not merged into the month before (each month's bill stays its own); a node
    whose holders' cost series are missing but whose GPU-hours arrived is split (all of it
    unaccounted), not a crash."""
    from datetime import datetime, timezone

    day = 86_400.0
    feb = datetime(2026, 2, 1, tzinfo=timezone.utc).timestamp()
    origins = {}
    for k, (start, capacity, charged) in enumerate(((feb - 2 * day, 10.0, 10.0), (feb - day, 0.0, 10.0),
                                                   (feb, 20.0, 10.0), (feb + day, 10.0, 10.0))):
        o = focus.Origin(start, start + day, "c", "n1", {"idle_policy": "keep"})
        o.capacity = capacity
        o.charge("holder", {"pod": "p", "namespace": "x"}).parts[("gpu", "held")] += charged
        origins[(k, "c", "n1")] = o
    assert focus._balanced(origins) == 0  # Jan 31 and Feb 1 would add up together: not across the month
    assert len(origins) == 4

    held_only = focus.Origin(feb, feb + day, "c", "n2", {})
    held_only.capacity = 10.0
    held_only.charge("holder", {"pod": "q", "namespace": "x"}).gpu_seconds = 3600.0
    data = focus.Dataset("request", [held_only], [])
    # as collect() finishes an origin: the gap becomes an unaccounted charge
    held_only.charge("unaccounted", {}).parts[(focus._main(held_only), "unaccounted")] += 10.0
    rows = dataset_rows(data)
    assert sum(r["BilledCost"] for r in rows) == pytest.approx(10.0)
