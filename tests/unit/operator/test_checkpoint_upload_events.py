"""A bucket behind the workers' local disks (``status.checkpointUpload``) is a Warning Event with a budget of its own:
at most one every five minutes, and it never crowds out the job's own Warnings."""

from __future__ import annotations

import pytest
from tests.unit.operator.world import World, job_manifest

from disttrain.operator import announcements, eventrate

pytestmark = pytest.mark.timeout(30)


def behind_warnings(world: World) -> list[str]:
    events = world.last.events if world.last else ()
    return [e.message for e in events if e.reason == announcements.CHECKPOINT_UPLOAD_BEHIND]


def test_a_bucket_behind_is_a_warning_naming_the_saves_and_the_error_and_none_once_caught_up():
    world = World(job_manifest(min=1, max=2, replicas=2)).running_world(2)
    behind = "2 save(s) not yet COMPLETE in the bucket (oldest step-40): EndpointConnectionError: Could not connect"
    world.status["checkpointUpload"] = behind
    world.step(1.0)
    assert behind_warnings(world) == [f"checkpoints wait for the bucket: {behind}"]
    world.status.pop("checkpointUpload")
    world.step(1.0)
    assert behind_warnings(world) == []


def test_a_bucket_behind_for_an_hour_posts_one_warning_per_five_minutes_and_the_jobs_own_still_go_out():
    event_filter = eventrate.EventFilter()
    posted = 0
    for second in range(0, 3600, 10):
        message = f"checkpoints wait for the bucket: {second // 10 + 1} save(s) not yet COMPLETE in the bucket"
        posted += event_filter.admit(("ns", "job", "Warning", announcements.CHECKPOINT_UPLOAD_BEHIND, message), second)
    assert posted == 12
    for n in range(eventrate.BURST):
        assert event_filter.admit(("ns", "job", "Warning", "NodeLost", f"node {n} lost"), 3600.0), n
