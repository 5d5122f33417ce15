"""The reconcile core: ``reconcile(job, observed, now) -> Actions``. Pure: no I/O, no kopf, no clock.

Every policy is a small named function below; :func:`reconcile` is the pipeline that strings them together.
All memory lives in ``status`` (tracked pods, handled losses, pending scale, the directive in flight,
backoff), so the result depends only on the inputs and a restarted operator continues where it stopped.

The group protocol, in short:

* ``status.desiredNodes`` is what we work towards: ``spec.nodes.replicas`` clamped to [min, max], snapped
  to a node count valid for the batch contract, after the scale debounce.
* Worker pods are named ``<job>-worker-<index>``; a new pod takes the lowest index no existing pod holds, so
  a replacement never waits for a stuck Terminating pod to free its name.
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
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any, Optional

from disttrain.api import conditions as cond
from disttrain.api import constants
from disttrain.api.plan import valid_node_counts
from disttrain.api.conditions import ConditionType, Reason
from disttrain.api.exitcodes import ExitCode
from disttrain.api.spec import DistTrainJob, DistTrainJobSpec, SuccessPolicy
from disttrain.api.status import Condition, DistTrainJobStatus, PendingScale, Phase, ReformRecord
from disttrain.operator import names
from disttrain.operator.observed import Actions, Event, NodeView, Observed, PodDeletion, PodView

NORMAL = "Normal"
WARNING = "Warning"

# Reasons that come from an unplanned loss (replacement wait applies to them).
LOSS_REASONS = frozenset({
    Reason.POD_FAILED.value, Reason.POD_DELETED.value, Reason.EVICTED.value, Reason.NODE_NOT_READY.value,
    Reason.NODE_UNREACHABLE.value, Reason.NODE_DELETED.value, Reason.NODE_DRAINING.value,
    Reason.AGENT_RESTARTED.value,
})


# --------------------------------------------------------------------------------------------------------------
# Small policies (each unit-tested on its own)
# --------------------------------------------------------------------------------------------------------------


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
    current: int, requested: int, pending: Optional[dict[str, Any]], debounce_s: float, now: float
) -> tuple[int, Optional[dict[str, Any]]]:
    """(desired now, pendingScale to keep). A request must stand ``debounce_s`` before it takes effect.

    ``current`` 0 means the job has no size yet: the request applies at once.
    """
    if current == 0 or requested == current:
        return requested if current == 0 else current, None
    if pending is not None and pending.get("replicas") == requested:
        since = cond.parse_time(pending.get("since")) or now
        if now - since >= debounce_s:
            return requested, None
        return current, pending
    if debounce_s <= 0:
        return requested, None
    return current, {"replicas": requested, "since": cond.format_time(now)}


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


def backoff_seconds(spec: DistTrainJobSpec, consecutive_failures: int) -> float:
    """Delay before restarting after the n-th consecutive failure: backoff x 2^(n-1), capped."""
    policy = spec.restart_policy
    if consecutive_failures <= 0:
        return 0.0
    return min(policy.max_backoff_seconds, policy.backoff_seconds * 2 ** min(consecutive_failures - 1, 30))


def choose_victims(live: Iterable[PodView], count: int) -> list[PodView]:
    """Pods to remove on scale-down: not-running ones first (they hold no work), then the highest index.

    The lowest index usually hosts rank 0; keeping it avoids moving rank-0-only duties without need.
    """
    ordered = sorted(live, key=lambda p: (p.phase == "Running" and p.ready, p.phase == "Running", -p.node_index))
    return ordered[:count]


def free_indices(existing: Iterable[PodView], count: int) -> list[int]:
    """The ``count`` lowest node indices that no existing worker pod (Terminating ones included) holds."""
    taken = {p.node_index for p in existing}
    found: list[int] = []
    index = 0
    while len(found) < count:
        if index not in taken:
            found.append(index)
        index += 1
    return found


def is_force_delete_due(pod: PodView, spec: DistTrainJobSpec, nodes: Optional[Mapping[str, NodeView]], now: float) -> bool:
    """A Terminating pod is force-deleted when its node is gone or it has been stuck past the timeout."""
    if pod.deleting_since is None:
        return False
    if node_loss_reason(pod.node_name, nodes) is Reason.NODE_DELETED:
        return True
    return now - pod.deleting_since >= spec.elastic.stuck_pod_timeout_seconds


def training_complete(spec: DistTrainJobSpec, status: DistTrainJobStatus) -> bool:
    """The agent's relayed progress shows the training length reached."""
    training = spec.training
    if training.max_steps is not None:
        return status.step >= training.max_steps
    return training.max_samples is not None and status.samples_consumed >= training.max_samples


