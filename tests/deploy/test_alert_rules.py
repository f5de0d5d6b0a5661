"""The alerting and recording rules (`otelgpu rules`): the shipped files are what the generator
writes from the example budgets, Prometheus' own checker accepts them, promtool's unit tests of
every alert pass (firing and not firing), and a bad budgets file is refused with every problem."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import yaml
from manifests import REPO

from otelgpu.alerts import AlertsConfig, load_alerts_config, rule_groups
from otelgpu.errors import ConfigError

RULES = REPO / "monitoring" / "rules" / "otelgpu-rules.yaml"
MANIFEST = REPO / "k8s" / "monitoring" / "prometheusrule.yaml"
BUDGETS = "monitoring/budgets.example.yaml"


def promtool() -> str:
    found = shutil.which("promtool") or shutil.which("/usr/bin/promtool")
    if not found:
        pytest.fail("promtool was not found: install the Debian package `prometheus` (CI's .ci/run installs it)")
    return found


def generate(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "otelgpu", "rules", "--budgets", BUDGETS, *args], cwd=REPO,
                          capture_output=True, text=True, check=True)
    return done.stdout


def test_the_shipped_rules_are_what_the_generator_writes_from_the_example_budgets() -> None:
    assert RULES.read_text() == generate()
    assert MANIFEST.read_text() == generate("--prometheusrule")
    manifest = yaml.safe_load(MANIFEST.read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert manifest["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_promtool_accepts_the_rules() -> None:
    done = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 25 rules found" in done.stdout


def test_every_alert_has_a_promtool_unit_test_and_they_pass() -> None:
    tests = RULES.with_name("otelgpu-rules.test.yaml")
    tested = {case["alertname"] for group in yaml.safe_load(tests.read_text())["tests"]
              for case in group.get("alert_rule_test", [])}
    alerts = {rule["alert"] for group in rule_groups(load_alerts_config(REPO / BUDGETS))
              for rule in group["rules"] if "alert" in rule}
    assert alerts == tested
    done = subprocess.run([promtool(), "test", "rules", str(tests)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_links_its_runbook_section() -> None:
    docs = (REPO / "docs" / "alerts.md").read_text()
    anchors = {line.lstrip("#").strip().lower() for line in docs.splitlines() if line.startswith("### ")}
    for group in rule_groups(AlertsConfig(budgets={"a": 1.0}, runbooks="https://example.com/alerts.md")):
        for rule in group["rules"]:
            if "alert" in rule:
                assert rule["annotations"]["runbook_url"] == f"https://example.com/alerts.md#{rule['alert'].lower()}"
                assert rule["alert"].lower() in anchors, f"docs/alerts.md has no section for {rule['alert']}"


def test_budgets_become_hourly_rates_and_thresholds_reach_the_alerts(tmp_path) -> None:
    path = tmp_path / "budgets.yaml"
    path.write_text("cost_model: scad\nbudgets: {vision: 7200, nlp: 1000}\npage_burn_rate: 10\nidle_share_max: 0.25\n")
    groups = {g["name"]: g for g in rule_groups(load_alerts_config(path))}
    budgets = [(r["record"], r["expr"], r["labels"]["team"]) for r in groups["otelgpu-cost-rates"]["rules"] if "labels" in r]
    assert budgets == [("team:gpu_cost_budget_usd:30d", "vector(1000)", "nlp"),
                       ("team:gpu_cost_budget_usd_per_hour", "vector(1.3888888888888888)", "nlp"),
                       ("team:gpu_cost_budget_usd:30d", "vector(7200)", "vision"),
                       ("team:gpu_cost_budget_usd_per_hour", "vector(10)", "vision")]
    rates = [r for r in groups["otelgpu-cost-rates"]["rules"] if "labels" not in r]
    assert len(rates) == 4 and all('cost_model="scad"' in r["expr"] for r in rates)
    alerts = {r["alert"]: r["expr"] for r in groups["otelgpu-alerts"]["rules"]}
    assert alerts["GPUCostBudgetBurnFast"].count("> 10") == 2 and alerts["GPUIdleShareHigh"].endswith("> 0.25")


def test_a_bad_budgets_file_is_refused_with_every_problem(tmp_path) -> None:
    path = tmp_path / "budgets.yaml"
    path.write_text("budgets: {vision: -5, nlp: 100}\ncost_model: cheapest\nwarn_burn_rate: 1\nbudget: {}\n")
    with pytest.raises(ConfigError) as err:
        load_alerts_config(path)
    text = str(err.value)
    for expected in ("budgets", "'vision'", "cost_model", "warn_burn_rate", "budget: unknown key"):
        assert expected in text, text
    done = subprocess.run([sys.executable, "-m", "otelgpu", "rules", "--budgets", str(path)], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "cost_model" in done.stderr and not done.stdout


def test_alerts_read_recorded_series_no_staler_than_prometheus_sees_them() -> None:
    """A series is visible for 5 minutes after its last sample: an alert that reads a series
    recorded every 10 minutes directly would lose it for half of the time (and its `for` with it);
    promtool's unit tests evaluate every group each step and cannot show this."""
    groups = rule_groups(load_alerts_config(REPO / BUDGETS))
    interval = {r["record"]: g.get("interval", "1m") for g in groups for r in g["rules"] if "record" in r}
    for group in groups:
        for rule in group["rules"]:
            if "alert" not in rule:
                continue
            for record, every in interval.items():
                for use in re.finditer(re.escape(record) + r"(?![\w:])", rule["expr"]):
                    if every != "1m":
                        before = rule["expr"][:use.start()]
                        assert before.endswith("last_over_time("), (rule["alert"], record, every)


def test_budget_amounts_are_written_exactly() -> None:
    groups = rule_groups(AlertsConfig(budgets={"big": 1234567.89, "half": 100000.5}))
    values = {(r["record"], r["labels"]["team"]): r["expr"] for g in groups for r in g["rules"] if "record" in r and "labels" in r}
    assert values[("team:gpu_cost_budget_usd:30d", "big")] == "vector(1234567.89)"
    assert values[("team:gpu_cost_budget_usd:30d", "half")] == "vector(100000.5)"
    assert float(values[("team:gpu_cost_budget_usd_per_hour", "big")][7:-1]) == 1234567.89 / 720
