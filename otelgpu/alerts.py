"""Prometheus alerting and recording rules for otelgpu's cost series, from one budgets file.

`otelgpu rules --budgets FILE` writes a rule file that Prometheus, Amazon Managed Service for
Prometheus' ruler (`aws amp create-rule-groups-namespace`) and the Prometheus Operator
(`--prometheusrule`, a PrometheusRule manifest) all load:

- recording rules: each team's charge (allocated + unused, of one cost model, summed over the
  fleet's clusters) in USD per hour over 5 m, 30 m, 1 h and 6 h, and over the last 30 days;
  each team's budget, from the file, per 30 days and per hour;
- alerts, each with a runbook (docs/alerts.md): a team burning its budget at `page_burn_rate`
  times the planned rate over 1 h and 5 m (page), or `warn_burn_rate` times over 6 h and 30 m
  (warning); a team whose 30-day budget runs out within 24 h at the 6 h rate; tag coverage under
  `tag_coverage_min`; unattributed cost over `unattributed_max` of the allocated cost; GPU nodes
  costed without device data, or GPUs without a price; idle capacity over `idle_share_max` of
  capacity; the sidecar down, its cost series no longer arriving, its exports failing or
  lagging behind the intervals it closed, or snapshots given up.

Budgets are per rolling 30 days (a rule cannot restart a sum on the first of a month).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, field_validator
from pydantic.dataclasses import dataclass

from otelgpu.core.settings import format_loc, problem_message
from otelgpu.errors import ConfigError

PERIOD_HOURS = 30 * 24  # a budget's period
CHARGED = 'rate({{__name__=~"gpu_cost_(allocated|unused)_total", cost_model="{model}"}}[{window}])'


@dataclass(config=ConfigDict(extra="forbid", frozen=True))
class AlertsConfig:
    """The budgets file: what `otelgpu rules` reads."""

    budgets: dict[str, float] = Field(default_factory=dict)  # team -> USD per 30 days
    cost_model: Literal["request", "scad", "opencost", "hybrid"] = "request"  # the model budgets are charged in
    warn_burn_rate: float = Field(2.0, gt=1)
    page_burn_rate: float = Field(4.0, gt=1)
    tag_coverage_min: float = Field(0.8, ge=0, le=1)
    unattributed_max: float = Field(0.02, ge=0, le=1)
    idle_share_max: float = Field(0.5, ge=0, le=1)
    delivery_lag_max_seconds: float = Field(900, gt=0)  # data time an exporter may lag the intervals closed
    runbooks: str = "docs/alerts.md"  # where docs/alerts.md is published: each alert links its section
    job: str = "otelgpu"  # the scrape job of otelgpu's own /metrics (collector-config/)

    @field_validator("budgets")
    @classmethod
    def _positive(cls, value: dict[str, float]) -> dict[str, float]:
        bad = sorted(team for team, usd in value.items() if not usd > 0 or not team.strip())
        if bad:
            raise ValueError(f"budgets must be positive amounts of named teams: {', '.join(map(repr, bad))}")
        return value

    @field_validator("job")
    @classmethod
    def _label_value(cls, value: str) -> str:
        if '"' in value or "\\" in value or not value:
            raise ValueError("a job name without quotes or backslashes")
        return value


_ADAPTER = TypeAdapter(AlertsConfig)


def load_alerts_config(path: str | Path | None) -> AlertsConfig:
    """The budgets file's settings (the defaults, without budgets, for None); ConfigError lists
    every problem."""
    if path is None:
        return AlertsConfig()
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror}"]) from exc
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from exc
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: expected a mapping"])
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as exc:
        raise ConfigError([f"{path}: {format_loc(e['loc'])}: {problem_message(e)}" for e in exc.errors()]) from exc


def rule_groups(config: AlertsConfig) -> list[dict[str, Any]]:
    """The rule groups, as Prometheus' rule file format has them."""
    return [_recording(config), _spent(config), _alerts(config)]


