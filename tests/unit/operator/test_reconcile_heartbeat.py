"""Reconcile policy for a node the job agent reports silent in the rendezvous heartbeats (status.silentNodes):
a loss before Kubernetes notices, fenced, counted once, and never confused with a later pod of the same name."""

from __future__ import annotations

import pytest
from tests.unit.operator.world import World, job_manifest

from disttrain.api import timestamps
from disttrain.operator import agentfields
from disttrain.operator.observed import NodeView

pytestmark = pytest.mark.timeout(30)


def silent_world() -> World:
    world = World(job_manifest(replicas=3, min=2))
    world.nodes = {f"node-{i}": NodeView(f"node-{i}") for i in range(3)} | {"node-agent": NodeView("node-agent")}
    return world.running_world(3)


def report(world: World, *pods) -> World:
    world.status["silentNodes"] = [
        {"node": p.name, "podUid": p.uid, "lastHeartbeat": timestamps.format_time(world.now - 3)} for p in pods
    ]
    return world


def test_a_silent_node_is_lost_before_its_node_is_notready():
    world = silent_world()
    silent = world.worker(1)
    actions = report(world, silent).step(1)
    world.assert_reformed_without(actions, silent, "HeartbeatLost")
    world.status["silentNodes"] = []  # the agent's report may be gone by now; the pod lingers Terminating
    actions = world.step(5)  # after the restart backoff
    assert [(w.node_index, w.name) for w in actions.create_workers] == [(1, "demo-worker-1-1")], (
        "a replacement, with the silent node's index (and so its ranks)"
    )
    # Kubernetes still reads that node Ready: the scheduler must not put the replacement on the dead machine.
    assert actions.create_workers[0].avoid_nodes == (silent.node_name,)
    assert world.infrastructure_losses() == {"total": 1, "byReason": {"HeartbeatLost": 1}}
    assert world.status["restarts"]["total"] == 0
    assert world.status["lastReform"]["reason"] == "HeartbeatLost"


def test_repeated_reports_and_the_later_notready_count_one_loss():
    world = silent_world()
    silent = world.worker(1)
    report(world, silent).step(1)
    generation = world.control["generation"]
    world.step(1)
    world.step(1)
    world.nodes["node-1"] = NodeView("node-1", ready=False)  # Kubernetes, the second source, catches up
    world.step(20)
    world.finish_terminations().step(1)
    assert world.infrastructure_losses() == {"total": 1, "byReason": {"HeartbeatLost": 1}}
    assert world.control["generation"] == generation, "no second directive for the same loss"


def test_a_stale_report_does_not_touch_the_replacement_of_the_same_name():
    world = silent_world()
    silent = world.worker(1)
    report(world, silent).step(1)
    world.finish_terminations().step(5)  # the silent pod is gone (after the backoff: its replacement reuses the name)
    replacement = world.worker(1)
    assert replacement.name == silent.name and replacement.uid != silent.uid
    world.run_all()
    stale = dict(world.status["silentNodes"][0], node=replacement.name)  # same name, the old pod's uid
    world.status["silentNodes"] = [stale]
    actions = world.step(1)
    assert replacement.name not in [d.name for d in actions.delete_pods]
    assert world.infrastructure_losses()["total"] == 1


def test_a_report_for_a_pod_that_already_exited_is_judged_by_its_exit():
    world = silent_world()
    exited = world.worker(2)
    world.set_worker(2, phase="Succeeded")
    report(world, exited).step(1)
    assert world.status["restarts"]["total"] == 0


@pytest.mark.parametrize(
    "value",
    [
        "job-worker-1",
        [{"node": "w", "podUid": "u", "lastHeartbeat": "yesterday"}],
        [{"node": "w", "evil": 1}],
        [{"node": ""}],
        [{"node": "w"}] * 2000,
    ],
    ids=["not-a-list", "bad-time", "unknown-field", "empty-node", "too-long"],
)
def test_a_malformed_report_is_dropped_whole_and_named(value):
    clean, problems = agentfields.sanitize({"silentNodes": value, "step": 3})
    assert "silentNodes" not in clean and clean["step"] == 3
    assert problems and "status.silentNodes" in problems[0]


def test_a_replacement_avoids_a_node_whose_ready_turned_unknown_before_it_is_tainted():
    """The scheduler filters nodes by taints, and Kubernetes taints an unreachable node NoSchedule some moments after
    its Ready turned Unknown: a replacement created meanwhile must not go there, to be lost and replaced again."""
    world = silent_world()
    world.nodes["node-1"] = NodeView("node-1", ready=None)
    world.step(1)  # the loss: a reform without it; the lost pod is deleted, its deletion not seen yet
    world.set_worker(1, deleting_since=None)
    actions = world.step(5)
    assert [w.node_index for w in actions.create_workers] == [1]
    assert actions.create_workers[0].avoid_nodes == ("node-1",)
