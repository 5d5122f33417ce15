"""Queueing and gang scheduling: the labels, annotations and scheduler name of worker pods, and the PodGroup.

The keys are the ones each scheduler reads (Kueue's pod-group integration, Volcano, scheduler-plugins'
coscheduling); the real API server checks the PodGroups against the published CRDs in tests/cluster.
"""

from __future__ import annotations

import kubernetes_validate
import pytest
from tests.unit.operator.world import job_manifest

from disttrain.api.spec import DistTrainJob
from disttrain.operator import pods, scheduling

pytestmark = pytest.mark.timeout(60)
K8S_VERSION = "1.33.0"


def make_job(labels=None, **spec):
    manifest = job_manifest("train", replicas=3, **spec)
    manifest["metadata"]["uid"] = "0a1b2c3d-4e5f-6789-abcd-ef0123456789"
    manifest["metadata"]["labels"] = labels or {}
    return DistTrainJob.model_validate(manifest)


def test_a_job_with_a_kueue_queue_label_gives_its_workers_one_pod_group_of_replicas_pods():
    job = make_job({"kueue.x-k8s.io/queue-name": "team-a"})
    workers = [pods.build_worker_pod(job, i) for i in range(3)]
    for pod in workers:
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == "train-0a1b2c3d"
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "3"
        assert "schedulerName" not in pod["spec"], "Kueue gates pods; the default scheduler binds them"
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    agent = pods.build_agent_pod(job)
    assert not any(key.startswith("kueue.x-k8s.io/") for key in agent["metadata"]["labels"]), (
        "the agent is not part of the queued group"
    )


def test_a_job_without_queue_or_gang_has_no_scheduling_metadata():
    pod = pods.build_worker_pod(make_job(), 0)
    keys = {*pod["metadata"]["labels"], *pod["metadata"].get("annotations", {})}
    assert not any(key.startswith(("kueue.", "scheduling.")) for key in keys)
    assert "schedulerName" not in pod["spec"] and pods.build_pod_group(make_job()) is None


def test_volcano_gang_annotates_workers_and_builds_a_pod_group_of_nodes_min():
    job = make_job(min=2, gang={"scheduler": "volcano", "queue": "research"})
    pod = pods.build_worker_pod(job, 0)
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "train"
    assert pod["spec"]["schedulerName"] == "volcano"
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    group = pods.build_pod_group(job)
    assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1" and group["kind"] == "PodGroup"
    assert group["metadata"]["name"] == "train" and group["spec"] == {"minMember": 2, "queue": "research"}
    [owner] = group["metadata"]["ownerReferences"]
    assert owner["kind"] == "DistTrainJob" and owner["controller"] is True


def test_scheduler_plugins_gang_labels_workers_and_builds_a_coscheduling_pod_group():
    job = make_job(gang={"scheduler": "scheduler-plugins", "scheduleTimeoutSeconds": 120})
    pod = pods.build_worker_pod(job, 1)
    assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "train"
    assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
    group = pods.build_pod_group(job)
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert group["spec"] == {"minMember": 1, "scheduleTimeoutSeconds": 120}


@pytest.mark.parametrize(
    "gang, run_policy, expected",
    [
        ({"scheduler": "volcano", "schedulerName": "volcano-gpu"}, {}, "volcano-gpu"),
        ({"scheduler": "scheduler-plugins"}, {"schedulerName": "default-scheduler"}, "default-scheduler"),
    ],
    ids=["gang-scheduler-name", "run-policy-wins"],
)
def test_the_scheduler_name_can_be_chosen(gang, run_policy, expected):
    job = make_job(gang=gang, runPolicy=run_policy)
    assert pods.build_worker_pod(job, 0)["spec"]["schedulerName"] == expected


def test_template_labels_cannot_take_the_group_away():
    manifest = job_manifest("train", replicas=2, gang={"scheduler": "scheduler-plugins"})
    manifest["spec"]["template"]["metadata"] = {"labels": {"scheduling.x-k8s.io/pod-group": "other"}}
    pod = pods.build_worker_pod(DistTrainJob.model_validate(manifest), 0)
    assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "train"


def test_an_unknown_gang_scheduler_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"gang\.scheduler"):
        make_job(gang={"scheduler": "yunikorn"})


def test_the_kueue_group_name_is_a_valid_label_value_for_the_longest_job_name():
    manifest = job_manifest("a" * 45, replicas=2)
    manifest["metadata"]["uid"] = "0a1b2c3d-4e5f-6789-abcd-ef0123456789"
    name = scheduling.kueue_group_name(DistTrainJob.model_validate(manifest))
    assert len(name) <= 63 and name.endswith("-0a1b2c3d")
