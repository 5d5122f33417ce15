"""What the job agent wrote is checked before the reconcile core reads it: a value that is no time (or out of
range) is ignored, as if not reported yet, instead of failing every reconcile of the job."""

from __future__ import annotations

import pytest
from tests.unit.operator.world import World, job_manifest

from disttrain.api.spec import DistTrainJob
from disttrain.operator import agentfields
from disttrain.operator.reconcile import reconcile


def draining_world() -> World:
    world = World(job_manifest(replicas=3)).running_world(3)
    world.spec("nodes.replicas", 2)
    world.step(1)
    world.step(10)
    assert world.control["action"] == "drain"
    return world


@pytest.mark.parametrize(
    "field,value",
    [
        ("lastCheckpoint", {"step": 6, "samples": 144, "path": "/ckpt/step-6", "time": "yesterday", "worldSize": 3}),
        (
            "lastCheckpoint",
            {"step": 6, "samples": 144, "path": "/ckpt/step-6", "time": "99999-01-01T00:00:00Z", "worldSize": 3},
        ),
        ("lastProgressTime", "NaN"),
    ],
)
def test_an_unparsable_agent_time_is_ignored_not_fatal(field, value):
    world = draining_world()
    world.status[field] = value
    with pytest.raises(ValueError):  # what the core does with it unchecked: every reconcile fails
        reconcile(DistTrainJob.model_validate(world.manifest), world.observed(), world.now + 1)
    job = agentfields.sanitized_job(world.manifest, "default", "demo")
    assert field not in job["status"] and world.status[field] == value, "only the core's view is cleaned"
    actions = reconcile(DistTrainJob.model_validate(job), world.observed(), world.now + 1)
    assert actions.delete_pods == (), "no checkpoint was reported: the victim is not deleted yet"


def test_good_values_pass_untouched_and_each_problem_is_named():
    world = draining_world().checkpoint(6).progress(3, step=6, same_round=True)
    clean, problems = agentfields.sanitize(world.status)
    assert clean == world.status and problems == []
    _, problems = agentfields.sanitize({**world.status, "step": 2**60, "roundStartTime": 5})
    assert problems == [
        "status.roundStartTime=5 is no RFC 3339 time",
        f"status.step={2**60} is out of range [0, {2**53}]",
    ]


GOOD_INTERVAL = {
    "steps": 12,
    "saveSeconds": 0.2,
    "stepSeconds": 0.05,
    "mtbfSeconds": 60.0,
    "failures": 2,
    "time": "2026-01-01T00:00:00Z",
}


@pytest.mark.parametrize(
    "value,problem,fatal",
    [
        ({**GOOD_INTERVAL, "steps": 0}, "status.checkpointInterval.steps=0 is out of range", True),
        ({**GOOD_INTERVAL, "steps": "12"}, "status.checkpointInterval.steps='12' is out of range", False),
        (
            {**GOOD_INTERVAL, "mtbfSeconds": -1},
            "status.checkpointInterval.mtbfSeconds=-1 is no number of seconds",
            True,
        ),
        ({**GOOD_INTERVAL, "time": "soon"}, "status.checkpointInterval.time='soon' is no RFC 3339 time", False),
        ("auto", "status.checkpointInterval='auto' is no object", True),
    ],
)
def test_a_bad_checkpoint_interval_report_is_dropped_and_named(value, problem, fatal):
    world = draining_world()
    world.status["checkpointInterval"] = value
    if fatal:
        with pytest.raises(ValueError):  # unchecked, the status model refuses it on every reconcile
            reconcile(DistTrainJob.model_validate(world.manifest), world.observed(), world.now + 1)
    clean, problems = agentfields.sanitize(world.status)
    assert "checkpointInterval" not in clean and len(problems) == 1 and problems[0].startswith(problem), problems
    reconcile(
        DistTrainJob.model_validate(agentfields.sanitized_job(world.manifest, "default", "demo")),
        world.observed(),
        world.now + 1,
    )


def test_a_good_checkpoint_interval_report_passes():
    status = {**draining_world().status, "checkpointInterval": GOOD_INTERVAL}
    assert agentfields.sanitize(status) == (status, [])


@pytest.mark.parametrize("members", ["demo-worker-0", [""], [3], ["x" * 254], ["w"] * 1025])
def test_a_malformed_round_members_report_is_dropped_whole(members):
    clean, problems = agentfields.sanitize({"roundMembers": members, "step": 4})
    assert "roundMembers" not in clean and clean["step"] == 4
    assert problems and "status.roundMembers" in problems[0]


def test_a_round_members_report_is_kept():
    clean, problems = agentfields.sanitize({"roundMembers": ["demo-worker-0", "demo-worker-2"]})
    assert clean["roundMembers"] == ["demo-worker-0", "demo-worker-2"] and problems == []
