"""Who holds each entity when the pod-resources API cannot say: the pods of the processes running
on it, named from the kubelet's own records.

A process's cgroup (/proc/<pid>/cgroup) names its container's id under a `kubepods` slice. The
kubelet links every container's log as /var/log/containers/<pod>_<namespace>_<container>-<id>.log
(pod, namespace and container names cannot contain `_`), so the id names the pod, its namespace and
the container, as the kubelet knows them. A process outside any pod, or whose container has no such
link, names nobody: its entity then carries no pod, and the sidecar places the pods that request
such a device from kube-state-metrics, as it does for dcgm-exporter without pod mapping.

Only processes show: a pod that holds a GPU but runs nothing on it is not seen this way. NVML
lists the processes of other containers only to a process in the host's PID namespace (the
DaemonSet's `hostPID: true`, docs/nvml.md).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable, Optional

from otelgpu.nvml.holders import Holder, Key, key_of
from otelgpu.nvml.reader import Reading

PROC = "/proc"
CONTAINER_LOGS = "/var/log/containers"
# The container id at the end of a cgroup path: .../cri-containerd-<id>.scope, .../docker-<id>.scope,
# .../crio-<id>.scope, or .../kubepods/burstable/pod<uid>/<id> (cgroupfs driver).
_CONTAINER_ID = re.compile(r"(?:^|[/-])([0-9a-f]{64})(?:\.scope)?$")
_LOG_NAME = re.compile(r"([^_]+)_([^_]+)_(.+)-([0-9a-f]{64})\.log\Z")


class ProcessPods:
    """`proc` and `container_logs` are the host's /proc and /var/log/containers as mounted here."""

    def __init__(self, proc: str = PROC, container_logs: str = CONTAINER_LOGS) -> None:
        self.proc, self.container_logs = Path(proc), Path(container_logs)

    def holders_by_key(self, readings: Iterable[Reading]) -> dict[Key, list[Holder]]:
        containers = self._containers()
        out: dict[Key, list[Holder]] = {}
        for r in readings:
            found = {containers[c] for c in (self.container_of(pid) for pid in r.pids) if c in containers}
            if found:
                out[key_of(r)] = sorted(found)
        return out

    def container_of(self, pid: int) -> Optional[str]:
        """The id of the Kubernetes container process `pid` runs in, if it runs in one."""
        try:
            text = (self.proc / str(pid) / "cgroup").read_text()
        except OSError:  # gone already, or not visible from here
            return None
        for line in text.splitlines():
            path = line.split(":", 2)[-1]
            match = _CONTAINER_ID.search(path)
            if "kubepods" in path and match:
                return match.group(1)
        return None

    def _containers(self) -> dict[str, Holder]:
        """Container id -> its pod and container, from the kubelet's log links."""
        try:
            names = os.listdir(self.container_logs)
        except OSError:
            return {}
        out = {}
        for name in names:
            match = _LOG_NAME.match(name)
            if match:
                pod, namespace, container, cid = match.groups()
                out[cid] = Holder(namespace, pod, container)
        return out
