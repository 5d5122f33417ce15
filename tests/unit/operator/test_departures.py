"""Nodes that announce their end (cordon, ``kubectl drain``, scale-in and spot taints, node conditions): the worker
is drained off at a step boundary and replaced elsewhere, never charged as a restart. The real reconcile core on
the in-memory world of :mod:`tests.unit.operator.world`."""

from __future__ import annotations

import pytest
from tests.unit.operator.world import World, job_manifest

from disttrain.api.exitcodes import ExitCode
from disttrain.api.spec import DepartureSpec
from disttrain.operator import departures, views
from disttrain.operator.observed import NodeView

pytestmark = pytest.mark.timeout(30)


def running(**spec) -> World:
    world = World(job_manifest(replicas=2, **spec))
    world.nodes = {name: NodeView(name) for name in ("node-0", "node-1", "node-agent", "node-spare")}
    return world.running_world(2)


def assert_drained_off_node_1(world: World, reason: str = "NodeDeparting") -> None:
    """The departure of worker 1: a drain at 1 node excluding it, a replacement off node-1, nothing charged."""
    assert world.control["action"] == "drain" and world.control["reason"] == reason
    assert world.control["exclude"] == ["demo-worker-1"] and world.control["targetNodes"] == 1
    assert world.status["restarts"]["total"] == 0
    assert "NodeDeparting" in world.reasons() and "NodeLost" not in world.reasons()
    (replacement,) = world.last.create_workers
    assert replacement.node_index == 1, "the replacement takes the leaving node's index, hence its ranks"
    assert "node-1" in replacement.avoid_nodes


def test_a_cordoned_workers_node_drains_it_at_a_checkpoint_and_the_job_grows_back():
    world = running()
    world.nodes["node-1"] = NodeView("node-1", unschedulable=True)
    actions = world.step(1)
    assert actions.delete_pods == (), "the leaving worker stays until the drain's checkpoint"
    assert_drained_off_node_1(world)
    world.step(5)
    assert "demo-worker-1" in world.workers, "no checkpoint yet: still draining"
    world.checkpoint(6)
    assert [d.name for d in world.step(1).delete_pods] == ["demo-worker-1"]
    world.finish_terminations().progress(1, step=7).step(1)
    assert world.control["action"] == "none" and world.status["phase"] == "Running"
    # Capacity returns: the replacement runs, and a ScaledUp drain grows the group back to 2 nodes.
    world.set_worker(1, phase="Running", ready=True, node_name="node-spare").step(1)  # the scheduler avoids node-1
    assert world.control["action"] == "drain" and world.control["reason"] == "ScaledUp"
    world.checkpoint(8).progress(2, step=9).step(1)
    assert world.status["worldSize"] == 2 and world.status["restarts"]["total"] == 0


@pytest.mark.parametrize(
    "node, rule",
    [
        (NodeView("node-1", taints=frozenset({"ToBeDeletedByClusterAutoscaler"})), {}),
        (NodeView("node-1", taints=frozenset({"karpenter.sh/disrupted"})), {}),
        (NodeView("node-1", conditions=frozenset({"TerminationScheduled"})), {"conditions": ["TerminationScheduled"]}),
        (NodeView("node-1", taints=frozenset({"example.com/spot-notice"})), {"taints": ["example.com/spot-notice"]}),
        (NodeView("node-1", unschedulable=True, draining=True), {}),
    ],
    ids=["autoscaler-scale-in", "karpenter", "configured-condition", "configured-taint", "cordoned-and-tainted"],
)
def test_announced_ends_drain_the_worker_off_its_node(node, rule):
    world = running(elastic__departure=rule) if rule else running()
    world.nodes["node-1"] = node
    world.step(1)
    assert_drained_off_node_1(world)


@pytest.mark.parametrize(
    "node, rule",
    [
        (NodeView("node-1", unschedulable=True), {"onCordon": False}),
        (NodeView("node-1", taints=frozenset({"ToBeDeletedByClusterAutoscaler"})), {"taints": []}),
        (NodeView("node-1", conditions=frozenset({"TerminationScheduled"})), {}),
    ],
    ids=["cordon-ignored", "taints-replaced", "condition-not-configured"],
)
def test_signals_the_spec_does_not_name_change_nothing(node, rule):
    world = running(elastic__departure=rule)
    world.nodes["node-1"] = node
    actions = world.step(1)
    assert world.control["action"] == "none" and actions.delete_pods == () and actions.create_workers == ()


def test_an_evicted_worker_on_a_cordoned_node_is_a_departure_not_a_restart():
    """``kubectl drain`` cordons and evicts at once: the operator may first see the pod already Terminating."""
    world = running()
    world.nodes["node-1"] = NodeView("node-1", unschedulable=True)
    world.set_worker(1, deleting_since=world.now)
    world.step(1)
    assert_drained_off_node_1(world)
    world.vanish(1).step(1)  # it drained on its SIGTERM and its deletion completed
    world.checkpoint(6).progress(1, step=7).step(1)
    assert world.status["restarts"]["total"] == 0 and world.status["phase"] == "Running"


def test_a_worker_that_drained_on_its_own_sigterm_is_not_a_restart():
    """Graceful node shutdown: the kubelet SIGTERMs the pod, the trainer checkpoints and exits DRAINED."""
    world = running()
    world.set_worker(1, phase="Failed", exit_code=int(ExitCode.DRAINED), reason="Shutdown").step(1)
    assert world.status["restarts"]["total"] == 0
    assert any("SIGTERM of its own (Shutdown)" in message for _, message in world.events)


def test_a_departing_node_that_dies_first_is_a_loss():
    world = running()
    world.nodes["node-1"] = NodeView("node-1", ready=False, unschedulable=True)
    world.step(1)
    assert world.infrastructure_losses()["byReason"] == {"NodeNotReady": 1}
    assert world.status["restarts"]["total"] == 0
    assert world.control["action"] == "reform"


def test_a_departure_during_a_reform_joins_its_exclusions_uncharged():
    world = World(job_manifest(replicas=3))
    world.nodes = {name: NodeView(name) for name in ("node-0", "node-1", "node-2", "node-agent")}
    world.running_world(3)
    world.set_worker(2, phase="Failed", exit_code=1).step(1)
    assert world.control["action"] == "reform" and world.status["restarts"]["total"] == 1
    world.nodes["node-1"] = NodeView("node-1", unschedulable=True)
    actions = world.step(1)
    assert "demo-worker-1" in world.control["exclude"]
    assert "demo-worker-1" in {d.name for d in actions.delete_pods}, "a reform's group re-forms without it at once"
    assert world.status["restarts"]["total"] == 1


def test_node_views_carry_taints_and_true_conditions():
    node = views.node_view(
        {
            "metadata": {"name": "n"},
            "spec": {
                "unschedulable": True,
                "taints": [
                    {"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"},
                    {"key": "DeletionCandidateOfClusterAutoscaler", "effect": "PreferNoSchedule"},
                ],
            },
            "status": {
                "conditions": [
                    {"type": "Ready", "status": "True"},
                    {"type": "TerminationScheduled", "status": "True"},
                    {"type": "MemoryPressure", "status": "False"},
                ]
            },
        }
    )
    assert node.taints == {"ToBeDeletedByClusterAutoscaler"}, "a PreferNoSchedule hint announces nothing"
    assert node.conditions == {"TerminationScheduled"} and node.ready and node.unschedulable
    assert departures.node_departure(node, DepartureSpec()) == "cordoned"
    assert departures.node_departure(node, DepartureSpec(on_cordon=False)) == "taint ToBeDeletedByClusterAutoscaler"
