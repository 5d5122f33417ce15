"""The reconcile core: ``reconcile(job, observed, now) -> Actions``. Pure: no I/O, no kopf, no clock.

Every policy is a small named function below; :func:`reconcile` is the pipeline that strings them together.
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
  ``reform`` (survivors exit at once; torchrun re-rendezvouses), a counted restart with backoff, a
  replacement; if the replacement is not Running within ``replacementWaitSeconds`` the rendezvous target
  drops to the survivors (when >= min).
* Planned scale-down -> ``drain`` with the victims excluded from the next round; once a checkpoint was
  committed after the drain (or ``drainTimeoutSeconds`` passed) the victims are deleted.
* Scale-up -> new pods start and wait in the rendezvous; once they run, ``drain`` so the group re-forms with
  them at a checkpoint.
* A directive completes when the agent reports a rendezvous round newer than the one running when it was issued
  (``control.issuedRound``), at the target size, with progress after the issue. The old group keeps reporting
  steps for a moment after a directive; those reports belong to the old round and never complete it.
* A lost job agent is one restart (AgentRestarted). Worker pods that existed then fail on their own when their
  store disappears (torchrun exits 1); those failures belong to the same loss and are not counted again.
* One incident, one restart (``status.incident``): the first unplanned loss opens an incident and is charged; a
  later loss of a pod that existed then is folded into it (replaced, not charged) until a group runs again. An
  incident that finds the budget spent fails the job uncharged, so ``restarts.total`` counts restarts that happened.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Optional, TypedDict

from disttrain.api import conditions, constants, containers, rules, timestamps
from disttrain.api.conditions import ConditionType, Reason
from disttrain.api.control import DirectiveAction, is_drain_checkpoint
from disttrain.api.exitcodes import ExitCode
from disttrain.api.plan import valid_node_counts
from disttrain.api.reformphases import reform_phases
from disttrain.api.spec import CleanPodPolicy, DistTrainJob, DistTrainJobSpec, SuccessPolicy
from disttrain.api.status import CheckpointRef, DistTrainJobStatus, Incident, PendingScale, Phase, ReformRecord
from disttrain.operator import departures, heartbeat, names
from disttrain.operator.observed import (
    NORMAL,
    WARNING,
    Actions,
    CreateFailure,
    Event,
    EventType,
    NodeView,
    Observed,
    PodDeletion,
    PodView,
    WorkerCreation,
)
from disttrain.operator.patches import copy_json, merge_patch

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
REFUSED_RETRY_SECONDS = 10.0
"""How often a pod creation the API server refused (Pod Security, quota) is tried again."""
CHECKPOINT_MESSAGE_REFRESH_SECONDS = 60.0
"""How late the Checkpointed condition's message may name an older checkpoint than status.lastCheckpoint."""

# --------------------------------------------------------------------------------------------------------------
# Small policies (each unit-tested on its own)
# --------------------------------------------------------------------------------------------------------------


class PendingScaleWire(TypedDict):
    """``status.pendingScale`` on the wire: a scale request waiting out the debounce."""

    replicas: int
    since: str


def clamp_nodes(spec: DistTrainJobSpec, requested: int) -> int:
    """``requested`` limited to [nodes.min, nodes.max]."""
    return max(spec.nodes.min, min(spec.nodes.max, requested))


def snap_to_valid(spec: DistTrainJobSpec, count: int, *, allow_up: bool = True) -> Optional[int]:
    """The largest valid node count <= ``count``; if none and ``allow_up``, the smallest valid one above it.

    Valid means within [min, max] and dividing the batch contract (``plan.valid_node_counts``).
    """
    valid = valid_node_counts(spec)
    below = [n for n in valid if n <= count]
    if below:
        return below[-1]
    if allow_up:
        above = [n for n in valid if n > count]
        return above[0] if above else None
    return None


def debounce_scale(
    current: int, requested: int, pending: Optional[PendingScaleWire], debounce_s: float, now: float
) -> tuple[int, Optional[PendingScaleWire]]:
    """(desired now, pendingScale to keep). A request must stand ``debounce_s`` before it takes effect.

    ``current`` 0 means the job has no size yet: the request applies at once.
    """
    if current == 0 or requested == current:
        return requested if current == 0 else current, None
    if pending is not None and pending["replicas"] == requested:
        since = timestamps.parse_time(pending["since"]) or now
        if now - since >= debounce_s:
            return requested, None
        return current, pending
    if debounce_s <= 0:
        return requested, None
    return current, {"replicas": requested, "since": timestamps.format_time(now)}


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


def backoff_seconds(spec: DistTrainJobSpec, consecutive_failures: int) -> float:
    """Delay before restarting after the n-th consecutive failure: backoff x 2^(n-1), capped."""
    policy = spec.restart_policy
    if consecutive_failures <= 0:
        return 0.0
    return min(policy.max_backoff_seconds, policy.backoff_seconds * 2.0 ** min(consecutive_failures - 1, 30))


