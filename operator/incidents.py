"""One incident, one charge: how an unplanned loss is charged (``status.incident``), pure.

The first unplanned loss opens an incident covering every worker pod that exists then and is charged once (a
Warning event, the counters, the backoff, a reform); a later loss of a covered pod is folded into it (replaced, not
charged) until a group runs again. A failure of the user's code is charged one restart (``restartPolicy.maxRestarts``);
a loss of infrastructure (a node's, an eviction, a deletion) one infrastructure loss
(:mod:`~disttrain.operator.infralosses`), and a failure of the user's code folded into such an incident moves it to
the restart budget. An incident that finds its budget spent fails the job uncharged. Planned exits (a drain's) are
never charged, and neither are the failures the job agent's loss causes: those open an uncharged incident
(``charged=False``), since the agent's loss is counted once, as an infrastructure loss, when it is seen.
"""

from __future__ import annotations

from disttrain.api import timestamps
from disttrain.api.conditions import ConditionType, Reason
from disttrain.api.control import DirectiveAction
from disttrain.api.exitcodes import ExitCode
from disttrain.api.status import DistTrainJobStatus, Incident
from disttrain.operator.draft import Draft, fail, issue
from disttrain.operator.infralosses import charge_infrastructure_loss, is_infrastructure_cause, remove_loss
from disttrain.operator.losses import (
    LOSS_REASONS,
    failure_cause,
    is_peer_loss_exit,
    loss_event_reason,
    stall_detail,
)
from disttrain.operator.observed import NORMAL, WARNING, PodView
from disttrain.operator.sizing import backoff_seconds


def is_outside_the_group(d: Draft, name: str) -> bool:
    """The pod waits outside the running group (a hot spare, a newcomer not drained in yet), by the agent's report of
    the round's pods (``status.roundMembers``). Only trusted while that report describes the group that runs: no
    directive re-forms it, and it names as many pods as the group has nodes. Otherwise the pod counts as a member."""
    st = d.status
    members = st.round_members
    nproc = d.spec.nproc_per_node
    if not members or st.control.in_flight or nproc < 1 or len(members) * nproc != st.world_size:
        return False
    return name not in members


def count_lost_pod(d: Draft, pod: PodView, reason: Reason) -> None:
    """First sight of a lost pod: charged (a restart, or an infrastructure loss), unless it drained as asked or
    failed because the job agent was lost (then an uncharged incident). A pod lost with the agent's node is a node
    loss like any other: an infrastructure loss."""
    st = d.status
    st.tracked_pods.discard(pod.name)
    if pod.phase == "Failed" and pod.exit_code == ExitCode.DRAINED:
        if st.control.action is not DirectiveAction.DRAIN:  # a SIGTERM of its own: eviction, node shutdown
            d.event(
                NORMAL,
                Reason.NODE_DEPARTING,
                f"worker pod {pod.name} drained after a checkpoint on a SIGTERM of its own"
                + (f" ({pod.reason})" if pod.reason else "")
                + ": replaced, not a restart",
            )
        return  # planned: it committed a checkpoint holding every step it ran, then exited
    outside = is_outside_the_group(d, pod.name)
    if reason is Reason.POD_FAILED and failed_with_the_agent(st, pod):
        lost = timestamps.format_time(st.agent_lost_at or d.now)
        message = f"worker pod {pod.name} exited (code {pod.exit_code}) after the job agent was lost at {lost}"
        count_loss(d, pod.name, Reason.AGENT_RESTARTED, message, outside=outside, charged=False)
        return
    detail = f"worker pod {pod.name} lost: {reason.value}"
    if reason is Reason.STEP_STALLED:
        detail += stall_detail(d.status, pod)
    if pod.node_name and reason.value.startswith("Node"):
        detail += f" (node {pod.node_name})"
    if pod.exit_code is not None:
        detail += f", exit code {pod.exit_code}"
    cause = failure_cause(pod)
    if cause:
        detail += f": {cause}"
    count_loss(d, pod.name, reason, detail, outside=outside, consequence=is_peer_loss_exit(pod))


def is_users_failure(cause: Reason) -> bool:
    """The loss is a failure of the user's code, charged to ``restartPolicy.maxRestarts``: an exit code of its own,
    a stalled step."""
    return cause.value in LOSS_REASONS and not is_infrastructure_cause(cause)


def failed_with_the_agent(st: DistTrainJobStatus, pod: PodView) -> bool:
    """The pod existed when the job agent was lost and failed before the workers reported progress through its
    replacement (``status.agentLostAt`` is still set): a torchrun inside a rendezvous join exits when its store
    disappears, so the failure is the agent's loss, not the user's. A pod created later fails on its own."""
    lost_at = st.agent_lost_at
    if lost_at is None:
        return False
    return pod.created_at is None or pod.created_at <= lost_at


def open_incident(d: Draft, first: str, cause: Reason, message: str, *, charged: bool = True) -> bool:
    """A loss that no open incident explains: a new incident, charged once (counters, backoff): one restart for a
    failure of the user's code, one infrastructure loss for the cluster's (:mod:`~disttrain.operator.infralosses`).
    It covers every worker pod that exists now. An incident that finds its budget spent fails the job instead,
    uncharged: the budget counts restarts that happened. False when the job failed (or had succeeded) instead.

    ``charged=False``: a loss the user does not pay for (the job agent's): no counter, no backoff, and no budget
    check, so it never fails the job; it still folds the losses that follow until a group runs again."""
    st = d.status
    if d.is_true(ConditionType.SUCCEEDED):
        return False
    infrastructure = charged and is_infrastructure_cause(cause)
    charge = charge_infrastructure_loss if infrastructure else charge_restart
    if charged and not charge(d, cause, message):
        return False
    st.incident = Incident(
        opened_at=d.now,
        reason=cause.value,
        first_pod=first,
        covers={p.name for p in d.seen.workers},
        infrastructure=infrastructure,
        charged=charged,
    )
    if charged:
        st.consecutive_failures += 1
        delay = backoff_seconds(d.spec, st.consecutive_failures)
        st.next_restart_time = d.now + delay if delay > 0 else None
    return True


