"""One incident, one charge: failure accounting of the reconcile core.

A node that dies mid-collective takes every survivor's workers with it (NCCL's watchdog aborts them: SIGABRT, exit
134); a bug at start fails every node at once. Each is one incident, charged once (a node's loss as an
infrastructure loss, the user's crash as a restart), and the budget counts only restarts that happened. Every
decision comes from the real core; :class:`World` only applies its actions.
"""

from __future__ import annotations

import pytest
from tests.unit.operator.world import World, job_manifest

from disttrain.api import nameset
from disttrain.operator import losses
from disttrain.operator.observed import NodeView, PodView

pytestmark = pytest.mark.timeout(30)

SIGABRT = 134
NO_RESTART = {"total": 0, "byReason": {}}
WATCHDOG = "worker rank 3 failed with signal SIGABRT (exit code 134)"


def eight_nodes(**spec: object) -> World:
    """A running group of 8 nodes (world sizes dividing 8 are valid), each pod on node-<index>."""
    world = World(job_manifest(min=1, max=8, replicas=8, training__globalBatchSize=16, **spec))
    world.nodes = {f"node-{i}": NodeView(f"node-{i}") for i in range(8)} | {"node-agent": NodeView("node-agent")}
    return world.running_world(8)


def abort_survivors(world: World, lost: int) -> None:
    for index in range(8):
        if index != lost:
            world.set_worker(index, phase="Failed", exit_code=SIGABRT, termination_message=WATCHDOG)


def reasons_of(world: World, reason: str) -> list[str]:
    return [message for r, message in world.events if r == reason]


@pytest.mark.parametrize(
    "pod, expected",
    [
        (PodView("p", "u", 0, "Failed", exit_code=SIGABRT), True),
        (PodView("p", "u", 0, "Failed", exit_code=84), True),
        (
            PodView("p", "u", 0, "Failed", exit_code=1, termination_message="torch.distributed.DistBackendError: NCCL"),
            True,
        ),
        (
            PodView(
                "p", "u", 0, "Failed", exit_code=1, termination_message="Watchdog caught collective operation timeout"
            ),
            True,
        ),
        (
            PodView("p", "u", 0, "Failed", exit_code=3, termination_message="worker rank 0 failed with exit code 3"),
            False,
        ),
        (PodView("p", "u", 0, "Failed", exit_code=137), False),
        (PodView("p", "u", 0, "Running", True, "ok"), False),
    ],
    ids=["sigabrt", "reform-exit", "nccl-error", "collective-timeout", "exit-3", "sigkill", "running"],
)
def test_exits_a_peers_loss_explains(pod, expected):
    assert losses.is_peer_loss_exit(pod) is expected


def test_a_lost_node_then_seven_watchdog_aborts_is_one_infrastructure_loss():
    world = eight_nodes()
    world.nodes["node-3"] = NodeView("node-3", ready=False)
    world.step(1)
    assert world.infrastructure_losses() == {"total": 1, "byReason": {"NodeNotReady": 1}}
    assert world.status["restarts"] == NO_RESTART
    assert (
        world.status["incident"]["reason"] == "NodeNotReady" and world.status["incident"]["firstPod"] == "demo-worker-3"
    )
    abort_survivors(world, lost=3)
    actions = world.step(1)
    assert world.infrastructure_losses() == {"total": 1, "byReason": {"NodeNotReady": 1}}
    assert world.status["restarts"] == NO_RESTART
    assert len(reasons_of(world, "PartOfIncident")) == 7
    assert reasons_of(world, "NodeLost") and not reasons_of(world, "PodFailed")
    assert {d.name for d in actions.delete_pods} >= {f"demo-worker-{i}" for i in range(8) if i != 3}, "all replaced"
    assert world.status["phase"] != "Failed"


def test_watchdog_aborts_seen_before_the_dead_node_open_the_incident_as_a_node_loss():
    """Kubernetes marks the node NotReady 40 s after the survivors aborted: the aborts are the first sign."""
    world = eight_nodes(restartPolicy__maxRestarts=1)
    abort_survivors(world, lost=3)
    world.step(1)
    assert world.infrastructure_losses() == {"total": 1, "byReason": {"NodeLost": 1}}
    assert world.status["restarts"] == NO_RESTART
    assert world.control["action"] == "reform" and world.control["reason"] == "NodeLost"
    assert len(reasons_of(world, "NodeLost")) == 1 and len(reasons_of(world, "PartOfIncident")) == 6
    world.nodes["node-3"] = NodeView("node-3", ready=False)
    world.step(40)
    assert world.infrastructure_losses()["total"] == 1 and world.status["phase"] != "Failed"
    assert world.status["restarts"] == NO_RESTART
    assert "demo-worker-3" in nameset.unpack(world.status["incident"]["folded"])
    assert len(reasons_of(world, "PartOfIncident")) == 7


