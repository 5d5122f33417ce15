"""The reconcile core: ``reconcile(job, observed, now) -> Actions``. Pure: no I/O, no kopf, no clock.

Every step is a small named function below; :func:`reconcile` is the pipeline that strings them together. Beside
it: the working state of one reconcile (:mod:`~disttrain.operator.draft`), why a pod is lost
(:mod:`~disttrain.operator.losses`), how a loss is charged (:mod:`~disttrain.operator.incidents`), nodes that announce
their end (:mod:`~disttrain.operator.departures`) and the sizing rules (:mod:`~disttrain.operator.sizing`).
All memory lives in ``status`` (tracked pods, handled losses, pending scale, the directive in flight,
backoff), so the result depends only on the inputs and a restarted operator continues where it stopped.

The group protocol, in short:

* ``status.desiredNodes`` is what we work towards: ``spec.nodes.replicas`` clamped to [min, max], snapped
  to a node count valid for the batch contract, after the scale debounce.
* A new worker pod takes the lowest node index that no live pod holds. A lost pod releases its index at once,
  even while its object lingers Terminating on a dead node, so a replacement takes the index of the node it
  replaces; the rendezvous handler orders ranks by node index, so the replacement also takes its ranks and
  every survivor keeps its own. The pod is named ``<job>-worker-<index>``, or ``<job>-worker-<index>-<n>``
  while an older pod still holds that name, so a replacement never waits for a stuck pod to free its name.
* Unplanned loss (pod deleted, Failed, evicted, node NotReady/unreachable/deleted/draining) -> directive
  ``reform`` (survivors exit at once; torchrun re-rendezvouses), a charge (a restart, or an infrastructure loss)
  with backoff, a replacement; if the replacement is not Running within ``replacementWaitSeconds`` the rendezvous target
  drops to the survivors (when >= min).
* Planned scale-down -> ``drain`` with the victims excluded from the next round; once a checkpoint was
  committed after the drain (or ``drainTimeoutSeconds`` passed) the victims are deleted.
* Scale-up -> new pods start and wait in the rendezvous; once they run, ``drain`` so the group re-forms with
  them at a checkpoint.
* A directive completes when the agent reports a rendezvous round newer than the one running when it was issued
  (``control.issuedRound``), at the target size, with progress after the issue. The old group keeps reporting
  steps for a moment after a directive; those reports belong to the old round and never complete it.
* A lost job agent is recreated behind the same Service name and is no restart: the workers train on (training
  needs no store once the communicators exist) and reconnect to it. A worker pod that existed then and fails
  because its store vanished (a torchrun inside a rendezvous join exits 1) is replaced in an uncharged incident,
  with a reform as for any loss; one lost with the agent's node is an ordinary, charged node loss.
* One incident, one charge (``status.incident``): the first unplanned loss opens an incident and is charged; a
  later loss of a pod that existed then is folded into it (replaced, not charged) until a group runs again. A
  failure of the user's code is charged a restart; a loss of infrastructure (a node's, an eviction, a deletion, a
  departing node, the job agent) is counted in ``infrastructureLosses``, bounded per hour, never in ``restarts``.
  An incident that finds its budget spent fails the job uncharged, so ``restarts.total`` counts restarts that
  happened.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from disttrain.api import conditions, constants, containers, rules, timestamps
from disttrain.api.conditions import ConditionType, Reason
from disttrain.api.control import DirectiveAction, is_drain_checkpoint
from disttrain.api.reformphases import reform_phases
from disttrain.api.spec import CleanPodPolicy, DistTrainJob, DistTrainJobSpec, SuccessPolicy
from disttrain.api.status import DistTrainJobStatus, PendingScale, Phase, ReformRecord
from disttrain.operator import announcements, departures, names, replacement
from disttrain.operator.draft import Draft, fail, issue
from disttrain.operator.incidents import (
    close_incident,
    count_loss,
    count_lost_pod,
    is_outside_the_group,
    uncover_new_pods,
)
from disttrain.operator.infralosses import charge_infrastructure_loss, pending_note
from disttrain.operator.losses import (
    LOSS_REASONS,
    failure_cause,
    is_agent_lost,
    is_force_delete_due,
    is_on_dead_node,
    is_peer_loss_exit,
    is_permanent_exit,
    loss_reason,
)
from disttrain.operator.observed import (
    NORMAL,
    WARNING,
    Actions,
    CreateFailure,
    Observed,
    PodView,
    WorkerCreation,
)
from disttrain.operator.sizing import (
    PendingScaleWire,
    choose_victims,
    clamp_nodes,
    debounce_scale,
    free_indices,
    nodes_to_avoid,
    snap_to_valid,
    world_column,
)

REFUSED_RETRY_SECONDS = 10.0
"""How often a pod creation the API server refused (Pod Security, quota) is tried again."""

# --------------------------------------------------------------------------------------------------------------
# Small policies (each unit-tested on its own)
# --------------------------------------------------------------------------------------------------------------


def training_complete(spec: DistTrainJobSpec, status: DistTrainJobStatus) -> bool:
    """The agent's relayed progress shows the training length reached."""
    return spec.training.is_complete(status.step, status.samples_consumed)


