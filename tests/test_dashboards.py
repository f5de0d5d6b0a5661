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
            for selection in re.findall(r"(?:increase|rate)\(([^\[]*)\[", expr):
                if re.search(r"gpu_cost_(allocated|unused|idle|waste|capacity|effective|unmeasured)", selection):
                    assert 'cost_model="$cost_model"' in selection or "by (cost_model" in expr, (name, title, expr)


def evaluate(client: PromClient, expr: str, at: float) -> dict[str, float]:
    """A panel's query with the variables as Grafana would fill them for this run's hour."""
    concrete = (expr.replace("$cluster", "one").replace("$cost_model", "request").replace("$__range", "3600s")
                .replace("$__rate_interval", "15m"))
    return {json.dumps({k: v for k, v in labels.items() if k != "__name__"}, sort_keys=True): value
            for labels, value in client.vector(concrete, at)}


def test_every_query_runs_on_a_real_run_and_the_cost_panels_read_its_totals(prometheus: PrometheusServer) -> None:
    c = scenario()
    run(c, prometheus.write_url)
    client = PromClient(prometheus.url)
    end = c.t0 / NS + 3600
    got: dict[tuple[str, str], dict[str, float]] = {}
    for name, board in boards().items():
        for title, expr in queries(board):
            result = evaluate(client, expr, end)
            assert result or ELSEWHERE.search(expr), (name, title, expr)
            got[(name, title)] = result

    def one(title: str) -> float:
        (value,) = got[("executive", title)].values()
        return value

    # increase() reads each series from its first sample: it may leave out up to half an interval
    # at a series' start; the run's exact figures are within a few percent.
    assert one("Charged") == pytest.approx(38.0, rel=0.05)
    assert one("Capacity") == pytest.approx(48.0, rel=0.05)
    assert one("Idle share") == pytest.approx(10 / 48, rel=0.1)
    assert one("Cost per GPU-hour") == pytest.approx(12.0, rel=0.01)
    teams = {json.loads(k).get("team"): v for k, v in got[("executive", "Charged by team")].items()}
    assert teams == pytest.approx({"vision": 28.0, "nlp": 5.0, "research": 5.0}, rel=0.1)
    # nlp's $5 split between its tenants by tokens: acme 40 of every 49.5 a second.
    tenants = {json.loads(k)["tenant"]: v for k, v in got[("executive", "Charged by tenant")].items()}
    assert tenants == pytest.approx({"acme": 5.0 * 40 / 49.5, "globex": 5.0 * 9.5 / 49.5}, rel=0.1)
    per_mtok = {json.loads(k)["tenant"]: v for k, v in got[("executive", "Cost per million tokens")].items()}
    assert per_mtok == pytest.approx({"acme": 1e6 * 5.0 / 49.5 / 1500, "globex": 1e6 * 5.0 / 49.5 / 1500}, rel=0.1)
    units = {json.loads(k)["unit_kind"]: v for k, v in got[("debug", "GPU-hours by unit")].items()}
    assert sum(units.values()) == pytest.approx(38 / 12, rel=0.05) and set(units) == {"gpu"}


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
