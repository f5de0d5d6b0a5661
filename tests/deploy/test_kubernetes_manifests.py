"""Every shipped YAML parses; every overlay and component renders with kustomize; every rendered
object passes the Kubernetes OpenAPI schema (kubernetes-validate, strict) of the oldest and newest
Kubernetes the manifests support; the pods are locked down the same way everywhere."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml
from manifests import K8S, MODES, REPO, combinations, load_all, overlays, pod, render, shipped_yaml

# Native sidecars (init containers with restartPolicy Always) are on by default from 1.29.
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")


@pytest.mark.parametrize("path", shipped_yaml(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_yaml_file_parses_without_duplicate_keys(path):
    assert load_all(path), f"{path} is empty"


def test_the_duplicate_key_check_would_catch_one(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: 1\nb: {c: 2}\na: 3\n")
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate key 'a'"):
        load_all(bad)


@pytest.mark.parametrize("overlay", overlays(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_overlay_renders_and_validates(overlay):
    objects = render(str(overlay.relative_to(K8S)))
    assert objects
    _validate(objects)


@pytest.mark.parametrize("mode,components", combinations(), ids=lambda v: "+".join(v) if isinstance(v, tuple) else v)
def test_every_mode_with_its_components_renders_and_validates(mode, components):
    objects = render(mode, components)
    kinds = {o["kind"] for o in objects}
    assert {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "NetworkPolicy", "ConfigMap"} <= kinds
    assert {"gateway": "Deployment", "node": "DaemonSet"}[mode] in kinds
    _validate(objects)
    # Every namespaced object lands in the namespace of the pod that uses it (a PersistentVolumeClaim
    # elsewhere would leave the pod pending); the NVML agent's own objects in the agent's namespace.
    cluster_wide = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    namespaces = {(o["kind"], o["metadata"]["name"]): o["metadata"].get("namespace") for o in objects
                  if o["kind"] not in cluster_wide}
    agent = {(kind, "otelgpu-nvml") for kind in ("DaemonSet", "ServiceAccount", "NetworkPolicy")} \
        if "nvml" in components else set()
    assert agent <= namespaces.keys()
    assert namespaces == {k: "otelgpu-nvml" if k in agent else "otelgpu" for k in namespaces}, namespaces


def _validate(objects):
    for version in KUBERNETES_VERSIONS:
        for obj in objects:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                raise AssertionError(f"{obj['kind']}/{obj['metadata']['name']} (Kubernetes {version}): "
                                     f"{err.message} at {list(err.path)}") from None


def test_the_schema_check_would_catch_a_misspelt_field():
    deployment = copy.deepcopy(pod(render("gateway")).workload)
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"port": 9464}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


@pytest.mark.parametrize("mode,components", combinations(), ids=lambda v: "+".join(v) if isinstance(v, tuple) else v)
def test_every_container_runs_locked_down(mode, components):
    p = pod(render(mode, components))
    security = p.spec["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] > 0
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in p.containers():
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
        assert "privileged" not in sc and "runAsUser" not in sc, c["name"]
        assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"], c["name"]
    assert not any(k in p.spec for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert all(set(v) & {"configMap", "emptyDir", "persistentVolumeClaim"} for v in p.spec["volumes"])
    namespace = next(o for o in render(mode, components) if o["kind"] == "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


@pytest.mark.parametrize("mode", MODES)
def test_probes_point_at_ports_the_containers_open(mode):
    p = pod(render(mode))
    for c in (p.container("otel-collector"), p.container("otelgpu")):
        ports = {port["name"]: port["containerPort"] for port in c["ports"]}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"]["port"] in ports, (c["name"], probe)
    otelgpu = p.container("otelgpu")
    assert [otelgpu[k]["httpGet"]["path"] for k in ("startupProbe", "livenessProbe", "readinessProbe")] == \
        ["/healthz", "/healthz", "/readyz"]


@pytest.mark.parametrize("mode", MODES)
def test_the_collector_outlives_otelgpu(mode):
    """A native sidecar: started before otelgpu, stopped after it, so otelgpu's last intervals
    still reach the Collector on shutdown."""
    spec = pod(render(mode)).spec
    collector = next(c for c in spec["initContainers"] if c["name"] == "otel-collector")
    assert collector["restartPolicy"] == "Always"
    assert [c["name"] for c in spec["containers"]] == ["otelgpu"]
    assert spec["terminationGracePeriodSeconds"] > 10 + 10  # otelgpu's shutdown_timeout, then the Collector's flush


def test_the_gateway_never_runs_twice():
    p = pod(render("gateway"))
    assert p.workload["spec"]["replicas"] == 1 and p.workload["spec"]["strategy"]["type"] == "Recreate"
    budget = next(o for o in render("gateway") if o["kind"] == "PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"] == p.workload["spec"]["selector"]["matchLabels"]
    assert budget["spec"]["maxUnavailable"] == 1  # a single replica: anything stricter blocks every drain


def test_the_node_mode_runs_on_gpu_nodes_and_watches_only_its_own():
    p = pod(render("node"))
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in p.spec["tolerations"]
    assert p.spec["priorityClassName"] == "system-node-critical"  # a packed GPU node still gets its pod
    terms = p.spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {t["matchExpressions"][0]["key"] for t in terms} == {"nvidia.com/gpu.present",
                                                                 "karpenter.k8s.aws/instance-gpu-count"}
    for name in ("otel-collector", "otelgpu"):
        node_name = next(v for v in p.container(name)["env"] if v["name"] == "NODE_NAME")
        assert node_name["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_the_network_policy_admits_only_the_probe_and_metrics_ports():
    for mode in MODES:
        p = pod(render(mode))
        policy = p.find("NetworkPolicy")
        pod_labels = p.workload["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
        opened = {port["port"] for rule in policy["spec"]["ingress"] for port in rule["ports"]}
        listening = {port["containerPort"] for c in p.containers() for port in c.get("ports", [])}
        assert opened == listening == {9464, 13133}