def is_success(spec: DistTrainJobSpec, status: DistTrainJobStatus, members: list[PodView]) -> bool:
    """The success rule. Never "any worker succeeded" alone.

    AllWorkers: every member pod Succeeded. RankZero: a pod Succeeded and the trainer's progress (written by
    global rank 0) reached the training length. Hot spares never train: up to ``nodes.spares`` members may still
    be waiting (or starting) once the training length is reached.
    """
    succeeded = [p for p in members if p.phase == "Succeeded"]
    if not succeeded:
        return False
    if spec.success_policy is SuccessPolicy.RANK_ZERO:
        return training_complete(spec, status)
    unfinished = len(members) - len(succeeded)
    return unfinished == 0 or (unfinished <= spec.nodes.spares and training_complete(spec, status))


# --------------------------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------------------------

Step = Callable[[Draft], None]


def reconcile(job: DistTrainJob, seen: Observed, now: float) -> Actions:
    """Decide everything for one job at time ``now`` (Unix seconds). Pure; call it as often as you like.

    The steps run in order until one finishes the job (success, failure, budget, deadline); a finished job,
    whether it finished now or earlier, only has its pods cleaned up.
    """
    d = Draft(job, seen, now)
    for step in _steps(d.spec):
        if d.is_finished:
            break
        step(d)
    if d.is_finished:
        _clean_up_finished(d)
    return d.freeze()


def _steps(spec: DistTrainJobSpec) -> tuple[Step, ...]:
    if spec.run_policy.suspend:
        return (_suspend,)
    return (
        _refuse_unrunnable,
        _resume_if_suspended,
        _bootstrap,
        _ensure_agent,
        announcements.announce_checkpoint,
        announcements.announce_store_rejections,
        announcements.announce_checkpoint_upload,
        _handle_workers,
        _check_terminal,
        _size,
        _gang,
        _publish,
    )


def unrunnable(spec: DistTrainJobSpec) -> Optional[str]:
    """Why no worker pod can be built from ``spec`` although it was admitted (stored before the CRD had the rule,
    or a CRD installed without it); None when it can run. The same rules as api/rules.py's template rules."""
    pod_spec = spec.template.get("spec") or {}
    for field in ("serviceAccountName", "serviceAccount"):  # would run the user's code with an agent's token
        account_rule = rules.agent_service_account_rule(field)
        if field in pod_spec and not account_rule.holds(pod_spec[field]):
            return f"spec.template.spec.{field}: {account_rule.render(pod_spec[field])}"
    pod_containers = pod_spec.get("containers") or []
    index = containers.find_trainer_index(pod_containers)
    if index is None:
        return containers.NO_TRAINER_MESSAGE
    if not pod_containers[index].get("command"):
        return (
            f"spec.template.spec.containers[{index}].command: the trainer container needs a command: the operator "
            "runs it under torchrun and cannot read the image's entrypoint"
        )
    return None


def _refuse_unrunnable(d: Draft) -> None:
    """A spec no pod can be built from fails at once (InvalidSpec), instead of a pod creation retried forever."""
    problem = unrunnable(d.spec)
    if problem is not None:
        fail(d, Reason.INVALID_SPEC, problem)


def _bootstrap(d: Draft) -> None:
    """First sight of the job (or after a resume): start time, selector, Created condition."""
    st = d.status
    if st.start_time is None:
        st.start_time = d.now
    st.selector = f"{constants.LABEL_JOB_NAME}={d.job.metadata.name},{constants.LABEL_ROLE}={constants.ROLE_WORKER}"
    st.observed_generation = d.job.metadata.generation or st.observed_generation
    if d.seen.create_failure is not None:
        _announce_create_failure(d, d.seen.create_failure)
        return
    d.condition(
        ConditionType.CREATED,
        True,
        Reason.CREATED,
        "job agent, services, RBAC and workers are managed",
        announce=NORMAL,
    )


AGENT_RECONNECT_GRACE_S = 10.0
"""How long after the job agent's loss was seen the workers' progress must be stamped before the loss is over
(``status.agentLostAt`` cleared). It bounds how late a worker pod may still fail because of the loss and not be
charged: a client of the agent's store gives up on a silent server within about 10 s, so a torchrun caught inside a
rendezvous join has failed by then; it also absorbs the skew between rank 0's clock (progress stamps) and the
operator's."""


def _ensure_agent(d: Draft) -> None:
    """The agent pod exists and is healthy; a lost agent is recreated behind the same Service name.

    Its loss is announced (a Warning Event, ``status.agentLostAt``) and counted as an infrastructure loss, but is no
    restart: no incident, no directive. The workers train on and reconnect to the new agent; the ones that fail
    meanwhile are handled by :func:`~disttrain.operator.incidents.count_lost_pod` (uncharged)."""
    agent = d.seen.agent
    name = names.agent_name(d.job.metadata.name)
    tracked = d.status.tracked_pods
    silent = agent is not None and bool(d.seen.agent_silence) and not agent.is_finished
    lost = is_agent_lost(agent, d.seen.nodes) or silent
    if agent is not None and lost:
        # No kubelet will confirm the deletion of a pod on a dead node: force it at once so that the replacement
        # (same name) starts now, not after stuckPodTimeoutSeconds while the workers have no store. A silent
        # agent's node is taken for dead before Kubernetes says so (its kubelet, if alive, stops the old one).
        force = (
            silent
            or is_on_dead_node(agent, d.seen.nodes)
            or (agent.is_terminating and is_force_delete_due(agent, d.spec, d.seen.nodes, d.now))
        )
        d.delete(agent, Reason.AGENT_RESTARTED, force=force)
        if force:
            d.create_agent = True  # applied after the deletion; a 409 is retried by the next reconcile
        if silent and agent.node_name:
            d.agent_avoid_nodes = (agent.node_name,)  # still Ready to the scheduler
        elif agent.is_terminating:
            d.timer((agent.deleting_since or d.now) + d.spec.elastic.stuck_pod_timeout_seconds)
    if agent is None:
        d.create_agent = True
    if lost and name in tracked:
        tracked.discard(name)
        where = f" (node {agent.node_name})" if agent is not None and agent.node_name else ""
        why = f", {d.seen.agent_silence}" if silent else ""
        message = f"job agent pod {name} was lost{where}{why}"
        if not charge_infrastructure_loss(d, Reason.AGENT_RESTARTED, message):
            return
        d.event(
            WARNING,
            Reason.AGENT_RESTARTED,
            f"{message}; recreating it: the workers train on and reconnect to it, no restart",
        )
        d.status.agent_lost_at = d.now
    elif agent is not None and not lost and agent.is_running:
        tracked.add(name)
        _forget_agent_loss(d)