def choose_victims(live: Iterable[PodView], count: int) -> list[PodView]:
    """Pods to remove on scale-down: not-running ones first (they hold no work), then the highest index.

    The lowest index usually hosts rank 0; keeping it avoids moving rank-0-only duties without need.
    """
    ordered = sorted(live, key=lambda p: (p.is_running and p.ready, p.is_running, -p.node_index))
    return ordered[:count]


def free_indices(
    existing: Iterable[PodView],
    count: int,
    nodes: Optional[Mapping[str, NodeView]] = None,
    lost: Iterable[str] = (),
) -> list[int]:
    """The ``count`` lowest node indices that no live worker pod holds.

    A lost pod (:func:`loss_reason`, or named in ``lost``: silent in the heartbeats) frees its index even while
    the pod still exists, so its replacement takes that index and, through the rendezvous handler's rank order,
    the lost node's ranks.
    """
    gone = frozenset(lost)
    taken = {p.node_index for p in existing if loss_reason(p, nodes) is None and p.name not in gone}
    found: list[int] = []
    index = 0
    while len(found) < count:
        if index not in taken:
            found.append(index)
        index += 1
    return found


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
# The working state of one reconcile
# --------------------------------------------------------------------------------------------------------------


class _Draft:
    """The mutable working state of one reconcile: the typed status being decided and the actions collected so
    far; frozen into :class:`Actions` at the end."""

    def __init__(self, job: DistTrainJob, seen: Observed, now: float) -> None:
        self.job = job
        self.spec = job.spec
        self.seen = seen
        self.now = now
        raw = copy_json(job.status or {})
        # Patches are computed against what the API holds, so the first one also writes the defaults.
        self.old = copy_json(raw)
        self.status = DistTrainJobStatus.model_validate(raw)
        self.members: list[PodView] = []
        """Worker pods that exist, are not lost and are not scale-down victims (set by :func:`_handle_workers`)."""
        self.departing: list[tuple[PodView, str]] = []
        """Worker pods whose node announced its end, with why (:mod:`disttrain.operator.departures`): drained off
        it, never members again."""
        self.events: list[Event] = []
        self.create: list[WorkerCreation] = []
        self.create_agent = False
        self.deletions: dict[str, PodDeletion] = {}
        self.timers: list[float] = []
        self.delete_job = False
        self.agent_lost_node: Optional[str] = None
        """The dead node the job agent was lost with in this reconcile: the workers lost with it are that loss."""
        self.apply_pod_group = False
        self.silent = heartbeat.silent_pods(self.status.silent_nodes, seen.workers)
        """Worker pods the job agent reports silent in the rendezvous heartbeats (set once, from the inputs)."""
        self.stalled = heartbeat.silent_pods(self.status.stalled_nodes, seen.workers)
        """Worker pods the job agent reports behind a stalled step: evicted as silent ones are."""

    @property
    def is_finished(self) -> bool:
        return self.status.phase.is_finished

    def is_true(self, type_: ConditionType) -> bool:
        return conditions.is_true(self.status.conditions, type_)

    def event(self, type_: EventType, reason: Reason, message: str) -> None:
        self.events.append(Event(type_, reason.value, message))

    def condition(
        self, type_: ConditionType, ok: bool, reason: Reason, message: str, *, announce: Optional[EventType] = None
    ) -> bool:
        """Set a condition; emit an event (type ``announce``) when it turns True. Returns whether it flipped."""
        self.status.conditions, flipped = conditions.set_condition(
            self.status.conditions, type_, ok, reason, message, self.now
        )
        if flipped and ok and announce:
            self.event(announce, reason, message)
        return flipped

    def delete(self, pod: PodView, reason: Reason, force: bool = False) -> None:
        if pod.is_terminating and not force:
            return
        self.deletions[pod.name] = PodDeletion(pod.name, force=force, reason=reason.value)

    def timer(self, at: Optional[float]) -> None:
        if at is not None:
            self.timers.append(max(0.0, at - self.now))

    def freeze(self) -> Actions:
        new = self.status.to_wire()
        return Actions(
            create_workers=tuple(sorted(self.create, key=lambda w: w.node_index)),
            create_agent=self.create_agent,
            delete_pods=tuple(self.deletions.values()),
            status_patch=merge_patch(self.old, new),
            status=new,
            events=tuple(self.events),
            requeue_after=min(self.timers) if self.timers else None,
            delete_job=self.delete_job,
            apply_pod_group=self.apply_pod_group,
        )


# --------------------------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------------------------

Step = Callable[[_Draft], None]


def reconcile(job: DistTrainJob, seen: Observed, now: float) -> Actions:
    """Decide everything for one job at time ``now`` (Unix seconds). Pure; call it as often as you like.

    The steps run in order until one finishes the job (success, failure, budget, deadline); a finished job,
    whether it finished now or earlier, only has its pods cleaned up.
    """
    d = _Draft(job, seen, now)
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
        _announce_checkpoint,
        _announce_store_rejections,
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


def _refuse_unrunnable(d: _Draft) -> None:
    """A spec no pod can be built from fails at once (InvalidSpec), instead of a pod creation retried forever."""
    problem = unrunnable(d.spec)
    if problem is not None:
        _fail(d, Reason.INVALID_SPEC, problem)


