"""Translate Kubernetes objects (plain dicts) into the reconcile core's views. Pure, shared by tests and adapter."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Optional, cast

from disttrain.api import constants, timestamps
from disttrain.operator.observed import POD_PHASES, NodeView, Observed, PodPhase, PodView

# Taints that mean "this node is being emptied" (kubectl drain's NoExecute by node lifecycle, cluster autoscaler,
# Karpenter). A cordon alone (spec.unschedulable) only stops new pods and is not a loss.
DRAIN_TAINTS = frozenset(
    {
        "ToBeDeletedByClusterAutoscaler",
        "karpenter.sh/disrupted",
        "karpenter.sh/disruption",
        "node.kubernetes.io/out-of-service",
    }
)


def pod_phase(value: object) -> PodPhase:
    """pod.status.phase; absent (a pod just created) or anything Kubernetes does not define reads as Pending."""
    return cast(PodPhase, value) if value in POD_PHASES else "Pending"


def pod_view(pod: Mapping[str, Any]) -> PodView:
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    labels = meta.get("labels") or {}
    try:
        index = int(labels.get(constants.LABEL_NODE_INDEX, -1))
    except ValueError:
        index = -1
    ready_condition: Mapping[str, Any] = next(
        (c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {}
    )
    ready = ready_condition.get("status") == "True"
    exit_code: Optional[int] = None
    termination_message = ""
    ours = (constants.TRAINER_CONTAINER, constants.AGENT_CONTAINER)  # their exit code wins over a sidecar's
    for container in status.get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated")
        if terminated is not None and (container.get("name") in ours or exit_code is None):
            exit_code = terminated.get("exitCode")
            termination_message = str(terminated.get("message") or "")
    return PodView(
        name=meta.get("name", ""),
        uid=meta.get("uid") or f"{meta.get('name')}@{meta.get('creationTimestamp')}",
        node_index=index,
        phase=pod_phase(status.get("phase")),
        ready=ready,
        node_name=spec.get("nodeName"),
        created_at=timestamps.parse_time(meta.get("creationTimestamp")),
        ready_at=timestamps.parse_time(ready_condition.get("lastTransitionTime")) if ready else None,
        deleting_since=timestamps.parse_time(meta.get("deletionTimestamp")),
        exit_code=exit_code,
        reason=status.get("reason") or "",
        message=status.get("message") or "",
        termination_message=termination_message,
    )


def node_view(node: Mapping[str, Any]) -> NodeView:
    meta = node.get("metadata") or {}
    spec = node.get("spec") or {}
    ready: Optional[bool] = None
    true_conditions: set[str] = set()
    for condition in (node.get("status") or {}).get("conditions") or []:
        kind = condition.get("type")
        if kind == "Ready":
            ready = {"True": True, "False": False}.get(condition.get("status"))
        elif isinstance(kind, str) and condition.get("status") == "True":
            true_conditions.add(kind)
    taints = {
        t.get("key")
        for t in spec.get("taints") or []
        if t.get("effect") in ("NoExecute", "NoSchedule") and isinstance(t.get("key"), str)
    }
    unschedulable = bool(spec.get("unschedulable"))
    return NodeView(
        name=meta.get("name", ""),
        ready=ready,
        unschedulable=unschedulable,
        draining=bool(taints & DRAIN_TAINTS),
        taints=frozenset(taints),
        conditions=frozenset(true_conditions),
    )


def observe(job_name: str, pods: Iterable[Mapping[str, Any]], nodes: Optional[Iterable[Mapping[str, Any]]]) -> Observed:
    """Observed state of one job from the namespace's pods (filtered here: never trust the server's selector)."""
    workers: list[PodView] = []
    agent: Optional[PodView] = None
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if labels.get(constants.LABEL_JOB_NAME) != job_name:
            continue
        if labels.get(constants.LABEL_ROLE) == constants.ROLE_WORKER:
            workers.append(pod_view(pod))
        elif labels.get(constants.LABEL_ROLE) == constants.ROLE_AGENT:
            agent = pod_view(pod)
    node_map = None if nodes is None else {v.name: v for v in map(node_view, nodes)}
    return Observed(workers=tuple(workers), agent=agent, nodes=node_map)