def charge_restart(d: Draft, cause: Reason, message: str) -> bool:
    """Count a restart against ``restartPolicy.maxRestarts``, or fail the job when the budget is spent. False when
    it failed."""
    st = d.status
    budget = d.spec.restart_policy.max_restarts
    if st.restarts.total >= budget:
        # The failure that spent the budget may be a retry's, which can fail otherwise than the user's code did
        # (a replacement that timed out joining): the last charged failure is named too.
        before = (
            f"; the last charged failure: {st.last_failure}" if st.last_failure and st.last_failure != message else ""
        )
        fail(
            d,
            Reason.RESTART_BUDGET_EXHAUSTED,
            f"{st.restarts.total} of spec.restartPolicy.maxRestarts={budget} restarts used; no restart left for "
            f"{message}{before}",
        )
        return False
    st.restarts.total += 1
    st.restarts.by_reason[cause.value] = st.restarts.by_reason.get(cause.value, 0) + 1
    st.last_failure = message[:1024]
    return True


def count_loss(
    d: Draft,
    name: str,
    reason: Reason,
    message: str,
    *,
    outside: bool = False,
    consequence: bool = False,
    charged: bool = True,
) -> None:
    """An unplanned loss of worker pod ``name``: folded into the open incident when that covers the pod, else a new
    incident (a Warning Event naming the cause, a charged restart, a reform if a group is running). ``charged=False``
    opens it uncharged (:func:`open_incident`), announced by a Normal Event under ``reason``.

    ``consequence``: the pod failed the way a peer's loss makes survivors fail (:func:`is_peer_loss_exit`); an
    incident it opens is charged as NodeLost. A pod ``outside`` the running group is counted too (the budget and the
    backoff bound a spare that keeps failing) but re-forms nothing: the group never depended on it, and its
    replacement is created as for any missing pod."""
    st = d.status
    if d.is_true(ConditionType.SUCCEEDED):
        return
    incident = st.incident
    if incident is not None and name in incident.covers:
        users = incident.infrastructure and not consequence and is_users_failure(reason)
        if users and not move_to_restarts(d, incident, reason, message):
            return
        fold(d, incident, name, message, outside=outside)
        return
    cause = Reason.NODE_LOST if consequence else reason
    if charged:
        d.event(WARNING, loss_event_reason(cause), message)
    else:
        d.event(NORMAL, cause, f"{message}: replaced, not charged")
    if not open_incident(d, name, cause, message, charged=charged):
        return
    if outside:
        d.event(NORMAL, Reason.OUTSIDE_THE_GROUP, f"{message}; it was not in the running round: the group trains on")
        return
    if st.world_size > 0 or st.control.in_flight:
        issue(d, DirectiveAction.REFORM, cause, st.desired_nodes or d.spec.nodes.replicas, exclude=st.control.exclude)


def move_to_restarts(d: Draft, incident: Incident, cause: Reason, message: str) -> bool:
    """A failure of the user's code among the losses of an incident charged as the cluster's: the first sign was
    a consequence (survivors' collectives failed before the crashed pod's exit was seen), so the incident is the
    user's. Its infrastructure loss is taken back and a restart charged instead, under ``cause`` (a crash loop
    always meets maxRestarts). False when that found the restart budget spent and failed the job."""
    st = d.status
    remove_loss(st.infrastructure_losses, incident.reason, incident.opened_at)
    if not charge_restart(d, cause, message):
        return False
    d.event(WARNING, loss_event_reason(cause), f"{message}: the {incident.reason} incident is charged as a restart")
    incident.infrastructure = False
    incident.reason = cause.value
    return True


def fold(d: Draft, incident: Incident, name: str, message: str, *, outside: bool) -> None:
    """A loss of a pod the open incident covers: replaced (by the caller), not charged. The group is told to re-form
    again, as for any loss: a round being formed may hold the pod just lost."""
    st = d.status
    incident.folded.add(name)
    opened = timestamps.format_time(incident.opened_at)
    d.event(
        NORMAL,
        Reason.PART_OF_INCIDENT,
        f"{message}; part of the {incident.reason} incident of {incident.first_pod} at {opened}: "
        + ("replaced, not charged again" if incident.charged else "replaced, not charged"),
    )
    if not outside and (st.world_size > 0 or st.control.in_flight):
        cause = Reason(incident.reason) if incident.reason in LOSS_REASONS else Reason.NODE_LOST
        issue(d, DirectiveAction.REFORM, cause, st.desired_nodes or d.spec.nodes.replicas, exclude=st.control.exclude)


def uncover_new_pods(d: Draft) -> None:
    """The pods this reconcile creates are the restart happening: outside the open incident, even when one takes the
    name of a pod the incident covers (a replacement's name is free once the lost pod is gone)."""
    if d.status.incident is not None:
        d.status.incident.covers -= {w.name for w in d.create}


def close_incident(d: Draft) -> None:
    """A group runs again: the incident is over, and the next loss is a new one."""
    d.status.incident = None
