"""`kill -9` at random instants while a Collector-like sender streams and resends whatever was not
acknowledged, and backend outages with series ending during them: read back from a real Prometheus,
every cost total equals an uninterrupted run's exactly and no counter ever resets.

The sender behaves as the Collector's exporter does: it sends each request until it is answered
OK, retrying through refused connections and UNAVAILABLE while the sidecar restarts."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from sidecar import Sidecar
from support import eventually
from test_prometheus_end_to_end import INSTANCE, INTERVAL_S, TOTALS, config, in_process, scenario

from otelgpu.enrich.window import NS

if TYPE_CHECKING:
    from promserver import PrometheusServer

pytest_plugins = ["promserver"]


def send_until_acknowledged(side: Sidecar, request, kill_after_s: float | None = None) -> None:  # noqa: ANN001
    """One request, resent until a sidecar answers OK. With `kill_after_s`, the sidecar is killed
    that long after the first attempt starts (possibly while the request is in flight) and
    restarted from its checkpoint."""
    killer = None
    if kill_after_s is not None:
        killer = threading.Timer(kill_after_s, side.kill)
        killer.start()

    def attempt() -> bool:
        try:
            side.export(request)
            return True
        except grpc.RpcError as err:
            assert err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                                  grpc.StatusCode.DEADLINE_EXCEEDED), err
            if killer is not None:
                killer.join()
            if side.proc is not None and side.proc.poll() is not None:
                side.start()
            return False

    eventually(attempt, timeout=300, message="the sidecar never acknowledged the request")  # retried as the Collector does
    if killer is not None:
        killer.join()
        if side.proc is not None and side.proc.poll() is not None:
            side.start()  # killed after the answer: the next request goes to a fresh process


EFFECTIVE = 'sum by (cost_model, team) (max_over_time(gpu_cost_effective_total{{cluster="{cluster}"}}[2h]))'
TENANTS = 'sum by (cost_model, tenant) (max_over_time(gpu_cost_tenant_total{{cluster="{cluster}"}}[2h]))'
TOKENS = 'sum by (tenant, token_kind) (max_over_time(llm_tokens_total{{cluster="{cluster}"}}[2h]))'


def keyed(prom: PrometheusServer, query: str, cluster: str, at: float) -> dict[tuple[str, ...], float]:
    return {tuple(m.get(k, "") for k in ("cost_model", "tenant", "token_kind")): v
            for m, v in prom.query(query.format(cluster=cluster), at)}


def totals(prom: PrometheusServer, cluster: str, at: float, query: str = TOTALS) -> dict[tuple[str, str], float]:
    return {(m["cost_model"], m["team"]): v for m, v in prom.query(query.format(cluster=cluster), at)}


@pytest.mark.slow
@pytest.mark.parametrize("kernels, fold_rows", [("compiled", None), ("interpreted", None), ("compiled", 1)],
                         ids=["compiled", "interpreted", "folded"])  # interpreted: k8s/node's pods
def test_kill_9_at_random_instants_loses_and_double_counts_nothing(prometheus: PrometheusServer, tmp_path: Path,
                                                                    kernels: str, fold_rows: int | None) -> None:
    """The uninterrupted reference runs compiled kernels in this process, its open intervals too
    small to fold; the killed sidecar runs `kernels`, and with `fold_rows` 1 folds what each open
    interval holds from its first batch on, whenever that doubles (so a kill finds intervals
    folded, and folded again as the log replays): the money is the same, through every kill."""
    c = scenario()
    # The first pod's activity changes at every scrape, so that each interval's effective cost
    # depends on every DCGM sample of it: none may be lost or counted twice across a kill.
    c.pods[0].activity = lambda t_s: 0.2 + 0.15 * (int(t_s // 60) % 5)
    end = c.t0 / NS + 3600
    in_process(c, config("uninterrupted", prometheus.write_url))
    rng = random.Random(20261123)
    requests = c.scrapes(60, 3600)
    kills = set(rng.sample(range(3, len(requests) - 2), 12))
    doc = config("killed", prometheus.write_url, checkpoint={"directory": str(tmp_path / "state")}, kernels=kernels)
    if fold_rows is not None:
        doc["attribution"]["fold_rows"] = fold_rows
    side = Sidecar(tmp_path, doc)
    side.start()
    try:
        for i, request in enumerate(requests):
            # From before the request is decoded to after its interval is checkpointed and exported.
            send_until_acknowledged(side, request, rng.uniform(0.0, 0.1) if i in kills else None)
        assert side.stop() == 0
    finally:
        side.close()
    log = side.log.read_text()
    # Every kill was followed by a start that replayed the log (and continued from a checkpoint,
    # once the first interval had closed).
    starts = [line for line in log.splitlines() if "kernels ready" in line]
    assert len(starts) == len(kills) + 1
    assert all(("scad interpreted" in line) == (kernels == "interpreted") for line in starts)  # as configured
    assert "continuing" in log and "replayed" in log

    reference, killed = totals(prometheus, "uninterrupted", end), totals(prometheus, "killed", end)
    assert killed == pytest.approx(reference, rel=1e-12, abs=1e-12)
    reference, killed = (totals(prometheus, cluster, end, EFFECTIVE) for cluster in ("uninterrupted", "killed"))
    assert reference and killed == pytest.approx(reference, rel=1e-12, abs=1e-12)
    # The serving pod's tenants too: their split and the tokens it is split by (the token counters'
    # last values came back from the checkpoint at every restart: no token counted twice or lost).
    for query in (TENANTS, TOKENS):
        ref, got = keyed(prometheus, query, "uninterrupted", end), keyed(prometheus, query, "killed", end)
        assert ref and got == pytest.approx(ref, rel=1e-12, abs=1e-12)
    tokens = keyed(prometheus, TOKENS, "killed", end)
    assert tokens[("", "acme", "prompt")] == 30.0 * 1440  # 30 a second from the first scrape to the last, at 1440 s
    resets = prometheus.query('resets(gpu_cost_allocated_total{cluster="killed"}[2h])', end)
    assert resets and all(v == 0 for _, v in resets)
    # The node's instance came back with its facts at every restart: one instance_id, never none.
    for metric in ("gpu_cost_allocated_total", "gpu_cost_capacity_total", "gpu_cost_idle_total"):
        instances = {(m.get("node"), m.get("instance_id")) for m, _ in prometheus.query(
            f'count by (node, instance_id) (count_over_time({metric}{{cluster="killed"}}[2h]))', end)}
        assert instances == {("gpu-1", INSTANCE)}, metric
    window = 'sum by (team) (increase(gpu_cost_allocated_total{{cluster="{}", cost_model="request"}}[30m]))'
    for at in (c.t0 / NS + 1800, c.t0 / NS + 2700):
        ref = {m["team"]: v for m, v in prometheus.query(window.format("uninterrupted"), at)}
        got = {m["team"]: v for m, v in prometheus.query(window.format("killed"), at)}
        assert got == pytest.approx(ref, rel=1e-9)


@pytest.mark.slow
def test_kill_9_behind_mutual_tls_and_a_token_with_hostile_traffic_mixed_in(prometheus: PrometheusServer,
                                                                             tmp_path: Path) -> None:
    """The worst day for the secured receiver: the real sidecar behind mutual TLS and a bearer
    token, killed -9 at random instants and restarted, while a client without the token and a
    scrape target outside the trusted jobs (spoofing kube-state-metrics and dcgm-exporter series
    under another job) send alongside the Collector. The money is what an undisturbed run gives,
    to the cent; the intruders are refused, every time, and nothing of theirs is counted."""
    from certs import Authority
    from test_source_trust import rogue

    c = scenario()
    end = c.t0 / NS + 3600
    in_process(c, config("undisturbed", prometheus.write_url))
    ca = Authority(tmp_path / "pki")
    server, client = ca.issue("otelgpu", file="server"), ca.issue("collector", server=False, file="client")
    token = tmp_path / "token"
    token.write_text("collector-token\n")
    secured = {"grpc": {"tls": {"cert_file": str(server.cert), "key_file": str(server.key),
                                "client_ca_file": str(ca.cert)},
                        "auth": {"bearer_token_file": str(token)}}}
    credentials = grpc.ssl_channel_credentials(ca.cert.read_bytes(), client.key.read_bytes(), client.cert.read_bytes())
    side = Sidecar(tmp_path, config("secured", prometheus.write_url, receiver=secured,
                                    checkpoint={"directory": str(tmp_path / "state")}),
                   credentials=credentials, token="collector-token")
    rng = random.Random(20261124)
    requests = c.scrapes(60, 3600)
    kills = set(rng.sample(range(3, len(requests) - 2), 6))
    unauthenticated = 0
    side.start()
    try:
        for i, request in enumerate(requests):
            hostile = rogue(int(request.resource_metrics[0].scope_metrics[0].metrics[0].gauge.data_points[0]
                                .time_unix_nano), teams=20)
            send_until_acknowledged(side, request, rng.uniform(0.0, 0.1) if i in kills else None)
            send_until_acknowledged(side, hostile[0])  # trusted transport, untrusted source: refused points
            with grpc.secure_channel(f"localhost:{side.grpc_port}", credentials) as channel, \
                    pytest.raises(grpc.RpcError) as refused:  # the right certificate, a guessed token
                metrics_service_pb2_grpc.MetricsServiceStub(channel).Export(
                    request, timeout=10, metadata=(("authorization", "Bearer guess"),))
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
            unauthenticated += 1
        assert side.stop() == 0
    finally:
        side.close()
    assert side.log.read_text().count("kernels ready") == len(kills) + 1
    undisturbed, secured_totals = totals(prometheus, "undisturbed", end), totals(prometheus, "secured", end)
    assert secured_totals == pytest.approx(undisturbed, rel=1e-12, abs=1e-12)
    assert unauthenticated == len(requests)


@pytest.mark.slow
def test_restart_during_an_outage_delivers_the_series_that_ended_meanwhile(prometheus: PrometheusServer,
                                                                            tmp_path: Path) -> None:
    c = scenario()  # nlp's pod ends at 25 minutes: its series end while Prometheus is away
    end = c.t0 / NS + 3600
    in_process(c, config("steady", prometheus.write_url))
    state = {"checkpoint": {"directory": str(tmp_path / "state")}}
    # The first process gives up delivering 1 s after SIGTERM (the backend is down); the second
    # has the usual time to deliver what is left.
    first = Sidecar(tmp_path, config("outage-restart", prometheus.write_url, shutdown_timeout_s=1, **state), "first")
    second = Sidecar(tmp_path, config("outage-restart", prometheus.write_url, **state), "second")
    requests = c.scrapes(60, 3600)
    try:
        first.start()
        for request in requests[:15]:
            send_until_acknowledged(first, request)
        first.wait_for("otelgpu_exports_total", 2)
        prometheus.stop()
        for request in requests[15:40]:  # 15 to 40 minutes: nlp ends at 25
            send_until_acknowledged(first, request)
        first.wait_for("otelgpu_export_failures_total", 1)
        assert first.stop() == 0  # SIGTERM while the backend is still down: the queue stays on disk
        prometheus.start(port=prometheus.port)
        second.start()
        for request in requests[40:]:
            send_until_acknowledged(second, request)
        assert second.stop() == 0
    finally:
        first.close()
        second.close()
    assert totals(prometheus, "outage-restart", end) == pytest.approx(totals(prometheus, "steady", end), rel=1e-12)
    # nlp's pod serves tenants: their split and tokens, which ended in the outage too, arrive whole.
    for query in (TENANTS, TOKENS):
        steady = keyed(prometheus, query, "steady", end)
        assert steady and keyed(prometheus, query, "outage-restart", end) == pytest.approx(steady, rel=1e-12)
    # nlp's series were delivered with their last value and then ended (a stale marker).
    last = prometheus.query('max_over_time(gpu_cost_allocated_total{cluster="outage-restart", team="nlp", '
                            'cost_model="request"}[2h])', end)
    assert last and last[0][1] == pytest.approx(5 * 12.0 * INTERVAL_S / 3600)
    assert not prometheus.query('gpu_cost_allocated_total{cluster="outage-restart", team="nlp"}', end)
    resets = prometheus.query('resets(gpu_cost_allocated_total{cluster="outage-restart"}[2h])', end)
    assert all(v == 0 for _, v in resets)


@pytest.mark.slow
def test_kill_9_while_an_interval_computed_ahead_waits_for_its_close(prometheus: PrometheusServer,
                                                                     tmp_path: Path) -> None:
    """Four times, the process is killed once the interval that just ended has been computed
    ahead (attribution.compute_ahead, on by default) and before the scrape that closes it: what
    it computed was never recorded, so the next process computes it again, and the money is the
    uninterrupted run's, which never computes ahead."""
    c = scenario()
    end = c.t0 / NS + 3600
    in_process(c, config("never-ahead", prometheus.write_url))
    side = Sidecar(tmp_path, config("killed-ahead", prometheus.write_url,
                                    checkpoint={"directory": str(tmp_path / "state")}))
    side.start()
    every = INTERVAL_S // 60  # requests per interval: one scrape a minute
    try:
        for i, request in enumerate(c.scrapes(60, 3600)):
            send_until_acknowledged(side, request)
            if i in (every, 2 * every, 3 * every, 4 * every):  # an interval's end: it is complete now
                eventually(lambda: side.metric("otelgpu_work_seconds_total", step="ahead") > 0, timeout=60,
                           message="the interval that just ended was not computed ahead")
                side.kill()  # each process's first interval computed ahead dies with it
                side.start()
        assert side.stop() == 0
    finally:
        side.close()
    reference, killed = totals(prometheus, "never-ahead", end), totals(prometheus, "killed-ahead", end)
    assert killed and killed == pytest.approx(reference, rel=1e-12, abs=1e-12)
    resets = prometheus.query('resets(gpu_cost_allocated_total{cluster="killed-ahead"}[2h])', end)
    assert resets and all(v == 0 for _, v in resets)


