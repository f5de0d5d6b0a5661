"""The Grafana dashboards (monitoring/dashboards): the JSON shipped is what the grafana-foundation-sdk
builder writes, every variable and panel is wired to the data source and the `cluster` and
`cost_model` variables, and every query of every panel runs on a real Prometheus holding what a
real otelgpu run remote-wrote: the cost panels read that run's known totals."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from costrun import remote_write, run, scenario
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from otelgpu.enrich.window import NS
from otelgpu.report.promql import PromClient
from otelgpu.report.showback import increases, showback

if TYPE_CHECKING:
    from promserver import PrometheusServer

pytest_plugins = ["promserver"]  # the `prometheus` fixture

BOARDS = Path(__file__).resolve().parents[1] / "monitoring" / "dashboards"
NAMES = ("executive", "oncall", "debug")
# Queries of series the in-process run does not write: the sidecar's own /metrics (scraped by the
# Collector in a deployment), the Collector's `up`, and the recording rules of `otelgpu rules`.
ELSEWHERE = re.compile(r"otelgpu_|\bup\{|team:gpu_cost")


def boards() -> dict[str, dict]:
    return {name: json.loads((BOARDS / f"{name}.json").read_text()) for name in NAMES}


def queries(board: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p["targets"]]


def test_the_shipped_dashboards_are_what_the_builder_writes(tmp_path) -> None:
    subprocess.run([sys.executable, str(BOARDS / "build.py"), str(tmp_path)], check=True)
    for name in NAMES:
        assert (tmp_path / f"{name}.json").read_text() == (BOARDS / f"{name}.json").read_text(), name


def test_every_panel_uses_the_data_source_and_the_variables() -> None:
    for name, board in boards().items():
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert {"datasource", "cluster", "cost_model", "resolution"} <= set(variables), name
        assert variables["cluster"]["multi"] and variables["cluster"]["includeAll"]
        # A rate needs two samples of a series otelgpu writes once per attribution interval.
        ranged = [p for p in board["panels"] if not any(t.get("instant") for t in p["targets"])]
        assert ranged and all(p.get("interval") == "$resolution" for p in ranged), name
        for panel in board["panels"]:
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel["targets"] and panel.get("description"), panel["title"]
            for target in panel["targets"]:
                expr = target["expr"]
                if "gpu_cost_" in expr and "team:" not in expr:
                    assert "$cluster" in expr, (panel["title"], expr)
        # Money is never added up across cost models: every sum of a money series selects the
        # dashboard's model, or keeps the models apart.
        for title, expr in queries(board):
            for selection in re.findall(r"(?:increase|rate|last_over_time|min_over_time|max_over_time|resets)"
                                        r"\(([^\[]*)\[", expr):
                if re.search(r"gpu_cost_(allocated|unused|idle|waste|capacity|effective|unmeasured)", selection):
                    assert 'cost_model="$cost_model"' in selection or "by (cost_model" in expr, (name, title, expr)


def evaluate(client: PromClient, expr: str, at: float, range_s: int = 3600) -> dict[str, float]:
    """A panel's query with the variables as Grafana would fill them for a range ending at `at`."""
    concrete = (expr.replace("$cluster", "one").replace("$cost_model", "request").replace("$__range", f"{range_s}s")
                .replace("$__rate_interval", "15m"))
    return {json.dumps({k: v for k, v in labels.items() if k != "__name__"}, sort_keys=True): value
            for labels, value in client.vector(concrete, at)}


REQUEST = {"cluster": "one", "cost_model": "request"}
# The money and usage panels that total a range, each with what `otelgpu report` reads for it:
# (metric, its matchers, the labels the panel groups by); several metrics add up.
TOTALS = {
    ("executive", "Charged"): ([("gpu_cost_allocated_total", REQUEST), ("gpu_cost_unused_total", REQUEST)], ()),
    ("executive", "Capacity"): ([("gpu_cost_capacity_total", REQUEST)], ()),
    **{("executive", f"Charged by {tag.replace('_', ' ')}"): (
        [("gpu_cost_allocated_total", REQUEST), ("gpu_cost_unused_total", REQUEST)], (tag,))
        for tag in ("team", "project", "model", "cost_center")},
    ("executive", "Charged by tenant"): ([("gpu_cost_tenant_total", REQUEST)], ("tenant", "served_model")),
    ("executive", "Top spenders"): ([("gpu_cost_allocated_total", REQUEST), ("gpu_cost_unused_total", REQUEST)],
                                    ("cluster", "namespace", "workload_kind", "workload_name")),
    ("executive", "Cost models side by side"): ([("gpu_cost_allocated_total", {"cluster": "one"}),
                                                 ("gpu_cost_unused_total", {"cluster": "one"})], ("cost_model", "team")),
    ("oncall", "Unattributed cost by reason"): ([("gpu_cost_unattributed_total", {"cluster": "one"})],
                                                ("reason", "namespace")),
    ("oncall", "Idle by node and GPU model"): ([("gpu_cost_idle_total", {**REQUEST, "resource": "gpu"})],
                                               ("cluster", "node", "gpu_model")),
    ("debug", "Cost per node"): ([("gpu_cost_capacity_total", REQUEST)],
                                 ("cluster", "node", "instance_type", "capacity_type", "price_source")),
}


