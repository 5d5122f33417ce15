"""Hot spares (``spec.nodes.spares``): warm pods beyond the group that take a lost node's place at once.

Every decision comes from the real reconcile core; :class:`World` only applies its actions.
"""

from __future__ import annotations

import pytest
from tests.unit.operator.world import World, job_manifest

pytestmark = pytest.mark.timeout(30)


def with_spares(spares: int = 1, replicas: int = 3, **spec: object) -> World:
    return World(job_manifest(replicas=replicas, min=2, nodes__spares=spares, **spec)).running_world(replicas)


def test_a_job_runs_its_spares_beside_the_group_and_never_drains_them_in():
    world = with_spares(1)
    assert sorted(p.node_index for p in world.workers.values()) == [0, 1, 2, 3]
    for _ in range(3):
        world.step(5)
    assert world.control["targetNodes"] == 3 and world.control["action"] == "none"
    assert "ScaledUp" not in world.reasons()
    # The scale subresource and the columns count the group, not the spare.
    assert world.status["replicas"] == 3 and world.status["readyReplicas"] == 3
    assert world.condition("Scheduled")["status"] == "True"


def test_a_lost_node_is_replaced_by_the_ready_spare_and_its_replacement_comes_after_the_round():
    """The spare is already Ready, so the round completes with it; the replacement is created only once that
    round formed (as the next spare): created at once, a pod that starts fast could take the spare's place."""
    world = with_spares(1, elastic__replacementWaitSeconds=5, restartPolicy__backoffSeconds=0)
    world.set_worker(1, phase="Failed", exit_code=137).step(1)
    assert world.control["action"] == "reform" and world.control["targetNodes"] == 3
    world.finish_terminations().step(1)
    world.step(10)
    assert sorted(p.node_index for p in world.workers.values()) == [0, 2, 3], "no replacement while re-forming"
    assert world.control["targetNodes"] == 3
    assert "ReplacementTimeout" not in world.reasons()
    world.progress(3, step=6).step(1)  # survivors + the spare
    assert world.control["action"] == "none" and world.status["lastReform"]["to"] == 3
    assert world.status["restarts"]["total"] == 1
    world.step(1)
    assert sorted(p.node_index for p in world.workers.values()) == [0, 1, 2, 3]  # the replacement takes index 1


def test_a_replacement_held_for_the_spares_is_created_when_they_never_form_the_round():
    world = with_spares(1, restartPolicy__backoffSeconds=0)
    world.set_worker(1, phase="Failed", exit_code=137).step(1)
    world.finish_terminations().step(1)
    assert 1 not in {p.node_index for p in world.workers.values()}
    world.step(35)  # past replacement.SPARE_JOIN_SECONDS with no new round
    assert 1 in {p.node_index for p in world.workers.values()}


def test_without_a_spare_the_same_loss_waits_for_the_replacement_then_shrinks():
    """The contrast: no spare, the replacement never runs, so the target drops after the wait."""
    world = with_spares(0, elastic__replacementWaitSeconds=5, restartPolicy__backoffSeconds=0)
    world.set_worker(1, phase="Failed", exit_code=137).step(1)
    world.finish_terminations().step(1)
    world.step(10)
    assert world.control["targetNodes"] == 2 and "ReplacementTimeout" in world.reasons()


def test_a_scale_up_drains_the_ready_spare_in_at_once_and_starts_a_new_spare():
    world = with_spares(1, elastic__scaleDebounceSeconds=0)
    world.spec("nodes.replicas", 4).step(0)
    assert world.control["action"] == "drain" and world.control["reason"] == "ScaledUp"
    assert world.control["targetNodes"] == 4
    assert sorted(p.node_index for p in world.workers.values()) == [0, 1, 2, 3, 4]


def test_a_scale_down_with_a_spare_drains_to_the_new_size_and_keeps_one_spare():
    world = with_spares(1, elastic__scaleDebounceSeconds=0)
    world.spec("nodes.replicas", 2).step(0)
    assert world.control["action"] == "drain" and world.control["targetNodes"] == 2
    assert len(world.control["exclude"]) == 1
    world.checkpoint(6).step(1)  # the drain's checkpoint: the victim goes
    world.finish_terminations()
    world.progress(2, step=6).step(1)
    assert world.control["action"] == "none"
    assert len(world.workers) == 3 and world.status["replicas"] == 2


def test_success_does_not_wait_for_a_spare_that_never_trained():
    world = with_spares(1)
    for index in range(3):
        world.set_worker(index, phase="Succeeded", exit_code=0)
    world.progress(3, step=50, same_round=True).step(1)
    assert world.status["phase"] != "Succeeded"  # the training length (100 steps) is not reached
    world.progress(3, step=100, same_round=True).step(1)
    assert world.status["phase"] == "Succeeded"


def test_a_spare_that_is_not_ready_yet_holds_nothing_up():
    world = World(job_manifest(replicas=3, min=2, nodes__spares=1)).running_world(3)
    world.set_worker(3, ready=False).step(700)  # past pendingTimeoutSeconds
    assert world.control["targetNodes"] == 3 and world.control["action"] == "none"
    assert "PendingTimeout" not in world.reasons()


def members(world: World, *indices: int) -> World:
    """The agent's report of the pods in the running round (``status.roundMembers``)."""
    world.status["roundMembers"] = sorted(world.worker(i).name for i in indices)
    return world


def test_losing_a_spare_outside_the_round_replaces_it_without_disturbing_the_group():
    world = members(with_spares(1), 0, 1, 2)
    generation = world.control["generation"]
    spare = world.worker(3).uid
    world.set_worker(3, phase="Failed", exit_code=137).step(1)
    assert world.control["action"] == "none" and world.control["generation"] == generation
    assert "OutsideTheGroup" in world.reasons() and "Reforming" not in world.reasons()
    assert world.status["restarts"]["total"] == 1  # counted: the budget and backoff bound a crash-looping spare
    world.finish_terminations().step(6)  # after the backoff, a new spare with the same index
    assert world.worker(3).uid != spare and world.worker(3).phase == "Pending"
    assert world.control["action"] == "none" and world.status["phase"] == "Running"


def test_losing_a_member_of_the_round_reforms_with_the_spare():
    world = members(with_spares(1), 0, 1, 2)
    world.set_worker(1, phase="Failed", exit_code=137).step(1)
    assert world.control["action"] == "reform" and world.control["targetNodes"] == 3
    assert "OutsideTheGroup" not in world.reasons()


@pytest.mark.parametrize(
    "report",
    [
        None,  # no report yet (an older agent)
        ["demo-worker-0", "demo-worker-1"],  # describes another round than the 3-node group that runs
    ],
)
def test_without_a_report_that_matches_the_running_group_every_loss_reforms(report):
    world = with_spares(1)
    if report is not None:
        world.status["roundMembers"] = report
    world.set_worker(3, phase="Failed", exit_code=137).step(1)
    assert world.control["action"] == "reform"


def test_a_spare_lost_while_a_reform_is_in_flight_counts_as_a_member():
    """The round is being re-formed: the spare may be joining it, so the report is not trusted."""
    world = members(with_spares(2), 0, 1, 2)
    world.set_worker(1, phase="Failed", exit_code=137).step(1)
    generation = world.control["generation"]
    world.set_worker(4, phase="Failed", exit_code=137).step(1)
    assert world.control["action"] == "reform" and world.control["generation"] == generation + 1
