"""A collective desync reported by the trainer fails the job as CollectiveDesync, in the status and an Event."""

from __future__ import annotations

from tests.unit.operator.world import World, job_manifest

from disttrain.api import conditions as cond

DESYNC = (
    "collective desync: rank 0 called BROADCAST (tensor shape [5], float, collective #10) while rank 1 called "
    "ALLREDUCE (tensor shape [7], long, collective #10); they differ in Op type: BROADCASTvs ALLREDUCE. The ranks "
    "call collectives in a different order (a data-dependent branch, a rank that skipped one): a restart would "
    "repeat it"
)


def test_the_agents_report_of_a_desync_fails_the_job_with_its_own_reason_and_an_event():
    world = World(job_manifest(replicas=2)).running_world(2)
    world.status["workerFailure"] = {
        "exitCode": 85,
        "node": "demo-worker-0",
        "message": DESYNC,
        "time": cond.format_time(world.now),
    }
    actions = world.step(1)
    assert world.status["phase"] == "Failed"
    failed = world.condition("Failed")
    assert failed["reason"] == "CollectiveDesync" and "rank 0 called BROADCAST" in failed["message"]
    assert "rank 1 called ALLREDUCE" in world.status["message"]
    events = [e for e in actions.events if e.reason == "CollectiveDesync"]
    assert [e.type for e in events] == ["Warning"] and "rank 1 called ALLREDUCE" in events[0].message


def test_a_pod_that_ended_on_a_desync_fails_the_job_with_the_same_reason():
    world = World(job_manifest(replicas=2)).running_world(2)
    line = f"worker rank 1 failed with exit code 85: CollectiveDesyncError: {DESYNC}"
    world.set_worker(1, phase="Failed", exit_code=85, termination_message=f"{line}\n").step(1)
    failed = world.condition("Failed")
    assert failed["reason"] == "CollectiveDesync" and "rank 0 called BROADCAST" in failed["message"]
    assert world.status["restarts"]["total"] == 0


def test_any_other_permanent_failure_keeps_its_reason():
    world = World(job_manifest(replicas=2)).running_world(2)
    world.set_worker(1, phase="Failed", exit_code=85, termination_message="worker rank 1 failed: ValueError: x\n")
    world.step(1)
    assert world.condition("Failed")["reason"] == "PermanentExitCode"
