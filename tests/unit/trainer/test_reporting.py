"""When the job agent writes: the urgency matrix and the throttle, with a manual clock."""

from __future__ import annotations

import itertools
import random

import pytest

from disttrain.api.spec import ReportingSpec, TrainingSpec
from disttrain.trainer.agent import reporting

TRAINING = TrainingSpec.model_validate(
    {"globalBatchSize": 24, "microBatchSize": 2, "lr": {"base": 0.1}, "maxSteps": 100}
)
RUNNING = {"step": 40, "samplesConsumed": 960, "rendezvousRound": 2, "control": {"action": "none"}}


@pytest.mark.parametrize(
    "changes, status, expected",
    [
        ({"step": 41, "lastProgressTime": "t"}, RUNNING, None),
        ({"lastCheckpoint": {"step": 40}}, RUNNING, None),
        ({"step": 41, "rendezvousRound": 3, "worldSize": 2}, RUNNING, "new rendezvous round"),
        ({"workerFailure": {"exitCode": 85}}, RUNNING, "worker failure"),
        ({"lastCheckpoint": {"step": 40}}, {**RUNNING, "control": {"action": "drain"}}, "checkpoint during a drain"),
        (
            {"lastCheckpoint": {"step": 52, "time": "2026-12-03T08:00:09Z"}},
            {
                **RUNNING,
                "control": {"action": "drain", "issuedAt": "2026-12-03T08:00:05Z"},
                "lastCheckpoint": {"step": 40, "time": "2026-12-03T08:00:01Z"},
            },
            "checkpoint during a drain",
        ),
        (
            {"lastCheckpoint": {"step": 64, "time": "2026-12-03T08:00:12Z"}},
            {
                **RUNNING,
                "control": {"action": "drain", "issuedAt": "2026-12-03T08:00:05Z"},
                "lastCheckpoint": {"step": 52, "time": "2026-12-03T08:00:09Z"},
            },
            None,
        ),
        (
            {"lastCheckpoint": {"step": 40, "time": "2026-12-03T08:00:04Z"}},
            {
                **RUNNING,
                "control": {"action": "drain", "issuedAt": "2026-12-03T08:00:05Z"},
                "lastCheckpoint": {"step": 28, "time": "2026-12-03T08:00:01Z"},
            },
            None,
        ),
        (
            {"lastCheckpoint": {"step": 40, "time": "2026-12-03T08:00:05Z"}},
            {
                **RUNNING,
                "control": {"action": "drain", "issuedAt": "2026-12-03T08:00:05Z"},
                "lastCheckpoint": {"step": 28, "time": "2026-12-03T08:00:01Z"},
            },
            "checkpoint during a drain",
        ),
        ({"lastCheckpoint": {"step": 40}}, {**RUNNING, "control": {"action": "reform"}}, None),
        ({"step": 41}, {**RUNNING, "control": {"action": "drain"}}, None),
        ({"step": 100}, RUNNING, "training complete"),
        ({"step": 41}, {"step": 40}, None),
    ],
    ids=[
        "progress-waits",
        "routine-checkpoint-waits",
        "new-round",
        "failure",
        "drain-checkpoint",
        "first-checkpoint-after-the-drain",
        "later-checkpoints-of-a-reported-drain-wait",
        "a-checkpoint-from-before-the-drain-waits",
        "one-committed-as-the-drain-was-issued-is-urgent",
        "reform-checkpoint-waits",
        "old-group-progress-during-a-drain-waits",
        "last-step",
        "no-control-yet",
    ],
)
def test_urgent_reason(changes, status, expected):
    assert reporting.urgent_reason(changes, status, TRAINING) == expected


def test_training_complete_by_samples():
    training = TRAINING.model_copy(update={"max_steps": None, "max_samples": 1000})
    assert not reporting.is_training_complete({"samplesConsumed": 999}, training)
    assert reporting.is_training_complete({"samplesConsumed": 1000}, training)


def test_throttle_writes_first_then_once_an_interval_and_urgent_at_once():
    throttle = reporting.ProgressThrottle(draw=lambda: 0.0)
    assert throttle.is_due(urgent=False, interval_s=10, now=100.0), "a restarted agent reports at once"
    throttle.wrote(100.0)
    assert not throttle.is_due(urgent=False, interval_s=10, now=109.9)
    assert throttle.is_due(urgent=True, interval_s=10, now=100.1)
    assert throttle.is_due(urgent=False, interval_s=10, now=110.0)


def test_the_write_reason_names_urgent_first_and_periodic_writes():
    throttle = reporting.ProgressThrottle(draw=lambda: 0.0)
    assert throttle.write_reason(urgent=None, interval_s=60, now=100.0) == reporting.FIRST
    throttle.wrote(100.0)
    assert throttle.write_reason(urgent=None, interval_s=60, now=159.9) is None
    assert throttle.write_reason(urgent="worker failure", interval_s=60, now=100.1) == "worker failure"
    assert throttle.write_reason(urgent=None, interval_s=60, now=160.0) == reporting.PERIODIC


