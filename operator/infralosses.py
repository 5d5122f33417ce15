"""Losses of infrastructure the job survived: counted apart from the restart budget, with a per-hour guard, pure.

``restartPolicy.maxRestarts`` pays for failures of the user's code (an exit code, a crash loop, a stalled step).
A node lost, NotReady or silent, a pod evicted, preempted or deleted, a node departing and the job agent lost are
the cluster's: they are counted in ``status.infrastructureLosses`` (total, by reason, and the times of the last
hour's, so that a restarted operator keeps the window) and bounded by
``restartPolicy.maxInfrastructureLossesPerHour`` alone, a guard against a cluster that keeps losing the job's nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

from disttrain.api.conditions import Reason
from disttrain.api.status import InfrastructureLossCounts
from disttrain.operator.draft import Draft, fail
from disttrain.operator.losses import NODE_CAUSES

WINDOW_SECONDS = 3_600.0
"""The guard's window: ``maxInfrastructureLossesPerHour`` losses at most within any hour."""

INFRASTRUCTURE_CAUSES = NODE_CAUSES | {
    Reason.EVICTED,
    Reason.POD_DELETED,
    Reason.NODE_DEPARTING,
    Reason.AGENT_RESTARTED,
}
"""Loss causes that are the cluster's, not the user's code: a node's loss (NodeLost also names a failure that a
peer's loss explains), an eviction, a deletion (a scheduler's preemption deletes the pod), a departing node and the
job agent's loss. PodFailed (the user's exit code) and StepStalled (a hang may be the user's code as well as a GPU)
stay on the restart budget."""


def is_infrastructure_cause(cause: Reason) -> bool:
    """The loss is the cluster's: charged to ``status.infrastructureLosses``, not to ``maxRestarts``."""
    return cause in INFRASTRUCTURE_CAUSES


def within_window(times: Sequence[float], now: float) -> list[float]:
    """The loss times of the last hour before ``now``, oldest first (a time after ``now``, a skewed clock's, stays)."""
    return sorted(t for t in times if now - t < WINDOW_SECONDS)


def add_loss(counts: InfrastructureLossCounts, cause: Reason, now: float) -> None:
    """Count one loss of ``cause`` at ``now``: the total, its reason and the window (older times dropped)."""
    counts.total += 1
    counts.by_reason[cause.value] = counts.by_reason.get(cause.value, 0) + 1
    counts.recent = [*within_window(counts.recent, now), now]


def remove_loss(counts: InfrastructureLossCounts, reason: str, at: float) -> None:
    """Take back a loss counted under ``reason`` at ``at`` (an incident that turned out to be the user's code)."""
    counts.total = max(0, counts.total - 1)
    left = counts.by_reason.get(reason, 0) - 1
    if left > 0:
        counts.by_reason[reason] = left
    else:
        counts.by_reason.pop(reason, None)
    if at in counts.recent:
        counts.recent.remove(at)


def pending_note(d: Draft) -> str:
    """What a job waiting after an infrastructure loss says of it (its restart budget is not what it spends); ''
    when the open incident is no infrastructure loss."""
    incident = d.status.incident
    if incident is None or not incident.infrastructure:
        return ""
    recent = len(within_window(d.status.infrastructure_losses.recent, d.now))
    limit = d.spec.restart_policy.max_infrastructure_losses_per_hour
    return (
        f"; {recent} of spec.restartPolicy.maxInfrastructureLossesPerHour={limit} infrastructure losses in the last "
        f"hour, last: {incident.reason} of {incident.first_pod} (no restart charged)"
    )


def charge_infrastructure_loss(d: Draft, cause: Reason, message: str) -> bool:
    """Count an infrastructure loss, or fail the job when the last hour already holds
    ``maxInfrastructureLossesPerHour`` of them (uncharged, as a spent restart budget is). False when it failed."""
    counts = d.status.infrastructure_losses
    limit = d.spec.restart_policy.max_infrastructure_losses_per_hour
    recent = within_window(counts.recent, d.now)
    if len(recent) >= limit:
        fail(
            d,
            Reason.INFRASTRUCTURE_LOSSES_EXCEEDED,
            f"{len(recent)} infrastructure losses within the last hour, "
            f"spec.restartPolicy.maxInfrastructureLossesPerHour={limit}: the cluster keeps losing the job's nodes; "
            f"no more tolerated for {message} (none was charged to spec.restartPolicy.maxRestarts)",
        )
        return False
    add_loss(counts, cause, d.now)
    return True