def is_success(spec: DistTrainJobSpec, status: DistTrainJobStatus, members: list[PodView]) -> bool:
    """The success rule. Never "any worker succeeded" alone.

    AllWorkers: every member pod Succeeded. RankZero: a pod Succeeded and the trainer's progress (written by
    global rank 0) reached the training length.
    """
    succeeded = [p for p in members if p.phase == "Succeeded"]
    if not succeeded:
        return False
    if spec.success_policy is SuccessPolicy.RANK_ZERO:
        return training_complete(spec, status)
    return len(succeeded) == len(members)


def merge_patch(old: Any, new: Any) -> Any:
    """RFC 7386 merge patch turning ``old`` into ``new`` (dicts recurse; removed keys become None)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = merge_patch(old[key], value)
    return patch


# --------------------------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------------------------


class _Draft:
    """The mutable working state of one reconcile; frozen into :class:`Actions` at the end."""

    def __init__(self, job: DistTrainJob, seen: Observed, now: float) -> None:
        self.job = job
        self.spec = job.spec
        self.seen = seen
        self.now = now
        raw = copy.deepcopy(job.status or {})
        # Patches are computed against what the API holds, so the first one also writes the defaults.
        self.old = copy.deepcopy(raw)
        self.status = DistTrainJobStatus.model_validate(raw)
        self.events: list[Event] = []
        self.create: list[int] = []
        self.create_agent = False
        self.deletions: dict[str, PodDeletion] = {}
        self.timers: list[float] = []
        self.delete_job = False

    # -- helpers
    def event(self, type_: str, reason: Reason | str, message: str) -> None:
        self.events.append(Event(type_, getattr(reason, "value", reason), message))

    def condition(self, type_: ConditionType, ok: bool, reason: Reason | str, message: str, *,
                  announce: Optional[str] = None) -> bool:
        """Set a condition; emit an event (type ``announce``) when it turns True. Returns whether it flipped."""
        reason_s = getattr(reason, "value", reason)
        conds = [c.to_wire() for c in self.status.conditions]
        updated, flipped = cond.set_condition(conds, type_.value, ok, reason_s, message, self.now)
        if updated is not conds:
            self.status.conditions = [Condition.model_validate(c) for c in updated]
        if flipped and ok and announce:
            self.event(announce, reason_s, message)
        return flipped

    def delete(self, pod: PodView, reason: str, force: bool = False) -> None:
        if pod.is_terminating and not force:
            return
        self.deletions[pod.name] = PodDeletion(pod.name, force=force, reason=reason)

    def timer(self, at: Optional[float]) -> None:
        if at is not None:
            self.timers.append(max(0.0, at - self.now))

    def elapsed(self, rfc3339: Optional[str]) -> float:
        at = cond.parse_time(rfc3339)
        return 0.0 if at is None else self.now - at

    def freeze(self) -> Actions:
        new = self.status.to_wire()
        patch = merge_patch(self.old, new)
        return Actions(
            create_workers=tuple(sorted(self.create)),
            create_agent=self.create_agent,
            delete_pods=tuple(self.deletions.values()),
            status_patch=patch,
            status=new,
            events=tuple(self.events),
            requeue_after=min(self.timers) if self.timers else None,
            delete_job=self.delete_job,
        )


def reconcile(job: DistTrainJob, seen: Observed, now: float) -> Actions:
    """Decide everything for one job at time ``now`` (Unix seconds). Pure; call it as often as you like."""
    d = _Draft(job, seen, now)
    if d.status.phase.is_finished:
        _clean_up_finished(d)
        return d.freeze()
    if d.spec.run_policy.suspend:
        _suspend(d)
        return d.freeze()
    if d.status.phase is Phase.SUSPENDED:
        _resume(d)
    _bootstrap(d)
    _ensure_agent(d)
    if d.status.phase.is_finished:  # the agent loss exhausted the restart budget
        _clean_up_finished(d)
        return d.freeze()
    _announce_checkpoint(d)
    members = _handle_workers(d)
    if d.status.phase.is_finished:
        _clean_up_finished(d)
        return d.freeze()
    if _check_terminal(d, members):
        _clean_up_finished(d)
        return d.freeze()
    _size(d, members)
    _publish(d, members)
    return d.freeze()


def _bootstrap(d: _Draft) -> None:
    """First sight of the job (or after a resume): start time, selector, Created condition."""
    st = d.status
    if st.start_time is None:
        st.start_time = cond.format_time(d.now)
    st.selector = f"{constants.LABEL_JOB_NAME}={d.job.metadata.name},{constants.LABEL_ROLE}={constants.ROLE_WORKER}"
    st.observed_generation = d.job.metadata.generation or st.observed_generation
    d.condition(ConditionType.CREATED, True, Reason.CREATED, "job agent, services, RBAC and workers are managed",
                announce=NORMAL)


def _ensure_agent(d: _Draft) -> None:
    """The agent pod exists and is healthy; a lost agent is recreated and the workers re-join it."""
    agent = d.seen.agent
    name = names.agent_name(d.job.metadata.name)
    tracked = d.status.tracked_pods
    lost = agent is None or agent.phase in ("Failed", "Succeeded", "Unknown") or agent.is_terminating \
        or node_loss_reason(agent.node_name, d.seen.nodes) is not None
    if agent is not None and lost:
        force = agent.is_terminating and is_force_delete_due(agent, d.spec, d.seen.nodes, d.now)
        d.delete(agent, Reason.AGENT_RESTARTED.value, force=force)
        if agent.is_terminating and not force:
            d.timer((agent.deleting_since or d.now) + d.spec.elastic.stuck_pod_timeout_seconds)
    if agent is None:
        d.create_agent = True
    if lost and name in tracked:
        del tracked[name]
        d.event(WARNING, Reason.AGENT_RESTARTED, f"job agent pod {name} was lost; recreating it, workers re-join")
        # One loss, one restart: the workers that fail because their store vanished are part of it (_handle_workers).
        d.status.agent_lost_at = cond.format_time(d.now)
        _count_restart(d, Reason.AGENT_RESTARTED, f"job agent pod {name} was lost")
        if d.status.phase.is_finished:
            return
        if d.status.world_size > 0:
            _issue(d, "reform", Reason.AGENT_RESTARTED.value, d.status.desired_nodes, exclude=d.status.control.exclude)
    elif agent is not None and not lost and agent.phase == "Running":
        tracked[name] = agent.uid


def _announce_checkpoint(d: _Draft) -> None:
    """CheckpointCommitted event each time the agent relays a newer complete checkpoint."""
    ckpt = d.status.last_checkpoint
    if ckpt is None:
        return
    message = f"checkpoint at step {ckpt.step} is complete ({ckpt.path})" if ckpt.path else \
        f"checkpoint at step {ckpt.step} is complete"
    previous = cond.find_condition([c.to_wire() for c in d.status.conditions], ConditionType.CHECKPOINTED.value)
    d.condition(ConditionType.CHECKPOINTED, True, Reason.CHECKPOINT_COMMITTED, message)
    if previous is None or previous.get("message") != message:
        d.event(NORMAL, Reason.CHECKPOINT_COMMITTED, message)


def _handle_workers(d: _Draft) -> list[PodView]:
    """Detect lost pods (count, reform, delete, force-delete) and return the live members.

    Live members: worker pods that exist, are not lost and are not scale-down victims being removed.
    """
    st, spec, now = d.status, d.spec, d.now
    seen_names = {p.name for p in d.seen.workers}
    exclude = set(st.control.exclude)
    agent_name = names.agent_name(d.job.metadata.name)
    # Pods that vanished without us seeing them lost (force-deleted, or deleted while we were down).
    for name in sorted(set(st.tracked_pods) - seen_names - {agent_name}):
        del st.tracked_pods[name]
        if name not in exclude:
            _count_loss(d, name, Reason.POD_DELETED, f"worker pod {name} disappeared")
    st.control.exclude = [name for name in st.control.exclude if name in seen_names]
    handled = set(st.handled_pods)
    members: list[PodView] = []
    for pod in sorted(d.seen.workers, key=lambda p: p.node_index):
        reason = loss_reason(pod, d.seen.nodes)
        if pod.name in exclude:
            if pod.phase in ("Failed", "Succeeded") or reason is not None:
                d.delete(pod, Reason.SCALED_DOWN.value, force=is_force_delete_due(pod, spec, d.seen.nodes, now))
            continue
        if reason is None:
            members.append(pod)
            st.tracked_pods[pod.name] = pod.uid
            continue
        if pod.phase == "Failed" and is_permanent_exit(spec, pod.exit_code):
            _fail(d, Reason.PERMANENT_EXIT_CODE,
                  f"worker pod {pod.name} exited with code {pod.exit_code}, listed as permanent in "
                  f"spec.restartPolicy.exitCodes.permanent")
            return members
        if pod.uid not in handled:
            handled.add(pod.uid)
            st.tracked_pods.pop(pod.name, None)
            planned = pod.phase == "Failed" and pod.exit_code == ExitCode.DRAINED and st.control.action == "drain"
            if not planned and reason is Reason.POD_FAILED and _failed_with_the_agent(st, pod):
                d.event(NORMAL, Reason.AGENT_RESTARTED,
                        f"worker pod {pod.name} exited (code {pod.exit_code}) after the job agent was lost; "
                        f"restarting it as part of that restart")
            elif not planned:
                detail = f"worker pod {pod.name} lost: {reason.value}"
                if pod.node_name and reason.value.startswith("Node"):
                    detail += f" (node {pod.node_name})"
                if pod.exit_code is not None:
                    detail += f", exit code {pod.exit_code}"
                _count_loss(d, pod.name, reason, detail)
        force = is_force_delete_due(pod, spec, d.seen.nodes, now)
        if force:
            d.event(WARNING, Reason.FORCE_DELETED, f"worker pod {pod.name} was stuck Terminating; force-deleting it")
        elif pod.is_terminating:
            d.timer(pod.deleting_since + spec.elastic.stuck_pod_timeout_seconds)  # type: ignore[operator]
        d.delete(pod, reason.value, force=force or reason is Reason.NODE_DELETED)
    # Forget handled uids whose pods are gone: the list stays as short as the set of lingering pods.
    present = {p.uid for p in d.seen.workers}
    st.handled_pods = sorted(uid for uid in handled if uid in present)
    return members


def _failed_with_the_agent(st: DistTrainJobStatus, pod: PodView) -> bool:
    """The pod existed when the job agent was lost and failed while that reform is in flight: torchrun exits
    when its rendezvous store disappears, so this failure is the agent loss, already counted once."""
    lost_at = cond.parse_time(st.agent_lost_at)
    if lost_at is None:
        return False
    return pod.created_at is None or pod.created_at <= lost_at


def _count_restart(d: _Draft, reason: Reason, message: str) -> bool:
    """Restart counters and backoff for one failure; fails the job past the budget. False when not counted."""
    st = d.status
    if any(c.type == ConditionType.SUCCEEDED.value and c.status == "True" for c in st.conditions):
        return False
    st.restarts.total += 1
    st.restarts.by_reason[reason.value] = st.restarts.by_reason.get(reason.value, 0) + 1
    st.consecutive_failures += 1
    delay = backoff_seconds(d.spec, st.consecutive_failures)
    st.next_restart_time = cond.format_time(d.now + delay) if delay > 0 else None
    if st.restarts.total > d.spec.restart_policy.max_restarts:
        _fail(d, Reason.RESTART_BUDGET_EXHAUSTED,
              f"{st.restarts.total} restarts exceed spec.restartPolicy.maxRestarts={d.spec.restart_policy.max_restarts} "
              f"(last: {message})")
    return True


def _count_loss(d: _Draft, name: str, reason: Reason, message: str) -> None:
    """An unplanned loss: restart counters, backoff, NodeLost event, and a reform if a group is running."""
    st = d.status
    if any(c.type == ConditionType.SUCCEEDED.value and c.status == "True" for c in st.conditions):
        return
    d.event(WARNING, Reason.NODE_LOST, message)
    _count_restart(d, reason, message)
    if st.phase.is_finished:
        return
    if st.world_size > 0 or st.control.action != "none":
        _issue(d, "reform", reason.value, st.desired_nodes or d.spec.nodes.replicas, exclude=st.control.exclude)


def _issue(d: _Draft, action: str, reason: str, target: int, exclude: Iterable[str] = ()) -> None:
    """A new directive generation for the agent; the reform record starts here."""
    st = d.status
    ctl = st.control
    first_of_episode = ctl.action == "none"
    ctl.generation += 1
    ctl.action = action
    ctl.reason = reason
    ctl.target_nodes = target
    ctl.issued_at = cond.format_time(d.now)
    ctl.issued_round = st.rendezvous_round
    ctl.exclude = sorted(set(exclude))
    if first_of_episode:
        st.reforms += 1
        nproc = d.spec.nproc_per_node
        st.last_reform = ReformRecord.model_validate(
            {"reason": reason, "from": st.world_size // nproc if nproc else 0, "to": 0,
             "start": ctl.issued_at})
    if action == "drain":
        d.event(NORMAL, Reason.DRAINING, f"drain (checkpoint at the next step boundary, then exit) for {reason}; "
                                          f"target {target} nodes")
    else:
        d.event(WARNING, Reason.REFORMING, f"reform (survivors exit at once and re-rendezvous) for {reason}; "
                                            f"target {target} nodes")


def _fail(d: _Draft, reason: Reason, message: str) -> None:
    st = d.status
    st.phase = Phase.FAILED
    st.message = message
    st.completion_time = st.completion_time or cond.format_time(d.now)
    d.condition(ConditionType.FAILED, True, reason, message, announce=WARNING)
    d.condition(ConditionType.RUNNING, False, reason, message)
    d.condition(ConditionType.REFORMING, False, reason, message)


def _check_terminal(d: _Draft, members: list[PodView]) -> bool:
    """Permanent failure reported by a worker, active deadline, success rule. True when the job finished."""
    st, spec = d.status, d.spec
    failure = st.worker_failure
    started = cond.parse_time(st.start_time) or 0.0
    if failure is not None and is_permanent_exit(spec, failure.exit_code) \
            and (cond.parse_time(failure.time) or d.now) >= started - 1:
        _fail(d, Reason.PERMANENT_EXIT_CODE,
              f"worker {failure.node or '?'} exited with permanent code {failure.exit_code}: {failure.message}")
        return True
    deadline = spec.run_policy.active_deadline_seconds
    if deadline is not None:
        if d.now - started >= deadline:
            _fail(d, Reason.DEADLINE_EXCEEDED,
                  f"job ran longer than spec.runPolicy.activeDeadlineSeconds={deadline}")
            return True
        d.timer(started + deadline)
    if is_success(spec, st, members):
        st.phase = Phase.SUCCEEDED
        st.completion_time = st.completion_time or cond.format_time(d.now)
        st.message = f"training finished at step {st.step}"
        d.condition(ConditionType.SUCCEEDED, True, Reason.SUCCEEDED, st.message, announce=NORMAL)
        d.condition(ConditionType.RUNNING, False, Reason.SUCCEEDED, st.message)
        d.condition(ConditionType.REFORMING, False, Reason.SUCCEEDED, st.message)
        return True
    return False


def _clean_up_finished(d: _Draft) -> None:
    """Finished jobs: delete pods per cleanPodPolicy, always the agent; delete the job after the TTL."""
    policy = d.spec.run_policy.clean_pod_policy.value
    for pod in d.seen.workers:
        if policy == "All" or (policy == "Running" and pod.phase in ("Running", "Pending", "Unknown")):
            d.delete(pod, d.status.phase.value)
    if d.seen.agent is not None:
        d.delete(d.seen.agent, d.status.phase.value)
    d.status.control.action = "none"
    d.status.pending_scale = None
    ttl = d.spec.run_policy.ttl_seconds_after_finished
    done = cond.parse_time(d.status.completion_time)
    if ttl is not None and done is not None:
        if d.now >= done + ttl:
            d.delete_job = True
        else:
            d.timer(done + ttl)


def _suspend(d: _Draft) -> None:
    """No pods while suspended; status (checkpoint, counters) kept; restarts are not counted."""
    st = d.status
    for pod in d.seen.workers:
        d.delete(pod, Reason.SUSPENDED.value)
    if d.seen.agent is not None:
        d.delete(d.seen.agent, Reason.SUSPENDED.value)
    st.tracked_pods = {}
    st.handled_pods = []
    st.pending_scale = None
    st.agent_lost_at = None
    st.control.action = "none"
    st.control.exclude = []
    st.world_size = 0
    st.replicas = len(d.seen.workers)
    st.ready_replicas = 0
    st.phase = Phase.SUSPENDED
    message = "suspended: no pods run; resuming continues from the last complete checkpoint"
    st.message = message
    d.condition(ConditionType.SUSPENDED, True, Reason.SUSPENDED, message, announce=NORMAL)
    d.condition(ConditionType.RUNNING, False, Reason.SUSPENDED, message)
    d.condition(ConditionType.REFORMING, False, Reason.SUSPENDED, message)


def _resume(d: _Draft) -> None:
    st = d.status
    st.phase = Phase.PENDING
    st.consecutive_failures = 0
    st.next_restart_time = None
    d.condition(ConditionType.SUSPENDED, False, Reason.RESUMED, "resumed")
    d.event(NORMAL, Reason.RESUMED, "job resumed")
    if st.last_checkpoint is not None:
        d.event(NORMAL, Reason.RESUMED_FROM_STEP,
                f"resuming from the complete checkpoint at step {st.last_checkpoint.step}")


def _size(d: _Draft, members: list[PodView]) -> None:
    """Desired size (clamp, valid sizes, debounce), directives for scale and replacement, pod creation."""
    st, spec, now = d.status, d.spec, d.now
    requested = snap_to_valid(spec, clamp_nodes(spec, spec.nodes.replicas)) or clamp_nodes(spec, spec.nodes.replicas)
    pending = st.pending_scale.to_wire() if st.pending_scale else None
    desired, pending = debounce_scale(st.desired_nodes, requested, pending, spec.elastic.scale_debounce_seconds, now)
    st.pending_scale = PendingScale.model_validate(pending) if pending else None
    if pending:
        d.timer((cond.parse_time(pending["since"]) or now) + spec.elastic.scale_debounce_seconds)
    previous = st.desired_nodes
    st.desired_nodes = desired
    ctl = st.control
    nproc = spec.nproc_per_node
    group_nodes = st.world_size // nproc if nproc else 0

    _complete_directive(d, group_nodes)

    live = list(members)
    # Scale-down: more live pods than desired.
    surplus = len(live) - desired
    if surplus > 0:
        if previous and desired < previous:
            d.event(NORMAL, Reason.SCALED_DOWN, f"scaling down from {previous} to {desired} nodes")
        victims = choose_victims(live, surplus)
        if group_nodes > 0 and any(v.phase == "Running" for v in victims) and ctl.action != "reform":
            if ctl.action != "drain" or ctl.reason != Reason.SCALED_DOWN.value or ctl.target_nodes != desired:
                _issue(d, "drain", Reason.SCALED_DOWN.value, desired, exclude=[*ctl.exclude, *(v.name for v in victims)])
        else:
            for victim in victims:
                st.tracked_pods.pop(victim.name, None)  # a planned removal, not a loss
                d.delete(victim, Reason.SCALED_DOWN.value)
        live = [p for p in live if p not in victims]
    # Victims of a drain: delete once a checkpoint was committed after the drain, or after the drain timeout.
    if ctl.exclude:
        _remove_drained_victims(d)

    # Create what is missing (after the restart backoff).
    missing = desired - len(live)
    if missing > 0 and not any(p.phase == "Succeeded" for p in d.seen.workers):
        resume_at = cond.parse_time(st.next_restart_time)
        if resume_at is not None and now < resume_at:
            d.timer(resume_at)
            d.condition(ConditionType.RUNNING, st.phase is Phase.RUNNING, Reason.BACKOFF,
                        f"restarting {missing} node(s) after backoff at {st.next_restart_time}")
        else:
            occupied = [p for p in d.seen.workers]
            indices = free_indices(occupied, missing)
            d.create.extend(indices)
            if previous and desired > previous:
                d.event(NORMAL, Reason.SCALED_UP, f"scaling up from {previous} to {desired} nodes")

    _choose_target(d, live, group_nodes)


def _complete_directive(d: _Draft, group_nodes: int) -> None:
    """A directive is done when a new rendezvous round runs at the target size.

    New: the agent reports a round newer than ``control.issuedRound`` (the old group keeps reporting steps of
    its round for a moment after the directive; they never complete it). The reform's duration runs from the
    start of the episode to the first progress report of the new round.
    """
    st = d.status
    ctl = st.control
    if ctl.action == "none":
        if st.world_size > 0:
            st.agent_lost_at = None  # a group runs with the new agent: later failures are failures of their own
        return
    issued = cond.parse_time(ctl.issued_at) or d.now
    progressed = cond.parse_time(st.last_progress_time)
    new_round = ctl.issued_round is None or st.rendezvous_round > ctl.issued_round
    if new_round and group_nodes == ctl.target_nodes and progressed is not None and progressed > issued:
        reason = ctl.reason
        ctl.action = "none"
        st.agent_lost_at = None
        # Victims still shutting down stay excluded so they are not mistaken for members again.
        present = {p.name for p in d.seen.workers}
        ctl.exclude = [name for name in ctl.exclude if name in present]
        st.consecutive_failures = 0
        st.next_restart_time = None
        if st.last_reform is not None:
            start = cond.parse_time(st.last_reform.start) or issued
            first = cond.parse_time(st.round_start_time)
            first = progressed if first is None or first < start else first
            st.last_reform.to = group_nodes
            st.last_reform.duration_seconds = round(max(0.0, first - start), 3)
        d.event(NORMAL, Reason.REFORMED, f"group re-formed with {group_nodes} nodes after {reason} "
                                          f"(world size {st.world_size})")


def _remove_drained_victims(d: _Draft) -> None:
    st, spec = d.status, d.spec
    ctl = st.control
    victims = [p for p in d.seen.workers if p.name in ctl.exclude]
    if not victims:
        return
    issued = cond.parse_time(ctl.issued_at) or d.now
    ckpt_time = cond.parse_time(st.last_checkpoint.time) if st.last_checkpoint else None
    drained = ckpt_time is not None and ckpt_time >= issued
    timed_out = d.now - issued >= spec.elastic.drain_timeout_seconds
    if ctl.action != "drain" or drained or timed_out:
        if timed_out and not drained and ctl.action == "drain":
            d.event(WARNING, Reason.DRAIN_TIMEOUT,
                    f"no checkpoint within spec.elastic.drainTimeoutSeconds={spec.elastic.drain_timeout_seconds}; "
                    f"deleting {', '.join(p.name for p in victims)}")
        for pod in victims:
            st.tracked_pods.pop(pod.name, None)
            d.delete(pod, Reason.SCALED_DOWN.value, force=is_force_delete_due(pod, spec, d.seen.nodes, d.now))
    else:
        d.timer(issued + spec.elastic.drain_timeout_seconds)


def _choose_target(d: _Draft, live: list[PodView], group_nodes: int) -> None:
    """The node count the next rendezvous round completes with, and a ScaleUp drain when new nodes run.

    While some desired pods are not Running yet, the target stays at the desired size until their wait
    expires (replacementWaitSeconds after a loss, pendingTimeoutSeconds for a new pod); then it drops to the
    Running pods when they are a valid count >= min, so the job never waits forever on a Pending pod.
    """
    st, spec, now = d.status, d.spec, d.now
    ctl = st.control
    desired = st.desired_nodes
    running = [p for p in live if p.phase == "Running"]
    waiting = [p for p in live if p.phase != "Running"]
    missing = max(0, desired - len(live))
    target = desired
    if waiting or missing:
        if ctl.action == "reform" and ctl.reason in LOSS_REASONS:
            expiry = (cond.parse_time(ctl.issued_at) or now) + spec.elastic.replacement_wait_seconds
            timeout_reason = Reason.REPLACEMENT_TIMEOUT
        else:
            created = [p.created_at for p in waiting if p.created_at is not None]
            expiry = (min(created) if created else now) + spec.elastic.pending_timeout_seconds
            timeout_reason = Reason.PENDING_TIMEOUT
        survivors = snap_to_valid(spec, len(running), allow_up=False)
        if now >= expiry and survivors is not None:
            target = survivors
            if ctl.target_nodes != target:
                d.event(WARNING, timeout_reason,
                        f"{len(waiting) + missing} node(s) not running after the wait; continuing with {target} nodes")
        else:
            d.timer(expiry)
    if ctl.action == "none" and group_nodes > 0:
        grown = snap_to_valid(spec, len(running), allow_up=False) or 0
        if not waiting and not missing and grown > group_nodes:
            _issue(d, "drain", Reason.SCALED_UP.value, grown)
            target = grown
        elif target < group_nodes and not ctl.exclude:
            target = group_nodes
    if ctl.action != "none":
        if target < ctl.target_nodes or ctl.reason in LOSS_REASONS:
            ctl.target_nodes = target
    else:
        ctl.target_nodes = target


def _publish(d: _Draft, members: list[PodView]) -> None:
    """Counts, phase and conditions from what was decided."""
    st = d.status
    live = [p for p in members if p.name not in st.control.exclude]
    st.replicas = len(d.seen.workers)
    st.ready_replicas = sum(1 for p in d.seen.workers if p.phase == "Running" and p.ready)
    unscheduled = [p.name for p in live if not p.is_scheduled]
    if live and not unscheduled and len(live) >= st.desired_nodes:
        d.condition(ConditionType.SCHEDULED, True, Reason.SCHEDULED,
                    f"all {len(live)} worker pods are bound to nodes", announce=NORMAL)
    else:
        d.condition(ConditionType.SCHEDULED, False, Reason.PODS_PENDING,
                    f"waiting for {max(len(unscheduled), st.desired_nodes - len(live))} worker pod(s) to be scheduled")
    ctl = st.control
    nproc = d.spec.nproc_per_node
    if ctl.action != "none":
        st.phase = Phase.REFORMING
        st.message = f"{ctl.action} for {ctl.reason}: re-forming with {ctl.target_nodes} nodes"
        d.condition(ConditionType.REFORMING, True, Reason.DRAINING if ctl.action == "drain" else Reason.REFORMING,
                    st.message)
        d.condition(ConditionType.RUNNING, False, Reason.REFORMING, st.message)
    elif st.world_size > 0:
        st.phase = Phase.RUNNING
        st.message = f"training with {st.world_size // nproc} nodes (world size {st.world_size})"
        d.condition(ConditionType.REFORMING, False, Reason.REFORMED, st.message)
        flipped = d.condition(ConditionType.RUNNING, True, Reason.RENDEZVOUS_COMPLETE, st.message, announce=NORMAL)
        if flipped and st.last_checkpoint is not None and st.step <= st.last_checkpoint.step + 1 \
                and st.last_checkpoint.step > 0:
            d.event(NORMAL, Reason.RESUMED_FROM_STEP, f"training resumed from step {st.last_checkpoint.step}")
    else:
        st.phase = Phase.PENDING
        running = sum(1 for p in live if p.phase == "Running")
        if running < d.spec.nodes.min:
            st.message = f"waiting for nodes: {running} running, at least spec.nodes.min={d.spec.nodes.min} needed"
            reason = Reason.WAITING_FOR_NODES
        else:
            st.message = f"waiting for the first rendezvous round with {ctl.target_nodes} nodes"
            reason = Reason.PODS_PENDING
        d.condition(ConditionType.RUNNING, False, reason, st.message)
