"""k8s/components/nvml: the NVML agent's DaemonSet reaches the otlp/nvml receiver of its own node's
otelgpu pod and nothing else does; the Collector hands what it receives there to otelgpu, which
trusts it as dcgm data by default; the agent runs without privilege, with the kubelet's
pod-resources socket read-only, on GPU nodes without the GPU Operator's dcgm-exporter; and its
arguments are ones `otelgpu nvml` accepts."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from manifests import REPO, collector_config, otelgpu_config, pod, render

from otelgpu.receiver.sources import BIT, SourceTrust

COMPONENTS = ("nvml",)


@pytest.fixture(scope="module")
def objects() -> tuple[dict, ...]:
    return render("node", COMPONENTS)


def find(objects: tuple[dict, ...], kind: str, name: str, namespace: str | None = None) -> dict:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name
                and o["metadata"].get("namespace") == namespace)


def agent_args(objects: tuple[dict, ...]) -> dict[str, str]:
    container = pod(objects, "otelgpu-nvml").container("nvml")
    assert container["args"][0] == "nvml"
    return dict(a.removeprefix("--").partition("=")[::2] for a in container["args"][1:])


def test_the_agent_sends_to_the_otlp_nvml_receiver_of_its_own_nodes_otelgpu_pod(objects):
    host, _, port = agent_args(objects)["endpoint"].rpartition(":")
    name, namespace, _ = host.split(".", 2)
    service = find(objects, "Service", name, namespace)
    assert service["spec"]["internalTrafficPolicy"] == "Local"  # never another node's otelgpu
    (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
    node = pod(objects)
    assert service["spec"]["selector"].items() <= node.workload["spec"]["template"]["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in node.container("otel-collector")["ports"]}
    receiver = collector_config(node)["receivers"]["otlp/nvml"]["protocols"]["grpc"]["endpoint"]
    assert receiver == f":{ports[service_port['targetPort']]}"


def test_the_collector_hands_the_agents_dcgm_series_to_otelgpu_and_nothing_else(objects, tmp_path, monkeypatch):
    node = pod(objects)
    config = collector_config(node)
    pipeline = config["service"]["pipelines"]["metrics/nvml"]
    assert pipeline["receivers"] == ["otlp/nvml"] and pipeline["exporters"] == ["otlp_grpc/otelgpu"]
    assert "filter/nvml" in pipeline["processors"]
    dropped = config["processors"]["filter/nvml"]["metrics"]["metric"]
    assert 'not IsMatch(name, "^DCGM_FI_")' in dropped
    assert 'resource.attributes["service.name"] != "otelgpu-nvml"' in dropped
    assert all("otlp/nvml" not in p["receivers"] for n, p in config["service"]["pipelines"].items() if n != "metrics/nvml")
    # otelgpu takes them as dcgm data: its default sources.dcgm names the agent's service.name
    trust = SourceTrust(otelgpu_config(node, tmp_path, monkeypatch).sources)
    assert trust.bits({"service.name": "otelgpu-nvml"}) & BIT["dcgm"]


def test_only_the_agents_pods_reach_the_receiver(objects):
    agent = pod(objects, "otelgpu-nvml")
    policy = find(objects, "NetworkPolicy", "otelgpu-nvml-in", "otelgpu")
    node_labels = pod(objects).workload["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= node_labels.items()
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": 4320, "protocol": "TCP"}]
    (peer,) = rule["from"]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": agent.workload["metadata"]["namespace"]}
    assert peer["podSelector"]["matchLabels"].items() <= agent.workload["spec"]["template"]["metadata"]["labels"].items()
    own = find(objects, "NetworkPolicy", "otelgpu-nvml", "otelgpu-nvml")
    assert own["spec"]["policyTypes"] == ["Ingress", "Egress"] and not own["spec"].get("ingress")
    out = {p["port"] for rule in own["spec"]["egress"] for p in rule["ports"]}
    assert out == {53, 4320, 9400}


def test_the_agent_runs_unprivileged_with_the_pod_resources_socket_read_only(objects):
    agent = pod(objects, "otelgpu-nvml")
    spec = agent.spec
    assert not any(k in spec for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert spec["automountServiceAccountToken"] is False and spec["securityContext"]["seccompProfile"] == {
        "type": "RuntimeDefault"}
    (volume,) = spec["volumes"]
    assert volume["hostPath"]["path"] == "/var/lib/kubelet/pod-resources"
    (c,) = spec["containers"]
    sc = c["securityContext"]
    assert sc == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    assert c["volumeMounts"] == [{"name": volume["name"], "mountPath": "/var/lib/kubelet/pod-resources", "readOnly": True}]
    assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"]
    namespace = find(objects, "Namespace", agent.workload["metadata"]["namespace"])
    # "privileged" only because of the hostPath; otelgpu's own namespace stays "restricted"
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert find(objects, "Namespace", "otelgpu")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_the_agent_runs_on_gpu_nodes_without_the_gpu_operators_dcgm_exporter(objects):
    agent = pod(objects, "otelgpu-nvml")
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in agent.spec["tolerations"]
    terms = agent.spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    node_terms = pod(objects).spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert [t["matchExpressions"][0] for t in terms] == [t["matchExpressions"][0] for t in node_terms]
    skip = {"key": "nvidia.com/gpu.deploy.dcgm-exporter", "operator": "NotIn", "values": ["true"]}
    assert all(skip in t["matchExpressions"] for t in terms)  # terms are alternatives: each must say it
    env = {v["name"]: v.get("value") or v["valueFrom"]["fieldRef"]["fieldPath"] for v in agent.container("nvml")["env"]}
    assert env["NODE_NAME"] == "spec.nodeName"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"


def test_otelgpu_nvml_accepts_the_manifests_arguments(objects):
    """The container's arguments, its $(VAR)s expanded, through the real command line: it gets past
    the arguments and the endpoint's TLS rules to loading NVML, which this machine lacks."""
    container = pod(objects, "otelgpu-nvml").container("nvml")
    env = {"NODE_NAME": "ip-10-0-12-34.ec2.internal", "HOST_IP": "10.0.12.34"}
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    run = subprocess.run([sys.executable, "-m", "otelgpu", *args, "--nvml-library", "/nonexistent/libnvidia-ml.so.1"],
                         capture_output=True, text=True, cwd=REPO, timeout=60, env={"PATH": "/usr/bin:/bin", **env})
    assert run.returncode == 1 and "cannot load the NVIDIA Management Library" in run.stderr, run.stderr
