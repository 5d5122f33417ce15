"""Goodput by cause: every second of a job's wall time attributed to exactly one cause.

Why: a single goodput ratio says that time was lost, not where. The operator keeps the account in
``status.goodput``: seconds per :class:`Cause` from the job's creation up to ``accountedUntil``, which add up to
``wallSeconds``, and ``ratio`` = training / wall. ``bench/goodput.py`` and ``disttrain local`` read the same
account, so there is one definition.

Seconds are settled only once their cause is known, so nothing is ever moved from one cause to another (the
Prometheus counter by cause only grows):

* while the group trains, up to its newest progress report (``lastProgressTime``): training, or redone when the
  steps were reached before (the group resumed from an older checkpoint), less the seconds rank 0 reported blocked
  on checkpoint saves;
* during a reform, nothing; once it completed, its seconds go to the phases of ``lastReform.phases``
  (:mod:`disttrain.api.reformphases`), and the seconds between the old group's last progress and the first sign of
  the loss to ``stalled`` (a stalled step's wait) or ``redone`` (a step in flight, lost);
* queued, startup and suspended seconds up to now, and at the end of the job up to its completion time.

All state lives in the status (``accountedUntil``, the highest step, the reforms already settled), so an operator
that restarts continues the account without losing or counting a second twice. Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from typing import TYPE_CHECKING, Optional

from pydantic import Field

from disttrain.api.reformphases import ReformPhase, ReformPhases
from disttrain.api.spec import ContractModel
from disttrain.api.timestamps import Timestamp

if TYPE_CHECKING:
    from disttrain.api.status import DistTrainJobStatus

REFRESH_SECONDS = 120.0
"""While nothing else in the status changes, ``status.goodput`` is written at most this often (a write per job
every few seconds would double the operator's API requests); it is brought up to date with every other write. The
operator stretches it per job, up to 1.5 times, to spread jobs started together (``disttrain.operator.refresh``)."""
STALL_REASON = "StepStalled"
"""The reform reason of a stalled node's eviction (:class:`disttrain.api.conditions.Reason`)."""


class Cause(str, enum.Enum):
    """Where a second of wall time went; the values are the wire names in ``status.goodput.seconds``."""

    TRAINING = "training"
    """Steps completed for the first time, less the seconds blocked on checkpoint saves."""
    QUEUED = "queued"
    """From the job's creation to its first start (waiting in a queue, suspended before it ever ran)."""
    STARTUP = "startup"
    """No group runs and no reform is in flight: pods scheduled and started up to the first step of a group (the
    first start, the start after a resume), waiting for nodes, restart backoff."""
    SUSPENDED = "suspended"
    """Suspended after the first start (``spec.runPolicy.suspend``)."""
    DETECTION = ReformPhase.DETECTION.value
    DIRECTIVE = ReformPhase.DIRECTIVE.value
    RESTART = ReformPhase.RESTART.value
    IMPORTS = ReformPhase.IMPORTS.value
    MODEL_BUILD = ReformPhase.MODEL_BUILD.value
    PROCESS_GROUP = ReformPhase.PROCESS_GROUP.value
    CHECKPOINT_LOAD = ReformPhase.CHECKPOINT_LOAD.value
    FIRST_STEP = ReformPhase.FIRST_STEP.value
    REFORM = "reform"
    """A reform whose new group sent no startup stamps: its whole duration, phases unknown."""
    REDONE = "redone"
    """Steps run again after a resume from an older checkpoint, and the step in flight when the group was lost."""
    CHECKPOINT_BLOCKED = "checkpointBlocked"
    """Training waited for checkpoint saves (sync saves, an async save's kick-off and staging), as rank 0 reports."""
    STALLED = "stalled"
    """The group waited on a stalled step, from its last progress to the stalled node's eviction."""
    FINISHING = "finishing"
    """From the last step to the job's completion time (final save, exit; for a failed job, the failure)."""


REFORM_CAUSES = tuple(Cause(phase.value) for phase in ReformPhase)


def _seconds_field() -> float:
    return Field(0.0, ge=0, allow_inf_nan=False)


class GoodputSeconds(ContractModel):
    """Seconds per :class:`Cause`."""

    training: float = _seconds_field()
    queued: float = _seconds_field()
    startup: float = _seconds_field()
    suspended: float = _seconds_field()
    detection: float = _seconds_field()
    directive: float = _seconds_field()
    restart: float = _seconds_field()
    imports: float = _seconds_field()
    model_build: float = _seconds_field()
    process_group: float = _seconds_field()
    checkpoint_load: float = _seconds_field()
    first_step: float = _seconds_field()
    reform: float = _seconds_field()
    redone: float = _seconds_field()
    checkpoint_blocked: float = _seconds_field()
    stalled: float = _seconds_field()
    finishing: float = _seconds_field()

    def by_cause(self) -> dict[Cause, float]:
        wire = self.model_dump(by_alias=True)
        return {cause: float(wire[cause.value]) for cause in Cause}

    def total(self) -> float:
        return sum(self.by_cause().values())


class GoodputStatus(ContractModel):
    """``status.goodput``: where the job's wall time went, and the account's memory."""

    ratio: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    """Training seconds / wall seconds."""
    wall_seconds: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Seconds from the job's creation to ``accountedUntil``: the sum of ``seconds``."""
    seconds: GoodputSeconds = Field(default_factory=GoodputSeconds)
    """Seconds by cause (docs/observability.md, "Goodput by cause")."""
    accounted_until: Optional[Timestamp] = None
    """RFC 3339 time up to which every second is attributed; later ones wait until their cause is known."""
    since: Optional[Timestamp] = None
    """RFC 3339 time the account starts: the job's creation."""
    step: int = Field(0, ge=0)
    """The step reached at ``accountedUntil``."""
    highest_step: int = Field(0, ge=0)
    """The highest step any group reached: a step up to it, run again, is redone."""
    reforms: int = Field(0, ge=0)
    """``status.reforms`` when the last reform was settled."""
    checkpoint_blocked_seconds: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Rank 0's ``status.checkpointBlockedSeconds`` already settled."""
    round: int = Field(0, ge=0)
    """``status.rendezvousRound`` at ``accountedUntil``."""


@dataclasses.dataclass(frozen=True)
class Reform:
    """The last reform as the account needs it (``status.lastReform`` and ``status.reforms``)."""

    count: int
    """``status.reforms``: how many reforms started."""
    start: Optional[float] = None
    duration_seconds: Optional[float] = None
    """None while the reform is not complete."""
    phases: Optional[ReformPhases] = None
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the status says at one reconcile, in Unix seconds."""

    now: float
    created: float
    """The job's creation (metadata.creationTimestamp; the first reconcile's time when unknown)."""
    started: Optional[float]
    """``status.startTime``: None while the job never ran."""
    suspended: bool
    finished_at: Optional[float]
    """``status.completionTime`` once the job succeeded or failed."""
    reforming: bool
    """A directive is in flight."""
    training: bool
    """A group runs (``worldSize`` > 0) and no directive is in flight."""
    step: int = 0
    last_progress: Optional[float] = None
    round: int = 0
    round_start: Optional[float] = None
    resumed_from_step: Optional[int] = None
    checkpoint_blocked_seconds: Optional[float] = None
    """Rank 0's seconds blocked on checkpoint saves since its group started (None: not reported)."""
    reform: Reform = Reform(count=0)