def _bootstrap(d: _Draft) -> None:
    """First sight of the job (or after a resume): start time, selector, Created condition."""
    st = d.status
    if st.start_time is None:
        st.start_time = timestamps.format_time(d.now)
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


def _ensure_agent(d: _Draft) -> None:
    """The agent pod exists and is healthy; a lost agent is recreated and the workers re-join it."""
    agent = d.seen.agent
    name = names.agent_name(d.job.metadata.name)
    tracked = d.status.tracked_pods
    lost = is_agent_lost(agent, d.seen.nodes)
    if agent is not None and lost:
        # No kubelet will confirm the deletion of a pod on a dead node: force it at once so that the replacement
        # (same name) starts now, not after stuckPodTimeoutSeconds while the workers have no store.
        force = is_on_dead_node(agent, d.seen.nodes) or (
            agent.is_terminating and is_force_delete_due(agent, d.spec, d.seen.nodes, d.now)
        )
        d.delete(agent, Reason.AGENT_RESTARTED, force=force)
        if force:
            d.agent_lost_node = agent.node_name
            d.create_agent = True  # applied after the deletion; a 409 is retried by the next reconcile
        elif agent.is_terminating:
            d.timer((agent.deleting_since or d.now) + d.spec.elastic.stuck_pod_timeout_seconds)
    if agent is None:
        d.create_agent = True
    if lost and name in tracked:
        tracked.discard(name)
        d.event(WARNING, Reason.AGENT_RESTARTED, f"job agent pod {name} was lost; recreating it, workers re-join")
        # One loss, one restart: the workers that fail because their store vanished are part of it (_count_lost_pod).
        d.status.agent_lost_at = timestamps.format_time(d.now)
        if not _open_incident(d, name, Reason.AGENT_RESTARTED, f"job agent pod {name} was lost"):
            return
        if d.status.world_size > 0:
            _issue(
                d,
                DirectiveAction.REFORM,
                Reason.AGENT_RESTARTED,
                d.status.desired_nodes,
                exclude=d.status.control.exclude,
            )
    elif agent is not None and not lost and agent.is_running:
        tracked.add(name)


def checkpoint_refresh_seconds(job_key: str) -> float:
    """The job's own period between two refreshes of the Checkpointed message: between 1 and 1.5 x
    :data:`CHECKPOINT_MESSAGE_REFRESH_SECONDS`, fixed per job (from its uid).

    Why: jobs started together commit together, and with one period for all their refreshes would stay in step:
    at 500 jobs, 500 reconciles and status writes in the same second of every minute, and a directive decided or
    written then queued behind them. Different periods spread the refreshes over the minute within a few cycles.
    """
    fraction = int.from_bytes(hashlib.sha256(job_key.encode()).digest()[:4], "big") / 2**32
    return CHECKPOINT_MESSAGE_REFRESH_SECONDS * (1.0 + 0.5 * fraction)


def _announce_checkpoint(d: _Draft) -> None:
    """The Checkpointed condition names the newest complete checkpoint; CheckpointCommitted is an event only on a
    transition: the first checkpoint, and the first one committed after training resumed from a checkpoint.

    Between transitions the message follows ``status.lastCheckpoint`` at most
    :func:`checkpoint_refresh_seconds` late: each refresh is a status write, and a job committing every
    few seconds must not cost one per commit (the agent's ``lastCheckpoint`` and the checkpoint metrics are
    always current).
    """
    ckpt = d.status.last_checkpoint
    if ckpt is None:
        return
    message = checkpoint_message(ckpt)
    previous = conditions.find_condition(d.status.conditions, ConditionType.CHECKPOINTED)
    if previous is not None and previous.status == "True" and previous.reason == Reason.CHECKPOINT_COMMITTED.value:
        if previous.message != message:
            shown_since = timestamps.parse_time(previous.last_update_time or previous.last_transition_time) or 0.0
            refresh_at = shown_since + checkpoint_refresh_seconds(d.job.metadata.uid or d.job.metadata.name)
            if d.now >= refresh_at:
                d.condition(ConditionType.CHECKPOINTED, True, Reason.CHECKPOINT_COMMITTED, message)
            else:
                d.timer(refresh_at)
        return
    if (
        previous is not None
        and previous.reason == Reason.RESUMED_FROM_STEP.value
        and previous.message == resumed_message(ckpt)
    ):
        return  # still the checkpoint that training resumed from
    d.condition(ConditionType.CHECKPOINTED, True, Reason.CHECKPOINT_COMMITTED, message)
    d.event(NORMAL, Reason.CHECKPOINT_COMMITTED, message)


