"""What the reconcile core sees and what it decides: small frozen records, no I/O.

The kube adapter fills :class:`Observed` from the API (pods, nodes); the local runtime fills it from its
process groups. Both apply the same :class:`Actions`. Times are Unix seconds (floats) so tests and the local
runtime can drive a fake clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Final, Literal, Optional, get_args

PodPhase = Literal["Pending", "Running", "Succeeded", "Failed", "Unknown"]
"""pod.status.phase, as Kubernetes defines it."""
POD_PHASES: Final = frozenset(get_args(PodPhase))
FINISHED_PHASES: Final[frozenset[PodPhase]] = frozenset({"Succeeded", "Failed"})

EventType = Literal["Normal", "Warning"]
"""core/v1 Event.type."""
NORMAL: Final[EventType] = "Normal"
WARNING: Final[EventType] = "Warning"


@dataclasses.dataclass(frozen=True)
class PodView:
    """One worker or agent pod, reduced to what policy needs."""

    name: str
    uid: str
    node_index: int = -1
    """Value of the node-index label (the node's slot in rank order, see ``sizing.free_indices``); -1 for the
    agent. Not always the number in the pod's name: a replacement takes the index of the pod it replaces."""
    phase: PodPhase = "Pending"
    """Pending, Running, Succeeded, Failed or Unknown (pod.status.phase)."""
    ready: bool = False
    node_name: Optional[str] = None
    """spec.nodeName: set once scheduled."""
    created_at: Optional[float] = None
    ready_at: Optional[float] = None
    """When it last became Ready (the Ready condition's lastTransitionTime); None while not Ready."""
    deleting_since: Optional[float] = None
    """metadata.deletionTimestamp: the pod is Terminating."""
    exit_code: Optional[int] = None
    """Exit code of the trainer container when it terminated."""
    reason: str = ""
    """pod.status.reason, e.g. Evicted."""
    message: str = ""
    termination_message: str = ""
    """The trainer container's termination message: the launcher's root cause of a failure (exit code, the last
    line of the user's traceback)."""

    @property
    def is_terminating(self) -> bool:
        return self.deleting_since is not None

    @property
    def is_running(self) -> bool:
        return self.phase == "Running"

    @property
    def is_finished(self) -> bool:
        """Succeeded or Failed: its containers exited and will not run again (restartPolicy Never)."""
        return self.phase in FINISHED_PHASES

    @property
    def is_scheduled(self) -> bool:
        return bool(self.node_name)


@dataclasses.dataclass(frozen=True)
class NodeView:
    """A cluster node: Ready status, and what announces that it is being drained or is about to go."""

    name: str
    ready: Optional[bool] = True
    """Ready condition: True, False (NotReady) or None (Unknown: the node controller lost contact)."""
    unschedulable: bool = False
    """spec.unschedulable (cordoned)."""
    draining: bool = False
    """Cordoned nodes that are being emptied carry a NoExecute or autoscaler to-be-deleted taint."""
    taints: frozenset[str] = frozenset()
    """Keys of its NoSchedule and NoExecute taints (what ``spec.elastic.departure.taints`` is matched against)."""
    conditions: frozenset[str] = frozenset()
    """Types of its conditions other than Ready whose status is True (``spec.elastic.departure.conditions``)."""


@dataclasses.dataclass(frozen=True)
class CreateFailure:
    """The last creation of one of the job's objects that did not succeed, as the adapter saw it (the outcome of
    an API call comes back to the core as observed input, so the core stays pure)."""

    kind: str
    """Pod, Service, Secret, Role, RoleBinding, ServiceAccount, NetworkPolicy or PodGroup."""
    name: str
    message: str
    """The API server's answer (status, reason and its own sentence), or who holds the name."""
    held_by: Optional[str] = None
    """The uid of the owner of an existing object of that name (409) when it is not this job: an older job of the
    same name, whose dependents are still being deleted. A wait, never an adoption."""


@dataclasses.dataclass(frozen=True)
class Observed:
    """Everything the reconcile core reads besides the job itself."""

    workers: tuple[PodView, ...] = ()
    agent: Optional[PodView] = None
    nodes: Optional[Mapping[str, NodeView]] = None
    """Known nodes by name; None when the caller cannot see nodes (then no pod is judged by its node)."""
    refused: Optional[str] = None
    """The API server's answer when it last refused to create a pod of the job (Pod Security admission, a quota,
    a webhook), until a creation succeeds; the adapter remembers it between reconciles."""
    create_failure: Optional[CreateFailure] = None
    """The failed creation of the adapter's last apply (any object, a pod's admission refusal excepted: that is
    :attr:`refused`); None when it created everything it was asked to."""
    agent_silence: str = ""
    """Why the agent pod is taken for lost before Kubernetes says so (:mod:`disttrain.operator.agentbeat`: its pulse
    stopped, or it stopped renewing its Lease; "": it is not): its node is taken for dead."""


@dataclasses.dataclass(frozen=True)
class Event:
    type: EventType
    reason: str
    """A :class:`~disttrain.api.conditions.Reason` value."""
    message: str


@dataclasses.dataclass(frozen=True)
class PodDeletion:
    name: str
    force: bool = False
    """Delete with gracePeriodSeconds=0 (a pod stuck Terminating on a dead node)."""
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class WorkerCreation:
    """A worker pod to create (build it with ``pods.build_worker_pod(job, node_index, name=name)``)."""

    node_index: int
    """The stable node index: the rendezvous handler orders ranks by it."""
    name: str
    """``<job>-worker-<index>``, with a suffix while an older pod still holds that name (``names.worker_name``)."""
    avoid_nodes: tuple[str, ...] = ()
    """Nodes the pod must not be scheduled on: those of pods lost there while Kubernetes still thinks the node is
    fine (silent in the heartbeats, or stuck Terminating), where the scheduler would otherwise place it."""


@dataclasses.dataclass(frozen=True)
class Actions:
    """The decision of one reconcile; the caller applies it in this order: status, deletions, creations, events."""

    create_workers: tuple[WorkerCreation, ...] = ()
    """Worker pods to create, by node index."""
    create_agent: bool = False
    agent_avoid_nodes: tuple[str, ...] = ()
    """Nodes the new agent must not be scheduled on: its predecessor's, when only its silent Lease says the node
    died (Kubernetes still has it Ready and schedulable)."""
    delete_pods: tuple[PodDeletion, ...] = ()
    status_patch: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """JSON merge patch (RFC 7386) of status.* fields the operator owns; empty when nothing changed."""
    status: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The full status after the patch (wire form), for metrics and for local runtimes."""
    events: tuple[Event, ...] = ()
    requeue_after: Optional[float] = None
    """Seconds until a timer in the policy expires (debounce, waits, backoff, deadline, TTL); None: no timer."""
    delete_job: bool = False
    """TTL after finish expired: delete the DistTrainJob itself."""
    apply_pod_group: bool = False
    """Create or update the job's PodGroup (``spec.gang``; build it with ``pods.build_pod_group``), before the
    status write and before any pod is created: the scheduler must know the gang before it sees a member."""