def test_a_training_job_at_the_default_interval_costs_its_agent_at_most_one_write_a_minute():
    """The API budget of a job in steady state (steps every 0.25 s, a routine checkpoint every few seconds, fast
    writes): one periodic write a minute at most, so that agents and operator stay under two requests a minute."""
    training = TRAINING.model_copy(update={"max_steps": 10**8})
    interval_s = ReportingSpec().progress_interval_seconds
    throttle = reporting.ProgressThrottle(draw=random.Random(5).random)
    status = dict(RUNNING)
    reasons: list[str] = []
    now = 0.0
    while now < 3600.0:
        step = int(now * 4)
        changes = {"step": step, "lastCheckpoint": {"step": step - step % 12}}
        reason = throttle.write_reason(
            urgent=reporting.urgent_reason(changes, status, training), interval_s=interval_s, now=now
        )
        if reason is not None:
            throttle.wrote(now, took=0.02)
            status.update(changes)
            reasons.append(reason)
        now = round(now + 0.25, 2)
    assert reasons[0] == reporting.FIRST and set(reasons[1:]) == {reporting.PERIODIC}
    assert len(reasons) <= 60, f"{len(reasons)} writes in an hour"


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


def test_slow_writes_stretch_the_interval_up_to_the_cap_and_fast_ones_bring_it_back():
    """An agent whose writes take long (a saturated API server) writes progress less often, never more than
    MAX_BACKOFF intervals apart, and returns to the interval once its writes are fast again; urgent writes
    never wait."""
    throttle = reporting.ProgressThrottle(draw=lambda: 0.0)
    throttle.wrote(0.0, took=0.02)
    assert throttle.period(10) == 10, "a 20 ms write is an unloaded server's"
    throttle.wrote(10.0, took=0.3)  # smoothed: 0.16 s -> 16 s
    assert throttle.period(10) == pytest.approx(10 * 0.16 / reporting.SLOW_WRITE_S)
    assert throttle.period(1) == pytest.approx(1.6), "the stretch is relative to the job's own interval"
    assert not throttle.is_due(urgent=False, interval_s=10, now=10.0 + 15.9)
    assert throttle.is_due(urgent=True, interval_s=10, now=10.1)
    assert throttle.is_due(urgent=False, interval_s=10, now=10.0 + 16.0)
    for now in range(30, 300, 60):
        throttle.wrote(float(now), took=30.0)  # timeouts of a server that no longer answers
    assert throttle.period(10) == 10 * reporting.MAX_BACKOFF
    for now in range(300, 540, 60):  # four fast writes after the outage
        throttle.wrote(float(now), took=0.01)
    assert throttle.period(10) == 10


def test_the_stretch_is_bounded_in_seconds_for_long_intervals():
    """At a minute's interval a slow server stretches it to 3 minutes, not 6; an interval set longer stays."""
    throttle = reporting.ProgressThrottle(draw=lambda: 0.0)
    throttle.wrote(0.0, took=30.0)  # a timed-out first write: the full back-off
    assert throttle.period(10) == 10 * reporting.MAX_BACKOFF
    assert throttle.period(60) == reporting.MAX_STRETCHED_S
    assert throttle.period(600) == 600
    assert not throttle.is_due(urgent=False, interval_s=60, now=reporting.MAX_STRETCHED_S - 0.1)
    assert throttle.is_due(urgent=False, interval_s=60, now=reporting.MAX_STRETCHED_S)


def test_a_fleet_of_agents_lowers_its_write_rate_as_the_server_slows():
    """500 agents against a server whose latency grows with the write rate (one write at a time, 15 ms each, the
    rest queued): with the back-off the fleet settles where the server keeps up instead of queueing for good."""
    rng = random.Random(3)
    throttles = [reporting.ProgressThrottle(draw=rng.random) for _ in range(500)]
    service_s, now, busy_until, writes = 0.015, 0.0, 0.0, 0
    late_latency: list[float] = []
    while now < 300.0:
        for throttle in throttles:
            if throttle.is_due(urgent=False, interval_s=10, now=now):
                start = max(now, busy_until)
                busy_until = start + service_s * 2.5  # the server's share per write on a loaded 2-core machine
                throttle.wrote(busy_until, took=busy_until - now)
                if now >= 200.0:
                    writes += 1
                    late_latency.append(busy_until - now)
        now = round(now + 0.25, 2)
    rate = writes / 100.0
    assert rate < 1.0 / (service_s * 2.5), f"{rate:.1f} writes/s: the server stays saturated"
    assert max(late_latency) < 1.0, "writes still queue for seconds"
    assert rate > 500 / (10 * reporting.MAX_BACKOFF) * 0.9, "the fleet backs off no further than it must"
