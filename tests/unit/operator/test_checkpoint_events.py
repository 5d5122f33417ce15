"""Checkpoint announcements: an event only on a transition, a condition message that follows at a bounded cost."""

from __future__ import annotations

import pytest
from tests.unit.operator.world import World, job_manifest

from disttrain.api import goodput
from disttrain.operator import refresh

pytestmark = pytest.mark.timeout(30)
REFRESH = refresh.refresh_seconds("job-uid-1")  # the World's job


def test_each_job_has_its_own_refresh_period_so_jobs_started_together_spread_their_refreshes():
    periods = [refresh.refresh_seconds(f"uid-{i}") for i in range(500)]
    base = goodput.REFRESH_SECONDS
    assert all(base <= p < 1.5 * base for p in periods)
    assert periods == [refresh.refresh_seconds(f"uid-{i}") for i in range(500)], "stable per job"
    seconds = [sum(1 for p in periods if s <= p - base < s + 1) for s in range(int(base / 2))]
    assert max(seconds) < 0.1 * len(periods)  # with one period for all, every job would refresh in one second


def test_the_first_checkpoint_is_an_event_and_names_its_step():
    world = World(job_manifest(replicas=2)).running_world(2)
    world.checkpoint(10).step(1)
    assert world.reasons().count("CheckpointCommitted") == 1
    condition = world.condition("Checkpointed")
    assert condition["status"] == "True" and condition["reason"] == "CheckpointCommitted"
    assert condition["message"] == "checkpoint at step 10 is complete (/ckpt/step-10)"


def test_later_commits_post_no_event_and_refresh_the_message_at_most_once_a_refresh_period():
    world = World(job_manifest(replicas=2)).running_world(2)
    world.checkpoint(10).step(1)
    for step in (20, 30, 40):
        world.checkpoint(step)
        actions = world.step(REFRESH / 4)
        assert "Checkpointed" not in str(actions.status_patch), "no status write for a commit inside the period"
        assert actions.requeue_after is not None and actions.requeue_after <= REFRESH
    assert world.condition("Checkpointed")["message"].startswith("checkpoint at step 10 ")
    world.checkpoint(50)
    world.step(REFRESH / 4)  # the period since the last refresh is over
    assert world.condition("Checkpointed")["message"].startswith("checkpoint at step 50 ")
    assert world.reasons().count("CheckpointCommitted") == 1


def test_the_message_catches_up_when_its_timer_fires_without_a_new_commit():
    world = World(job_manifest(replicas=2)).running_world(2)
    world.checkpoint(10).step(1)
    world.checkpoint(20)
    actions = world.step(1)
    world.step(actions.requeue_after)
    assert world.condition("Checkpointed")["message"].startswith("checkpoint at step 20 ")


def replaced_world(replicas: int) -> World:
    """Checkpoint 10 committed, then node 1 lost and replaced after the backoff, the new group's pods running."""
    world = World(job_manifest(replicas=replicas)).running_world(replicas)
    world.checkpoint(10).step(1)
    world.vanish(1)
    world.step(1)
    world.step(5)  # after the backoff: the replacement
    world.run_all()
    world.step(1)
    return world


def test_the_first_commit_after_a_resume_is_announced_again():
    world = replaced_world(3)
    world.progress(3, step=11).step(1)  # the new group's first step follows the checkpoint it resumed from
    assert "ResumedFromStep" in world.reasons()
    resumed = world.condition("Checkpointed")
    assert resumed["reason"] == "ResumedFromStep" and "step 10" in resumed["message"]
    world.step(1)
    assert world.condition("Checkpointed")["reason"] == "ResumedFromStep", "the same checkpoint is no news"
    world.checkpoint(20).step(1)
    assert world.reasons().count("CheckpointCommitted") == 2
    assert world.condition("Checkpointed")["message"].startswith("checkpoint at step 20 ")


def resumed_world(resumed_from_step: int, **relayed: str) -> World:
    """Checkpoint 10 committed, a node lost, and the new group reporting the step after the one it loaded."""
    world = replaced_world(2)
    world.progress(2, step=resumed_from_step + 1)
    world.status.update(resumedFromStep=resumed_from_step, **relayed)
    world.step(1)
    return world


def test_the_resume_names_the_step_the_group_loaded_not_the_newest_commit():
    """The newest committed checkpoint (step 10) could not be loaded and the group fell back to step 5: the Event
    and the condition name step 5, as rank 0 reported it."""
    world = resumed_world(5)
    assert [m for r, m in world.events if r == "ResumedFromStep"] == ["training resumed from step 5"]
    assert world.condition("Checkpointed")["message"] == "training resumed from the complete checkpoint at step 5"
    world.step(1)
    assert world.reasons().count("CheckpointCommitted") == 1, "the step-10 checkpoint seen before is no news"


def test_resuming_an_earlier_jobs_checkpoint_is_a_warning_naming_that_job():
    """A job deleted and created again under the same name finds the first one's checkpoints: training goes on
    from them, and the Event says whose they are and how to start afresh."""
    world = resumed_world(10, resumedFromJobUid="uid-of-the-deleted-job")
    [message] = [m for r, m in world.events if r == "ResumedFromEarlierJob"]
    assert "step 10" in message and "uid-of-the-deleted-job" in message and "spec.checkpoint.path" in message


def test_resuming_the_jobs_own_checkpoint_is_no_warning():
    own = World(job_manifest(replicas=2)).manifest["metadata"]["uid"]
    assert "ResumedFromEarlierJob" not in resumed_world(10, resumedFromJobUid=own).reasons()