@dataclasses.dataclass
class _Ledger:
    """The account being advanced: seconds per cause and the time up to which they run."""

    seconds: dict[Cause, float]
    until: float

    def add(self, cause: Cause, end: float) -> None:
        """The seconds from ``until`` to ``end`` (if later) are ``cause``'s."""
        end = _ms(end)
        if end > self.until:
            self.seconds[cause] += end - self.until
            self.until = end

    def split(self, end: float, shares: dict[Cause, float]) -> None:
        """The seconds from ``until`` to ``end``, split by ``shares`` (seconds, the first cause takes the rest)."""
        end = _ms(end)
        if end <= self.until:
            return
        span = end - self.until
        causes = list(shares)
        rest = span
        for cause in causes[1:]:
            part = min(rest, max(0.0, _ms(shares[cause])))
            self.seconds[cause] += part
            rest -= part
        self.seconds[causes[0]] += rest
        self.until = end


def _ms(t: float) -> float:
    """Times are kept to the millisecond, as the status stores them, so a re-read account ends where it ended."""
    return round(t, 3)


def account(previous: Optional[GoodputStatus], facts: Facts) -> GoodputStatus:
    """``previous`` advanced by what ``facts`` settle; when None, a fresh account from ``facts.created``, or from
    ``facts.now`` for a job that trained before it had an account (its past causes are unknown)."""
    if previous is None and (facts.round > 0 or facts.reform.count > 0):
        previous = GoodputStatus(
            since=_ms(facts.now),
            step=facts.step,
            highest_step=facts.step,
            reforms=facts.reform.count,
            round=facts.round,
            checkpoint_blocked_seconds=facts.checkpoint_blocked_seconds or 0.0,
        )
    previous = previous or GoodputStatus()
    since = previous.since if previous.since is not None else _ms(min(facts.created, facts.now))
    until = previous.accounted_until if previous.accounted_until is not None else since
    ledger = _Ledger(previous.seconds.by_cause(), _ms(until))
    state = previous.model_copy(deep=True)
    if facts.finished_at is not None:
        _settle_progress(ledger, state, facts)
        ledger.add(Cause.FINISHING, min(facts.finished_at, facts.now))
        return _closed(state, ledger, since)
    if facts.training:
        _settle_progress(ledger, state, facts)
        return _closed(state, ledger, since)
    _settle_last_steps(ledger, state, facts)
    if facts.suspended:
        ledger.add(Cause.QUEUED if facts.started is None else Cause.SUSPENDED, facts.now)
    elif not facts.reforming:  # a reform's seconds are settled with its phases once it completed
        ledger.add(Cause.QUEUED if facts.started is None else Cause.STARTUP, facts.now)
    return _closed(state, ledger, since)