def _forget_agent_loss(d: Draft) -> None:
    """The agent's loss is over once the new agent runs and relays progress stamped at least
    :data:`AGENT_RECONNECT_GRACE_S` after the loss was seen: only the new agent can relay it (the old one is gone;
    a stamp restored from before the loss is older), so the workers reach its store. A worker that fails after that
    fails on its own and is charged. Until then a failure of a pod that existed at the loss is the loss's
    (:func:`~disttrain.operator.incidents.failed_with_the_agent`); a job that never progresses keeps the mark, which
    costs at most one uncharged replacement per pod that existed then. Pure: compares two status stamps."""
    st = d.status
    lost_at = st.agent_lost_at
    progressed = st.last_progress_time
    if lost_at is not None and progressed is not None and progressed >= lost_at + AGENT_RECONNECT_GRACE_S:
        st.agent_lost_at = None


# -- worker pods: losses and members -----------------------------------------------------------------------------


def _handle_workers(d: Draft) -> None:
    """Sort every worker pod into member, scale-down victim or lost pod; count and remove the lost ones.

    The books in status make this safe to repeat: ``trackedPods`` (seen alive) reveals pods that vanished
    unseen, ``handledPods`` (losses already counted) keeps a restarted operator from counting one twice.
    """
    victims = frozenset(d.status.control.exclude)  # as they stood before this reconcile's own directives
    _count_vanished_pods(d, victims)
    _forget_gone_victims(d)
    handled = set(d.status.handled_pods)
    # Causes before consequences: a dead node seen with its peers' aborts opens the incident under its own reason.
    for pod in sorted(d.seen.workers, key=lambda p: (is_peer_loss_exit(p), p.node_index)):
        reason = loss_reason(pod, d.seen.nodes)
        if reason is None and pod.name in d.silent:
            reason = Reason.HEARTBEAT_LOST
        if reason is None and pod.name in d.stalled:
            reason = Reason.STEP_STALLED
        why = None
        if reason in (None, Reason.NODE_DRAINING, Reason.POD_DELETED):  # it can still checkpoint
            why = departures.pod_departure(pod, d.seen.nodes, d.spec.elastic.departure)
            reason = None if why is not None else reason
        if pod.name in victims:
            _remove_exited_victim(d, pod, reason)
        elif why is not None:
            d.departing.append((pod, why))
            d.status.tracked_pods.add(pod.name)
        elif reason is None:
            d.members.append(pod)
            d.status.tracked_pods.add(pod.name)
        elif pod.phase == "Failed" and is_permanent_exit(d.spec, pod.exit_code):
            cause = failure_cause(pod)
            fail(
                d,
                conditions.failure_reason(cause or ""),
                f"worker pod {pod.name} exited with code {pod.exit_code}, listed as permanent in "
                f"spec.restartPolicy.exitCodes.permanent" + (f": {cause}" if cause else ""),
            )
            return
        else:
            if reason in (Reason.HEARTBEAT_LOST, Reason.STEP_STALLED):
                _fence(d, pod)
            _mark_lost(d, pod)
            if pod.uid not in handled:
                handled.add(pod.uid)
                if reason is Reason.STEP_STALLED:
                    d.status.stalls += 1
                count_lost_pod(d, pod, reason)
            _remove_lost_pod(d, pod, reason)
    # Forget handled uids whose pods are gone: the list stays as short as the set of lingering pods.
    present = {p.uid for p in d.seen.workers}
    d.status.handled_pods = sorted(uid for uid in handled if uid in present)


def _fence(d: Draft, pod: PodView) -> None:
    """A silent or stalled pod may be alive behind a partition, or still in its step: keep it out of the next round
    (the rendezvous ``exclude``) until it is gone. It is deleted too, and the checkpoint fence refuses its commits
    (docs/operator.md)."""
    if pod.name not in d.status.control.exclude:
        d.status.control.exclude = sorted({*d.status.control.exclude, pod.name})


def _count_vanished_pods(d: Draft, victims: frozenset[str]) -> None:
    """Pods that vanished without us seeing them lost (force-deleted, or deleted while we were down)."""
    seen = {p.name for p in d.seen.workers}
    agent = names.agent_name(d.job.metadata.name)
    for name in sorted(set(d.status.tracked_pods) - seen - {agent}):
        d.status.tracked_pods.discard(name)
        if name not in victims:
            count_loss(
                d, name, Reason.POD_DELETED, f"worker pod {name} disappeared", outside=is_outside_the_group(d, name)
            )


def _forget_gone_victims(d: Draft) -> None:
    seen = {p.name for p in d.seen.workers}
    d.status.control.exclude = [name for name in d.status.control.exclude if name in seen]