def _recording(config: AlertsConfig) -> dict[str, Any]:
    """Every minute: the charge rates and the budgets. A series is seen for 5 minutes after its last
    sample, so whatever an alert reads directly is recorded more often than that."""
    rules: list[dict[str, Any]] = [
        {"record": f"team:gpu_cost_usd_per_hour:rate{w}",
         "expr": f"3600 * sum by (team) ({CHARGED.format(model=config.cost_model, window=w)})"}
        for w in ("5m", "30m", "1h", "6h")]
    for team, usd in sorted(config.budgets.items()):
        rules.append({"record": "team:gpu_cost_budget_usd:30d", "expr": f"vector({_number(usd)})", "labels": {"team": team}})
        rules.append({"record": "team:gpu_cost_budget_usd_per_hour", "expr": f"vector({_number(usd / PERIOD_HOURS)})",
                      "labels": {"team": team}})
    return {"name": "otelgpu-cost-rates", "interval": "1m", "rules": rules}


def _spent(config: AlertsConfig) -> dict[str, Any]:
    """The 30-day spend, every 10 minutes (it reads 30 days of every cost series): the alert reads
    its latest value over the last 20 minutes, not the instant (gone 5 minutes after each sample)."""
    spent = ('sum by (team) (increase({{__name__=~"gpu_cost_(allocated|unused)_total", cost_model="{model}"}}[30d]))'
             .format(model=config.cost_model))
    return {"name": "otelgpu-cost-spent", "interval": "10m",
            "rules": [{"record": "team:gpu_cost_usd:increase30d", "expr": spent}]}


def _duration(seconds: float) -> str:
    """A threshold in seconds as people say it: `15 minutes`, `1 minute`, `90 s`."""
    if seconds % 60:
        return f"{seconds:g} s"
    return f"{seconds / 60:g} minute{'' if seconds == 60 else 's'}"


def _number(value: float) -> str:
    """A PromQL number that reads back as `x` exactly."""
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def _alerts(config: AlertsConfig) -> dict[str, Any]:
    """The alerting rules: the teams' budgets, the cost data's health, the sidecar's."""
    return {"name": "otelgpu-alerts", "rules": _budget_alerts(config) + _data_alerts(config) + _sidecar_alerts(config)}


def _burn(long: str, short: str, rate: float) -> str:
    """A team charged more than `rate` times its budget's hourly rate over both windows."""
    return (f"(team:gpu_cost_usd_per_hour:rate{long} / on (team) team:gpu_cost_budget_usd_per_hour > {rate:g})\n"
            f"and on (team)\n"
            f"(team:gpu_cost_usd_per_hour:rate{short} / on (team) team:gpu_cost_budget_usd_per_hour > {rate:g})")


def _alert(config: AlertsConfig, name: str, expr: str, duration: str, severity: str, summary: str,
           description: str) -> dict[str, Any]:
    return {"alert": name, "expr": expr, "for": duration, "labels": {"severity": severity},
            "annotations": {"summary": summary, "description": description,
                            "runbook_url": f"{config.runbooks}#{name.lower()}"}}


def _budget_alerts(config: AlertsConfig) -> list[dict[str, Any]]:
    model = config.cost_model
    return [
        _alert(config, "GPUCostBudgetBurnFast", _burn("1h", "5m", config.page_burn_rate), "2m", "page",
              "Team {{ $labels.team }} is spending GPUs at {{ $value | humanize }}x its budget's rate",
              f"Over the last hour and the last 5 minutes, team {{{{ $labels.team }}}} was charged more than "
              f"{config.page_burn_rate:g} times its planned hourly rate (its 30-day budget over 720 h), "
              f"{model} model."),
        _alert(config, "GPUCostBudgetBurnSlow", _burn("6h", "30m", config.warn_burn_rate), "15m", "warning",
              "Team {{ $labels.team }} is spending GPUs at {{ $value | humanize }}x its budget's rate",
              f"Over the last 6 hours and the last 30 minutes, team {{{{ $labels.team }}}} was charged more than "
              f"{config.warn_burn_rate:g} times its planned hourly rate, {model} model."),
        _alert(config, "GPUCostBudgetExhaustedWithin24h",
              "team:gpu_cost_budget_usd:30d - on (team) last_over_time(team:gpu_cost_usd:increase30d[20m])\n"
              "< on (team) 24 * team:gpu_cost_usd_per_hour:rate6h", "10m", "page",
              "Team {{ $labels.team }}'s GPU budget runs out within 24 hours",
              "At its rate over the last 6 hours, team {{ $labels.team }} spends what is left of its 30-day "
              "budget (team:gpu_cost_budget_usd:30d - team:gpu_cost_usd:increase30d) within a day."),
    ]