STORE_VALUE_REJECTED = "StoreValueRejected"
"""The Warning Event's reason when the job agent rejected a value in its store
(:mod:`disttrain.trainer.agent.guardian`)."""
STORE_REJECTION_RECENT_SECONDS = 300.0
"""A rejection the agent reported at most this long ago is announced. The Event filter drops the same message
for ``eventrate.REPEAT_WINDOW_S`` (600 s, longer than this), so each key is announced once per rejection spell,
and a status that keeps the agent's last rejections does not bring them back on later reconciles."""
_REJECTION_TEXT = {
    "foreign": "a key outside the job's namespace, deleted unread",
    "unsigned": "a value without a valid signature for this job and key, removed or replaced by the last valid one",
    "replayed": "an older valid value written again, replaced by the newest one",
    "deleted": "a valid value deleted, written back",
}


def _announce_store_rejections(d: _Draft) -> None:
    """A Warning Event naming each key the job agent recently rejected in its store: something without the job's
    secret reaches the store. The message holds only the key, its class and the reason, so the Event filter
    (repeats dropped for 10 min, a budget per job) turns this into one Event per key per rate window; the counts
    go to ``disttrain_store_rejected_values_total``."""
    rejections = d.status.store_rejections
    if rejections is None:
        return
    for entry in rejections.recent:
        at = timestamps.parse_time(entry.time)
        if at is None or abs(d.now - at) > STORE_REJECTION_RECENT_SECONDS:  # either clock may be ahead
            continue
        what = _REJECTION_TEXT.get(entry.reason, "an invalid value")
        d.events.append(
            Event(WARNING, STORE_VALUE_REJECTED, f"store key {entry.key} ({entry.key_class}): {what} by the job agent")
        )


def checkpoint_message(ckpt: CheckpointRef) -> str:
    """The Checkpointed condition's message while checkpoints are being committed."""
    return (
        f"checkpoint at step {ckpt.step} is complete ({ckpt.path})"
        if ckpt.path
        else f"checkpoint at step {ckpt.step} is complete"
    )


def resumed_message(ckpt: CheckpointRef) -> str:
    """The Checkpointed condition's message from a resume until the next checkpoint commits."""
    return f"training resumed from the complete checkpoint at step {ckpt.step}"


# -- worker pods: losses and members -----------------------------------------------------------------------------


