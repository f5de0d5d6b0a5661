"""Grafana dashboards for otelgpu's cost series, built with grafana-foundation-sdk:

    python monitoring/dashboards/build.py    # writes executive.json, oncall.json, debug.json here

- executive: spend by team, project, model and cost center; allocated, effective, waste, idle;
  cost per GPU-hour; the trend; top spenders; the cost models side by side;
- on-call: burn rate against the budgets (`otelgpu rules`), tag coverage and unattributed cost,
  idle capacity by node and GPU model, GPUs without device data or price, the sidecar's exports
  and how far behind each of its stages is;
- debug: per node, GPU, MIG slice and replica; activity; the sidecar's own health.

Every dashboard has a data source, `cluster` and `cost_model` variable, and a `resolution`
constant: the graphs' minimum step, twice otelgpu's attribution interval (each series gets one
sample per interval, and a rate needs two). Totals over the time range are exact, as `otelgpu
report` reads them: each series' last value in the range less its last value before it (0 for a
series born inside the range), never `increase()`'s extrapolation beyond a series' first and last
samples. The one thing they cannot see is a series that ended and started again inside the range
(a pod that held a unit, stopped, and held one again under the same name): the "Restarted series"
panel counts those and bounds what they leave out. Rates per hour (`$__rate_interval`) are trends,
not totals. Money panels add `allocated` and `unused` (what a group is charged) under one cost
model, never across models.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

from grafana_foundation_sdk.builders import bargauge, dashboard, prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, GridPos, VariableRefresh

HERE = Path(__file__).resolve().parent
SOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'cluster=~"$cluster", cost_model="$cost_model"'
ALLOCATED = f"gpu_cost_allocated_total{{{SEL}}}"
UNUSED = f"gpu_cost_unused_total{{{SEL}}}"
CLUSTER = 'cluster=~"$cluster"'
SELF = 'job="otelgpu", cluster=~"$cluster"'
GPU_ALLOCATED = f'gpu_cost_allocated_total{{{SEL}, resource="gpu"}}'
HELD = f"gpu_held_seconds_total{{{CLUSTER}}}"
RESOLUTION = "2m"  # graphs' minimum step: twice otelgpu's attribution interval (60 s by default)


LOOKBACK = "7d"  # how far before the range a series' last value is looked for (`otelgpu report --lookback`)


def exact(selector: str) -> str:
    """Each series' increase over the range, exactly: its last value in the range less its last
    value before the range, where that is no more than its smallest value in the range; a series
    born inside the range, or that started again after ending before it, counts from 0."""
    now = f"last_over_time({selector}[$__range])"
    before = f"last_over_time({selector}[{LOOKBACK}] offset $__range)"
    return f"({now} - ({before} <= min_over_time({selector}[$__range]) or {now} * 0))"


def total(selector: str, by: str = "", also: str = "") -> str:
    """The sum over the time range of one metric's series (and of `also`'s, another metric's:
    their series kept apart before the sum), optionally grouped."""
    group = f" by ({by})" if by else ""
    if not also:
        return f"sum{group} {exact(selector)}"
    return (f'sum{group} (label_replace({exact(selector)}, "part", "a", "", "") or '
            f'label_replace({exact(also)}, "part", "b", "", ""))')


def restarted(*selectors: str) -> tuple[str, str]:
    """How many series of these metrics ended and started again inside the range, and at most what
    their earlier lives in the range add (each such series' largest value in it)."""
    again = [f"resets({selector}[$__range]) > 0" for selector in selectors]
    count = " + ".join(f"(count({a}) or vector(0))" for a in again)
    bound = " + ".join(f"(sum(max_over_time({selector}[$__range]) and {a}) or vector(0))"
                       for selector, a in zip(selectors, again))
    return count, bound


def hourly(selector: str, by: str = "", also: str = "") -> str:
    """The trend per hour of one metric's series (and `also`'s, kept apart before the sum)."""
    group = f" by ({by})" if by else ""
    if not also:
        return f"3600 * sum{group} (rate({selector}[$__rate_interval]))"
    return (f'3600 * sum{group} (label_replace(rate({selector}[$__rate_interval]), "part", "a", "", "") or '
            f'label_replace(rate({also}[$__rate_interval]), "part", "b", "", ""))')


def idle(extra: str = "") -> tuple[str, str]:
    """Capacity nobody held: kept as idle, or booked to the platform tags (`idle.policy: platform`)."""
    return f"gpu_cost_idle_total{{{SEL}{extra}}}", f'gpu_cost_unused_total{{{SEL}{extra}, attribution="idle"}}'

class Layout:
    """Panels placed left to right on a 24-column grid, wrapping to a new row."""

    def __init__(self) -> None:
        self.x = self.y = self.row_h = 0

    def place(self, w: int, h: int) -> GridPos:
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        pos = GridPos(h=h, w=w, x=self.x, y=self.y)
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos


class Board:
    def __init__(self, uid: str, title: str, description: str) -> None:
        self.layout = Layout()
        self.d = (dashboard.Dashboard(title).uid(uid).description(description).tags(["otelgpu", "gpu", "cost"])
                  .time("now-7d", "now").refresh("5m").timezone("utc")
                  .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
                  .with_variable(_query_variable("cluster", "Cluster", "label_values(gpu_cost_capacity_total, cluster)",
                                                 multi=True))
                  .with_variable(_query_variable("cost_model", "Cost model",
                                                 "label_values(gpu_cost_capacity_total, cost_model)"))
                  .with_variable(dashboard.ConstantVariable("resolution").value(RESOLUTION)))

    def add(self, builder: Callable[[], Any], title: str, description: str, exprs: list[tuple[str, str]],
            unit: str = "currencyUSD", w: int = 8, h: int = 8, instant: bool = False) -> None:
        """A panel of `builder` with one query per (expression, legend)."""
        panel = (builder().title(title).description(description).datasource(SOURCE).unit(unit)
                 .grid_pos(self.layout.place(w, h)))
        if not instant:  # a rate needs two samples: otelgpu writes one per attribution interval
            panel = panel.interval("$resolution")
        for ref, (expr, legend) in zip("ABCDEFGH", exprs):
            query = prometheus.Dataquery().expr(expr).ref_id(ref).legend_format(legend)
            panel = panel.with_target(query.instant() if instant else query.range())
        self.d = self.d.with_panel(panel)

    def json(self) -> str:
        return json.dumps(self.d.build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def _query_variable(name: str, label: str, query: str, multi: bool = False) -> dashboard.QueryVariable:
    v = (dashboard.QueryVariable(name).label(label).datasource(SOURCE).query(query)
         .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED))
    return v.multi(True).include_all(True) if multi else v


def executive() -> Board:
    b = Board("otelgpu-executive", "GPU cost: executive",
              "Who spent what on GPUs over the time range, under one cost model (otelgpu).")
    b.add(stat.Panel, "Charged", "Allocated + unused: what the teams are charged.", [(total(ALLOCATED, also=UNUSED), "")], w=6, h=4,
          instant=True)
    b.add(stat.Panel, "Capacity", "The cost of the GPU capacity (and, under scad, the instances) the model splits.",
          [(total(f"gpu_cost_capacity_total{{{SEL}}}"), "")], w=6, h=4, instant=True)
    b.add(stat.Panel, "Idle share", "Capacity nobody held, over the capacity.",
          [(f'{total(idle()[0], also=idle()[1])} / {total(f"gpu_cost_capacity_total{{{SEL}}}")}', "")],
          unit="percentunit", w=6, h=4, instant=True)
    b.add(stat.Panel, "Cost per GPU-hour", "Allocated GPU cost over the GPU-hours held.",
          [(f"{total(GPU_ALLOCATED)} / ({total(HELD)} / 3600)", "")], w=6, h=4, instant=True)
    count, bound = restarted(ALLOCATED, UNUSED)
    b.add(stat.Panel, "Restarted series", "Charged series that ended and started again inside the time range (a "
          "pod that held a unit, stopped, and held one again under its name). 0: every total on this dashboard is "
          "exact, as `otelgpu report` gives it. Otherwise their earlier lives in the range are left out of the "
          "totals here (next panel: by at most how much); `otelgpu report` counts them.",
          [(count, "")], unit="none", w=12, h=3, instant=True)
    b.add(stat.Panel, "Left out by restarted series, at most", "The most the totals here leave out: the largest "
          "value in the range of each restarted series (0: nothing).", [(bound, "")], w=12, h=3, instant=True)
    for tag in ("team", "project", "model", "cost_center"):
        b.add(bargauge.Panel, f"Charged by {tag.replace('_', ' ')}", f"Allocated + unused per {tag}.",
              [(f"sort_desc({total(ALLOCATED, tag, UNUSED)})", f"{{{{{tag}}}}}")], w=6, h=8, instant=True)
    tenant_cost = f"gpu_cost_tenant_total{{{SEL}}}"
    b.add(bargauge.Panel, "Charged by tenant", "Shared inference pods' cost split among the tenants they served, "
          "by weighted tokens (served model and tenant; '(no tokens)': intervals a pod served nothing).",
          [(f"sort_desc({total(tenant_cost, 'tenant, served_model')})", "{{tenant}} {{served_model}}")],
          w=12, h=8, instant=True)
    b.add(table.Panel, "Cost per million tokens", "Each tenant's cost over the tokens it was served "
          "(prompt and generation), per served model.",
          [(f"{total(tenant_cost, 'tenant, served_model')} / "
            f"({total(f'llm_tokens_total{{{CLUSTER}}}', 'tenant, served_model')} > 0) * 1e6", "")],
          w=12, h=8, instant=True)
    b.add(timeseries.Panel, "Allocated, effective, waste and idle per hour",
          "Allocated = effective + waste + unmeasured; idle: capacity nobody held. A trend: rates over each step "
          "are estimates; the totals above are exact.",
          [(hourly(f"gpu_cost_allocated_total{{{SEL}}}"), "allocated"),
           (hourly(f"gpu_cost_effective_total{{{SEL}}}"), "effective"),
           (hourly(f"gpu_cost_waste_total{{{SEL}}}"), "waste"),
           (hourly(idle()[0], also=idle()[1]), "idle")], unit="currencyUSD", w=12, h=9)
    b.add(timeseries.Panel, "Charged per hour by team", "The trend of each team's charge (an estimate per step; "
          "the totals are exact).",
          [(hourly(ALLOCATED, "team", UNUSED), "{{team}}")], w=12, h=9)
    b.add(table.Panel, "Top spenders", "The ten workloads charged most over the time range.",
          [(f"topk(10, {total(ALLOCATED, 'cluster, namespace, workload_kind, workload_name', UNUSED)})", "")], w=12, h=9,
          instant=True)
    b.add(table.Panel, "Cost models side by side", "Each model's charge per team (the models split the same "
          "capacity differently; never add them up).",
          [(total(f"gpu_cost_allocated_total{{{CLUSTER}}}", "cost_model, team", f"gpu_cost_unused_total{{{CLUSTER}}}"), "")],
          w=12, h=9, instant=True)
    return b


def oncall() -> Board:
    b = Board("otelgpu-oncall", "GPU cost: on-call", "Budgets, attribution quality and the pipeline (otelgpu).")
    b.add(timeseries.Panel, "Burn rate against budget",
          "Each team's charge per hour over its planned rate (team budgets from `otelgpu rules`): 1 spends the "
          "30-day budget in 30 days; the alerts warn at 2 and page at 4.",
          [("team:gpu_cost_usd_per_hour:rate1h / on (team) team:gpu_cost_budget_usd_per_hour", "{{team}}")],
          unit="none", w=12, h=8)
    b.add(timeseries.Panel, "Tag coverage", "Share of allocated cost carrying all five tags, per cluster.",
          [(f'gpu_cost_tag_coverage_ratio{{{CLUSTER}, tag="all", namespace=""}}', "{{cluster}}")],
          unit="percentunit", w=12, h=8)
    b.add(table.Panel, "Unattributed cost by reason", "no_pod, pod_unknown, tag_missing; per namespace.",
          [(total(f"gpu_cost_unattributed_total{{{CLUSTER}}}", "reason, namespace"), "")], w=12, h=8, instant=True)
    b.add(table.Panel, "Idle by node and GPU model", "GPU capacity nobody held.",
          [(total(idle(', resource="gpu"')[0], "cluster, node, gpu_model", idle(', resource="gpu"')[1]), "")], w=12, h=8,
          instant=True)
    b.add(timeseries.Panel, "GPUs without device data or price", "GPU-seconds costed from kube-state-metrics alone, "
          "and GPU-seconds without a price.",
          [(f"sum by (cluster) (rate(otelgpu_gpu_seconds_without_device_data_total{{{SELF}}}[$__rate_interval]))",
            "{{cluster}} without device data"),
           (f"sum by (cluster) (rate(otelgpu_unpriced_gpu_seconds_total{{{SELF}}}[$__rate_interval]))",
            "{{cluster}} unpriced")], unit="none", w=12, h=8)
    b.add(timeseries.Panel, "Exports", "Snapshots delivered and failed attempts per exporter, and the queue.",
          [(f"sum by (cluster, exporter) (rate(otelgpu_exports_total{{{SELF}}}[$__rate_interval]))", "{{cluster}} {{exporter}} ok"),
           (f"sum by (cluster, exporter, reason) (rate(otelgpu_export_failures_total{{{SELF}}}[$__rate_interval]))",
            "{{cluster}} {{exporter}} {{reason}}"),
           (f"otelgpu_exporter_queue_size{{{SELF}}}", "{{cluster}} {{exporter}} queued")], unit="none", w=12, h=8)
    b.add(timeseries.Panel, "Lag", "How far behind the present each stage is, in data time, for the sidecar furthest "
          "behind: the data the scrapes brought (watermark), the intervals closed, checkpointed, and delivered per "
          "exporter. Delivered far behind closed: the exporter or the checkpoint (OtelgpuDeliveryLagging).",
          [(f"time() - min by (cluster) (otelgpu_watermark_timestamp_seconds{{{SELF}}})", "{{cluster}} data"),
           (f"time() - min by (cluster) (otelgpu_interval_closed_timestamp_seconds{{{SELF}}})", "{{cluster}} closed"),
           (f"time() - min by (cluster) (otelgpu_interval_checkpointed_timestamp_seconds{{{SELF}}} > 0)",
            "{{cluster}} checkpointed"),
           (f"time() - min by (cluster, exporter) (otelgpu_exporter_delivered_timestamp_seconds{{{SELF}}})",
            "{{cluster}} {{exporter}} delivered")], unit="s", w=24, h=8)
    b.add(stat.Panel, "Sidecars up", "otelgpu's /metrics scraped by the Collector.",
          [(f"sum by (cluster) (up{{{SELF}}})", "{{cluster}}")], unit="none", w=12, h=4, instant=True)
    b.add(stat.Panel, "Cost series arriving", "Cost series written in the last 15 minutes, per cluster.",
          [(f"count by (cluster) (count_over_time(gpu_cost_capacity_total{{{CLUSTER}}}[15m]))", "{{cluster}}")],
          unit="none", w=12, h=4, instant=True)
    return b


def debug() -> Board:
    b = Board("otelgpu-debug", "GPU cost: debug", "Per node, GPU, MIG slice and replica; the sidecar's health.")
    b.add(table.Panel, "Cost per node", "Capacity, allocated and idle per node.",
          [(total(f"gpu_cost_capacity_total{{{SEL}}}", "cluster, node, instance_type, capacity_type, price_source"), "")],
          w=12, h=9, instant=True)
    b.add(table.Panel, "GPU-hours by unit", "GPU-hours held per node, unit kind (gpu, mig, replica) and MIG profile.",
          [(f"{total(HELD, 'cluster, node, unit_kind, mig_profile')} / 3600", "")],
          unit="h", w=12, h=9, instant=True)
    b.add(table.Panel, "Pods on GPUs", "Allocated, effective and waste per pod.",
          [(total(f"gpu_cost_allocated_total{{{SEL}}}", "cluster, namespace, pod, node, unit_kind, mig_profile"), ""),
           (total(f"gpu_cost_waste_total{{{SEL}}}", "cluster, namespace, pod, node, unit_kind, mig_profile"), "")],
          w=24, h=9, instant=True)
    b.add(timeseries.Panel, "Activity", "Time-weighted activity of the units each pod held, last interval.",
          [(f"gpu_activity_ratio{{{CLUSTER}}}", "{{namespace}}/{{pod}} {{unit_kind}} {{mig_profile}}")],
          unit="percentunit", w=24, h=8)
    b.add(timeseries.Panel, "Points received and rejected", "Per second, by reason.",
          [(f"sum by (cluster) (rate(otelgpu_points_received_total{{{SELF}}}[$__rate_interval]))", "{{cluster}} received"),
           (f"sum by (cluster, metric, reason) (rate(otelgpu_points_rejected_total{{{SELF}}}[$__rate_interval]))",
            "{{cluster}} rejected {{metric}} {{reason}}"),
           (f"sum by (cluster) (rate(otelgpu_points_late_total{{{SELF}}}[$__rate_interval]))", "{{cluster}} late")],
          unit="none", w=12, h=8)
    b.add(timeseries.Panel, "Work per interval", "Seconds spent per step, per interval.",
          [(f"sum by (cluster, step) (rate(otelgpu_work_seconds_total{{{SELF}}}[$__rate_interval])) / on (cluster) "
            f"group_left sum by (cluster) (rate(otelgpu_intervals_computed_total{{{SELF}}}[$__rate_interval]))",
            "{{cluster}} {{step}}")], unit="s", w=12, h=8)
    b.add(timeseries.Panel, "Series and checkpoints", "Live cost series; checkpoint and write-ahead log errors.",
          [(f"otelgpu_series_active{{{SELF}}}", "{{cluster}} series"),
           (f"sum by (cluster, reason) (increase(otelgpu_checkpoint_errors_total{{{SELF}}}[$__rate_interval]))",
            "{{cluster}} checkpoint {{reason}}"),
           (f"sum by (cluster, error) (increase(otelgpu_wal_errors_total{{{SELF}}}[$__rate_interval]))",
            "{{cluster}} wal {{error}}")], unit="none", w=24, h=8)
    return b


BOARDS = {"executive": executive, "oncall": oncall, "debug": debug}


def main(out: Path = HERE) -> int:
    for name, build in BOARDS.items():
        (out / f"{name}.json").write_text(build().json())
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE))
