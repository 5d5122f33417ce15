"""When the job agent writes: the urgency matrix and the throttle, with a manual clock."""

from __future__ import annotations

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
    throttle = reporting.ProgressThrottle()
    assert throttle.is_due(urgent=False, interval_s=10, now=100.0), "a restarted agent reports at once"
    throttle.wrote(100.0)
    assert not throttle.is_due(urgent=False, interval_s=10, now=109.9)
    assert throttle.is_due(urgent=True, interval_s=10, now=100.1)
    assert throttle.is_due(urgent=False, interval_s=10, now=110.0)