def _data_alerts(config: AlertsConfig) -> list[dict[str, Any]]:
    """Cost the tags, the device data or the prices leave incomplete, and capacity left idle."""
    model, job = config.cost_model, config.job
    return [
        _alert(config, "GPUCostTagCoverageLow",
              f'gpu_cost_tag_coverage_ratio{{tag="all", namespace=""}} < {config.tag_coverage_min:g}',
              "1h", "warning", "Only {{ $value | humanizePercentage }} of cluster {{ $labels.cluster }}'s GPU cost carries all five tags",
              "Pods without team, project, environment, model or cost center labels (or namespace labels) are "
              "billed to the defaults. gpu_cost_unattributed_total says which namespaces."),
        _alert(config, "GPUCostUnattributedHigh",
              "sum by (cluster) (rate(gpu_cost_unattributed_total[1h]))\n"
              '/ sum by (cluster) (rate(gpu_cost_allocated_total{cost_model="request"}[1h]))\n'
              f"> {config.unattributed_max:g}", "1h", "warning",
              "{{ $value | humanizePercentage }} of cluster {{ $labels.cluster }}'s GPU cost is unattributed",
              "Allocated GPU cost that no pod, an unknown pod or a pod missing a tag holds: gpu_cost_unattributed_total "
              "by reason and namespace."),
        _alert(config, "GPUNodeCostedWithoutDeviceData",
              f'increase(otelgpu_gpu_seconds_without_device_data_total{{job="{job}"}}[15m]) > 0', "15m", "warning",
              "Cluster {{ $labels.cluster }} has GPU nodes costed without DCGM data",
              "GPUs that kube-state-metrics counts got no dcgm-exporter series: their cost is booked on requests, "
              "activity unmeasured. The exporter is down, not scraped, or the node lost GPUs."),
        _alert(config, "GPUCostUnpriced", f'increase(otelgpu_unpriced_gpu_seconds_total{{job="{job}"}}[15m]) > 0',
              "15m", "warning",
              "Cluster {{ $labels.cluster }} has GPUs without a price: their cost is missing",
              "No price for an instance type or GPU model: add it to prices.file or the catalog."),
        _alert(config, "GPUIdleShareHigh",
              f'sum by (cluster) (increase(gpu_cost_idle_total{{cost_model="{model}", resource="gpu"}}[6h])\n'
              f'  or increase(gpu_cost_unused_total{{cost_model="{model}", resource="gpu", attribution="idle"}}[6h]))\n'
              f'/ sum by (cluster) (increase(gpu_cost_capacity_total{{cost_model="{model}", resource="gpu"}}[6h]))\n'
              f"> {config.idle_share_max:g}", "1h", "warning",
              "{{ $value | humanizePercentage }} of cluster {{ $labels.cluster }}'s GPU capacity was idle over 6 h",
              "GPU capacity nobody held: scale the node groups down, or move work onto fewer nodes."),
    ]


