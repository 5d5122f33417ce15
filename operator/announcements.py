"""What the reconcile core announces of checkpoints and of the job agent's store: the Checkpointed condition and
its Events (committed, resumed from, an earlier job's checkpoints, a bucket that is behind), and the store's
rejected values. Pure."""

from __future__ import annotations

from disttrain.api import conditions, goodput, timestamps
from disttrain.api.conditions import ConditionType, Reason
from disttrain.api.status import STORE_KEY_CLASSES, STORE_REJECT_REASONS, CheckpointRef, DistTrainJobStatus
from disttrain.operator.draft import Draft
from disttrain.operator.observed import NORMAL, WARNING, Event
from disttrain.operator.refresh import refresh_seconds


def announce_checkpoint(d: Draft) -> None:
    """The Checkpointed condition names the newest complete checkpoint; CheckpointCommitted is an event only on a
    transition: the first checkpoint, and the first one committed after training resumed from a checkpoint.

    Between transitions the message follows ``status.lastCheckpoint`` at most the job's
    :func:`~disttrain.operator.refresh.refresh_seconds` late, and with the goodput account's refresh when that one
    is due first: each refresh is a status write, and a job committing every few seconds must not cost one per
    commit, nor one for the message and another for the account (the agent's ``lastCheckpoint`` and the checkpoint
    metrics are always current).
    """
    ckpt = d.status.last_checkpoint
    if ckpt is None:
        return
    message = checkpoint_message(ckpt)
    previous = conditions.find_condition(d.status.conditions, ConditionType.CHECKPOINTED)
    if previous is not None and previous.status == "True" and previous.reason == Reason.CHECKPOINT_COMMITTED.value:
        if previous.message != message:
            shown_since = timestamps.parse_time(previous.last_update_time or previous.last_transition_time) or 0.0
            period = refresh_seconds(d.job.metadata.uid or d.job.metadata.name)
            refresh_at = shown_since + period
            if d.now >= refresh_at or goodput.is_due(d.status.goodput, d.now, period):
                d.condition(ConditionType.CHECKPOINTED, True, Reason.CHECKPOINT_COMMITTED, message)
            else:
                d.timer(refresh_at)
        return
    if (
        previous is not None
        and previous.reason == Reason.RESUMED_FROM_STEP.value
        and previous.message == resumed_message(resumed_step(d.status, ckpt))
    ):
        return  # still the checkpoint that training resumed from
    d.condition(ConditionType.CHECKPOINTED, True, Reason.CHECKPOINT_COMMITTED, message)
    d.event(NORMAL, Reason.CHECKPOINT_COMMITTED, message)


STORE_VALUE_REJECTED = "StoreValueRejected"
"""The Warning Event's reason when the job agent rejected a value in its store
(:mod:`disttrain.trainer.agent.guardian`)."""
STORE_REJECTION_RECENT_SECONDS = 300.0
"""Rejections are announced while the agent reported one at most this long ago."""


def announce_store_rejections(d: Draft) -> None:
    """One Warning Event summing up what the job agent rejected in its store: something without the job's secret
    reaches the store. The message holds only counts by key class and reason (closed sets): never a key, which a
    stranger chooses; the keys are in ``status.storeRejections``. Its message changes with the counts, so the Event
    filter gives it a budget of its own (``eventrate.SEPARATE_BUDGETS``: one per minute), apart from the job's: the
    job's own Warnings are never crowded out."""
    rejections = d.status.store_rejections
    if rejections is None:
        return
    times = [entry.time for entry in rejections.recent]
    if not any(at is not None and abs(d.now - at) <= STORE_REJECTION_RECENT_SECONDS for at in times):
        return  # either clock may be ahead
    counts = [
        f"{key_class}/{reason} {count}"
        for name, count in sorted(rejections.counts.items())
        for key_class, _, reason in [name.partition("/")]
        if key_class in STORE_KEY_CLASSES and reason in STORE_REJECT_REASONS and count >= 0
    ]
    d.events.append(
        Event(
            WARNING,
            STORE_VALUE_REJECTED,
            f"the job agent rejected {rejections.total} store value(s) written without the job's secret "
            f"({', '.join(counts) or 'no known class'}); the keys are in status.storeRejections",
        )
    )


CHECKPOINT_UPLOAD_BEHIND = "CheckpointUploadBehind"
"""The Warning Event's reason while saves wait for the bucket of ``checkpoint.uri`` (``status.checkpointUpload``)."""


def announce_checkpoint_upload(d: Draft) -> None:
    """A Warning while the bucket is behind the workers' local disks: training goes on, but what the bucket does
    not hold is lost with the pods. The message follows the steps and the error, so the Event filter gives it a
    budget of its own (``eventrate.SEPARATE_BUDGETS``: one per five minutes)."""
    behind = d.status.checkpoint_upload
    if behind:
        d.events.append(Event(WARNING, CHECKPOINT_UPLOAD_BEHIND, f"checkpoints wait for the bucket: {behind}"))


def checkpoint_message(ckpt: CheckpointRef) -> str:
    """The Checkpointed condition's message while checkpoints are being committed."""
    return (
        f"checkpoint at step {ckpt.step} is complete ({ckpt.path})"
        if ckpt.path
        else f"checkpoint at step {ckpt.step} is complete"
    )


def warn_of_an_earlier_job(d: Draft, step: int) -> None:
    """The checkpoint the group resumed from was written by another job of this name (deleted, then created again
    under the same name and checkpoint path): its training goes on, so say so rather than resume silently."""
    earlier = d.status.resumed_from_job_uid
    if earlier and d.job.metadata.uid and earlier != d.job.metadata.uid:
        d.event(
            WARNING,
            Reason.RESUMED_FROM_EARLIER_JOB,
            f"resumed from checkpoint step {step}, written by an earlier job named {d.job.metadata.name} (uid "
            f"{earlier}); to start afresh, delete the job's checkpoints or set spec.checkpoint.path to a new folder",
        )


def resumed_step(status: DistTrainJobStatus, ckpt: CheckpointRef) -> int:
    """The checkpoint step the running group loaded: as its rank 0 reported it, else the newest committed one."""
    return status.resumed_from_step if status.resumed_from_step is not None else ckpt.step


def resumed_message(step: int) -> str:
    """The Checkpointed condition's message from a resume until the next checkpoint commits."""
    return f"training resumed from the complete checkpoint at step {step}"
