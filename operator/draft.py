"""The working state of one reconcile, and what every policy may do with it besides recording: issue a directive to
the job agent, fail the job.

:class:`Draft` holds the typed status being decided and the actions collected so far; the reconcile core
(:mod:`disttrain.operator.reconcile`) runs its steps over one and freezes it into :class:`Actions`. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

from disttrain.api import conditions, goodput, timestamps
from disttrain.api.conditions import ConditionType, Reason
from disttrain.api.control import DirectiveAction
from disttrain.api.spec import DistTrainJob
from disttrain.api.status import DistTrainJobStatus, Phase, ReformRecord
from disttrain.operator import heartbeat
from disttrain.operator.observed import (
    NORMAL,
    WARNING,
    Actions,
    Event,
    EventType,
    Observed,
    PodDeletion,
    PodView,
    WorkerCreation,
)
from disttrain.operator.patches import copy_json, merge_patch
from disttrain.operator.refresh import refresh_seconds


class Draft:
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
        self.agent_avoid_nodes: tuple[str, ...] = ()
        self.deletions: dict[str, PodDeletion] = {}
        self.timers: list[float] = []
        self.completed_directive = False
        """This reconcile completed a directive: its reform record stays in the status until the next reconcile,
        so a watcher, the metrics and ``disttrain local`` see every reform complete (set by ``_complete_directive``)."""
        self.delete_job = False
        self.apply_pod_group = False
        self.silent = heartbeat.silent_pods(self.status.silent_nodes, seen.workers)
        """Worker pods the job agent reports silent in the rendezvous heartbeats (set once, from the inputs)."""
        self.stalled = heartbeat.silent_pods(self.status.stalled_nodes, seen.workers)
        """Worker pods the job agent reports behind a stalled step: evicted as silent ones are."""

    def account_goodput(self) -> goodput.GoodputStatus:
        """``status.goodput`` advanced to what this reconcile decided (:mod:`disttrain.api.goodput`)."""
        try:
            created = timestamps.parse_time((self.job.metadata.model_extra or {}).get("creationTimestamp"))
        except (TypeError, ValueError):
            created = None  # the first reconcile's time
        return goodput.account(self.status.goodput, goodput.facts_of(self.status, created=created, now=self.now))

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
        patch = merge_patch(self.old, new)
        account = self.account_goodput()
        period = refresh_seconds(self.job.metadata.uid or self.job.metadata.name)
        if account != self.status.goodput and (patch or goodput.is_due(self.status.goodput, self.now, period)):
            new["goodput"] = account.to_wire()  # with another write, or when due: never a write per progress report
            patch = merge_patch(self.old, new)
        return Actions(
            create_workers=tuple(sorted(self.create, key=lambda w: w.node_index)),
            create_agent=self.create_agent,
            agent_avoid_nodes=self.agent_avoid_nodes if self.create_agent else (),
            delete_pods=tuple(self.deletions.values()),
            status_patch=patch,
            status=new,
            events=tuple(self.events),
            requeue_after=min(self.timers) if self.timers else None,
            delete_job=self.delete_job,
            apply_pod_group=self.apply_pod_group,
        )


def issue(d: Draft, action: DirectiveAction, reason: Reason, target: int, exclude: Iterable[str] = ()) -> None:
    """A new directive generation for the agent; the reform record starts here."""
    st = d.status
    ctl = st.control
    first_of_episode = not ctl.in_flight
    ctl.generation += 1
    ctl.action = action
    ctl.reason = reason.value
    ctl.target_nodes = target
    ctl.issued_at = d.now
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


def fail(d: Draft, reason: Reason, message: str) -> None:
    """Failed is final and says why: no restart is pending (no nextRestartTime, no incident), and no condition
    still reads as waiting for pods."""
    st = d.status
    st.phase = Phase.FAILED
    st.message = message
    st.completion_time = st.completion_time or d.now
    st.next_restart_time = None
    st.incident = None
    st.agent_lost_at = None
    d.condition(ConditionType.FAILED, True, reason, message, announce=WARNING)
    d.condition(ConditionType.RUNNING, False, reason, message)
    d.condition(ConditionType.REFORMING, False, reason, message)
    d.condition(ConditionType.SCHEDULED, False, reason, "the job failed: no worker pod is scheduled again")