def _mark_lost(d: Draft, pod: PodView) -> None:
    """List a lost pod in ``control.lost``: the survivors drop it from the finished rendezvous round at once
    instead of waiting for its heartbeats to expire. Kept until the next group runs even if the pod is gone
    first (pod names are never reused), so the survivors see it whenever they re-join."""
    if pod.name not in d.status.control.lost:
        d.status.control.lost = sorted({*d.status.control.lost, pod.name})


def _forget_lost(d: Draft) -> None:
    """Once a group runs again, only the lost pods still lingering stay listed."""
    present = {p.name for p in d.seen.workers}
    d.status.control.lost = [name for name in d.status.control.lost if name in present]


def _remove_exited_victim(d: Draft, pod: PodView, reason: Optional[Reason]) -> None:
    """A scale-down victim that exited or was lost anyway is deleted now (a planned removal, never counted)."""
    if reason is not None and not _left_as_planned(d, reason):
        _mark_lost(d, pod)
    if pod.is_finished or reason is not None:
        d.delete(pod, Reason.SCALED_DOWN, force=is_force_delete_due(pod, d.spec, d.seen.nodes, d.now))


def _left_as_planned(d: Draft, reason: Reason) -> bool:
    """A victim going away (deleted) after its drain's checkpoint, or once the group re-formed: the running or next
    group never counts it (it is in ``control.exclude``), so listing it lost would tell the survivors nothing and
    cost a status write per scale-down. A victim that failed, lost its node, or was deleted before the checkpoint
    (the drain timed out, or someone deleted it) may still be in the running group: that one is listed."""
    if reason is not Reason.POD_DELETED:
        return False
    action = d.status.control.action
    return action is DirectiveAction.NONE or (action is DirectiveAction.DRAIN and _drain_checkpointed(d))


def _drain_checkpointed(d: Draft) -> bool:
    """The status names a checkpoint committed after the drain in flight was issued."""
    st = d.status
    issued = st.control.issued_at or d.now
    ckpt_time = st.last_checkpoint.time if st.last_checkpoint else None
    return is_drain_checkpoint(issued, ckpt_time)  # the agent writes this one at once (trainer/agent/reporting.py)


def _remove_lost_pod(d: Draft, pod: PodView, reason: Reason) -> None:
    """Delete a lost pod; force-delete it when its node is gone or it is stuck Terminating."""
    force = is_force_delete_due(pod, d.spec, d.seen.nodes, d.now)
    if force:
        d.event(WARNING, Reason.FORCE_DELETED, f"worker pod {pod.name} was stuck Terminating; force-deleting it")
    elif pod.deleting_since is not None:
        d.timer(pod.deleting_since + d.spec.elastic.stuck_pod_timeout_seconds)
    d.delete(pod, reason, force=force or reason is Reason.NODE_DELETED)


# -- failures, restarts and directives ---------------------------------------------------------------------------


def _succeed(d: Draft) -> None:
    st = d.status
    st.phase = Phase.SUCCEEDED
    st.completion_time = st.completion_time or d.now
    st.message = f"training finished at step {st.step}"
    d.condition(ConditionType.SUCCEEDED, True, Reason.SUCCEEDED, st.message, announce=NORMAL)
    d.condition(ConditionType.RUNNING, False, Reason.SUCCEEDED, st.message)
    d.condition(ConditionType.REFORMING, False, Reason.SUCCEEDED, st.message)


# -- the end of a job: terminal checks, cleanup, suspend -----------------------------------------------------------


def _check_terminal(d: Draft) -> None:
    """Permanent failure reported by a worker, active deadline, success rule."""
    st, spec = d.status, d.spec
    failure = st.worker_failure
    started = st.start_time or 0.0
    if failure is not None and is_permanent_exit(spec, failure.exit_code) and (failure.time or d.now) >= started - 1:
        fail(
            d,
            conditions.failure_reason(failure.message),
            f"worker {failure.node or '?'} exited with permanent code {failure.exit_code}: {failure.message}",
        )
        return
    deadline = spec.run_policy.active_deadline_seconds
    if deadline is not None:
        ends = started + st.suspended_seconds + deadline  # time spent suspended does not count
        if d.now >= ends:
            fail(d, Reason.DEADLINE_EXCEEDED, f"job ran longer than spec.runPolicy.activeDeadlineSeconds={deadline}")
            return
        d.timer(ends)
    if is_success(spec, st, d.members):
        _succeed(d)


def _clean_up_finished(d: Draft) -> None:
    """Finished jobs: delete pods per cleanPodPolicy, always the agent; delete the job after the TTL. Nothing is
    created, even what a step decided before a later one failed the job in the same reconcile."""
    d.create.clear()
    d.create_agent = False
    policy = d.spec.run_policy.clean_pod_policy
    why = Reason.SUCCEEDED if d.status.phase is Phase.SUCCEEDED else Reason.FAILED
    for pod in d.seen.workers:
        if policy is CleanPodPolicy.ALL or (policy is CleanPodPolicy.RUNNING and not pod.is_finished):
            d.delete(pod, why)
    if d.seen.agent is not None:
        d.delete(d.seen.agent, why)
    d.status.control.action = DirectiveAction.NONE
    d.status.pending_scale = None
    ttl = d.spec.run_policy.ttl_seconds_after_finished
    done = d.status.completion_time
    if ttl is not None and done is not None:
        if d.now >= done + ttl:
            d.delete_job = True
        else:
            d.timer(done + ttl)


