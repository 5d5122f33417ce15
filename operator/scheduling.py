"""Queueing and gang scheduling: what worker pods carry for Kueue, Volcano or scheduler-plugins, and the PodGroup.

Pure builders, no I/O; the only inputs are the job. Why each mechanism (docs/operator.md, "Queueing and gang
scheduling"):

* **Kueue**, unmodified, through its plain-pod "pod group" integration: a job labelled
  ``kueue.x-k8s.io/queue-name`` gets worker pods with that label, the ``kueue.x-k8s.io/pod-group-name`` label
  and the ``kueue.x-k8s.io/pod-group-total-count`` annotation. Kueue gates the pods until the whole group is
  admitted; the operator creates replacements itself (Kueue never recreates pods). ``spec.suspend`` as Kueue's
  job integrations use it would need a Kueue-side integration for DistTrainJob (Go code in Kueue, or an
  external controller that writes Workloads): not what an unmodified Kueue offers.
* **Volcano** and **scheduler-plugins** (coscheduling): a PodGroup with ``minMember = spec.nodes.min``, owned
  by the job, and the pod annotation (Volcano) or label (coscheduling) that names it.

Kueue keys from sigs.k8s.io/kueue pkg/controller/jobs/pod/constants and pkg/controller/constants; Volcano's from
volcano.sh/apis pkg/apis/scheduling/v1beta1/labels.go; coscheduling's from scheduler-plugins
apis/scheduling/v1alpha1 (and pkg/coscheduling/README.md).
"""

from __future__ import annotations

from typing import Any, Final, Optional

from disttrain.api import constants
from disttrain.api.spec import DistTrainJob, GangScheduler

KUEUE_QUEUE_LABEL: Final = constants.KUEUE_QUEUE_LABEL
"""Label (on the job, copied to its worker pods): the Kueue LocalQueue."""
KUEUE_GROUP_NAME_LABEL: Final = "kueue.x-k8s.io/pod-group-name"
"""Label: the pods with one value form one Kueue Workload (named after it)."""
KUEUE_GROUP_TOTAL_COUNT_ANNOTATION: Final = "kueue.x-k8s.io/pod-group-total-count"
"""Annotation: how many pods the group has; Kueue admits it once that many exist, all with the same count."""

VOLCANO_GROUP_ANNOTATION: Final = "scheduling.k8s.io/group-name"
"""Annotation on a pod: the Volcano PodGroup it belongs to."""
COSCHEDULING_GROUP_LABEL: Final = "scheduling.x-k8s.io/pod-group"
"""Label on a pod: the scheduler-plugins PodGroup it belongs to."""

POD_GROUP_APIS: Final = {
    GangScheduler.VOLCANO: ("scheduling.volcano.sh", "v1beta1"),
    GangScheduler.SCHEDULER_PLUGINS: ("scheduling.x-k8s.io", "v1alpha1"),
}
"""(group, version) of each scheduler's PodGroup."""
POD_GROUP_PLURAL: Final = "podgroups"
DEFAULT_SCHEDULER_NAMES: Final = {
    GangScheduler.VOLCANO: "volcano",
    GangScheduler.SCHEDULER_PLUGINS: "scheduler-plugins-scheduler",
}


def kueue_queue(job: DistTrainJob) -> Optional[str]:
    """The Kueue LocalQueue named by the job's own ``kueue.x-k8s.io/queue-name`` label, as Kueue's job
    integrations read it; None: Kueue is not asked."""
    return job.metadata.labels.get(KUEUE_QUEUE_LABEL) or None


def kueue_group_name(job: DistTrainJob) -> str:
    """The Kueue pod group (and Workload) name: the job's name and the start of its uid, so a job created again
    under the same name never joins the Workload its predecessor's lingering pods still hold."""
    uid = (job.metadata.uid or "").replace("-", "")[:8]
    return f"{job.metadata.name}-{uid}" if uid else job.metadata.name


def pod_group_name(job: DistTrainJob) -> str:
    """The Volcano / scheduler-plugins PodGroup of a job: the job's name (owned by the job, so unique with it)."""
    return job.metadata.name


def scheduler_name(job: DistTrainJob) -> Optional[str]:
    """schedulerName of the worker pods: runPolicy.schedulerName, else the gang scheduler's, else None."""
    spec = job.spec
    if spec.run_policy.scheduler_name:
        return spec.run_policy.scheduler_name
    if spec.gang is None:
        return None
    return spec.gang.scheduler_name or DEFAULT_SCHEDULER_NAMES[spec.gang.scheduler]


def worker_labels(job: DistTrainJob) -> dict[str, str]:
    """Labels a worker pod carries for the queue and the gang scheduler (none when the job asks for neither)."""
    labels: dict[str, str] = {}
    queue = kueue_queue(job)
    if queue:
        labels[KUEUE_QUEUE_LABEL] = queue
        labels[KUEUE_GROUP_NAME_LABEL] = kueue_group_name(job)
    if job.spec.gang is not None and job.spec.gang.scheduler is GangScheduler.SCHEDULER_PLUGINS:
        labels[COSCHEDULING_GROUP_LABEL] = pod_group_name(job)
    return labels


def worker_annotations(job: DistTrainJob) -> dict[str, str]:
    """Annotations a worker pod carries for the queue and the gang scheduler.

    Kueue's total count is ``spec.nodes.replicas``, the pods the operator creates: every member of a group must
    carry the same count, so a resize under Kueue goes through suspend, edit, resume (docs/operator.md).
    """
    annotations: dict[str, str] = {}
    if kueue_queue(job):
        annotations[KUEUE_GROUP_TOTAL_COUNT_ANNOTATION] = str(job.spec.nodes.replicas)
    if job.spec.gang is not None and job.spec.gang.scheduler is GangScheduler.VOLCANO:
        annotations[VOLCANO_GROUP_ANNOTATION] = pod_group_name(job)
    return annotations


def apply_to_worker_pod(job: DistTrainJob, pod: dict[str, Any]) -> None:
    """Add the queue and gang metadata and the scheduler name to a built worker pod (in place)."""
    meta = pod["metadata"]
    labels = worker_labels(job)
    if labels:
        meta["labels"] = {**meta.get("labels", {}), **labels}
    annotations = worker_annotations(job)
    if annotations:
        meta["annotations"] = {**meta.get("annotations", {}), **annotations}
    name = scheduler_name(job)
    if name:
        pod["spec"]["schedulerName"] = name


def build_pod_group(job: DistTrainJob, metadata: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The PodGroup of ``spec.gang`` (None without one): ``minMember = spec.nodes.min``, so the scheduler binds
    no worker before the smallest group the job can train with fits; pods beyond it are placed one by one,
    which is what an elastic job needs. ``metadata`` is the object metadata every owned object carries."""
    gang = job.spec.gang
    if gang is None:
        return None
    group, version = POD_GROUP_APIS[gang.scheduler]
    spec: dict[str, Any] = {"minMember": job.spec.nodes.min}
    if gang.scheduler is GangScheduler.VOLCANO and gang.queue:
        spec["queue"] = gang.queue
    if gang.scheduler is GangScheduler.SCHEDULER_PLUGINS and gang.schedule_timeout_seconds:
        spec["scheduleTimeoutSeconds"] = gang.schedule_timeout_seconds
    if job.spec.run_policy.priority_class_name and gang.scheduler is GangScheduler.VOLCANO:
        spec["priorityClassName"] = job.spec.run_policy.priority_class_name
    return {"apiVersion": f"{group}/{version}", "kind": "PodGroup", "metadata": metadata, "spec": spec}
