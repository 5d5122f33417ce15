"""Conditions and event reasons of a DistTrainJob: one module owns them (as Kubeflow's ``util/status.go`` does).

``set_condition`` is idempotent and keeps ``lastTransitionTime`` while a condition's status holds, so the
operator can call it on every reconcile and patch status only when something really changed. Reasons are
constants here so that the operator, the docs and the tests never disagree on a spelling.
"""

from __future__ import annotations

import datetime
import enum
from typing import Any, Optional


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
    PERMANENT_EXIT_CODE = "PermanentExitCode"
    RESTART_BUDGET_EXHAUSTED = "RestartBudgetExhausted"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    INVALID_SPEC = "InvalidSpec"


def format_time(unix: float) -> str:
    """RFC 3339 UTC with millisecond precision.

    Milliseconds, not Kubernetes' usual seconds, because the reform protocol compares a directive's issue time
    with the time of the first progress report after it, and a reform can finish within a second.
    """
    moment = datetime.datetime.fromtimestamp(round(unix, 3), tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def parse_time(value: Optional[str]) -> Optional[float]:
    """Unix time of an RFC 3339 string (``Z`` or an offset, fractional seconds allowed); None stays None."""
    if not value:
        return None
    text = value.replace("Z", "+00:00")
    parsed = datetime.datetime.fromisoformat(text)
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.timezone.utc)
    return parsed.timestamp()


def find_condition(conditions: list[dict[str, Any]], type_: str) -> Optional[dict[str, Any]]:
    """The condition of ``type_`` in a wire-form list, if any."""
    for condition in conditions:
        if condition.get("type") == type_:
            return condition
    return None


def is_true(conditions: list[dict[str, Any]], type_: str) -> bool:
    condition = find_condition(conditions, type_)
    return condition is not None and condition.get("status") == "True"


def set_condition(
    conditions: list[dict[str, Any]],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    now: float,
) -> tuple[list[dict[str, Any]], bool]:
    """Return (new list, whether the status flipped) with ``type_`` set; the input list is not modified.

    ``lastTransitionTime`` changes only when ``status`` flips; reason and message follow the latest call. A
    condition that is absent and set to False is recorded too (so ``kubectl get -o yaml`` shows it).
    """
    wanted = "True" if status else "False"
    existing = find_condition(conditions, type_)
    if existing is not None and existing.get("status") == wanted:
        if existing.get("reason") == reason and existing.get("message") == message:
            return conditions, False
        updated = dict(existing, reason=reason, message=message)
        return [updated if c is existing else c for c in conditions], False
    fresh = {"type": type_, "status": wanted, "reason": reason, "message": message,
             "lastTransitionTime": format_time(now)}
    if existing is None:
        return [*conditions, fresh], True
    return [fresh if c is existing else c for c in conditions], True