def _suspend(d: Draft) -> None:
    """No pods while suspended; status (checkpoint, counters) kept; restarts are not counted."""
    st = d.status
    for pod in d.seen.workers:
        d.delete(pod, Reason.SUSPENDED)
    if d.seen.agent is not None:
        d.delete(d.seen.agent, Reason.SUSPENDED)
    st.tracked_pods = set()
    st.handled_pods = []
    st.pending_scale = None
    st.agent_lost_at = None
    st.incident = None
    st.control.action = DirectiveAction.NONE
    st.control.exclude = []
    st.control.lost = []
    st.world_size = 0
    st.world = world_column(0, st.desired_nodes * d.spec.nproc_per_node)
    st.replicas = len(d.seen.workers)
    st.ready_replicas = 0
    st.phase = Phase.SUSPENDED
    if st.start_time is not None and st.suspended_since is None:
        st.suspended_since = d.now
    message = "suspended: no pods run; resuming continues from the last complete checkpoint"
    st.message = message
    d.condition(ConditionType.SUSPENDED, True, Reason.SUSPENDED, message, announce=NORMAL)
    d.condition(ConditionType.RUNNING, False, Reason.SUSPENDED, message)
    d.condition(ConditionType.REFORMING, False, Reason.SUSPENDED, message)


def _resume_if_suspended(d: Draft) -> None:
    st = d.status
    if st.phase is not Phase.SUSPENDED:
        return
    st.phase = Phase.PENDING
    st.consecutive_failures = 0
    st.next_restart_time = None
    since = st.suspended_since
    if since is not None:
        st.suspended_seconds = round(st.suspended_seconds + max(0.0, d.now - since), 3)
    st.suspended_since = None
    d.condition(ConditionType.SUSPENDED, False, Reason.RESUMED, "resumed")
    d.event(NORMAL, Reason.RESUMED, "job resumed")
    if st.last_checkpoint is not None:
        d.event(
            NORMAL, Reason.RESUMED_FROM_STEP, f"resuming from the complete checkpoint at step {st.last_checkpoint.step}"
        )


# -- size: scale requests, directives, pod creation ----------------------------------------------------------------


def _size(d: Draft) -> None:
    """Desired size (clamp, valid sizes, debounce), directives for scale and replacement, pod creation."""
    st, spec, now = d.status, d.spec, d.now
    requested = snap_to_valid(spec, clamp_nodes(spec, spec.nodes.replicas)) or clamp_nodes(spec, spec.nodes.replicas)
    pending: Optional[PendingScaleWire] = None
    if st.pending_scale is not None:
        pending = {"replicas": st.pending_scale.replicas, "since": st.pending_scale.since}
    desired, pending = debounce_scale(st.desired_nodes, requested, pending, spec.elastic.scale_debounce_seconds, now)
    st.pending_scale = PendingScale(replicas=pending["replicas"], since=pending["since"]) if pending else None
    if pending:
        d.timer((timestamps.parse_time(pending["since"]) or now) + spec.elastic.scale_debounce_seconds)
    previous = st.desired_nodes
    st.desired_nodes = desired
    ctl = st.control
    nproc = spec.nproc_per_node
    group_nodes = st.world_size // nproc if nproc else 0

    _complete_directive(d, group_nodes)
    _drain_departing(d, group_nodes)

    live = list(d.members)
    wanted = desired + spec.nodes.spares  # the group's nodes and the hot spares waiting beside it
    # Scale-down: more live pods than wanted.
    surplus = len(live) - wanted
    if surplus > 0:
        if previous and desired < previous:
            d.event(NORMAL, Reason.SCALED_DOWN, f"scaling down from {previous} to {desired} nodes")
        victims = choose_victims(live, surplus)
        if group_nodes > 0 and any(v.is_running for v in victims) and ctl.action is not DirectiveAction.REFORM:
            already_asked = (
                ctl.action is DirectiveAction.DRAIN
                and ctl.reason == Reason.SCALED_DOWN.value
                and ctl.target_nodes == desired
            )
            if not already_asked:
                issue(
                    d,
                    DirectiveAction.DRAIN,
                    Reason.SCALED_DOWN,
                    desired,
                    exclude=[*ctl.exclude, *(v.name for v in victims)],
                )
        else:
            for victim in victims:
                st.tracked_pods.discard(victim.name)  # a planned removal, not a loss
                d.delete(victim, Reason.SCALED_DOWN)
        live = [p for p in live if p not in victims]
    # Victims of a drain: delete once a checkpoint was committed after the drain, or after the drain timeout.
    if ctl.exclude:
        _remove_drained_victims(d)

    # Create what is missing (after the restart backoff).
    missing = wanted - len(live)
    if missing > 0 and not any(p.phase == "Succeeded" for p in d.seen.workers):
        resume_at = st.next_restart_time
        if resume_at is not None and now < resume_at:
            d.timer(resume_at)
            d.condition(
                ConditionType.RUNNING,
                st.phase is Phase.RUNNING,
                Reason.BACKOFF,
                f"restarting {missing} node(s) after backoff at {timestamps.format_time(resume_at)}",
            )
        elif (held_until := _replacement_held_until(d, live)) is not None:
            d.timer(held_until)
        else:
            taken = {p.name for p in d.seen.workers}
            leaving = {p.name for p, _ in d.departing}
            avoid = nodes_to_avoid(
                d.seen.workers, silent=d.silent | d.stalled, lost=st.control.lost, nodes=d.seen.nodes
            )
            avoid = tuple(sorted({*avoid, *(p.node_name for p, _ in d.departing if p.node_name)}))
            for index in free_indices(d.seen.workers, missing, d.seen.nodes, lost=d.silent | d.stalled | leaving):
                name = names.unused_worker_name(d.job.metadata.name, index, taken)
                d.create.append(WorkerCreation(index, name, avoid_nodes=avoid))
            uncover_new_pods(d)
            if previous and desired > previous:
                d.event(NORMAL, Reason.SCALED_UP, f"scaling up from {previous} to {desired} nodes")

    _choose_target(d, live, group_nodes)


