"""When the job agent writes: the urgency matrix and the throttle, with a manual clock."""

from __future__ import annotations

import itertools
import random

import pytest

from disttrain.trainer import reporting

SPEC = {"training": {"globalBatchSize": 24, "microBatchSize": 2, "lr": {"base": 0.1}, "maxSteps": 100},
        "reporting": {"progressIntervalSeconds": 10}}
RUNNING = {"step": 40, "samplesConsumed": 960, "rendezvousRound": 2, "control": {"action": "none"}}


@pytest.mark.parametrize("changes, status, expected", [
    ({"step": 41, "lastProgressTime": "t"}, RUNNING, None),
    ({"lastCheckpoint": {"step": 40}}, RUNNING, None),
    ({"step": 41, "rendezvousRound": 3, "worldSize": 2}, RUNNING, "new rendezvous round"),
    ({"workerFailure": {"exitCode": 85}}, RUNNING, "worker failure"),
    ({"lastCheckpoint": {"step": 40}}, {**RUNNING, "control": {"action": "drain"}}, "checkpoint during a drain"),
    ({"lastCheckpoint": {"step": 40}}, {**RUNNING, "control": {"action": "reform"}}, None),
    ({"step": 41}, {**RUNNING, "control": {"action": "drain"}}, None),
    ({"step": 100}, RUNNING, "training complete"),
    ({"step": 41}, {"step": 40}, None),
], ids=["progress-waits", "routine-checkpoint-waits", "new-round", "failure", "drain-checkpoint",
        "reform-checkpoint-waits", "old-group-progress-during-a-drain-waits", "last-step", "no-control-yet"])
def test_urgent_reason(changes, status, expected):
    assert reporting.urgent_reason(changes, status, SPEC) == expected


def test_training_complete_by_samples():
    spec = {"training": {**SPEC["training"], "maxSteps": None, "maxSamples": 1000}}
    assert not reporting.is_training_complete({"samplesConsumed": 999}, spec)
    assert reporting.is_training_complete({"samplesConsumed": 1000}, spec)


def test_progress_interval_comes_from_the_spec_with_the_crd_default():
    assert reporting.progress_interval(SPEC) == 10
    assert reporting.progress_interval({"reporting": {"progressIntervalSeconds": 3}}) == 3
    assert reporting.progress_interval({}) == 10


def test_throttle_writes_first_then_once_an_interval_and_urgent_at_once():
    throttle = reporting.ProgressThrottle(draw=lambda: 0.0)
    assert throttle.is_due(urgent=False, interval_s=10, now=100.0), "a restarted agent reports at once"
    throttle.wrote(100.0)
    assert not throttle.is_due(urgent=False, interval_s=10, now=109.9)
    assert throttle.is_due(urgent=True, interval_s=10, now=100.1)
    assert throttle.is_due(urgent=False, interval_s=10, now=110.0)


def test_agents_started_together_spread_their_writes_over_the_interval_and_never_write_sooner():
    """500 agents started in the same second: their periodic writes must not come in one burst (the operator
    would take it as one queue of reconciles), and none may write more often than the interval."""
    rng = random.Random(7)
    throttles = [reporting.ProgressThrottle(draw=rng.random) for _ in range(500)]
    writes: list[list[float]] = [[] for _ in throttles]
    now = 0.0
    while now < 120.0:  # the agents' 0.25 s poll, 2 minutes
        for throttle, times in zip(throttles, writes, strict=True):
            if throttle.is_due(urgent=False, interval_s=10, now=now):
                throttle.wrote(now)
                times.append(now)
        now = round(now + 0.25, 2)
    gaps = [b - a for times in writes for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 10.0
    assert max(gaps) <= 20.25 and sum(gaps) / len(gaps) < 11.5  # the rate stays about one write an interval
    late = [t for times in writes for t in times if t >= 60.0]
    busiest = max(sum(1 for t in late if s <= t < s + 1.0) for s in range(60, 119))
    assert busiest < 0.25 * len(throttles)  # in step, every agent would write within the same second