def reported(client: PromClient, metrics: list[tuple[str, dict]], by: tuple[str, ...], start: float,
             end: float) -> dict[str, float]:
    """What `otelgpu report` reads for a panel: each series' exact increase, grouped as the panel."""
    out: dict[str, float] = {}
    for name, matchers in metrics:
        for labels, value in increases(client, name, matchers, start, end):
            key = json.dumps({k: labels[k] for k in by if labels.get(k)}, sort_keys=True)
            out[key] = out.get(key, 0.0) + value
    return out


def panels(client: PromClient, end: float, range_s: int) -> dict[tuple[str, str], dict[str, float]]:
    got = {}
    for name, board in boards().items():
        for title, expr in queries(board):
            result = evaluate(client, expr, end, range_s)
            assert result or ELSEWHERE.search(expr) or range_s < 3600, (name, title, expr)  # the hour has them all
            got[(name, title)] = {**got.get((name, title), {}), **result}
    return got


@pytest.mark.parametrize("start_s, end_s", [(0, 3600), (0, 2700), (600, 2400), (1500, 3300)])
def test_every_money_panel_equals_the_report_over_the_same_range(prometheus: PrometheusServer, start_s: int,
                                                                 end_s: int) -> None:
    """The ranges start and end inside series (nlp's pod ends at 25 minutes, research's starts at
    35, batch holds from 30 to 40 and again from 50): each panel is the report's figure, to 1e-6.
    Batch's series restarting inside a range is the one thing a panel cannot see: the restart
    panels count it and bound what it leaves out, exactly that on the whole hour."""
    c = scenario()
    run(c, prometheus.write_url)
    client = PromClient(prometheus.url)
    t0 = c.t0 / NS
    start, end = t0 + start_s, t0 + end_s
    got = panels(client, end, end_s - start_s)
    restarts = got[("executive", "Restarted series")]
    left_out = 2.0 if start_s < 2400 and end_s > 3000 else 0.0  # batch's first life: 10 minutes at $12 an hour
    assert list(restarts.values()) == [1.0 if left_out else 0.0]
    (batch, _), = client.vector('last_over_time(gpu_cost_allocated_total{pod="batch", cost_model="request"}[1d])', end)
    for (board, title), (metrics, by) in TOTALS.items():
        want = reported(client, metrics, by, start, end)
        if left_out and metrics[0][0] == "gpu_cost_allocated_total":  # batch's first life, left out of the panel
            want[json.dumps({k: batch[k] for k in by if batch.get(k)}, sort_keys=True)] -= left_out
        assert got[(board, title)] == pytest.approx(want, abs=1e-6), (board, title)
    (bound,) = got[("executive", "Left out by restarted series, at most")].values()
    assert bound >= left_out and (bound == 0.0) == (left_out == 0.0)
    showback_ = showback(client, start, end, ["team"], matchers={"cluster": "one"})
    (idle_share,) = got[("executive", "Idle share")].values()
    assert idle_share == pytest.approx(showback_.idle / showback_.capacity, abs=1e-9)
    (per_gpu_hour,) = got[("executive", "Cost per GPU-hour")].values()
    gpu_hours = sum(r.gpu_hours for r in showback_.rows)
    assert per_gpu_hour == pytest.approx((sum(r.gpu_allocated for r in showback_.rows) - left_out) /
                                         (gpu_hours - (1 / 6 if left_out else 0.0)), abs=1e-6)
    units = sum(got[("debug", "GPU-hours by unit")].values())
    assert units == pytest.approx(gpu_hours - (1 / 6 if left_out else 0.0), abs=1e-9)
    tenants = reported(client, [("gpu_cost_tenant_total", REQUEST)], ("tenant", "served_model"), start, end)
    tokens = reported(client, [("llm_tokens_total", {"cluster": "one"})], ("tenant", "served_model"), start, end)
    per_mtok = got[("executive", "Cost per million tokens")]
    assert per_mtok == pytest.approx({k: tenants[k] / tokens[k] * 1e6 for k in tenants if tokens.get(k)}, abs=1e-6)


def test_the_lag_panel_reads_the_gauges_a_real_run_ends_with(prometheus: PrometheusServer) -> None:
    """The run's own /metrics, as the Collector scrapes it into the workspace at the hour's end:
    the last scrape was a minute before (the data), every interval closed and delivered; no
    checkpoint directory, so no checkpointed line."""
    c = scenario()
    p = run(c, prometheus.write_url)
    end = c.t0 / NS + 3600
    scraped = {}
    for family in text_string_to_metric_families(generate_latest(p.metrics.registry).decode()):
        for s in family.samples:
            if s.name.endswith("_timestamp_seconds"):
                labels = {"__name__": s.name, "job": "otelgpu", "cluster": "one", "instance": "10.0.0.9:9464", **s.labels}
                scraped[tuple(sorted(labels.items()))] = [(end, s.value)]
    remote_write(prometheus.write_url, scraped)
    (panel,) = [p for p in boards()["oncall"]["panels"] if p["title"] == "Lag"]
    client = PromClient(prometheus.url)
    lines = {t["legendFormat"]: sorted(evaluate(client, t["expr"], end).items()) for t in panel["targets"]}
    assert lines == {"{{cluster}} data": [('{"cluster": "one"}', 60.0)],
                     "{{cluster}} closed": [('{"cluster": "one"}', 0.0)],
                     "{{cluster}} checkpointed": [],
                     "{{cluster}} {{exporter}} delivered": [('{"cluster": "one", "exporter": "remote_write"}', 0.0)]}