def _replacement_held_until(d: Draft, live: list[PodView]) -> Optional[float]:
    """Until when a lost node's replacement waits to be created, None: create it now.

    While the group re-forms after a loss that the Ready hot spares cover, the spares take the lost nodes' places;
    a replacement created at once could be up before the round completes (a forked local pod is, within a second)
    and take a place a spare should have. So the replacement is created once the round formed, as the next spare,
    or once :data:`~disttrain.operator.replacement.SPARE_JOIN_SECONDS` (or a longer ``replacementWaitSeconds``) after
    the loss passed, in case the spares never joined."""
    st, spec, ctl = d.status, d.spec, d.status.control
    if not (spec.nodes.spares and ctl.in_flight and ctl.action is DirectiveAction.REFORM):
        return None
    if ctl.reason not in LOSS_REASONS:
        return None
    if sum(1 for p in live if p.is_running and p.ready) < st.desired_nodes:
        return None
    hold = max(replacement.SPARE_JOIN_SECONDS, replacement.wait_seconds(spec.elastic, live))
    expiry = (ctl.issued_at or d.now) + hold
    return expiry if d.now < expiry else None


def _drain_departing(d: Draft, group_nodes: int) -> None:
    """Workers whose node announced its end leave the group at the next step boundary: a drain directive (a
    checkpoint, then the group re-forms without them) at the size the other running members allow, or the desired
    size when they are too few (the group then waits for the replacements, which :func:`_size` creates at once).
    While another directive is in flight they join its exclusions (a drain in flight deletes them after its
    checkpoint, a reform at once: its group re-forms without them either way). Never a restart."""
    st, ctl = d.status, d.status.control
    new = [(pod, why) for pod, why in d.departing if pod.name not in ctl.exclude]
    if not new:
        return
    for pod, why in new:
        message = departures.departure_message(pod, why)
        if not charge_infrastructure_loss(d, Reason.NODE_DEPARTING, message):
            return
        d.event(NORMAL, Reason.NODE_DEPARTING, message)
    leaving = [pod.name for pod, _ in new]
    if ctl.in_flight or group_nodes == 0:
        ctl.exclude = sorted({*ctl.exclude, *leaving})
        return
    running = len([p for p in d.members if p.is_running and p.ready])
    target = snap_to_valid(d.spec, min(running, st.desired_nodes), allow_up=False) or st.desired_nodes
    issue(d, DirectiveAction.DRAIN, Reason.NODE_DEPARTING, target, exclude=[*ctl.exclude, *leaving])


def _complete_directive(d: Draft, group_nodes: int) -> None:
    """A directive is done when a new rendezvous round runs at the target size.

    New: the agent reports a round newer than ``control.issuedRound`` (the old group keeps reporting steps of
    its round for a moment after the directive; they never complete it). The reform's duration runs from the
    start of the episode to the first progress report of the new round.
    """
    st = d.status
    ctl = st.control
    if not ctl.in_flight:
        if st.world_size > 0:
            close_incident(d)
            _forget_lost(d)
        return
    issued = ctl.issued_at or d.now
    progressed = st.last_progress_time
    new_round = ctl.issued_round is None or st.rendezvous_round > ctl.issued_round
    # At least the target: a late replacement can join the round in the instant its wait ran out and the target was
    # lowered (the handler completes a round at the target or more, never fewer); that group runs, so the directive
    # is done. Before, it stayed in flight for good (seen under load in tests/e2e/test_node_loss.py).
    reached = group_nodes >= ctl.target_nodes > 0
    if new_round and reached and progressed is not None and progressed > issued:
        reason = ctl.reason
        planned = ctl.action is DirectiveAction.DRAIN
        ctl.action = DirectiveAction.NONE
        d.completed_directive = True
        # Victims still shutting down stay excluded so they are not mistaken for members again.
        present = {p.name for p in d.seen.workers}
        ctl.exclude = [name for name in ctl.exclude if name in present]
        _forget_lost(d)
        close_incident(d)
        st.consecutive_failures = 0
        st.next_restart_time = None
        if st.last_reform is not None:
            start = st.last_reform.start or issued
            first = st.round_start_time
            first = progressed if first is None or first < start else first
            st.last_reform.to = group_nodes
            st.last_reform.duration_seconds = round(max(0.0, first - start), 3)
            st.last_reform.phases = reform_phases(start, st.worker_startup, planned=planned)
            _note_state_source(st.last_reform, st)
        phases = st.last_reform.phases if st.last_reform is not None else None
        source = st.last_reform.resumed_from if st.last_reform is not None else None
        d.event(
            NORMAL,
            Reason.REFORMED,
            f"group re-formed with {group_nodes} nodes after {reason} (world size {st.world_size})"
            + (f"; state from {source}" if source else "")
            + (f" ({st.recovery_note})" if source == "checkpoint" and st.recovery_note else "")
            + (f"; phases: {phases.describe()}" if phases is not None else ""),
        )


