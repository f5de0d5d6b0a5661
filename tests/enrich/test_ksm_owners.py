"""Workload identity and annotation tags from kube-state-metrics alone: kube_replicaset_owner,
kube_job_owner and kube_pod_annotations, as the Collector forwards them."""

from __future__ import annotations

from support import feed, make_config, offline_pipeline

from otelgpu.demo.otlp import request, scrape
from otelgpu.enrich.config import TagRule
from otelgpu.enrich.workload import workload

T = 1_700_000_000 * 10**9


def _ksm() -> object:
    ident = {"namespace": "ml", "uid": "u1"}
    return request(scrape("kube-state-metrics", "10.0.0.2:8080", "n", T, {
        "kube_pod_info": [({**ident, "pod": "serve-abc-1", "created_by_kind": "ReplicaSet",
                            "created_by_name": "serve-abc"}, 1.0),
                          ({**ident, "pod": "nightly-290-x", "created_by_kind": "Job",
                            "created_by_name": "nightly-290"}, 1.0),
                          ({**ident, "pod": "lonely-7d9f8-1", "created_by_kind": "ReplicaSet",
                            "created_by_name": "lonely-7d9f8"}, 1.0)],
        "kube_replicaset_owner": [({"namespace": "ml", "replicaset": "serve-abc", "owner_kind": "Deployment",
                                    "owner_name": "serve", "owner_is_controller": "true"}, 1.0),
                                  ({"namespace": "ml", "replicaset": "lonely-7d9f8", "owner_kind": "<none>",
                                    "owner_name": "<none>", "owner_is_controller": "false"}, 1.0)],
        "kube_job_owner": [({"namespace": "ml", "job_name": "nightly-290", "owner_kind": "CronJob",
                             "owner_name": "nightly", "owner_is_controller": "true"}, 1.0)],
        "kube_pod_annotations": [({**ident, "pod": "serve-abc-1",
                                   "annotation_ml_example_com_model": "llama-3-8b"}, 1.0)],
    }))


def test_owner_chains_and_annotations_from_kube_state_metrics():
    cfg = make_config(tags__model=TagRule(annotations=("ml.example.com/model",)))
    p = offline_pipeline(cfg)
    feed(p, _ksm())
    p.close_due(flush=True)  # facts apply when the interval they are stamped in closes
    view = p.facts.view()
    got = {name: workload(ns, name, pod, view.owners) for (ns, name), pod in view.pods.items()}
    assert got == {"serve-abc-1": ("Deployment", "serve"), "nightly-290-x": ("CronJob", "nightly"),
                   "lonely-7d9f8-1": ("ReplicaSet", "lonely-7d9f8")}
    pod = view.pods[("ml", "serve-abc-1")]
    tags = p.joiner.tags.resolve(pod.labels, {}, pod.annotations)
    assert tags.values[3] == "llama-3-8b" and tags.from_labels[3]
