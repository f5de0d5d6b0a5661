"""A pod's workload: its owner chain followed up to the object people cost as one thing.

ReplicaSet -> Deployment and Job -> CronJob go through the owner facts (from the Kubernetes API or
kube-state-metrics' `kube_replicaset_owner` / `kube_job_owner`); StatefulSet, DaemonSet and custom
owners (RayCluster, PyTorchJob, ...) are workloads by their own kind. A bare pod is its own workload.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

from otelgpu.enrich.labels import POD_TEMPLATE_HASH
from otelgpu.enrich.model import OwnerFacts, OwnerKey, PodFacts

MAX_DEPTH = 4
# A Deployment names its ReplicaSets `<deployment>-<pod-template-hash>`, the hash in the
# alphabet of k8s.io/apimachinery's rand.SafeEncodeString.
_TEMPLATE_HASH = re.compile(r"-[bcdfghjklmnpqrstvwxz2456789]{5,10}$")


def workload(namespace: str, pod_name: str, pod: Optional[PodFacts],
             owners: Mapping[OwnerKey, OwnerFacts]) -> tuple[str, str]:
    """(kind, name) of the pod's workload; ("", "") for a pod with no facts."""
    if pod is None:
        return "", ""
    kind, name = pod.owner_kind, pod.owner_name
    if not kind:
        return "Pod", pod_name
    for _ in range(MAX_DEPTH):
        up = owners.get((namespace, kind, name))
        if up is None:
            break
        if not up.kind:
            return kind, name  # known to have no controller of its own
        kind, name = up.kind, up.name
    else:
        return kind, name
    if kind == "ReplicaSet":  # its owner unknown: a Deployment's ReplicaSet carries the template hash
        template_hash = pod.labels.get(POD_TEMPLATE_HASH, "")
        if (template_hash and name.endswith("-" + template_hash)) or \
                (not template_hash and _TEMPLATE_HASH.search(name)):
            return "Deployment", name.rsplit("-", 1)[0]
    return kind, name
