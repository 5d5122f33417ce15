"""The restart budget is for the job's own failures: losses of infrastructure are counted apart
(``status.infrastructureLosses``) and bounded per hour (``restartPolicy.maxInfrastructureLossesPerHour``). The
real reconcile core on the in-memory world of :mod:`tests.unit.operator.world`, and the window's pure logic."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from tests.unit.operator.world import World, job_manifest

from disttrain.api.conditions import Reason
from disttrain.api.spec import DistTrainJob
from disttrain.api.status import DistTrainJobStatus, InfrastructureLossCounts
from disttrain.operator import infralosses
from disttrain.operator.observed import NodeView

pytestmark = pytest.mark.timeout(30)

NO_RESTART = {"total": 0, "byReason": {}}
SIGABRT = 134
WATCHDOG = "worker rank 3 failed with signal SIGABRT (exit code 134)"


def three_nodes(**spec: object) -> World:
    world = World(job_manifest(min=1, max=3, replicas=3, restartPolicy__backoffSeconds=0, **spec))
    world.nodes = {f"node-{i}": NodeView(f"node-{i}") for i in range(3)} | {"node-agent": NodeView("node-agent")}
    return world.running_world(3)


def lose_node_and_recover(world: World, index: int, step: int, pause: float = 1.0) -> None:
    """Node-<index> goes NotReady, its pod is replaced, the node comes back and the group of 3 trains again."""
    world.step(pause)
    world.nodes[f"node-{index}"] = NodeView(f"node-{index}", ready=False)
    world.step(1)
    world.finish_terminations()
    world.nodes[f"node-{index}"] = NodeView(f"node-{index}")
    world.step(1)
    world.run_all().step(1)
    world.progress(3, step=step).step(1)


@pytest.mark.parametrize(
    "cause, infrastructure",
    [
        (Reason.NODE_NOT_READY, True),
        (Reason.NODE_UNREACHABLE, True),
        (Reason.NODE_DELETED, True),
        (Reason.NODE_DRAINING, True),
        (Reason.HEARTBEAT_LOST, True),
        (Reason.NODE_LOST, True),
        (Reason.EVICTED, True),
        (Reason.POD_DELETED, True),
        (Reason.NODE_DEPARTING, True),
        (Reason.AGENT_RESTARTED, True),
        (Reason.POD_FAILED, False),
        (Reason.STEP_STALLED, False),
    ],
    ids=lambda v: v.value if isinstance(v, Reason) else str(v),
)
def test_which_causes_are_the_clusters(cause, infrastructure):
    assert infralosses.is_infrastructure_cause(cause) is infrastructure


def test_the_window_keeps_the_last_hours_losses_oldest_first():
    now = 10_000.0
    assert infralosses.within_window([now - 3_600, now - 10, now - 3_599, now], now) == [now - 3_599, now - 10, now]


def test_a_loss_counted_and_taken_back():
    counts = InfrastructureLossCounts(recent=[1.0])
    infralosses.add_loss(counts, Reason.NODE_NOT_READY, 5_000.0)
    assert (counts.total, counts.by_reason, counts.recent) == (1, {"NodeNotReady": 1}, [5_000.0])
    infralosses.add_loss(counts, Reason.NODE_NOT_READY, 5_001.0)
    infralosses.remove_loss(counts, "NodeNotReady", 5_001.0)
    assert (counts.total, counts.by_reason, counts.recent) == (1, {"NodeNotReady": 1}, [5_000.0])
    infralosses.remove_loss(counts, "NodeNotReady", 5_000.0)
    assert (counts.total, counts.by_reason, counts.recent) == (0, {}, [])


def test_the_window_survives_the_status_round_trip():
    """The operator keeps no memory of its own: the loss times come back from the stored status."""
    status = DistTrainJobStatus()
    infralosses.add_loss(status.infrastructure_losses, Reason.HEARTBEAT_LOST, 1_700_000_000.25)
    wire = status.model_dump(by_alias=True, mode="json", exclude_none=True)
    assert wire["infrastructureLosses"]["recent"] == ["2023-11-14T22:13:20.250Z"]
    assert DistTrainJobStatus.model_validate(wire).infrastructure_losses.recent == [1_700_000_000.25]


@pytest.mark.parametrize("value", [0, -1, 1_001, "many"])
def test_the_guard_is_refused_out_of_range(value):
    manifest = job_manifest(restartPolicy__maxInfrastructureLossesPerHour=value)
    with pytest.raises(ValidationError, match="maxInfrastructureLossesPerHour"):
        DistTrainJob.model_validate(manifest)


def test_eleven_node_losses_with_max_restarts_10_keep_the_job_training():
    world = three_nodes(restartPolicy__maxRestarts=10)
    for loss in range(11):
        lose_node_and_recover(world, index=loss % 3, step=10 + loss)
        assert world.status["phase"] == "Running", world.status.get("message")
    assert world.status["restarts"] == NO_RESTART
    assert world.infrastructure_losses() == {"total": 11, "byReason": {"NodeNotReady": 11}}
    assert len(world.status["infrastructureLosses"]["recent"]) == 11
    assert world.reasons().count("NodeLost") == 11


def test_a_job_waiting_after_a_node_loss_names_the_hourly_limit_not_the_restart_budget():
    world = World(job_manifest(min=1, max=1, replicas=1, restartPolicy__backoffSeconds=60))
    world.nodes = {"node-0": NodeView("node-0"), "node-agent": NodeView("node-agent")}
    world.step()
    world.run_all().step(1)  # the pods run, no group formed yet
    world.nodes["node-0"] = NodeView("node-0", ready=False)
    world.step(1)
    world.finish_terminations().step(1)
    assert world.status["phase"] == "Pending", world.status["message"]
    assert "1 of spec.restartPolicy.maxInfrastructureLossesPerHour=20" in world.status["message"]
    assert "NodeNotReady of demo-worker-0 (no restart charged)" in world.status["message"]
    assert "restarts used" not in world.status["message"]


def test_more_losses_within_an_hour_than_the_guard_fail_the_job():
    world = three_nodes(restartPolicy__maxInfrastructureLossesPerHour=3)
    for loss in range(3):
        lose_node_and_recover(world, index=loss, step=10 + loss)
    assert world.status["phase"] == "Running" and world.infrastructure_losses()["total"] == 3
    world.nodes["node-0"] = NodeView("node-0", ready=False)
    world.step(1)
    failed = world.condition("Failed")
    assert world.status["phase"] == "Failed" and failed["reason"] == "InfrastructureLossesExceeded"
    assert "maxInfrastructureLossesPerHour=3" in failed["message"] and "node-0" in failed["message"]
    assert world.infrastructure_losses()["total"] == 3, "the loss that failed the job is not counted"
    assert world.status["restarts"] == NO_RESTART and "incident" not in world.status


def test_losses_older_than_an_hour_leave_the_window():
    world = three_nodes(restartPolicy__maxInfrastructureLossesPerHour=2)
    lose_node_and_recover(world, index=0, step=10)
    lose_node_and_recover(world, index=1, step=11)
    lose_node_and_recover(world, index=2, step=12, pause=infralosses.WINDOW_SECONDS)
    assert world.status["phase"] == "Running"
    assert world.infrastructure_losses()["total"] == 3 and len(world.status["infrastructureLosses"]["recent"]) == 1


def test_the_users_crash_still_spends_the_restart_budget():
    world = three_nodes(restartPolicy__maxRestarts=1)
    world.set_worker(1, phase="Failed", exit_code=3).step(1)
    assert world.status["restarts"] == {"total": 1, "byReason": {"PodFailed": 1}}
    assert world.infrastructure_losses()["total"] == 0
    world.finish_terminations().step(1)
    world.run_all().step(1)
    world.progress(3, step=9).step(1)
    world.set_worker(2, phase="Failed", exit_code=3).step(1)
    assert world.condition("Failed")["reason"] == "RestartBudgetExhausted"


def test_a_crash_whose_peers_aborted_first_is_charged_as_a_restart():
    """The survivors' watchdog aborts are seen before the crashed pod's own exit: the incident opens as a node loss,
    and the crash, folded in, makes it the user's. A crash loop cannot hide behind its peers' aborts."""
    world = three_nodes()
    for index in (0, 2):
        world.set_worker(index, phase="Failed", exit_code=SIGABRT, termination_message=WATCHDOG)
    world.step(1)
    assert world.infrastructure_losses() == {"total": 1, "byReason": {"NodeLost": 1}}
    world.set_worker(1, phase="Failed", exit_code=3, termination_message="ValueError: bad batch").step(1)
    assert world.status["restarts"] == {"total": 1, "byReason": {"PodFailed": 1}}
    assert world.infrastructure_losses()["total"] == 0 and world.status["infrastructureLosses"]["recent"] == []
    assert world.status["incident"]["reason"] == "PodFailed" and not world.status["incident"].get("infrastructure")
    assert "bad batch" in world.status["lastFailure"]


def test_a_crash_folded_into_a_node_loss_meets_a_spent_budget():
    world = three_nodes(restartPolicy__maxRestarts=0)
    for index in (0, 2):
        world.set_worker(index, phase="Failed", exit_code=SIGABRT, termination_message=WATCHDOG)
    world.step(1)
    assert world.status["phase"] != "Failed"
    world.set_worker(1, phase="Failed", exit_code=3).step(1)
    assert world.condition("Failed")["reason"] == "RestartBudgetExhausted"


def test_a_departure_or_an_agent_loss_past_the_guard_fails_the_job_and_creates_nothing():
    world = three_nodes(restartPolicy__maxInfrastructureLossesPerHour=1)
    world.nodes["node-1"] = NodeView("node-1", unschedulable=True)
    actions = world.step(1)
    assert actions.create_workers, "the first departure is tolerated: its replacement is created at once"
    world.nodes["node-2"] = NodeView("node-2", unschedulable=True)
    actions = world.step(1)
    assert world.condition("Failed")["reason"] == "InfrastructureLossesExceeded"
    assert actions.create_workers == () and "demo-agent" in {d.name for d in actions.delete_pods}

    world = three_nodes(restartPolicy__maxInfrastructureLossesPerHour=1)
    lose_node_and_recover(world, index=0, step=10)
    world.agent = None
    actions = world.step(1)
    assert world.condition("Failed")["reason"] == "InfrastructureLossesExceeded"
    assert "job agent pod demo-agent was lost" in world.condition("Failed")["message"]
    assert not actions.create_agent and actions.create_workers == ()


def test_a_departing_node_and_a_lost_agent_are_infrastructure_losses():
    world = three_nodes()
    world.nodes["node-1"] = NodeView("node-1", unschedulable=True)
    world.step(1)
    world.step(1)
    assert world.infrastructure_losses() == {"total": 1, "byReason": {"NodeDeparting": 1}}, "counted once"
    world.agent = None
    world.step(1)
    assert world.infrastructure_losses() == {"total": 2, "byReason": {"NodeDeparting": 1, "AgentRestarted": 1}}
    assert world.status["restarts"] == NO_RESTART
