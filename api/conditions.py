"""Conditions and event reasons of a DistTrainJob: one module owns them (as Kubeflow's ``util/status.go`` does).

``set_condition`` is idempotent and keeps ``lastTransitionTime`` while a condition's status holds, so the
operator can call it on every reconcile and patch status only when something really changed. The functions work
on the :class:`~disttrain.api.status.Condition` models of a typed status, never on wire dicts. Reasons are
constants here so that the operator, the docs and the tests never disagree on a spelling.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Optional

from disttrain.api import timestamps
from disttrain.api.status import Condition

# Condition times are RFC 3339 like every time disttrain writes; :mod:`disttrain.api.timestamps` is their home.
format_time = timestamps.format_time
parse_time = timestamps.parse_time


class ConditionType(str, enum.Enum):
    CREATED = "Created"
    """The job's agent, Services and RBAC exist."""
    SCHEDULED = "Scheduled"
    """Every desired worker pod is bound to a node."""
    RUNNING = "Running"
    """A rendezvous round completed and the trainer reports progress."""
    REFORMING = "Reforming"
    """A drain or reform directive is in flight."""
    CHECKPOINTED = "Checkpointed"
    """A complete checkpoint exists; the message names its step."""
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class Reason(str, enum.Enum):
    """Event and condition reasons (CamelCase, as Kubernetes conventions ask)."""

    CREATED = "Created"
    SCHEDULED = "Scheduled"
    PODS_PENDING = "PodsPending"
    PENDING_TIMEOUT = "PendingTimeout"
    RENDEZVOUS_COMPLETE = "RendezvousComplete"
    NODE_LOST = "NodeLost"
    """A node's loss: the Warning Event of a node cause (NodeNotReady, HeartbeatLost, ...), and the restart cause of
    an incident first seen as an exit that a peer's loss explains (SIGABRT, an NCCL or collective-timeout message)."""
    SCALED_UP = "ScaledUp"
    SCALED_DOWN = "ScaledDown"
    SCALE_PENDING = "ScalePending"
    DRAINING = "Draining"
    DRAIN_TIMEOUT = "DrainTimeout"
    REFORMING = "Reforming"
    REFORMED = "Reformed"
    REPLACEMENT_TIMEOUT = "ReplacementTimeout"
    CHECKPOINT_COMMITTED = "CheckpointCommitted"
    RESUMED_FROM_STEP = "ResumedFromStep"
    RESUMED_FROM_EARLIER_JOB = "ResumedFromEarlierJob"
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    FORCE_DELETED = "ForceDeleted"
    AGENT_RESTARTED = "AgentRestarted"
    WAITING_FOR_NODES = "WaitingForNodes"
    BACKOFF = "Backoff"
    # Failure reasons (status.restarts.byReason keys and Failed condition reasons).
    POD_FAILED = "PodFailed"
    POD_DELETED = "PodDeleted"
    EVICTED = "Evicted"
    NODE_NOT_READY = "NodeNotReady"
    NODE_UNREACHABLE = "NodeUnreachable"
    NODE_DELETED = "NodeDeleted"
    NODE_DRAINING = "NodeDraining"
    NODE_DEPARTING = "NodeDeparting"
    """Event and drain reason: a worker's node announced its end (``spec.elastic.departure``); the worker is drained
    off it and replaced elsewhere, with no restart charged."""
    HEARTBEAT_LOST = "HeartbeatLost"
    """The job agent found the node silent in the rendezvous heartbeats (before Kubernetes marks it NotReady)."""
    STEP_STALLED = "StepStalled"
    """The job agent found the node's ranks behind a step's gradient reduction while their peers waited there
    (``spec.elastic.stallFactor``): the node is evicted as a lost one."""
    PART_OF_INCIDENT = "PartOfIncident"
    """Event: a lost pod belongs to the incident already being handled (``status.incident``): replaced, not charged."""
    OUTSIDE_THE_GROUP = "OutsideTheGroup"
    """Event: a lost pod was not in the running round (a hot spare, a newcomer): replaced, and the group trains on."""
    PERMANENT_EXIT_CODE = "PermanentExitCode"
    COLLECTIVE_DESYNC = "CollectiveDesync"
    """Failed: ranks called different collectives (``spec.debug.distributed: DETAIL`` caught it); the message names
    the ranks and the operations. A program bug: no restart."""
    RESTART_BUDGET_EXHAUSTED = "RestartBudgetExhausted"
    INFRASTRUCTURE_LOSSES_EXCEEDED = "InfrastructureLossesExceeded"
    """Failed: more infrastructure losses within an hour than restartPolicy.maxInfrastructureLossesPerHour (a
    flapping cluster); the message names the last one."""
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    INVALID_SPEC = "InvalidSpec"
    POD_REJECTED = "PodRejected"
    CREATE_FAILED = "CreateFailed"
    """Created=False: the API server did not create one of the job's objects (its answer is in the message)."""
    NAME_HELD = "NameHeld"
    """Created=False: an object of the name the job needs belongs to another owner (an older job of the same name
    whose dependents are still being deleted); the job waits for it to go."""


DESYNC_MARKER = "collective desync:"
"""Starts the trainer's message of a :attr:`Reason.COLLECTIVE_DESYNC` failure (``disttrain.trainer.failures``)."""


def failure_reason(message: str) -> Reason:
    """The Failed reason of a permanent worker failure: :attr:`Reason.COLLECTIVE_DESYNC` when the trainer's message
    says so, else :attr:`Reason.PERMANENT_EXIT_CODE`."""
    return Reason.COLLECTIVE_DESYNC if DESYNC_MARKER in message else Reason.PERMANENT_EXIT_CODE


def find_condition(conditions: Sequence[Condition], type_: ConditionType) -> Optional[Condition]:
    """The condition of ``type_``, if any."""
    for condition in conditions:
        if condition.type == type_.value:
            return condition
    return None


def is_true(conditions: Sequence[Condition], type_: ConditionType) -> bool:
    """Whether the condition of ``type_`` exists with status True."""
    condition = find_condition(conditions, type_)
    return condition is not None and condition.status == "True"


def set_condition(
    conditions: list[Condition],
    type_: ConditionType,
    status: bool,
    reason: Reason,
    message: str,
    now: float,
) -> tuple[list[Condition], bool]:
    """Return (new list, whether the status flipped) with ``type_`` set; the input list is not modified.

    ``lastTransitionTime`` changes only when ``status`` flips; reason and message follow the latest call, and
    ``lastUpdateTime`` says when they last changed. A condition that is absent and set to False is recorded too
    (so ``kubectl get -o yaml`` shows it). When nothing changes, the input list itself is returned.
    """
    wanted = "True" if status else "False"
    existing = find_condition(conditions, type_)
    stamp = timestamps.format_time(now)
    if existing is not None and existing.status == wanted:
        if existing.reason == reason.value and existing.message == message:
            return conditions, False
        updated = existing.model_copy(update={"reason": reason.value, "message": message, "last_update_time": stamp})
        return [updated if c is existing else c for c in conditions], False
    fresh = Condition(
        type=type_.value,
        status=wanted,
        reason=reason.value,
        message=message,
        last_transition_time=stamp,
        last_update_time=stamp,
    )
    if existing is None:
        return [*conditions, fresh], True
    return [fresh if c is existing else c for c in conditions], True
