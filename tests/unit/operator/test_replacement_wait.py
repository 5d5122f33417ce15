"""`spec.elastic.replacementWaitSeconds`: how long the survivors of an unplanned loss wait for the replacement, with
`auto` decided by how fast this job's pods start (pure reconcile, simulated clock)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from tests.unit.operator.world import T0, World, job_manifest

from disttrain.api.spec import DistTrainJob, ElasticSpec
from disttrain.operator import replacement, views
from disttrain.operator.observed import NodeView, PodView


def _world(wait: Any, start_s: float) -> World:
    """Three nodes running, whose pods took ``start_s`` from creation to Ready; a node's worker then fails."""
    world = World(
        job_manifest(replicas=3, min=2, elastic__replacementWaitSeconds=wait, restartPolicy__backoffSeconds=0)
    )
    world.nodes = {f"node-{i}": NodeView(f"node-{i}") for i in range(3)} | {"node-agent": NodeView("node-agent")}
    world.step()
    world.now += start_s
    world.run_all().step()
    world.progress(3, step=5).step()
    world.set_worker(1, phase="Failed", exit_code=1).step(1)
    assert world.control["action"] == "reform" and world.control["reason"] == "PodFailed"
    return world


def test_auto_waits_for_a_replacement_where_the_jobs_pods_start_in_seconds():
    world = _world("auto", start_s=1.0)
    assert world.control["targetNodes"] == 3
    world.step(2)
    assert world.control["targetNodes"] == 3, "the replacement may be Ready before a second reform would be over"
    world.run_all().step(0.5)
    assert world.control["targetNodes"] == 3, "it came in time: one reform, at the full size"


def test_auto_waits_no_longer_than_a_second_reform_would_cost():
    world = _world("auto", start_s=1.0)
    world.step(replacement.AUTO_WAIT_SECONDS)
    assert world.control["targetNodes"] == 2, "the replacement is late: the survivors go on without it"
    assert "ReplacementTimeout" in world.reasons()


def test_auto_goes_on_at_once_where_the_jobs_pods_start_slower_than_a_reform():
    world = _world("auto", start_s=8.0)
    assert world.control["targetNodes"] == 2, "no wait: training again at 2 nodes, the replacement drained in later"
    world.run_all().step(1)
    world.progress(2, step=6).step(1)
    world.step(0)
    assert world.control["action"] == "drain" and world.control["reason"] == "ScaledUp"


def test_a_number_of_seconds_is_waited_whatever_the_pods_start_time():
    world = _world(10, start_s=8.0)
    world.step(9)
    assert world.control["targetNodes"] == 3
    world.step(1)
    assert world.control["targetNodes"] == 2


def test_a_fixed_size_job_past_the_wait_sets_no_timer_that_fires_at_once():
    """min = replicas: the survivors cannot go on, so they wait for the replacement, woken by its pod's events."""
    world = World(job_manifest(replicas=3, min=3, elastic__replacementWaitSeconds=0, restartPolicy__backoffSeconds=0))
    world.nodes = {f"node-{i}": NodeView(f"node-{i}") for i in range(3)} | {"node-agent": NodeView("node-agent")}
    world.running_world(3)
    world.set_worker(1, phase="Failed", exit_code=1).step(1)
    actions = world.step(1)
    assert world.control["targetNodes"] == 3
    assert actions.requeue_after is None or actions.requeue_after > 0


def test_auto_is_the_default():
    manifest = job_manifest()
    del manifest["spec"]["elastic"]["replacementWaitSeconds"]
    assert DistTrainJob.model_validate(manifest).spec.elastic.replacement_wait_seconds == "auto"


@pytest.mark.parametrize("value", [-1, 86_401, "soon", "30", True, 1.5])
def test_a_wait_that_is_neither_seconds_nor_auto_is_refused_naming_the_field(value: Any):
    with pytest.raises(ValidationError, match="replacementWaitSeconds must be an integer from 0 to 86400 or 'auto'"):
        ElasticSpec.model_validate({"replacementWaitSeconds": value})


def test_a_pods_ready_time_is_its_ready_conditions_transition_and_only_while_ready():
    def pod(status: str) -> dict[str, Any]:
        conditions = [{"type": "Ready", "status": status, "lastTransitionTime": "2026-12-06T10:00:07Z"}]
        return {
            "metadata": {"name": "p", "creationTimestamp": "2026-12-06T10:00:00Z"},
            "status": {"conditions": conditions},
        }

    ready = views.pod_view(pod("True"))
    assert ready.ready and ready.created_at is not None and ready.ready_at == ready.created_at + 7
    assert views.pod_view(pod("False")).ready_at is None
    assert replacement.start_seconds([ready]) == 7


def test_the_start_time_is_the_newest_ready_pods():
    old = PodView("a", "1", ready=True, created_at=T0, ready_at=T0 + 60)  # the first pods pulled the image
    new = PodView("b", "2", ready=True, created_at=T0 + 100, ready_at=T0 + 101)
    pending = PodView("c", "3", created_at=T0 + 200)
    assert replacement.start_seconds([old, new, pending]) == 1
    assert replacement.start_seconds([pending]) is None
