"""Reconcile policy for a node the job agent reports behind a stalled step (status.stalledNodes): evicted as a lost
node (fenced, deleted, replaced, the group re-formed), named in a StepStalled Event, one incident, one stall counted."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from tests.unit.operator.world import World, job_manifest

from disttrain.operator import agentfields
from disttrain.operator.metrics import OperatorMetrics
from disttrain.operator.observed import NodeView

pytestmark = pytest.mark.timeout(30)
DUMPS = "/ckpt/default/demo/diagnostics/demo-worker-1/stall-7-rank*"


def stalled_world() -> World:
    world = World(job_manifest(replicas=3, min=2))
    world.nodes = {f"node-{i}": NodeView(f"node-{i}") for i in range(3)} | {"node-agent": NodeView("node-agent")}
    return world.running_world(3)


def report(world: World, *pods, step: int = 7) -> World:
    world.status["stalledNodes"] = [
        {
            "node": p.name,
            "podUid": p.uid,
            "ranks": [p.node_index],
            "step": step,
            "waitedSeconds": 12.5,
            "diagnostics": DUMPS,
        }
        for p in pods
    ]
    return world


def test_a_stalled_node_is_named_evicted_and_replaced_and_the_group_reforms():
    world = stalled_world()
    lagging = world.worker(1)
    actions = report(world, lagging).step(1)
    world.assert_reformed_without(actions, lagging, "StepStalled")
    [message] = [m for r, m in world.events if r == "StepStalled"]
    assert f"node {lagging.name}" in message and "rank(s) 1" in message and "step 7" in message
    assert "waited 12 s" in message and DUMPS in message
    assert world.status["lastFailure"] == message
    assert world.status["stalls"] == 1
    world.status["stalledNodes"] = []
    actions = world.step(5)  # after the restart backoff
    assert [w.node_index for w in actions.create_workers] == [1], "a replacement with the stalled node's index"
    assert world.status["restarts"] == {"total": 1, "byReason": {"StepStalled": 1}}


def test_repeated_reports_count_one_stall_and_one_restart():
    world = stalled_world()
    lagging = world.worker(1)
    report(world, lagging).step(1)
    generation = world.control["generation"]
    world.step(1)
    world.step(1)
    assert world.status["stalls"] == 1
    assert world.status["restarts"] == {"total": 1, "byReason": {"StepStalled": 1}}
    assert world.control["generation"] == generation, "no second directive for the same stall"


def test_a_stale_report_does_not_touch_the_replacement_of_the_same_name():
    world = stalled_world()
    lagging = world.worker(1)
    report(world, lagging).step(1)
    world.status["stalledNodes"] = []
    world.finish_terminations().step(5)
    replacement = world.worker(1)
    assert replacement.name == lagging.name and replacement.uid != lagging.uid
    world.run_all()
    report(world, lagging)
    actions = world.step(1)
    assert replacement.name not in [d.name for d in actions.delete_pods]
    assert world.status["stalls"] == 1


def test_an_unusable_stall_report_is_dropped_whole():
    status = {"stalledNodes": [{"node": "demo-worker-1", "ranks": "one"}]}
    clean, problems = agentfields.sanitize(status)
    assert "stalledNodes" not in clean and problems and problems[0].startswith("status.stalledNodes")


def test_the_stall_counter_follows_status_stalls():
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    labels = {"namespace": "team-a", "job": "demo"}
    metrics.observe_job("team-a", "demo", {"phase": "Running"}, now=1)
    assert registry.get_sample_value("disttrain_stalls_total", labels) == 0, "the series exists from the first sight"
    metrics.observe_job("team-a", "demo", {"phase": "Reforming", "stalls": 1}, now=2)
    metrics.observe_job("team-a", "demo", {"phase": "Running", "stalls": 1}, now=3)
    assert registry.get_sample_value("disttrain_stalls_total", labels) == 1
    metrics.forget_job("team-a", "demo")
    assert registry.get_sample_value("disttrain_stalls_total", labels) is None
