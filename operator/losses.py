"""Why a worker pod or the job agent no longer counts: the classification of losses, pure.

A pod is lost when it failed, was deleted or evicted, or its node is NotReady, unreachable, deleted, or cordoned and
draining (a node that announces its end first is a departure: :mod:`disttrain.operator.departures`). A failed pod
whose exit a peer's loss explains is a consequence, not a cause (:func:`is_peer_loss_exit`). Used by the reconcile
core (:mod:`disttrain.operator.reconcile`) and the sizing rules (:mod:`disttrain.operator.sizing`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

from disttrain.api.conditions import Reason
from disttrain.api.exitcodes import ExitCode
from disttrain.api.spec import DistTrainJobSpec
from disttrain.api.status import DistTrainJobStatus
from disttrain.operator.observed import NodeView, PodView

# Reasons that come from an unplanned loss (replacement wait applies to them). Values: control.reason is a string.
LOSS_REASONS = frozenset(
    {
        Reason.NODE_LOST.value,
        Reason.POD_FAILED.value,
        Reason.POD_DELETED.value,
        Reason.EVICTED.value,
        Reason.NODE_NOT_READY.value,
        Reason.NODE_UNREACHABLE.value,
        Reason.NODE_DELETED.value,
        Reason.NODE_DRAINING.value,
        Reason.HEARTBEAT_LOST.value,
        Reason.STEP_STALLED.value,
        Reason.AGENT_RESTARTED.value,
    }
)


def is_permanent_exit(spec: DistTrainJobSpec, code: Optional[int]) -> bool:
    """Exit codes in restartPolicy.exitCodes.permanent fail the job; retryable wins if listed in both."""
    classes = spec.restart_policy.exit_codes
    return code is not None and code in classes.permanent and code not in classes.retryable


def node_loss_reason(node_name: Optional[str], nodes: Optional[Mapping[str, NodeView]]) -> Optional[Reason]:
    """Why a pod's node makes it lost: deleted, NotReady, unreachable, or cordoned and being drained."""
    if not node_name or nodes is None:
        return None
    node = nodes.get(node_name)
    if node is None:
        return Reason.NODE_DELETED
    if node.ready is False:
        return Reason.NODE_NOT_READY
    if node.ready is None:
        return Reason.NODE_UNREACHABLE
    if node.unschedulable and node.draining:
        return Reason.NODE_DRAINING
    return None


def loss_reason(pod: PodView, nodes: Optional[Mapping[str, NodeView]]) -> Optional[Reason]:
    """Why a worker pod no longer counts as a member, or None when it is healthy (or Succeeded)."""
    if pod.phase == "Succeeded":
        return None
    if pod.phase == "Failed":
        return Reason.EVICTED if pod.reason == "Evicted" else Reason.POD_FAILED
    if pod.is_terminating:
        return Reason.POD_DELETED
    if pod.phase == "Unknown":
        return Reason.NODE_UNREACHABLE
    return node_loss_reason(pod.node_name, nodes)


NODE_CAUSES = frozenset(
    {
        Reason.NODE_LOST,
        Reason.NODE_NOT_READY,
        Reason.NODE_UNREACHABLE,
        Reason.NODE_DELETED,
        Reason.NODE_DRAINING,
        Reason.HEARTBEAT_LOST,
    }
)
"""Loss causes that are a node's loss: their Warning Event says NodeLost. A pod's own end (PodFailed, PodDeleted,
Evicted) is announced under its own reason: an exit 3 is not a lost node."""


PEER_LOSS_EXIT_CODES = frozenset({128 + 6, int(ExitCode.REFORM)})
"""Pod exit codes that a peer's loss explains: SIGABRT (NCCL's watchdog aborts every survivor of a failed
collective when TORCH_NCCL_ASYNC_ERROR_HANDLING=1, as torchrun sets it) and the reform exit."""


PEER_LOSS_MARKERS = (
    "NCCL",
    "Watchdog caught collective operation timeout",
    "collective operation timeout",
    "DistBackendError",
    "DistNetworkError",
    "Connection closed by peer",
)
"""Substrings of a failed pod's termination message that say a collective failed because a peer went away."""


def is_peer_loss_exit(pod: PodView) -> bool:
    """The pod failed the way a survivor fails when a peer dies mid-collective: a consequence, not a cause."""
    if pod.phase != "Failed":
        return False
    if pod.exit_code in PEER_LOSS_EXIT_CODES:
        return True
    return any(marker in pod.termination_message for marker in PEER_LOSS_MARKERS)


def loss_event_reason(cause: Reason) -> Reason:
    """The Warning Event reason that announces a charged loss: NodeLost for a node's loss, else the cause itself."""
    return Reason.NODE_LOST if cause in NODE_CAUSES else cause


def is_force_delete_due(
    pod: PodView, spec: DistTrainJobSpec, nodes: Optional[Mapping[str, NodeView]], now: float
) -> bool:
    """A Terminating pod is force-deleted when its node is gone or it has been stuck past the timeout."""
    if pod.deleting_since is None:
        return False
    if node_loss_reason(pod.node_name, nodes) is Reason.NODE_DELETED:
        return True
    return now - pod.deleting_since >= spec.elastic.stuck_pod_timeout_seconds


def is_agent_lost(agent: Optional[PodView], nodes: Optional[Mapping[str, NodeView]]) -> bool:
    """The job agent is missing, exited, unreachable, being deleted, or on a lost node."""
    return (
        agent is None
        or agent.is_finished
        or agent.phase == "Unknown"
        or agent.is_terminating
        or node_loss_reason(agent.node_name, nodes) is not None
    )


DEAD_NODE_REASONS = frozenset({Reason.NODE_NOT_READY, Reason.NODE_UNREACHABLE, Reason.NODE_DELETED})
"""Node states in which no kubelet runs the node's pods or confirms their deletion."""


def is_on_dead_node(pod: PodView, nodes: Optional[Mapping[str, NodeView]]) -> bool:
    """The pod's node is NotReady, unreachable or deleted, or the pod's phase is Unknown (its node went silent)."""
    return pod.phase == "Unknown" or node_loss_reason(pod.node_name, nodes) in DEAD_NODE_REASONS


def failure_cause(pod: PodView) -> str:
    """The last line of a failed pod's termination message (the launcher writes the exit code and the last line
    of the user's traceback there), at most 512 characters; '' when there is none."""
    lines = [line.strip() for line in pod.termination_message.splitlines() if line.strip()]
    return lines[-1][:512] if lines else ""


def stall_detail(status: DistTrainJobStatus, pod: PodView) -> str:
    """What the agent's stall report says of ``pod``: its ranks, the step, the wait and where the dumps are."""
    for entry in status.stalled_nodes or ():
        if entry.node == pod.name and entry.pod_uid in ("", pod.uid):
            ranks = ", ".join(str(r) for r in entry.ranks) or "?"
            detail = (
                f" (node {pod.name}, rank(s) {ranks} did not reach step {entry.step}'s gradient reduction; their peers "
                f"waited {entry.waited_seconds:.0f} s"
            )
            return detail + (f"; stacks in {entry.diagnostics})" if entry.diagnostics else ")")
    return ""