def _note_state_source(record: ReformRecord, st: DistTrainJobStatus) -> None:
    """Where the re-formed group took its state from, as its rank 0 reported it (in-place reforms only)."""
    if st.resumed_from_memory is None:
        return
    record.resumed_from = "memory" if st.resumed_from_memory else "checkpoint"
    record.note = None if st.resumed_from_memory else st.recovery_note


def _remove_drained_victims(d: Draft) -> None:
    st, spec = d.status, d.spec
    ctl = st.control
    victims = [p for p in d.seen.workers if p.name in ctl.exclude]
    if not victims:
        return
    issued = ctl.issued_at or d.now
    drained = _drain_checkpointed(d)
    timed_out = d.now - issued >= spec.elastic.drain_timeout_seconds
    if ctl.action is not DirectiveAction.DRAIN or drained or timed_out:
        if timed_out and not drained and ctl.action is DirectiveAction.DRAIN:
            d.event(
                WARNING,
                Reason.DRAIN_TIMEOUT,
                f"no checkpoint within spec.elastic.drainTimeoutSeconds={spec.elastic.drain_timeout_seconds}; "
                f"deleting {', '.join(p.name for p in victims)}",
            )
        for pod in victims:
            if pod.name in d.deletions:
                continue  # already deleted as lost in this reconcile (a fenced silent pod): keep that reason
            st.tracked_pods.discard(pod.name)
            d.delete(pod, Reason.SCALED_DOWN, force=is_force_delete_due(pod, spec, d.seen.nodes, d.now))
    else:
        d.timer(issued + spec.elastic.drain_timeout_seconds)


def _choose_target(d: Draft, live: list[PodView], group_nodes: int) -> None:
    """The node count the next rendezvous round completes with, and a ScaleUp drain when new nodes run.

    While some desired pods are not Running and Ready yet, the target stays at the desired size until their wait
    expires (replacementWaitSeconds after a loss, pendingTimeoutSeconds for a new pod); then it drops to the
    Running pods when they are a valid count >= min, so the job never waits forever on a Pending pod.
    A worker pod is Ready once its workers can start without import delay (``disttrain.trainer.launch.readiness``): a
    running group is drained for a newcomer only then, so it never stops to wait for a newcomer's imports.
    Hot spares (``spec.nodes.spares``) are the Ready pods beyond the desired size: they wait in the rendezvous
    outside the group, so a lost node is replaced from them at once and no wait starts while they suffice.
    """
    st, spec, now = d.status, d.spec, d.now
    ctl = st.control
    desired = st.desired_nodes
    running = [p for p in live if p.is_running and p.ready]
    waiting = [p for p in live if not (p.is_running and p.ready)]
    missing = max(0, desired + spec.nodes.spares - len(live))
    enough = len(running) >= desired  # Ready pods for the whole group, spares among them if need be
    target = desired
    if not enough and (waiting or missing):
        if ctl.action is DirectiveAction.REFORM and ctl.reason in LOSS_REASONS:
            expiry = (ctl.issued_at or now) + replacement.wait_seconds(spec.elastic, live)
            timeout_reason = Reason.REPLACEMENT_TIMEOUT
        else:
            created = [p.created_at for p in waiting if p.created_at is not None]
            expiry = (min(created) if created else now) + spec.elastic.pending_timeout_seconds
            timeout_reason = Reason.PENDING_TIMEOUT
        survivors = snap_to_valid(spec, len(running), allow_up=False)
        if now >= expiry and survivors is not None:
            target = survivors
            if ctl.target_nodes != target:
                d.event(
                    WARNING,
                    timeout_reason,
                    f"{desired - len(running)} node(s) not running after the wait; continuing with {target} nodes",
                )
        elif now < expiry:  # after it, with too few survivors, a pod's Ready wakes the next reconcile
            d.timer(expiry)
    if not ctl.in_flight and group_nodes > 0:
        grown = snap_to_valid(spec, min(len(running), desired), allow_up=False) or 0
        if (enough or not (waiting or missing)) and grown > group_nodes:
            if d.completed_directive:
                d.timer(now)  # drained in by the next reconcile, once the completed reform's record was published
                target = group_nodes
            else:
                # Scale-down victims still terminating stay excluded: out of the round, and their end no loss.
                issue(d, DirectiveAction.DRAIN, Reason.SCALED_UP, grown, exclude=ctl.exclude)
                target = grown
        elif target < group_nodes and not ctl.exclude:
            target = group_nodes
    if ctl.in_flight:
        # Lowered, never raised while in flight: once a lower target was published, a round may already have
        # formed at it, and raising the target then would leave the directive waiting for a size the running
        # group will never reach (the late node waits outside; a ScaledUp drain brings it in once this completes).
        if target < ctl.target_nodes:
            ctl.target_nodes = target
    else:
        ctl.target_nodes = target


def _gang(d: Draft) -> None:
    """The PodGroup of ``spec.gang``: written before the first pod of a gang is created (and again whenever pods
    are created, so one deleted by hand comes back) and whenever ``spec.nodes.min`` moved."""
    if d.spec.gang is None:
        return
    minimum = d.spec.nodes.min
    if d.create or d.create_agent or d.status.pod_group_min_member != minimum:
        d.apply_pod_group = True
        d.status.pod_group_min_member = minimum


# -- what the status says -------------------------------------------------------------------------------------------


def refusal_message(answer: str) -> str:
    """Scheduled=False's message while the API server refuses the job's pods."""
    return f"the API server refuses to create the job's pods: {answer}"[:1024]