def test_the_dead_node_seen_with_its_peers_aborts_names_the_incident():
    world = eight_nodes()
    world.nodes["node-5"] = NodeView("node-5", ready=None)
    abort_survivors(world, lost=5)
    world.step(1)
    assert world.infrastructure_losses() == {"total": 1, "byReason": {"NodeUnreachable": 1}}
    assert world.status["restarts"] == NO_RESTART
    assert world.status["incident"]["firstPod"] == "demo-worker-5"


def test_a_crash_loop_on_every_node_is_charged_once_per_retry_that_happened():
    """Exit 3 at start on 3 nodes, maxRestarts 2: two retries happen, two restarts are charged, and the failure
    that finds the budget spent fails the job with a final, true status."""
    world = World(job_manifest(replicas=3, restartPolicy__maxRestarts=2, restartPolicy__backoffSeconds=5))
    world.step()
    world.run_all().step(1)
    crash = "worker rank 0 failed with exit code 3"
    retries = 0
    for _ in range(3):
        for index in range(3):
            world.set_worker(index, phase="Failed", exit_code=3, termination_message=crash)
            world.step(0.5)
        if world.status["phase"] == "Failed":
            break
        world.finish_terminations()
        created = world.step(60).create_workers
        assert len(created) == 3
        retries += 1
        world.run_all().step(1)
    assert world.status["phase"] == "Failed"
    assert retries == 2 and world.status["restarts"] == {"total": 2, "byReason": {"PodFailed": 2}}
    assert "NodeLost" not in world.reasons() and len(reasons_of(world, "PodFailed")) == 3
    assert "nextRestartTime" not in world.status and "incident" not in world.status
    conditions = {c["type"]: c for c in world.status["conditions"]}
    assert conditions["Failed"]["status"] == "True" and conditions["Failed"]["reason"] == "RestartBudgetExhausted"
    assert conditions["Running"]["status"] == "False" and conditions["Running"]["reason"] == "RestartBudgetExhausted"
    assert (
        conditions["Scheduled"]["status"] == "False" and conditions["Scheduled"]["reason"] == "RestartBudgetExhausted"
    )
    assert "waiting" not in conditions["Scheduled"]["message"]
    assert "exit code 3" in conditions["Failed"]["message"]
    final = dict(world.status)
    world.step(60)
    assert world.status == final, "a Failed job's status does not change"


def test_a_second_incident_after_the_group_ran_again_is_charged_again():
    world = eight_nodes(restartPolicy__backoffSeconds=0)
    world.nodes["node-3"] = NodeView("node-3", ready=False)
    world.step(1)
    abort_survivors(world, lost=3)
    world.step(1)
    world.nodes["node-3"] = NodeView("node-3")
    world.finish_terminations().step(1)
    world.run_all().step(1)
    world.progress(8, step=6).step(1)
    assert world.status["phase"] == "Running" and "incident" not in world.status
    assert world.infrastructure_losses()["total"] == 1
    world.set_worker(2, phase="Failed", exit_code=1).step(1)
    assert world.status["restarts"] == {"total": 1, "byReason": {"PodFailed": 1}}
    assert world.infrastructure_losses() == {"total": 1, "byReason": {"NodeNotReady": 1}}
    assert world.status["incident"]["reason"] == "PodFailed"


def test_a_replacement_that_takes_a_covered_name_and_fails_is_a_new_incident():
    """The lost pod is gone before its backoff ends, so its replacement is created under the same name."""
    world = World(job_manifest(replicas=2, restartPolicy__backoffSeconds=5)).running_world(2)
    world.set_worker(1, phase="Failed", exit_code=1).step(1)
    assert "demo-worker-1" not in world.workers
    world.step(5)
    assert "demo-worker-1" in world.workers
    assert nameset.unpack(world.status["incident"]["covers"]) == {"demo-worker-0"}
    world.run_all().set_worker(1, phase="Failed", exit_code=1).step(1)
    assert world.status["restarts"] == {"total": 2, "byReason": {"PodFailed": 2}}


def test_a_permanent_exit_code_inside_an_incident_still_fails_the_job_at_once():
    world = World(job_manifest(replicas=3, restartPolicy__exitCodes={"permanent": [85]})).running_world(3)
    world.set_worker(0, phase="Failed", exit_code=1).step(1)
    world.set_worker(2, phase="Failed", exit_code=85).step(1)
    assert world.status["phase"] == "Failed" and world.condition("Failed")["reason"] == "PermanentExitCode"
    assert world.status["restarts"]["total"] == 1
