"""Rank 0's estimator for intervalSteps: auto, and the agent's halves (failure history out, report in)."""

from __future__ import annotations

import json

from disttrain.api import control, interval
from disttrain.api.timestamps import format_time
from disttrain.trainer.checkpoint import autointerval


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_agent_turns_the_status_into_a_failure_history():
    status = {
        "startTime": format_time(1_000.0),
        "restarts": {"total": 4, "byReason": {"NodeLost": 4}},
        "suspendedSeconds": 100.0,
    }
    report = control.ReliabilityReport.model_validate_json(autointerval.reliability_from_status(status))
    assert report.failures == 4 and report.age_seconds(1_500.0) == 400.0
    # Node losses redo steps as failures do; a departure (drained at a checkpoint) and the agent's loss do not.
    status["infrastructureLosses"] = {
        "total": 4,
        "byReason": {"HeartbeatLost": 2, "NodeDeparting": 1, "AgentRestarted": 1},
    }
    report = control.ReliabilityReport.model_validate_json(autointerval.reliability_from_status(status))
    assert report.failures == 6
    assert autointerval.reliability_from_status({}) is None  # not started yet
    assert autointerval.reliability_from_status({"startTime": "yesterday"}) is None


def test_the_planner_re_estimates_when_the_failure_history_changes():
    clock = Clock(10_000.0)
    history: list = [None]
    planner = autointerval.IntervalPlanner(lambda: history[0], clock=clock, poll_seconds=1.0)
    assert planner.propose(0.2) == 0, "no step measured yet: nothing to propose"
    for seconds in (0.05, 0.05, 0.05):
        planner.observe_step(seconds)
    first = planner.propose(0.2)  # no agent: the prior
    assert first == interval.choose(0.2, 0.05, 0.0, 0).steps
    report = planner.report()
    assert report is not None and report.steps == first and report.failures == 0
    assert planner.report() is None, "published once per change"

    history[0] = control.ReliabilityReport(started_at=clock.now - 600.0, failures=10)
    assert planner.propose(0.2) == first, "the history is read at most every poll_seconds"
    clock.now += 1.0
    second = planner.propose(0.2)
    assert second == interval.choose(0.2, 0.05, 601.0, 10).steps < first
    report = planner.report()
    assert report is not None and report.failures == 10 and report.mtbf_seconds == 60.1
    status = autointerval.interval_status(report)
    assert status["steps"] == second and status["mtbfSeconds"] == 60.1 and json.dumps(status)


def test_a_failing_store_keeps_the_last_history_known():
    clock = Clock(100.0)
    calls = iter([control.ReliabilityReport(started_at=0.0, failures=5), RuntimeError("agent restarting")])

    def read():
        item = next(calls)
        if isinstance(item, Exception):
            raise item
        return item

    planner = autointerval.IntervalPlanner(read, clock=clock, poll_seconds=0.0)
    planner.observe_step(0.1)
    before = planner.propose(0.3)
    clock.now += 1.0
    assert planner.propose(0.3) == interval.choose(0.3, 0.1, 101.0, 5).steps
    assert planner.reliability is not None and planner.reliability.failures == 5 and before > 0