def _announce_refusal(d: Draft, answer: str) -> None:
    """Scheduled=False (PodRejected) names the API server's answer; a Warning event whenever the answer changes.
    The adapter keeps retrying the creation: an administrator may relabel the namespace or raise the quota."""
    message = refusal_message(answer)
    previous = conditions.find_condition(d.status.conditions, ConditionType.SCHEDULED)
    if previous is None or previous.reason != Reason.POD_REJECTED.value or previous.message != message:
        d.event(WARNING, Reason.POD_REJECTED, message)
    d.condition(ConditionType.SCHEDULED, False, Reason.POD_REJECTED, message)
    d.timer(d.now + REFUSED_RETRY_SECONDS)


def create_failure_message(failure: CreateFailure) -> str:
    """Created=False's message: which object, and the API server's answer or who holds the name."""
    if failure.held_by is not None:
        return f"waiting to create {failure.kind} {failure.name}: {failure.message}"[:1024]
    return f"the API server did not create {failure.kind} {failure.name}: {failure.message}"[:1024]


def _announce_create_failure(d: Draft, failure: CreateFailure) -> None:
    """Created=False names the object the adapter could not create (CreateFailed) or whose name another owner
    holds (NameHeld); a Warning event whenever that changes (the adapter rate-limits repeats). The adapter
    retries the creation after its backoff."""
    reason = Reason.NAME_HELD if failure.held_by is not None else Reason.CREATE_FAILED
    message = create_failure_message(failure)
    previous = conditions.find_condition(d.status.conditions, ConditionType.CREATED)
    if previous is None or previous.reason != reason.value or previous.message != message:
        d.event(WARNING, reason, message)
    d.condition(ConditionType.CREATED, False, reason, message)


def _publish(d: Draft) -> None:
    """Counts, phase and conditions from what was decided."""
    st = d.status
    live = [p for p in d.members if p.name not in st.control.exclude]
    # Hot spares are not replicas: the scale subresource (HPA) and the columns count the group's pods only.
    spares = min(d.spec.nodes.spares, max(0, len(live) - st.desired_nodes))
    st.replicas = len(d.seen.workers) - spares
    st.ready_replicas = max(0, sum(1 for p in d.seen.workers if p.is_running and p.ready) - spares)
    unscheduled = [p.name for p in live if not p.is_scheduled]
    bound = len(live) - len(unscheduled)
    if d.seen.refused:
        _announce_refusal(d, d.seen.refused)
    elif live and bound >= st.desired_nodes and (spares or not unscheduled):  # a spare may wait for a node
        d.condition(
            ConditionType.SCHEDULED,
            True,
            Reason.SCHEDULED,
            f"all {bound} worker pods are bound to nodes"
            if not unscheduled
            else f"{bound} worker pods are bound to nodes, {len(unscheduled)} hot spare(s) not yet",
            announce=NORMAL,
        )
    else:
        d.condition(
            ConditionType.SCHEDULED,
            False,
            Reason.PODS_PENDING,
            f"waiting for {max(len(unscheduled), st.desired_nodes - len(live))} worker pod(s) to be scheduled",
        )
    ctl = st.control
    nproc = d.spec.nproc_per_node
    st.world = world_column(st.world_size, st.desired_nodes * nproc)
    if ctl.in_flight:
        st.phase = Phase.REFORMING
        st.message = f"{ctl.action.value} for {ctl.reason}: re-forming with {ctl.target_nodes} nodes"
        reason = Reason.DRAINING if ctl.action is DirectiveAction.DRAIN else Reason.REFORMING
        d.condition(ConditionType.REFORMING, True, reason, st.message)
        d.condition(ConditionType.RUNNING, False, Reason.REFORMING, st.message)
    elif st.world_size > 0:
        st.phase = Phase.RUNNING
        st.message = f"training with {st.world_size // nproc} nodes (world size {st.world_size})"
        d.condition(ConditionType.REFORMING, False, Reason.REFORMED, st.message)
        flipped = d.condition(ConditionType.RUNNING, True, Reason.RENDEZVOUS_COMPLETE, st.message, announce=NORMAL)
        ckpt = st.last_checkpoint
        resumed = announcements.resumed_step(st, ckpt) if ckpt is not None else 0
        if flipped and st.step <= resumed + 1 and resumed > 0:
            d.event(NORMAL, Reason.RESUMED_FROM_STEP, f"training resumed from step {resumed}")
            message = announcements.resumed_message(resumed)
            d.condition(ConditionType.CHECKPOINTED, True, Reason.RESUMED_FROM_STEP, message)
            announcements.warn_of_an_earlier_job(d, resumed)
    else:
        st.phase = Phase.PENDING
        running = sum(1 for p in live if p.is_running)
        if running < d.spec.nodes.min:
            st.message = f"waiting for nodes: {running} running, at least spec.nodes.min={d.spec.nodes.min} needed"
            reason = Reason.WAITING_FOR_NODES
        else:
            st.message = f"waiting for the first rendezvous round with {ctl.target_nodes} nodes"
            reason = Reason.PODS_PENDING
        if d.seen.refused:
            st.message = refusal_message(d.seen.refused)
        elif st.consecutive_failures and (note := pending_note(d)):
            st.message += note
        elif st.consecutive_failures and st.last_failure:
            st.message += (
                f"; {st.restarts.total} of spec.restartPolicy.maxRestarts={d.spec.restart_policy.max_restarts} "
                f"restarts used, last: {st.last_failure}"
            )
        d.condition(ConditionType.RUNNING, False, reason, st.message)
