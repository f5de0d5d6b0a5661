"""The Collector configs as each pod runs them (its --config files merged, its environment
expanded): pipelines without a loop through otelgpu, endpoints that match otelgpu's config,
plaintext only over loopback, scrape configs Prometheus itself accepts, and the otelgpu config
inside the manifests accepted by `otelgpu serve`'s validator."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import yaml
from manifests import (
    COLLECTOR_CONFIG,
    ENV_REF,
    MODES,
    REPO,
    collector_config,
    combinations,
    otelgpu_config,
    pod,
    render,
)
from prometheus_client.parser import text_string_to_metric_families
from support import fixtures_dir

from otelgpu.receiver.schema import KSM_METRICS

LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
PODS = combinations()
IDS = ["+".join((mode, *components)) for mode, components in PODS]


def _host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return ("127.0.0.1" if host in LOOPBACK else host), int(port)


def _same(a: str, b: str) -> bool:
    (ha, pa), (hb, pb) = _host_port(a), _host_port(b)
    return pa == pb and (ha == hb or "0.0.0.0" in (ha, hb))


def flow(config: dict, otelgpu) -> dict[str, set[str]]:
    """Who feeds whom: receiver -> exporter through each pipeline, the Collector's exporter to
    otelgpu when it targets otelgpu's gRPC receiver, otelgpu to the Collector's receiver its OTLP
    exporter targets."""
    edges: dict[str, set[str]] = {}
    for pipeline in config["service"]["pipelines"].values():
        for receiver in pipeline["receivers"]:
            edges.setdefault(f"receiver {receiver}", set()).update(f"exporter {e}" for e in pipeline["exporters"])
    for name, exporter in config["exporters"].items():
        if name.split("/")[0] == "otlp_grpc" and _same(exporter["endpoint"], otelgpu.receiver.grpc.endpoint):
            edges.setdefault(f"exporter {name}", set()).add("otelgpu")
    for name, receiver in config["receivers"].items():
        grpc = (receiver.get("protocols") or {}).get("grpc") if name.split("/")[0] == "otlp" else None
        if grpc and _same(grpc["endpoint"], otelgpu.exporter.otlp.endpoint):
            edges.setdefault("otelgpu", set()).add(f"receiver {name}")
    return edges


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), list(edges.get(start, ()))
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(edges.get(node, ()))
    return seen


@pytest.mark.parametrize("mode,components", PODS, ids=IDS)
def test_data_flows_through_otelgpu_once_and_never_back(mode, components, tmp_path, monkeypatch):
    p = pod(render(mode, components))
    config, otelgpu = collector_config(p), otelgpu_config(p, tmp_path, monkeypatch)
    edges = flow(config, otelgpu)
    assert "otelgpu" in reachable(edges, "receiver prometheus"), "scrapes never reach otelgpu"
    downstream = reachable(edges, "otelgpu")
    assert "exporter prometheus_remote_write/amp" in downstream, "cost never reaches AMP"
    assert "otelgpu" not in downstream, "a loop: otelgpu's output comes back to its input"
    assert "otelgpu" not in reachable(edges, "receiver prometheus/self"), "otelgpu would cost its own metrics"
    assert "exporter prometheus_remote_write/amp" in reachable(edges, "receiver prometheus/self")
    # The cost reaches AMP once: over OTLP. The self scrape of /metrics carries otelgpu's own
    # metrics only, or every cost series would be stored twice (two job/instance label sets) and
    # every sum in AMP would double.
    assert otelgpu.exporter.otlp is not None and otelgpu.exporter.prometheus.cost_series is False
    (own,) = [job for job in config["receivers"]["prometheus/self"]["config"]["scrape_configs"]
              if job["job_name"] == "otelgpu"]
    assert own["metric_relabel_configs"] == [{"source_labels": ["__name__"], "regex": "otelgpu_.*", "action": "keep"}]
    # otelgpu's output goes only to AMP, never to a pipeline that also carries its inputs
    assert {n for n in downstream if n.startswith("exporter")} == {"exporter prometheus_remote_write/amp"}


def test_the_loop_check_would_catch_a_loop(tmp_path, monkeypatch):
    p = pod(render("gateway"))
    config, otelgpu = collector_config(p), otelgpu_config(p, tmp_path, monkeypatch)
    config["service"]["pipelines"]["metrics/cost"]["exporters"].append("otlp_grpc/otelgpu")
    assert "otelgpu" in reachable(flow(config, otelgpu), "otelgpu")


@pytest.mark.parametrize("mode,components", PODS, ids=IDS)
def test_every_pipeline_names_declared_components_and_every_declared_one_is_used(mode, components):
    config = collector_config(pod(render(mode, components)))
    service = config["service"]
    used = {kind: set() for kind in ("receivers", "processors", "exporters")}
    for name, pipeline in service["pipelines"].items():
        assert name.split("/")[0] == "metrics", name
        assert pipeline["processors"][0] == "memory_limiter", f"{name}: memory_limiter must come first"
        assert pipeline["processors"][-1] == "batch", f"{name}: batch last, after anything that drops data"
        for kind in used:
            assert set(pipeline[kind]) <= set(config[kind]), (name, kind)
            used[kind] |= set(pipeline[kind])
    for kind, names in used.items():
        assert names == set(config[kind]), f"declared but unused {kind}: {set(config[kind]) - names}"
    assert set(service["extensions"]) == set(config["extensions"])
    assert config["exporters"]["prometheus_remote_write/amp"]["auth"]["authenticator"] in service["extensions"]


@pytest.mark.parametrize("mode,components", PODS, ids=IDS)
def test_plaintext_only_over_loopback_and_endpoints_match_otelgpu(mode, components, tmp_path, monkeypatch):
    p = pod(render(mode, components))
    config, otelgpu = collector_config(p), otelgpu_config(p, tmp_path, monkeypatch)
    for name, exporter in config["exporters"].items():
        if (exporter.get("tls") or {}).get("insecure"):
            assert _host_port(exporter["endpoint"])[0] == "127.0.0.1", name
        if name.startswith("prometheus_remote_write"):
            assert exporter["endpoint"].startswith("https://aps-workspaces."), name
    for name, receiver in config["receivers"].items():
        if name == "otlp/nvml":  # the NVML agents', on the pod's address behind a NetworkPolicy (test_nvml_component.py)
            continue
        if name.split("/")[0] == "otlp":
            assert all(_host_port(proto["endpoint"])[0] == "127.0.0.1" for proto in receiver["protocols"].values())
    # otelgpu listens and sends only over loopback too, and its ports are the ones the Collector uses
    assert _host_port(otelgpu.receiver.grpc.endpoint) == _host_port(config["exporters"]["otlp_grpc/otelgpu"]["endpoint"])
    assert not otelgpu.receiver.http.enabled
    assert _host_port(otelgpu.exporter.otlp.endpoint) == _host_port(
        config["receivers"]["otlp/cost"]["protocols"]["grpc"]["endpoint"])
    assert otelgpu.exporter.otlp.tls.insecure and _host_port(otelgpu.exporter.otlp.endpoint)[0] == "127.0.0.1"
    # the health endpoints the probes call are where the configs listen
    health = _host_port(config["extensions"]["health_check"]["endpoint"])
    assert health == ("", p.container("otel-collector")["ports"][0]["containerPort"])  # every interface
    metrics_port = next(port["containerPort"] for port in p.container("otelgpu")["ports"] if port["name"] == "metrics")
    assert _host_port(otelgpu.exporter.prometheus.endpoint) == ("0.0.0.0", metrics_port)


@pytest.mark.parametrize("mode,components", PODS, ids=IDS)
def test_every_series_in_amp_says_its_cluster(mode, components, tmp_path, monkeypatch):
    p = pod(render(mode, components))
    config, otelgpu = collector_config(p), otelgpu_config(p, tmp_path, monkeypatch)
    amp = config["exporters"]["prometheus_remote_write/amp"]
    assert amp["external_labels"] == {"cluster": p.env("otel-collector")["CLUSTER_NAME"]}
    assert otelgpu.cluster.name == amp["external_labels"]["cluster"]
    assert config["extensions"]["sigv4auth"] == {"region": p.env("otel-collector")["AMP_REGION"], "service": "aps"}


@pytest.mark.parametrize("mode", MODES)
def test_the_otelgpu_config_in_the_manifests_passes_the_serve_validator(mode, tmp_path):
    """`otelgpu check-config` (what `serve` runs first) on the mounted file, in the container's env."""
    p = pod(render(mode))
    path = tmp_path / "otelgpu.yaml"
    path.write_text(p.mounted("otelgpu", p.otelgpu_config_path()))
    run = subprocess.run([sys.executable, "-m", "otelgpu", "check-config", str(path)], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin", **p.env("otelgpu")}, cwd=REPO, timeout=60)
    assert run.returncode == 0, run.stderr
    # and without the container's environment it would not pass: the check is real
    bare = subprocess.run([sys.executable, "-m", "otelgpu", "check-config", str(path)], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin"}, cwd=REPO, timeout=60)
    assert bare.returncode == 2 and "CLUSTER_NAME" in bare.stderr


def _bytes(quantity: str) -> int:
    """A Kubernetes quantity in Ki, Mi or Gi, in bytes."""
    return int(quantity[:-2]) * {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}[quantity[-2:]]


@pytest.mark.parametrize("mode,components", PODS, ids=IDS)
def test_the_queue_to_otelgpu_is_on_a_volume_of_the_collectors_own_with_room_for_it(mode, components):
    """otlp_grpc/otelgpu's sending queue is in a file_storage extension whose directory is a volume
    mounted in the Collector's container only (an emptyDir outlives a restart of that container),
    holding three times the file's max_size (the file, a compaction's copy beside it, a corrupt file
    set aside at start): a pod whose emptyDir passes its sizeLimit is evicted, and the queue with it."""
    p = pod(render(mode, components))
    config = collector_config(p)
    queue = config["exporters"]["otlp_grpc/otelgpu"]["sending_queue"]
    storage = config["extensions"][queue["storage"]]
    assert queue["storage"] in config["service"]["extensions"]
    assert queue["sizer"] == "bytes" and 0 < queue["queue_size"] < storage["max_size"]
    # The compacted copy replaces the file by a rename: on the same volume.
    assert storage["directory"] == storage["compaction"]["directory"]
    mounts = {m["mountPath"]: m["name"] for m in p.container("otel-collector")["volumeMounts"]}
    name = mounts[storage["directory"]]
    assert [c["name"] for c in p.containers() if any(m["name"] == name for m in c.get("volumeMounts", []))] == \
        ["otel-collector"]
    volume = next(v for v in p.spec["volumes"] if v["name"] == name)
    if "persistentVolumeClaim" in volume:
        claim = next(o for o in p.objects if o["kind"] == "PersistentVolumeClaim"
                     and o["metadata"]["name"] == volume["persistentVolumeClaim"]["claimName"])
        room = _bytes(claim["spec"]["resources"]["requests"]["storage"])
    else:
        room = _bytes(volume["emptyDir"]["sizeLimit"])
    assert room >= 3 * storage["max_size"], (room, storage["max_size"])


@pytest.mark.parametrize("mode", MODES)
def test_the_node_mode_scrapes_and_watches_only_its_node(mode, tmp_path, monkeypatch):
    p = pod(render(mode))
    otelgpu = otelgpu_config(p, tmp_path, monkeypatch)
    jobs = {job["job_name"]: job for job in collector_config(p)["receivers"]["prometheus"]["config"]["scrape_configs"]}
    node = p.env("otel-collector").get("NODE_NAME")
    if mode == "node":
        assert otelgpu.kubernetes.scope == "node" and otelgpu.kubernetes.node_name == node
        assert set(jobs) == {"dcgm-exporter", "kubelet-cadvisor", "vllm"}  # kube-state-metrics describes the whole cluster
        for job in jobs.values():
            (sd,) = job["kubernetes_sd_configs"]
            (selector,) = sd["selectors"]
            field = {"pod": f"spec.nodeName={node}", "node": f"metadata.name={node}"}[sd["role"]]
            assert selector == {"role": sd["role"], "field": field}
    else:
        assert otelgpu.kubernetes.scope == "cluster"
        assert set(jobs) == {"dcgm-exporter", "kube-state-metrics", "kubelet-cadvisor", "vllm"}
        assert all("selectors" not in sd for job in jobs.values() for sd in job["kubernetes_sd_configs"])
    assert otelgpu.kubernetes.enabled and otelgpu.kubernetes.auth == "in_cluster"
    own = collector_config(p)["receivers"]["prometheus/self"]["config"]["scrape_configs"]
    assert {t for job in own for c in job["static_configs"] for t in c["targets"]} == \
        {otelgpu.exporter.prometheus.endpoint.replace("0.0.0.0", "127.0.0.1"), "127.0.0.1:8888"}
    if mode == "node":  # each node's pod scrapes 127.0.0.1: its series must say which node
        assert all(job["relabel_configs"] == [{"target_label": "instance", "replacement": node}] for job in own)
    assert jobs["dcgm-exporter"]["honor_labels"] is True
    assert otelgpu.checkpoint.directory in {m["mountPath"] for m in p.container("otelgpu")["volumeMounts"]}


@pytest.mark.parametrize("mode", MODES)
def test_the_fact_sources_are_scraped_only_in_their_namespaces_under_the_jobs_otelgpu_trusts(mode, tmp_path,
                                                                                             monkeypatch):
    """A pod labelled like dcgm-exporter or kube-state-metrics in another namespace is not scraped
    as one; and the jobs that do scrape them are the ones otelgpu's `sources` trust."""
    p = pod(render(mode))
    env = p.env("otel-collector")
    jobs = {job["job_name"]: job for job in collector_config(p)["receivers"]["prometheus"]["config"]["scrape_configs"]}
    namespaces = {"dcgm-exporter": env["DCGM_EXPORTER_NAMESPACE"], "kube-state-metrics": env["KUBE_STATE_METRICS_NAMESPACE"]}
    for name, namespace in namespaces.items():
        if name in jobs:
            (sd,) = jobs[name]["kubernetes_sd_configs"]
            assert sd["namespaces"] == {"names": [namespace]} and namespace
    sources = otelgpu_config(p, tmp_path, monkeypatch).sources
    trusted = {kind: {v for m in getattr(sources, kind) for v in ((m["service.name"],) if isinstance(m["service.name"], str)
                                                                  else m["service.name"])}
               for kind in ("dcgm", "kube_state_metrics", "cadvisor")}
    assert "dcgm-exporter" in trusted["dcgm"] and "kubelet-cadvisor" in trusted["cadvisor"]
    assert mode == "node" or "kube-state-metrics" in trusted["kube_state_metrics"]
    for kind, names in trusted.items():  # no other job of the Collector is trusted for facts
        assert not names & (set(jobs) - {"dcgm-exporter", "kube-state-metrics", "kubelet-cadvisor"}), kind


# Prometheus' kubernetes_sd_configs fields (discovery/kubernetes/kubernetes.go, SDConfig and SelectorConfig).
KUBERNETES_SD_FIELDS = {"api_server", "role", "kubeconfig_file", "namespaces", "selectors", "attach_metadata",
                        "authorization", "tls_config", "basic_auth", "oauth2", "follow_redirects", "proxy_url"}
SELECTOR_FIELDS = {"role", "label", "field"}


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool comes with Debian's prometheus (make test installs it)")
@pytest.mark.parametrize("mode", MODES)
def test_prometheus_accepts_the_scrape_configs(mode, tmp_path):
    """The prometheus receiver's `config` is Prometheus' own configuration: promtool checks it.
    Debian builds Prometheus without Kubernetes discovery, so promtool sees each job with a static
    target instead, and the discovery blocks are checked against Prometheus' own field list."""
    config = collector_config(pod(render(mode)))
    scrape = {"scrape_configs": [job for name, receiver in config["receivers"].items() if name.startswith("prometheus")
                                 for job in receiver["config"]["scrape_configs"]]}
    assert len({job["job_name"] for job in scrape["scrape_configs"]}) == len(scrape["scrape_configs"])
    for job in scrape["scrape_configs"]:
        if "static_configs" in job:
            continue
        for sd in job.pop("kubernetes_sd_configs"):
            assert set(sd) <= KUBERNETES_SD_FIELDS and sd["role"] in {"pod", "node"}, job["job_name"]
            for selector in sd.get("selectors", []):
                assert set(selector) <= SELECTOR_FIELDS and selector["role"] == sd["role"], job["job_name"]
        job["static_configs"] = [{"targets": ["10.0.0.1:9400"]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(scrape))
    run = subprocess.run(["promtool", "check", "config", "--syntax-only", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    broken = tmp_path / "broken.yml"
    broken.write_text(yaml.safe_dump({"scrape_configs": [{**scrape["scrape_configs"][0], "scrape_intervall": "1m"}]}))
    assert subprocess.run(["promtool", "check", "config", "--syntax-only", str(broken)],
                          capture_output=True, timeout=60).returncode != 0


@pytest.mark.parametrize("path", sorted(COLLECTOR_CONFIG.glob("*.yaml")), ids=lambda p: p.name)
def test_dollar_signs_are_only_env_references(path):
    """The Collector expands `$` itself: a Prometheus `$1` must be written `$$1`."""
    text = ENV_REF.sub("", path.read_text()).replace("$$", "")
    assert "$" not in text


@pytest.mark.parametrize("mode,components", PODS, ids=IDS)
def test_the_collector_sends_otelgpu_only_what_it_reads(mode, components):
    """filter/otelgpu stands in metrics/gpu before the batch (tests/test_collector_filter.py runs it
    in the real Collector); the same processor whichever components the pod adds."""
    config = collector_config(pod(render(mode, components)))
    assert config["service"]["pipelines"]["metrics/gpu"]["processors"] == ["memory_limiter", "filter/otelgpu", "batch"]
    shipped = yaml.safe_load((COLLECTOR_CONFIG / f"{mode}.yaml").read_text())
    assert config["processors"]["filter/otelgpu"] == shipped["processors"]["filter/otelgpu"]


def test_kube_state_metrics_is_kept_to_the_families_otelgpu_reads():
    """The gateway's kube-state-metrics job keeps, at the scrape, each family otelgpu reads and no
    other the fixtures' kube-state-metrics serves (Prometheus anchors a relabel regex at both ends)."""
    jobs = {job["job_name"]: job for job in collector_config(pod(render("gateway")))["receivers"]["prometheus"]
            ["config"]["scrape_configs"]}
    (keep,) = jobs["kube-state-metrics"]["metric_relabel_configs"]
    assert keep["source_labels"] == ["__name__"] and keep["action"] == "keep"
    served = {s.name for path in (fixtures_dir() / "ksm").iterdir()
              for family in text_string_to_metric_families(path.read_text()) for s in family.samples}
    assert len(served - set(KSM_METRICS)) > 20
    kept = {name for name in served | set(KSM_METRICS) if re.fullmatch(keep["regex"], name)}
    assert kept == set(KSM_METRICS)
