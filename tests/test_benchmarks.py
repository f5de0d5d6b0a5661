"""The on-demand benchmarks still run (their figures are read by people, not asserted here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_footprint_benchmark_runs_the_node_pod_and_reports_against_its_limits():
    res = subprocess.run([sys.executable, "benchmarks/bench_footprint.py", "--mode", "node", "--hours", "0.1",
                          "--churn-minutes", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    intervals = int(re.search(r"otelgpu: (\d+) intervals computed", out).group(1))
    assert intervals == 5  # 6 minutes of data: the last interval is still open
    assert "0 points rejected" in out and "every 2 min (4 generations)" in out
    delivered = int(re.search(r"([\d,]+) points delivered", out).group(1).replace(",", ""))
    assert delivered > 0
    assert re.search(r"peak / limit \(512Mi\) = \d\.\d\d", out) and re.search(r"/ request \(50m\) = \d", out)


@pytest.mark.slow
def test_fuzz_benchmark_keeps_the_sidecar_alive_and_answering():
    res = subprocess.run([sys.executable, "benchmarks/bench_fuzz.py", "--requests", "300"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "alive at end: True; answering: True; exit status after SIGTERM: 0" in out
    assert int(re.search(r"points rejected: (\d+)", out).group(1)) > 0
    assert "ERROR lines in the sidecar's log: 0" in out
    assert re.search(r"memory at end:   VmRSS \d+ kB", out)


def test_pipeline_benchmark_runs():
    res = subprocess.run([sys.executable, "benchmarks/bench_pipeline.py", "--nodes", "5", "--scrapes", "3"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert re.search(r"decode: [\d,]+ points/s", res.stdout) and re.search(r"ratio \d+x", res.stdout)


@pytest.mark.slow
def test_sharing_benchmark_prices_every_way_of_sharing_and_adds_up():
    res = subprocess.run([sys.executable, "benchmarks/bench_sharing.py", "--nodes", "3", "--grants", "3"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = re.findall(r"^(whole|hami|dra)\s+([\d,]+) pods .* \|allocated \+ idle - capacity\| (\S+)$", res.stdout, re.M)
    assert [(how, int(pods)) for how, pods, _ in rows] == [("whole", 24), ("hami", 72), ("dra", 72)]
    assert all(float(gap) < 1e-9 for *_, gap in rows)


@pytest.mark.slow
def test_overload_benchmark_counts_every_refusal_and_keeps_the_sidecar_within_its_limit():
    res = subprocess.run([sys.executable, "benchmarks/bench_overload.py", "--mode", "node", "--seconds", "2",
                          "--processes", "1", "--outstanding", "60", "--big", "6", "--big-mib", "2"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    answered, counted = map(int, re.search(r"refusals: (\d+) UNAVAILABLE or 503 answers, (\d+) counted", out).groups())
    assert answered == counted
    assert len(re.findall(r"peak +\d+ MiB = \d\.\d\d of the limit", out)) == 6
    assert "no answer" not in out
    assert "alive and answering: True" in out


def test_close_benchmark_reports_every_interval():
    res = subprocess.run([sys.executable, "benchmarks/bench_close.py", "--gpus", "100", "--minutes", "3"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    closes = re.findall(r"interval \d+: +(\d+) MiB before its close, peak +(\d+) MiB during it", res.stdout)
    assert len(closes) == 4  # 3 minutes of 1-minute intervals, the last one flushed
    assert all(int(peak) >= int(before) > 0 for before, peak in closes)
    assert re.search(r"largest ratio x\d\.\d\d, largest step -?\d+ MiB", res.stdout)


def test_bench_bill_reads_the_month_it_wrote():
    res = subprocess.run([sys.executable, "benchmarks/bench_bill.py", "--instances", "20", "--days", "2",
                          "--transfer-lines", "2"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "bill: 3,312 lines (20 instances x 48 hours)" in res.stdout and "960 instance-hours" in res.stdout


@pytest.mark.parametrize("mode", ["memory", "cpu", "stages", "owners"])
def test_bench_profile_names_the_owners_of_memory_and_cpu(mode: str):
    res = subprocess.run([sys.executable, "benchmarks/bench_profile.py", "--gpus", "40", "--minutes", "3", "--mode",
                          mode, "--top", "5"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    if mode == "memory":
        owners = re.findall(r"MiB +\d+\.\d% +(otelgpu/\S+)", res.stdout)
        assert len(owners) == 4 * 5 and all(not o.startswith("otelgpu/demo/") for o in owners)  # 2 moments, 2 views
    elif mode == "stages":  # each interval computed: its peak, and the stages in the order they ran
        peaks = r"^interval ending \d+: peak (\d+\.\d) MiB above the computation's start"
        intervals = re.findall(peaks, res.stdout, re.M)
        ran = re.findall(r"^ +(\w+) \(\w+\) +start +-?\d+\.\d +peak +-?\d+\.\d$", res.stdout, re.M)
        assert intervals and ran[:4] == ["_samples", "_samples", "reported", "dedupe"], res.stdout
        assert ran.count("tenures") == ran.count("attribute") == len(intervals), res.stdout
    elif mode == "owners":
        held = dict(re.findall(r"^  (the store|the open intervals|the decoder) +(\d+\.\d) MiB", res.stdout, re.M))
        assert len(held) == 3 and all(float(mib) > 0 for mib in held.values()), res.stdout
        assert re.search(r"^walked: \d+\.\d MiB; the process .*RSS \d+ MiB$", res.stdout, re.M), res.stdout
    else:
        assert re.search(r"decode: +\d+\.\d\d CPU-s +\d+\.\d\d us a point", res.stdout)
        assert re.search(r"apply and close: +\d+\.\d\d CPU-s", res.stdout) and "close:" in res.stdout
        table = re.search(r"label-set table: ([\d,]+) sets, (\d+\.\d) MiB; the store: ([\d,]+) series", res.stdout)
        assert table and int(table[1].replace(",", "")) > 40 and float(table[2]) > 0, res.stdout


def test_scale_benchmark_splits_a_large_target_as_the_batch_processor_does():
    """bench_scale.py's requests: a target larger than the batch size (kube-state-metrics) in
    pieces, every request within the batch size, and every point of every target sent once."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_footprint as bf
    import bench_scale
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    from otelgpu.demo import scrapes

    nodes, ns_labels = bf.fleet(400, 0)
    targets = [scrapes.ksm(nodes, ns_labels, 7)] + [bf.dcgm(node, 7, 0.3) for node in nodes[:40]]
    assert bf.points(targets[0]) > bf.BATCH_POINTS

    def points_of(messages: list) -> list[tuple]:
        return sorted((rm.resource.SerializeToString(), metric.name, metric.WhichOneof("data"),
                       point.SerializeToString())
                      for rm in messages for scope in rm.scope_metrics for metric in scope.metrics
                      for point in getattr(metric, metric.WhichOneof("data")).data_points)

    requests = [(ExportMetricsServiceRequest.FromString(raw), n) for raw, n in bench_scale.encoded(targets)]
    assert all(0 < n <= bf.BATCH_POINTS for _, n in requests)
    assert [n for _, n in requests] == [sum(map(bf.points, r.resource_metrics)) for r, _ in requests]
    assert points_of([rm for r, _ in requests for rm in r.resource_metrics]) == points_of(targets)