def _closed(state: GoodputStatus, ledger: _Ledger, since: float) -> GoodputStatus:
    """``state`` with the ledger's seconds, wall time and ratio."""
    seconds = GoodputSeconds.model_validate({c.value: round(v, 3) for c, v in ledger.seconds.items()})
    wall = round(ledger.until - since, 3)
    state.since = since
    state.accounted_until = ledger.until
    state.seconds = seconds
    state.wall_seconds = max(0.0, wall)
    state.ratio = round(min(1.0, seconds.training / wall), 4) if wall > 0 else 0.0
    return state


def _settle_last_steps(ledger: _Ledger, state: GoodputStatus, facts: Facts) -> None:
    """The steps the group that ran last reported before it stopped (a reform, a suspension, a loss), settled
    before what follows."""
    if facts.round == state.round and facts.last_progress is not None and facts.started is not None:
        _settle_steps(ledger, state, facts, min(facts.last_progress, facts.now))


def _settle_progress(ledger: _Ledger, state: GoodputStatus, facts: Facts) -> None:
    """Up to the newest progress report: a reform completed since, a new group's start, then the steps."""
    end = facts.last_progress
    if end is None:
        return
    end = min(end, facts.now)
    reform = facts.reform
    new_round = facts.round > state.round
    completed = reform.duration_seconds is not None and reform.start is not None
    if reform.count > state.reforms and completed and end > ledger.until:
        _settle_reform(ledger, reform, end)
        state.reforms = reform.count
    elif new_round and facts.round_start is not None:
        ledger.add(Cause.STARTUP, min(facts.round_start, end))  # a group started without a reform
    if new_round:
        if facts.resumed_from_step is not None:  # else: the steps go on from the last one settled
            state.step = facts.resumed_from_step
        state.round = facts.round
    _settle_steps(ledger, state, facts, end)