def _handle_workers(d: _Draft) -> None:
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
            _fail(
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
                _count_lost_pod(d, pod, reason)
            _remove_lost_pod(d, pod, reason)
    # Forget handled uids whose pods are gone: the list stays as short as the set of lingering pods.
    present = {p.uid for p in d.seen.workers}
    d.status.handled_pods = sorted(uid for uid in handled if uid in present)


def _fence(d: _Draft, pod: PodView) -> None:
    """A silent or stalled pod may be alive behind a partition, or still in its step: keep it out of the next round
    (the rendezvous ``exclude``) until it is gone. It is deleted too, and the checkpoint fence refuses its commits
    (docs/operator.md)."""
    if pod.name not in d.status.control.exclude:
        d.status.control.exclude = sorted({*d.status.control.exclude, pod.name})


def _count_vanished_pods(d: _Draft, victims: frozenset[str]) -> None:
    """Pods that vanished without us seeing them lost (force-deleted, or deleted while we were down)."""
    seen = {p.name for p in d.seen.workers}
    agent = names.agent_name(d.job.metadata.name)
    for name in sorted(set(d.status.tracked_pods) - seen - {agent}):
        d.status.tracked_pods.discard(name)
        if name not in victims:
            _count_loss(
                d, name, Reason.POD_DELETED, f"worker pod {name} disappeared", outside=is_outside_the_group(d, name)
            )


def _forget_gone_victims(d: _Draft) -> None:
    seen = {p.name for p in d.seen.workers}
    d.status.control.exclude = [name for name in d.status.control.exclude if name in seen]


def _mark_lost(d: _Draft, pod: PodView) -> None:
    """List a lost pod in ``control.lost``: the survivors drop it from the finished rendezvous round at once
    instead of waiting for its heartbeats to expire. Kept until the next group runs even if the pod is gone
    first (pod names are never reused), so the survivors see it whenever they re-join."""
    if pod.name not in d.status.control.lost:
        d.status.control.lost = sorted({*d.status.control.lost, pod.name})


def _forget_lost(d: _Draft) -> None:
    """Once a group runs again, only the lost pods still lingering stay listed."""
    present = {p.name for p in d.seen.workers}
    d.status.control.lost = [name for name in d.status.control.lost if name in present]


def _remove_exited_victim(d: _Draft, pod: PodView, reason: Optional[Reason]) -> None:
    """A scale-down victim that exited or was lost anyway is deleted now (a planned removal, never counted)."""
    if reason is not None and not _left_as_planned(d, reason):
        _mark_lost(d, pod)
    if pod.is_finished or reason is not None:
        d.delete(pod, Reason.SCALED_DOWN, force=is_force_delete_due(pod, d.spec, d.seen.nodes, d.now))


def _left_as_planned(d: _Draft, reason: Reason) -> bool:
    """A victim going away (deleted) after its drain's checkpoint, or once the group re-formed: the running or next
    group never counts it (it is in ``control.exclude``), so listing it lost would tell the survivors nothing and
    cost a status write per scale-down. A victim that failed, lost its node, or was deleted before the checkpoint
    (the drain timed out, or someone deleted it) may still be in the running group: that one is listed."""
    if reason is not Reason.POD_DELETED:
        return False
    action = d.status.control.action
    return action is DirectiveAction.NONE or (action is DirectiveAction.DRAIN and _drain_checkpointed(d))


def _drain_checkpointed(d: _Draft) -> bool:
    """The status names a checkpoint committed after the drain in flight was issued."""
    st = d.status
    issued = timestamps.parse_time(st.control.issued_at) or d.now
    ckpt_time = timestamps.parse_time(st.last_checkpoint.time) if st.last_checkpoint else None
    return is_drain_checkpoint(issued, ckpt_time)  # the agent writes this one at once (trainer/agent/reporting.py)


def _count_lost_pod(d: _Draft, pod: PodView, reason: Reason) -> None:
    """First sight of a lost pod: a restart, unless it drained as asked or fell with the job agent."""
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
    if reason is Reason.POD_FAILED and _failed_with_the_agent(st, pod):
        d.event(
            NORMAL,
            Reason.AGENT_RESTARTED,
            f"worker pod {pod.name} exited (code {pod.exit_code}) after the job agent was lost; "
            f"restarting it as part of that restart",
        )
        return
    if d.agent_lost_node is not None and pod.node_name == d.agent_lost_node:
        d.event(
            NORMAL,
            Reason.AGENT_RESTARTED,
            f"worker pod {pod.name} was lost with the job agent's node {pod.node_name}; replacing it as part of "
            "that restart",
        )
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
    _count_loss(
        d, pod.name, reason, detail, outside=is_outside_the_group(d, pod.name), consequence=is_peer_loss_exit(pod)
    )


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


def is_outside_the_group(d: _Draft, name: str) -> bool:
    """The pod waits outside the running group (a hot spare, a newcomer not drained in yet), by the agent's report of
    the round's pods (``status.roundMembers``). Only trusted while that report describes the group that runs: no
    directive re-forms it, and it names as many pods as the group has nodes. Otherwise the pod counts as a member."""
    st = d.status
    members = st.round_members
    nproc = d.spec.nproc_per_node
    if not members or st.control.in_flight or nproc < 1 or len(members) * nproc != st.world_size:
        return False
    return name not in members


def _remove_lost_pod(d: _Draft, pod: PodView, reason: Reason) -> None:
    """Delete a lost pod; force-delete it when its node is gone or it is stuck Terminating."""
    force = is_force_delete_due(pod, d.spec, d.seen.nodes, d.now)
    if force:
        d.event(WARNING, Reason.FORCE_DELETED, f"worker pod {pod.name} was stuck Terminating; force-deleting it")
    elif pod.deleting_since is not None:
        d.timer(pod.deleting_since + d.spec.elastic.stuck_pod_timeout_seconds)
    d.delete(pod, reason, force=force or reason is Reason.NODE_DELETED)


def failure_cause(pod: PodView) -> str:
    """The last line of a failed pod's termination message (the launcher writes the exit code and the last line
    of the user's traceback there), at most 512 characters; '' when there is none."""
    lines = [line.strip() for line in pod.termination_message.splitlines() if line.strip()]
    return lines[-1][:512] if lines else ""


def _failed_with_the_agent(st: DistTrainJobStatus, pod: PodView) -> bool:
    """The pod existed when the job agent was lost and failed while that reform is in flight: torchrun exits
    when its rendezvous store disappears, so this failure is the agent loss, already counted once."""
    lost_at = timestamps.parse_time(st.agent_lost_at)
    if lost_at is None:
        return False
    return pod.created_at is None or pod.created_at <= lost_at


# -- failures, restarts and directives ---------------------------------------------------------------------------


def _open_incident(d: _Draft, first: str, cause: Reason, message: str) -> bool:
    """A loss that no open incident explains: a new incident, charged one restart (counters, backoff). It covers
    every worker pod that exists now. An incident that finds the budget spent fails the job instead, uncharged: the
    budget counts restarts that happened. False when nothing was charged."""
    st = d.status
    if d.is_true(ConditionType.SUCCEEDED):
        return False
    budget = d.spec.restart_policy.max_restarts
    if st.restarts.total >= budget:
        _fail(
            d,
            Reason.RESTART_BUDGET_EXHAUSTED,
            f"{st.restarts.total} of spec.restartPolicy.maxRestarts={budget} restarts used; no restart left for "
            f"{message}",
        )
        return False
    st.incident = Incident(
        opened_at=timestamps.format_time(d.now),
        reason=cause.value,
        first_pod=first,
        covers={p.name for p in d.seen.workers},
    )
    st.restarts.total += 1
    st.restarts.by_reason[cause.value] = st.restarts.by_reason.get(cause.value, 0) + 1
    st.last_failure = message[:1024]
    st.consecutive_failures += 1
    delay = backoff_seconds(d.spec, st.consecutive_failures)
    st.next_restart_time = timestamps.format_time(d.now + delay) if delay > 0 else None
    return True


def _count_loss(
    d: _Draft, name: str, reason: Reason, message: str, *, outside: bool = False, consequence: bool = False
) -> None:
    """An unplanned loss of worker pod ``name``: folded into the open incident when that covers the pod, else a new
    incident (a Warning Event naming the cause, a charged restart, a reform if a group is running).

    ``consequence``: the pod failed the way a peer's loss makes survivors fail (:func:`is_peer_loss_exit`); an
    incident it opens is charged as NodeLost. A pod ``outside`` the running group is counted too (the budget and the
    backoff bound a spare that keeps failing) but re-forms nothing: the group never depended on it, and its
    replacement is created as for any missing pod."""
    st = d.status
    if d.is_true(ConditionType.SUCCEEDED):
        return
    incident = st.incident
    if incident is not None and name in incident.covers:
        _fold(d, incident, name, message, outside=outside)
        return
    cause = Reason.NODE_LOST if consequence else reason
    d.event(WARNING, loss_event_reason(cause), message)
    if not _open_incident(d, name, cause, message):
        return
    if outside:
        d.event(NORMAL, Reason.OUTSIDE_THE_GROUP, f"{message}; it was not in the running round: the group trains on")
        return
    if st.world_size > 0 or st.control.in_flight:
        _issue(d, DirectiveAction.REFORM, cause, st.desired_nodes or d.spec.nodes.replicas, exclude=st.control.exclude)


def _fold(d: _Draft, incident: Incident, name: str, message: str, *, outside: bool) -> None:
    """A loss of a pod the open incident covers: replaced (by the caller), not charged. The group is told to re-form
    again, as for any loss: a round being formed may hold the pod just lost."""
    st = d.status
    incident.folded.add(name)
    d.event(
        NORMAL,
        Reason.PART_OF_INCIDENT,
        f"{message}; part of the {incident.reason} incident of {incident.first_pod} at {incident.opened_at}: "
        "replaced, not charged again",
    )
    if not outside and (st.world_size > 0 or st.control.in_flight):
        cause = Reason(incident.reason) if incident.reason in LOSS_REASONS else Reason.NODE_LOST
        _issue(d, DirectiveAction.REFORM, cause, st.desired_nodes or d.spec.nodes.replicas, exclude=st.control.exclude)


def _uncover_new_pods(d: _Draft) -> None:
    """The pods this reconcile creates are the restart happening: outside the open incident, even when one takes the
    name of a pod the incident covers (a replacement's name is free once the lost pod is gone)."""
    if d.status.incident is not None:
        d.status.incident.covers -= {w.name for w in d.create}


def _close_incident(d: _Draft) -> None:
    """A group runs again: the incident is over, and the next loss is a new one."""
    d.status.incident = None


def _issue(d: _Draft, action: DirectiveAction, reason: Reason, target: int, exclude: Iterable[str] = ()) -> None:
    """A new directive generation for the agent; the reform record starts here."""
    st = d.status
    ctl = st.control
    first_of_episode = not ctl.in_flight
    ctl.generation += 1
    ctl.action = action
    ctl.reason = reason.value
    ctl.target_nodes = target
    ctl.issued_at = timestamps.format_time(d.now)
    ctl.issued_round = st.rendezvous_round
    ctl.exclude = sorted(set(exclude))
    if first_of_episode:
        st.reforms += 1
        nproc = d.spec.nproc_per_node
        st.last_reform = ReformRecord.model_validate(
            {"reason": reason.value, "from": st.world_size // nproc if nproc else 0, "to": 0, "start": ctl.issued_at}
        )
    if action is DirectiveAction.DRAIN:
        d.event(
            NORMAL,
            Reason.DRAINING,
            f"drain (checkpoint at the next step boundary, then exit) for {reason.value}; target {target} nodes",
        )
    else:
        d.event(
            WARNING,
            Reason.REFORMING,
            f"reform (survivors exit at once and re-rendezvous) for {reason.value}; target {target} nodes",
        )


def _fail(d: _Draft, reason: Reason, message: str) -> None:
    """Failed is final and says why: no restart is pending (no nextRestartTime, no incident), and no condition
    still reads as waiting for pods."""
    st = d.status
    st.phase = Phase.FAILED
    st.message = message
    st.completion_time = st.completion_time or timestamps.format_time(d.now)
    st.next_restart_time = None
    st.incident = None
    st.agent_lost_at = None
    d.condition(ConditionType.FAILED, True, reason, message, announce=WARNING)
    d.condition(ConditionType.RUNNING, False, reason, message)
    d.condition(ConditionType.REFORMING, False, reason, message)
    d.condition(ConditionType.SCHEDULED, False, reason, "the job failed: no worker pod is scheduled again")


def _succeed(d: _Draft) -> None:
    st = d.status
    st.phase = Phase.SUCCEEDED
    st.completion_time = st.completion_time or timestamps.format_time(d.now)
    st.message = f"training finished at step {st.step}"
    d.condition(ConditionType.SUCCEEDED, True, Reason.SUCCEEDED, st.message, announce=NORMAL)
    d.condition(ConditionType.RUNNING, False, Reason.SUCCEEDED, st.message)
    d.condition(ConditionType.REFORMING, False, Reason.SUCCEEDED, st.message)


# -- the end of a job: terminal checks, cleanup, suspend -----------------------------------------------------------


def _check_terminal(d: _Draft) -> None:
    """Permanent failure reported by a worker, active deadline, success rule."""
    st, spec = d.status, d.spec
    failure = st.worker_failure
    started = timestamps.parse_time(st.start_time) or 0.0
    if (
        failure is not None
        and is_permanent_exit(spec, failure.exit_code)
        and (timestamps.parse_time(failure.time) or d.now) >= started - 1
    ):
        _fail(
            d,
            conditions.failure_reason(failure.message),
            f"worker {failure.node or '?'} exited with permanent code {failure.exit_code}: {failure.message}",
        )
        return
    deadline = spec.run_policy.active_deadline_seconds
    if deadline is not None:
        ends = started + st.suspended_seconds + deadline  # time spent suspended does not count
        if d.now >= ends:
            _fail(d, Reason.DEADLINE_EXCEEDED, f"job ran longer than spec.runPolicy.activeDeadlineSeconds={deadline}")
            return
        d.timer(ends)
    if is_success(spec, st, d.members):
        _succeed(d)


def _clean_up_finished(d: _Draft) -> None:
    """Finished jobs: delete pods per cleanPodPolicy, always the agent; delete the job after the TTL."""
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
    done = timestamps.parse_time(d.status.completion_time)
    if ttl is not None and done is not None:
        if d.now >= done + ttl:
            d.delete_job = True
        else:
            d.timer(done + ttl)


def _suspend(d: _Draft) -> None:
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
        st.suspended_since = timestamps.format_time(d.now)
    message = "suspended: no pods run; resuming continues from the last complete checkpoint"
    st.message = message
    d.condition(ConditionType.SUSPENDED, True, Reason.SUSPENDED, message, announce=NORMAL)
    d.condition(ConditionType.RUNNING, False, Reason.SUSPENDED, message)
    d.condition(ConditionType.REFORMING, False, Reason.SUSPENDED, message)


def _resume_if_suspended(d: _Draft) -> None:
    st = d.status
    if st.phase is not Phase.SUSPENDED:
        return
    st.phase = Phase.PENDING
    st.consecutive_failures = 0
    st.next_restart_time = None
    since = timestamps.parse_time(st.suspended_since)
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


def _size(d: _Draft) -> None:
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
                _issue(
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
        resume_at = timestamps.parse_time(st.next_restart_time)
        if resume_at is not None and now < resume_at:
            d.timer(resume_at)
            d.condition(
                ConditionType.RUNNING,
                st.phase is Phase.RUNNING,
                Reason.BACKOFF,
                f"restarting {missing} node(s) after backoff at {st.next_restart_time}",
            )
        else:
            taken = {p.name for p in d.seen.workers}
            leaving = {p.name for p, _ in d.departing}
            avoid = nodes_to_avoid(d.seen.workers, silent=d.silent | d.stalled, lost=st.control.lost)
            avoid = tuple(sorted({*avoid, *(p.node_name for p, _ in d.departing if p.node_name)}))
            for index in free_indices(d.seen.workers, missing, d.seen.nodes, lost=d.silent | d.stalled | leaving):
                name = names.unused_worker_name(d.job.metadata.name, index, taken)
                d.create.append(WorkerCreation(index, name, avoid_nodes=avoid))
            _uncover_new_pods(d)
            if previous and desired > previous:
                d.event(NORMAL, Reason.SCALED_UP, f"scaling up from {previous} to {desired} nodes")

    _choose_target(d, live, group_nodes)


def _drain_departing(d: _Draft, group_nodes: int) -> None:
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
        d.event(NORMAL, Reason.NODE_DEPARTING, departures.departure_message(pod, why))
    leaving = [pod.name for pod, _ in new]
    if ctl.in_flight or group_nodes == 0:
        ctl.exclude = sorted({*ctl.exclude, *leaving})
        return
    running = len([p for p in d.members if p.is_running and p.ready])
    target = snap_to_valid(d.spec, min(running, st.desired_nodes), allow_up=False) or st.desired_nodes
    _issue(d, DirectiveAction.DRAIN, Reason.NODE_DEPARTING, target, exclude=[*ctl.exclude, *leaving])


def nodes_to_avoid(workers: Sequence[PodView], *, silent: Collection[str], lost: Collection[str]) -> tuple[str, ...]:
    """Nodes a new worker must not land on: where a pod went silent in the rendezvous heartbeats, or where a pod
    declared lost lingers Terminating (no kubelet confirms its deletion). Kubernetes may still read such a node
    Ready for its whole grace period, and the scheduler would place the replacement there, to be lost again (seen
    on the real control plane: the replacement of a HeartbeatLost pod went to the dead node, and its NodeUnreachable
    loss 20 s later cost a second restart)."""
    return tuple(
        sorted(
            {
                p.node_name
                for p in workers
                if p.node_name and (p.name in silent or (p.is_terminating and p.name in lost))
            }
        )
    )


def _complete_directive(d: _Draft, group_nodes: int) -> None:
    """A directive is done when a new rendezvous round runs at the target size.

    New: the agent reports a round newer than ``control.issuedRound`` (the old group keeps reporting steps of
    its round for a moment after the directive; they never complete it). The reform's duration runs from the
    start of the episode to the first progress report of the new round.
    """
    st = d.status
    ctl = st.control
    if not ctl.in_flight:
        if st.world_size > 0:
            st.agent_lost_at = None  # a group runs with the new agent: later failures are failures of their own
            _close_incident(d)
            _forget_lost(d)
        return
    issued = timestamps.parse_time(ctl.issued_at) or d.now
    progressed = timestamps.parse_time(st.last_progress_time)
    new_round = ctl.issued_round is None or st.rendezvous_round > ctl.issued_round
    # At least the target: a late replacement can join the round in the instant its wait ran out and the target was
    # lowered (the handler completes a round at the target or more, never fewer); that group runs, so the directive
    # is done. Before, it stayed in flight for good (seen under load in tests/e2e/test_node_loss.py).
    reached = group_nodes >= ctl.target_nodes > 0
    if new_round and reached and progressed is not None and progressed > issued:
        reason = ctl.reason
        planned = ctl.action is DirectiveAction.DRAIN
        ctl.action = DirectiveAction.NONE
        st.agent_lost_at = None
        # Victims still shutting down stay excluded so they are not mistaken for members again.
        present = {p.name for p in d.seen.workers}
        ctl.exclude = [name for name in ctl.exclude if name in present]
        _forget_lost(d)
        _close_incident(d)
        st.consecutive_failures = 0
        st.next_restart_time = None
        if st.last_reform is not None:
            start = timestamps.parse_time(st.last_reform.start) or issued
            first = timestamps.parse_time(st.round_start_time)
            first = progressed if first is None or first < start else first
            st.last_reform.to = group_nodes
            st.last_reform.duration_seconds = round(max(0.0, first - start), 3)
            st.last_reform.phases = reform_phases(start, st.worker_startup, planned=planned)
        phases = st.last_reform.phases if st.last_reform is not None else None
        d.event(
            NORMAL,
            Reason.REFORMED,
            f"group re-formed with {group_nodes} nodes after {reason} (world size {st.world_size})"
            + (f"; phases: {phases.describe()}" if phases is not None else ""),
        )


def _remove_drained_victims(d: _Draft) -> None:
    st, spec = d.status, d.spec
    ctl = st.control
    victims = [p for p in d.seen.workers if p.name in ctl.exclude]
    if not victims:
        return
    issued = timestamps.parse_time(ctl.issued_at) or d.now
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


def _choose_target(d: _Draft, live: list[PodView], group_nodes: int) -> None:
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
            expiry = (timestamps.parse_time(ctl.issued_at) or now) + spec.elastic.replacement_wait_seconds
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
        else:
            d.timer(expiry)
    if not ctl.in_flight and group_nodes > 0:
        grown = snap_to_valid(spec, min(len(running), desired), allow_up=False) or 0
        if (enough or not (waiting or missing)) and grown > group_nodes:
            _issue(d, DirectiveAction.DRAIN, Reason.SCALED_UP, grown)
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


def world_column(world_size: int, desired_world_size: int) -> str:
    """``status.world``, the WORLD column of ``kubectl get dtj``: the running group's world size / the desired."""
    return f"{world_size}/{desired_world_size}"


def _gang(d: _Draft) -> None:
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


def _announce_refusal(d: _Draft, answer: str) -> None:
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


def _announce_create_failure(d: _Draft, failure: CreateFailure) -> None:
    """Created=False names the object the adapter could not create (CreateFailed) or whose name another owner
    holds (NameHeld); a Warning event whenever that changes (the adapter rate-limits repeats). The adapter
    retries the creation after its backoff."""
    reason = Reason.NAME_HELD if failure.held_by is not None else Reason.CREATE_FAILED
    message = create_failure_message(failure)
    previous = conditions.find_condition(d.status.conditions, ConditionType.CREATED)
    if previous is None or previous.reason != reason.value or previous.message != message:
        d.event(WARNING, reason, message)
    d.condition(ConditionType.CREATED, False, reason, message)


def _publish(d: _Draft) -> None:
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
        if flipped and ckpt is not None and st.step <= ckpt.step + 1 and ckpt.step > 0:
            d.event(NORMAL, Reason.RESUMED_FROM_STEP, f"training resumed from step {ckpt.step}")
            d.condition(ConditionType.CHECKPOINTED, True, Reason.RESUMED_FROM_STEP, resumed_message(ckpt))
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
        elif st.consecutive_failures and st.last_failure:
            st.message += (
                f"; {st.restarts.total} of spec.restartPolicy.maxRestarts={d.spec.restart_policy.max_restarts} "
                f"restarts used, last: {st.last_failure}"
            )
        d.condition(ConditionType.RUNNING, False, reason, st.message)