def test_scale_benchmark_churn_renames_one_group_of_nodes_pods_and_nothing_else():
    """bench_scale.py's --churn-nodes: a churn gives the pods of one group of nodes new names in
    every request that names them (dcgm-exporter, kube-state-metrics, the kubelet), in turn, and
    changes no other value, point or count; without churn the same points are sent."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_footprint as bf
    import bench_scale
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    nodes, ns_labels = bf.fleet(12, 0)
    plain, churning = bench_scale.Scrapes(nodes, ns_labels), bench_scale.Scrapes(nodes, ns_labels, churn_nodes=5)
    assert len(churning.groups) == 3 and len(plain.groups) == 1

    def values(load: bench_scale.Scrapes) -> list[tuple]:
        """Every point of a scrape with the kubelet's, each as its target, metric and labels."""
        return sorted((rm.resource.SerializeToString(), metric.name, point.time_unix_nano,
                       tuple((kv.key, kv.value.string_value) for kv in point.attributes))
                      for raw, _ in load.at(1_790_000_000 * 10**9, with_kubelet=True)  # both stamped so
                      for rm in ExportMetricsServiceRequest.FromString(raw).resource_metrics
                      for scope in rm.scope_metrics for metric in scope.metrics
                      for point in getattr(metric, metric.WhichOneof("data")).data_points)

    before = values(churning)
    assert before == values(plain)
    pods_of_group = {p.name for n in nodes[:5] for p in [d.holder for d in n.devices] + n.shared if p}
    assert churning.churn() == len(pods_of_group) > 0
    after = values(churning)
    assert len(after) == len(before)
    renamed = set()
    for old, new in zip(before, after):
        assert old[:3] == new[:3]
        for (key, was), (key_now, now) in zip(old[3], new[3]):
            assert key == key_now
            if was != now:
                assert key == "pod" and was in pods_of_group and now == was[:-1] + "1", (key, was, now)
                renamed.add(was)
    assert renamed == pods_of_group
    assert not {value for point in after for key, value in point[3] if key == "pod"} & pods_of_group  # none left
    assert sum(n for _, n in churning.every) == sum(n for _, n in plain.every)
    churning.churn()  # the next group's turn: the first keeps its new names
    assert ({value for point in values(churning) for key, value in point[3] if key == "pod"}
            >= {pod[:-1] + "1" for pod in pods_of_group})


def test_scale_benchmark_sends_what_the_shipped_collector_forwards():
    """bench_scale.py's load by default: the points of the metrics otelgpu reads (filter/otelgpu's
    READ_NAMES), each as the unfiltered load has it; `unfiltered`: dcgm-exporter's other default
    counters too."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_footprint as bf
    import bench_scale
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    from otelgpu.receiver.schema import READ_NAMES

    nodes, ns_labels = bf.fleet(6, 0)

    def points_of(load: bench_scale.Scrapes) -> list[tuple]:
        return sorted((rm.resource.SerializeToString(), metric.name, point.SerializeToString())
                      for raw, _ in load.at(1_790_000_000 * 10**9, with_kubelet=True)
                      for rm in ExportMetricsServiceRequest.FromString(raw).resource_metrics
                      for scope in rm.scope_metrics for metric in scope.metrics
                      for point in getattr(metric, metric.WhichOneof("data")).data_points)

    forwarded = points_of(bench_scale.Scrapes(nodes, ns_labels))
    everything = points_of(bench_scale.Scrapes(nodes, ns_labels, unfiltered=True))
    assert forwarded == [p for p in everything if p[1] in READ_NAMES]
    assert {p[1] for p in everything} - READ_NAMES >= set(bf.DCGM_GAUGES) - READ_NAMES
    assert len(everything) > 2 * len(forwarded)