def _settle_reform(ledger: _Ledger, reform: Reform, end: float) -> None:
    """The reform's seconds after ``ledger.until``: the gap before it began, then its phases in order."""
    assert reform.start is not None and reform.duration_seconds is not None
    start = min(reform.start, end)
    ledger.add(Cause.STALLED if reform.reason == STALL_REASON else Cause.REDONE, start)
    finish = min(start + reform.duration_seconds, end)
    if reform.phases is None:
        ledger.add(Cause.REFORM, finish)
        return
    bounds = itertools.accumulate(reform.phases.seconds().values(), initial=start)
    for cause, bound in zip(REFORM_CAUSES, list(bounds)[1:], strict=True):
        ledger.add(cause, min(bound, finish))
    ledger.add(REFORM_CAUSES[-1], finish)  # rounding of the phases: the rest is the first step's


def _settle_steps(ledger: _Ledger, state: GoodputStatus, facts: Facts, end: float) -> None:
    """Steps ``state.step`` to ``facts.step`` ran until ``end``: redone up to the highest step reached before,
    training beyond it; the seconds blocked on checkpoint saves since the last settlement come out of training."""
    span = max(0.0, _ms(end) - ledger.until)
    ran = facts.step - state.step
    if ran > 0:
        redone_share = max(0, min(facts.step, state.highest_step) - state.step) / ran
    else:
        redone_share = 1.0 if facts.step <= state.highest_step and state.highest_step > 0 else 0.0
    redone = span * redone_share
    blocked = 0.0
    reported = facts.checkpoint_blocked_seconds
    if reported is not None:  # rank 0's running total; a smaller one is a new process counting from 0
        before = state.checkpoint_blocked_seconds
        blocked = reported - before if reported >= before else reported
        state.checkpoint_blocked_seconds = reported
    blocked = min(blocked, span - redone)
    ledger.split(end, {Cause.TRAINING: 0.0, Cause.REDONE: redone, Cause.CHECKPOINT_BLOCKED: blocked})
    state.step = facts.step
    state.highest_step = max(state.highest_step, facts.step)


def facts_of(status: DistTrainJobStatus, *, created: Optional[float], now: float) -> Facts:
    """The :class:`Facts` of a decided status at ``now``; ``created`` is the job's metadata.creationTimestamp."""
    record = status.last_reform
    reform = Reform(count=status.reforms)
    if record is not None:
        reform = Reform(
            count=status.reforms,
            start=record.start,
            duration_seconds=record.duration_seconds,
            phases=record.phases,
            reason=record.reason,
        )
    phase = status.phase.value
    return Facts(
        now=now,
        created=created if created is not None else (status.start_time or now),
        started=status.start_time,
        suspended=phase == "Suspended",
        finished_at=(status.completion_time or now) if phase in ("Succeeded", "Failed") else None,
        reforming=status.control.in_flight,
        training=status.world_size > 0 and not status.control.in_flight,
        step=status.step,
        last_progress=status.last_progress_time,
        round=status.rendezvous_round,
        round_start=status.round_start_time,
        resumed_from_step=status.resumed_from_step,
        checkpoint_blocked_seconds=status.checkpoint_blocked_seconds,
        reform=reform,
    )


def is_due(previous: Optional[GoodputStatus], now: float, period: float = REFRESH_SECONDS) -> bool:
    """Whether the account must be written although nothing else in the status changed (``period``: the job's
    seconds between two such writes)."""
    if previous is None or previous.accounted_until is None:
        return True
    return now - previous.accounted_until >= period
