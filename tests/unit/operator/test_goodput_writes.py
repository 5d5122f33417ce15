"""status.goodput in the reconcile core: written with the operator's other status writes, and on its own only when
it is REFRESH_SECONDS old, never once per progress report (the agent reports every few seconds per job)."""

from __future__ import annotations

import itertools

import pytest
from tests.unit.operator.world import World, job_manifest

from disttrain.api import goodput, timestamps
from disttrain.operator import refresh

pytestmark = pytest.mark.timeout(30)


def test_a_steady_job_writes_its_account_only_when_due():
    world = World(job_manifest(replicas=2)).running_world(2)
    first = world.status["goodput"]
    assert first["seconds"]["startup"] >= 0 and first["since"]
    written = []
    for i in range(1, 31):  # 300 s of progress every 10 s
        world.now += 10
        world.progress(2, 5 + i, same_round=True)
        patch = world.step().status_patch
        if patch:
            assert set(patch) == {"goodput"}, patch
            written.append(world.now)
    assert written, "never refreshed"
    gaps = [b - a for a, b in itertools.pairwise(written)]
    assert all(gap >= goodput.REFRESH_SECONDS for gap in gaps), gaps
    assert len(written) <= 300 / goodput.REFRESH_SECONDS + 1
    account = world.status["goodput"]
    assert account["seconds"]["training"] > 0
    assert timestamps.parse_time(account["accountedUntil"]) == written[-1]


def test_the_account_rides_on_another_write():
    world = World(job_manifest(replicas=2)).running_world(2)
    world.now += 10
    world.progress(2, 6, same_round=True)
    assert not world.step().status_patch  # 10 s old: not due
    world.now += 10
    world.progress(2, 7, same_round=True)
    world.set_worker(1, phase="Failed")  # a loss: the operator writes its restart and directive
    patch = world.step().status_patch
    assert "restarts" in patch and "goodput" in patch
    assert timestamps.parse_time(world.status["goodput"]["accountedUntil"]) == world.now


def test_a_job_that_commits_often_refreshes_its_checkpoint_message_and_its_account_in_one_write():
    world = World(job_manifest(replicas=2)).running_world(2)
    world.checkpoint(5).step(1)
    period = refresh.refresh_seconds("job-uid-1")  # the World's job
    written = []
    for step in range(6, 66):  # 600 s of progress every 10 s, a checkpoint with each
        world.now += 10
        world.progress(2, step, same_round=True).checkpoint(step)
        patch = world.step().status_patch
        if patch:
            assert set(patch) == {"conditions", "goodput"}, patch  # the message and the account together
            assert world.condition("Checkpointed")["message"].startswith(f"checkpoint at step {step} ")
            written.append(world.now)
    assert len(written) >= 3, written
    gaps = [b - a for a, b in itertools.pairwise(written)]
    assert all(gap >= period for gap in gaps), gaps
    assert len(written) <= 600 / period + 1