SHARED = 'sum by (cost_model, pod, fraction_basis) (max_over_time({metric}{{cluster="{cluster}"}}[2h]))'


@pytest.mark.slow
def test_kill_9_while_gpus_are_shared_out_with_resends_and_forged_grants(prometheus: PrometheusServer,
                                                                          tmp_path: Path) -> None:
    """The worst day for GPU sharing: HAMi and KAI nodes (a fraction job that ends mid-run, whose
    pod phases say how long it ran), with malformed and forged grants mixed in, the real sidecar
    killed -9 at random instants and every third request resent. Every pod's allocated and
    effective cost, by fraction basis, is an undisturbed run's exactly; the malformed grant's pod
    pays its request (GPU-a1 whole), and a pod that requests a GPU and writes itself a KAI
    fraction gets none."""
    import time as clock

    from cluster import Cluster, Pod
    from test_sharing import HAMI, hami_node, hami_pods, kai_cluster

    t0 = (int(clock.time()) // INTERVAL_S * INTERVAL_S - 3600) * NS
    kai = kai_cluster((Pod("team-c", "job", "kai-1", {"runai-gpu-group": "g-1"}, annotations={"gpu-fraction": "0.25"},
                           start_s=600, end_s=1500),))
    hami = Cluster([hami_node()], hami_pods())
    forged = [Pod("t", "malformed", "hami-1", gpu=("nvidia_com_gpu", 1), annotations={HAMI: "GPU-a1,NVIDIA,x,5:"}),
              Pod("t", "cheat", "hami-1", {"runai-gpu-group": "g-1"}, gpu=("nvidia_com_gpu", 1),
                  annotations={"gpu-fraction": "0.01"}, start_s=1800)]
    c = Cluster(hami.nodes + kai.nodes, hami.pods + kai.pods + forged, t0=t0)
    prices = {"prices": {"gpu_hour_by_gpu_model": {"NVIDIA A100-SXM4-40GB": 12.0, "NVIDIA H100 80GB HBM3": 40.0}}}
    doc = config("shared-reference", prometheus.write_url)
    doc["attribution"].update(prices)
    in_process(c, doc)
    rng = random.Random(20261124)
    requests = c.scrapes(60, 3600)
    kills = set(rng.sample(range(3, len(requests) - 2), 6))
    doc = config("shared-killed", prometheus.write_url, checkpoint={"directory": str(tmp_path / "state")})
    doc["attribution"].update(prices)
    side = Sidecar(tmp_path, doc)
    side.start()
    try:
        for i, request in enumerate(requests):
            send_until_acknowledged(side, request, rng.uniform(0.0, 0.1) if i in kills else None)
            if i % 3 == 0:  # the answer was lost: the Collector sends it again
                send_until_acknowledged(side, request)
        assert side.stop() == 0
    finally:
        side.close()
    assert side.log.read_text().count("kernels ready") == len(kills) + 1
    end = c.t0 / NS + 3600

    def by_pod(metric: str, cluster: str) -> dict[tuple[str, str, str], float]:
        return {(m["cost_model"], m.get("pod", ""), m.get("fraction_basis", "")): v
                for m, v in prometheus.query(SHARED.format(metric=metric, cluster=cluster), end)}

    for metric in ("gpu_cost_allocated_total", "gpu_cost_effective_total"):
        ref, got = by_pod(metric, "shared-reference"), by_pod(metric, "shared-killed")
        assert ref and got == pytest.approx(ref, rel=1e-12, abs=1e-12)
    allocated = by_pod("gpu_cost_allocated_total", "shared-killed")
    assert allocated[("request", "infer-a", "hami_cores")] == pytest.approx(0.30 * 12, rel=1e-9)
    assert allocated[("request", "job", "kai_fraction")] == pytest.approx(0.25 * 40 * 900 / 3600, rel=1e-9)
    assert allocated[("request", "malformed", "")] == pytest.approx(12.0, rel=1e-9)  # its request: GPU-a1, whole
    assert not any(pod == "cheat" and basis for _, pod, basis in allocated)
