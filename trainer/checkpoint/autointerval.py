"""``spec.checkpoint.intervalSteps: auto`` in the running job: who measures what, and how the group agrees.

The rule itself is :mod:`disttrain.api.interval`. Its inputs come from three places:

* the save cost (with a bucket, the upload's too) and the step time: measured by rank 0 (:class:`IntervalPlanner`,
  fed by the loop);
* the failures: only the operator counts them (``status.restarts.total``, the infrastructure losses that cost
  steps in ``status.infrastructureLosses.byReason``, ``status.startTime``), so the job
  agent writes them into ``RELIABILITY_KEY`` (:func:`reliability_from_status`) and rank 0 reads that key at most
  every :data:`RELIABILITY_POLL_SECONDS`; without an agent (a bare ``torchrun``) the job's age is the process's and
  no failure is known, so the prior holds;
* the decision: rank 0 proposes the interval through the step-boundary all-reduce
  (:class:`disttrain.trainer.boundary.BoundaryFlags.interval_steps`), so every rank saves at the same steps.

Rank 0 publishes each new choice in ``INTERVAL_KEY``; the agent relays it to ``status.checkpointInterval``
(:func:`interval_status`). No torch here: the agent imports this module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Optional

from disttrain.api import control as keys
from disttrain.api import interval
from disttrain.api.conditions import Reason
from disttrain.api.timestamps import format_time, parse_time

log = logging.getLogger("disttrain.trainer")

STEP_FREE_LOSSES = frozenset({Reason.NODE_DEPARTING.value, Reason.AGENT_RESTARTED.value})
"""Infrastructure losses that cost no steps (a departing node drains at a checkpoint; the group trains on without
its agent): no failure for the interval's mean time between failures. Every other one is a node lost mid-step."""

RELIABILITY_POLL_SECONDS = 2.0
"""How often rank 0 reads the failure history from the agent's store (one store round trip)."""
STEP_SMOOTHING = 0.2
"""Weight of the newest step in the moving average of the step time."""


def reliability_from_status(status: dict[str, Any]) -> Optional[str]:
    """``RELIABILITY_KEY``'s value for a job status (the agent's side); None before the job first ran."""
    try:
        started = parse_time(status.get("startTime"))
        if started is None:
            return None
        restarts = status.get("restarts") or {}
        report = keys.ReliabilityReport(
            started_at=started,
            suspended_seconds=float(status.get("suspendedSeconds") or 0.0),
            failures=int(restarts.get("total") or 0) + losses_costing_steps(status),
        )
    except (TypeError, ValueError, OverflowError) as error:
        log.warning("no failure history for intervalSteps: auto from this status: %s", error)
        return None
    return report.model_dump_json()


def losses_costing_steps(status: dict[str, Any]) -> int:
    """The infrastructure losses of ``status`` that redo the steps since the last checkpoint, as failures do."""
    by_reason = (status.get("infrastructureLosses") or {}).get("byReason") or {}
    return sum(int(count) for reason, count in by_reason.items() if reason not in STEP_FREE_LOSSES)


def interval_status(report: keys.IntervalReport) -> dict[str, Any]:
    """``status.checkpointInterval`` for rank 0's report (the agent's side)."""
    return {
        "steps": report.steps,
        "saveSeconds": round(report.save_seconds, 3),
        "stepSeconds": round(report.step_seconds, 4),
        "mtbfSeconds": round(report.mtbf_seconds, 1),
        "failures": report.failures,
        "time": format_time(report.time),
    }


class IntervalPlanner:
    """Rank 0's estimator: step times and save costs in, a proposed interval (and its report) out."""

    def __init__(
        self,
        read_reliability: Callable[[], Optional[keys.ReliabilityReport]],
        *,
        clock: Callable[[], float] = time.time,
        poll_seconds: float = RELIABILITY_POLL_SECONDS,
    ) -> None:
        self.read_reliability = read_reliability
        self.clock = clock
        self.poll_seconds = poll_seconds
        self.started = clock()
        self.step_seconds: Optional[float] = None
        self.reliability: Optional[keys.ReliabilityReport] = None
        self._read_at: Optional[float] = None
        self._published: Optional[tuple[int, int]] = None
        self.choice: Optional[interval.IntervalChoice] = None

    def observe_step(self, seconds: float) -> None:
        """One step's seconds, without the time saves blocked it."""
        if not seconds > 0:
            return
        previous = self.step_seconds
        self.step_seconds = seconds if previous is None else previous + STEP_SMOOTHING * (seconds - previous)

    def _failures_and_age(self, now: float) -> tuple[int, float]:
        if self._read_at is None or now - self._read_at >= self.poll_seconds:
            self._read_at = now
            try:
                self.reliability = self.read_reliability() or self.reliability
            except Exception as error:  # noqa: BLE001 - a restarting agent: keep the last history known
                log.debug("could not read the failure history: %r", error)
        if self.reliability is None:
            return 0, now - self.started
        return self.reliability.failures, self.reliability.age_seconds(now)

    def propose(self, save_seconds: Optional[float], upload_seconds: Optional[float] = None) -> int:
        """The interval to propose at this boundary (0: nothing measured yet, keep the agreed one), from the newest
        save's blocking seconds and, with a bucket, its upload's."""
        if self.step_seconds is None:
            return 0
        failures, age = self._failures_and_age(self.clock())
        self.choice = interval.choose(save_seconds, self.step_seconds, age, failures, upload_seconds=upload_seconds)
        return self.choice.steps

    def report(self) -> Optional[keys.IntervalReport]:
        """A report of the newest choice when its interval or the failures it counted changed, else None."""
        choice = self.choice
        if choice is None:
            return None
        failures = self.reliability.failures if self.reliability is not None else 0
        if self._published == (choice.steps, failures):
            return None
        if self._published is None or self._published[1] != failures or _far(self._published[0], choice.steps):
            log.info(
                "checkpoint interval: %d steps (save %.3fs, step %.4fs, MTBF %.0fs from %d failures)",
                choice.steps,
                choice.save_seconds,
                choice.step_seconds,
                choice.mtbf_seconds,
                failures,
            )
        self._published = (choice.steps, failures)
        return keys.IntervalReport(
            steps=choice.steps,
            save_seconds=choice.save_seconds,
            step_seconds=choice.step_seconds,
            mtbf_seconds=min(choice.mtbf_seconds, keys.MAX_TIME),
            failures=failures,
            time=self.clock(),
        )


def _far(old: int, new: int) -> bool:
    """Worth a log line: the interval moved by a fifth or more."""
    return abs(new - old) * 5 >= max(old, 1)