def _sidecar_alerts(config: AlertsConfig) -> list[dict[str, Any]]:
    """otelgpu down, its series missing, its deliveries failing, lagging, refused or given up."""
    job = config.job
    failures, exports = f'otelgpu_export_failures_total{{job="{job}"}}', f'otelgpu_exports_total{{job="{job}"}}'
    return [
        _alert(config, "OtelgpuDown", f'up{{job="{job}"}} == 0', "5m", "page",
              "otelgpu in cluster {{ $labels.cluster }} is down",
              "The Collector cannot scrape otelgpu's /metrics: the sidecar is not running or not ready. Costs are "
              "computed again from its checkpoint and write-ahead log when it is back."),
        _alert(config, "OtelgpuCostSeriesMissing",
              "count by (cluster) (count_over_time(gpu_cost_capacity_total[3h]))\n"
              "unless count by (cluster) (count_over_time(gpu_cost_capacity_total[20m]))\n"
              f'unless on (cluster) max by (cluster) (otelgpu_series_active{{job="{job}"}}) == 0', "0m", "page",
              "No GPU cost from cluster {{ $labels.cluster }} for 20 minutes",
              "Cost series stopped arriving: otelgpu, its Collector or the remote write to the workspace."),
        _alert(config, "OtelgpuExportFailing",
              _counted(failures, "15m", "cluster, instance, exporter") + "\nunless on (cluster, instance, exporter)\n"
              + _counted(exports, "15m", "cluster, instance, exporter"),
              "5m", "warning", "otelgpu in cluster {{ $labels.cluster }} cannot deliver over {{ $labels.exporter }}",
              "Every delivery failed for 15 minutes; snapshots wait in the queue (otelgpu_exporter_queue_size)."),
        _alert(config, "OtelgpuDeliveryLagging",
              f'otelgpu_interval_closed_timestamp_seconds{{job="{job}"}}\n'
              "- ignoring (exporter) group_right\n"
              f'otelgpu_exporter_delivered_timestamp_seconds{{job="{job}"}}\n'
              f"> {config.delivery_lag_max_seconds:g}", "5m", "warning",
              "otelgpu in cluster {{ $labels.cluster }} is {{ $value | humanizeDuration }} behind delivering "
              "over {{ $labels.exporter }}",
              f"More than {_duration(config.delivery_lag_max_seconds)} of closed intervals (in data time) wait to be "
              "delivered over {{ $labels.exporter }}: the exporter fails or is too slow, or the checkpoint cannot be "
              "written (nothing is released then). otelgpu_interval_checkpointed_timestamp_seconds and "
              "otelgpu_export_failures_total say which."),
        _alert(config, "OtelgpuSnapshotsRefused",
              _counted(f'otelgpu_export_snapshots_carried_total{{job="{job}"}}', "1h", "cluster, instance, exporter"),
              "0m", "warning", "The backend behind {{ $labels.exporter }} refused cost snapshots from cluster "
              "{{ $labels.cluster }}",
              "Snapshots refused for good (samples older than the backend's window, label limits): each series' "
              "last value went with the next snapshot, so no total is lost, but the refused samples' place in "
              "time is; a refusal that repeats means nothing is delivered (OtelgpuExportFailing then fires too)."),
        _alert(config, "OtelgpuSnapshotsDropped",
              _counted(f'otelgpu_export_snapshots_dropped_total{{job="{job}"}}', "1h", "cluster, instance, exporter, reason"),
              "0m", "page", "otelgpu in cluster {{ $labels.cluster }} gave up cost snapshots",
              "Snapshots given up (reason {{ $labels.reason }}): shutdown, undelivered at a stop with no "
              "checkpoint directory to keep them; unreadable, persisted but their file no longer read back (set "
              "aside as .rejected). Their cost is in the next snapshot of each series still live, but the last "
              "totals of series that ended are lost."),
    ]


class _Dumper(yaml.SafeDumper):
    """Multi-line expressions as literal blocks, as people write rule files."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))

HEADER = ("# Generated by: otelgpu rules{args}\n"
          "# Recording and alerting rules for otelgpu's cost series (docs/alerts.md): edit the budgets file\n"
          "# and generate again rather than editing this file.\n")


def _dump(document: dict[str, Any]) -> str:
    return yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)


def rule_file(config: AlertsConfig, args: str = "") -> str:
    return HEADER.format(args=args) + _dump({"groups": rule_groups(config)})


def prometheus_rule(config: AlertsConfig, name: str = "otelgpu", namespace: str = "monitoring", args: str = "") -> str:
    """The same groups as a Prometheus Operator PrometheusRule."""
    manifest = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
                "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/name": "otelgpu"}},
                "spec": {"groups": rule_groups(config)}}
    return HEADER.format(args=args) + _dump(manifest)



def _counted(counter: str, window: str, by: str) -> str:
    """Counts of a labelled counter in the last `window`, per `by`, where any: its increase, and the
    value of a series that appeared in the window (the sidecar exposes a label's series from its
    first count on, so `increase()` alone never sees that first one)."""
    return (f"(sum by ({by}) (increase({counter}[{window}])) > 0\n"
            f" or sum by ({by}) ({counter} unless {counter} offset {window}) > 0)")
