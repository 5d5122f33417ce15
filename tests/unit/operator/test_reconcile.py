"""Reconcile policy matrix: every policy of the core, and each anchor failure mode by name.

Anchors (the failures other operators are known for, which must not happen here):
  kubeflow#1638 deleting one worker restarts every pod / crash-loops
  kubeflow#1509 a scale-down restarts the survivors
  kubeflow#1751 a pod stuck Pending leaves the job "Running" forever
  kubeflow#2072 a dead node leaves a pod Terminating forever and the job "Restarting" forever
  elastic#115   deleting the pod that hosts the rendezvous store hangs training forever
  pytorch#111646 survivors of a scale-down hang in collectives until the 30-minute timeout
  "any worker succeeded" is not success
"""

from __future__ import annotations

import dataclasses

import pytest
from tests.unit.operator.world import T0, World, job_manifest

from disttrain.api import conditions as cond
from disttrain.api.spec import DistTrainJob
from disttrain.api.status import DistTrainJobStatus, Incident
from disttrain.operator import losses, names, patches, sizing
from disttrain.operator import reconcile as core
from disttrain.operator.observed import NodeView, Observed, PodView

pytestmark = pytest.mark.timeout(30)


def spec_of(**kw):
    return DistTrainJob.model_validate(job_manifest(**kw)).spec


def created(actions) -> list[int]:
    """Node indices of the worker pods an action set creates."""
    return [w.node_index for w in actions.create_workers]


# ---------------------------------------------------------------------------------------------- small policies


@pytest.mark.parametrize(
    "requested, expected", [(0, 1), (1, 1), (3, 3), (9, 4)], ids=["below-min", "min", "inside", "above-max"]
)
def test_clamp_limits_requests_to_min_max(requested, expected):
    assert sizing.clamp_nodes(spec_of(min=1, max=4, replicas=2), requested) == expected


@pytest.mark.parametrize(
    "count, allow_up, expected",
    [
        (3, True, 2),
        (4, True, 4),
        (1, True, 1),
        (3, False, 2),
        (0, False, None),
        (0, True, 1),
    ],
    ids=["3-invalid-snaps-down", "4-valid", "1-valid", "survivors-3-to-2", "none-below", "zero-snaps-up"],
)
def test_snap_to_valid_uses_the_batch_contract(count, allow_up, expected):
    # globalBatch 16, micro 2: world sizes dividing 8 -> node counts 1, 2, 4 are valid, 3 is not.
    spec = spec_of(min=1, max=4, replicas=2, training__globalBatchSize=16)
    assert sizing.snap_to_valid(spec, count, allow_up=allow_up) == expected


@pytest.mark.parametrize(
    "current, requested, pending, now, expected_desired, expected_pending",
    [
        (2, 2, None, T0, 2, None),
        (0, 3, None, T0, 3, None),
        (2, 3, None, T0, 2, {"replicas": 3, "since": cond.format_time(T0)}),
        (
            2,
            3,
            {"replicas": 3, "since": cond.format_time(T0)},
            T0 + 5,
            2,
            {"replicas": 3, "since": cond.format_time(T0)},
        ),
        (2, 3, {"replicas": 3, "since": cond.format_time(T0)}, T0 + 10, 3, None),
        (
            2,
            4,
            {"replicas": 3, "since": cond.format_time(T0)},
            T0 + 10,
            2,
            {"replicas": 4, "since": cond.format_time(T0 + 10)},
        ),
        (2, 2, {"replicas": 3, "since": cond.format_time(T0)}, T0 + 10, 2, None),
    ],
    ids=[
        "no-change",
        "first-size-immediate",
        "new-request-waits",
        "still-waiting",
        "stood-long-enough",
        "flapping-restarts-the-wait",
        "request-withdrawn",
    ],
)
def test_debounce(current, requested, pending, now, expected_desired, expected_pending):
    assert sizing.debounce_scale(current, requested, pending, 10, now) == (expected_desired, expected_pending)


NODES = {
    "ok": NodeView("ok"),
    "notready": NodeView("notready", ready=False),
    "unknown": NodeView("unknown", ready=None),
    "cordoned": NodeView("cordoned", unschedulable=True),
    "draining": NodeView("draining", unschedulable=True, draining=True),
}


@pytest.mark.parametrize(
    "pod, expected",
    [
        (PodView("p", "u", 0, "Running", True, "ok"), None),
        (PodView("p", "u", 0, "Pending"), None),
        (PodView("p", "u", 0, "Succeeded", node_name="ok"), None),
        (PodView("p", "u", 0, "Failed", node_name="ok", exit_code=1), "PodFailed"),
        (PodView("p", "u", 0, "Failed", node_name="ok", reason="Evicted"), "Evicted"),
        (PodView("p", "u", 0, "Running", True, "ok", deleting_since=T0), "PodDeleted"),
        (PodView("p", "u", 0, "Unknown", node_name="ok"), "NodeUnreachable"),
        (PodView("p", "u", 0, "Running", True, "notready"), "NodeNotReady"),
        (PodView("p", "u", 0, "Running", True, "unknown"), "NodeUnreachable"),
        (PodView("p", "u", 0, "Running", True, "gone"), "NodeDeleted"),
        (PodView("p", "u", 0, "Running", True, "cordoned"), None),
        (PodView("p", "u", 0, "Running", True, "draining"), "NodeDraining"),
    ],
    ids=[
        "healthy",
        "pending",
        "succeeded",
        "failed",
        "evicted",
        "deleted",
        "phase-unknown",
        "node-notready",
        "node-unreachable",
        "node-deleted",
        "cordoned-only-is-fine",
        "cordoned-and-draining",
    ],
)
def test_lost_pod_detection(pod, expected):
    reason = losses.loss_reason(pod, NODES)
    assert (reason.value if reason else None) == expected


def test_pods_are_not_judged_by_nodes_the_operator_cannot_see():
    assert losses.loss_reason(PodView("p", "u", 0, "Running", True, "gone"), None) is None


@pytest.mark.parametrize(
    "failures, expected",
    [(0, 0), (1, 5), (2, 10), (3, 20), (10, 60)],
    ids=["none", "first", "doubles", "doubles-again", "capped"],
)
def test_backoff_doubles_and_is_capped(failures, expected):
    assert sizing.backoff_seconds(spec_of(), failures) == expected


@pytest.mark.parametrize(
    "code, permanent, retryable, expected",
    [
        (85, [85], [], True),
        (1, [85], [], False),
        (85, [85], [85], False),
        (None, [85], [], False),
        (3, [3, 85], [], True),
    ],
    ids=["default-permanent", "generic-error-retried", "retryable-wins", "no-code", "user-listed"],
)
def test_exit_code_classes(code, permanent, retryable, expected):
    spec = spec_of(restartPolicy__exitCodes={"permanent": permanent, "retryable": retryable})
    assert losses.is_permanent_exit(spec, code) is expected


def test_victims_prefer_pods_that_are_not_running_then_the_highest_index():
    pods = [
        PodView("w0", "a", 0, "Running", True),
        PodView("w1", "b", 1, "Running", True),
        PodView("w2", "c", 2, "Pending"),
        PodView("w3", "d", 3, "Running", True),
    ]
    assert [p.name for p in sizing.choose_victims(pods, 2)] == ["w2", "w3"]


@pytest.mark.parametrize(
    "lost, expected",
    [
        (PodView("w1", "b", 1, "Running", deleting_since=T0), [1, 2]),
        (PodView("w1", "b", 1, "Failed"), [1, 2]),
        (PodView("w1", "b", 1, "Unknown"), [1, 2]),
        (PodView("w1", "b", 1, "Running", True, node_name="dead"), [1, 2]),
        (PodView("w1", "b", 1, "Running", True, node_name="fine"), [2, 4]),
        (PodView("w1", "b", 1, "Pending"), [2, 4]),
    ],
    ids=["terminating", "failed", "unknown", "on-a-notready-node", "healthy", "pending"],
)
def test_a_lost_pod_frees_its_node_index_at_once_a_live_one_keeps_it(lost, expected):
    nodes = {"dead": NodeView("dead", ready=False), "fine": NodeView("fine")}
    pods = [PodView("w0", "a", 0), lost, PodView("w3", "d", 3)]
    assert sizing.free_indices(pods, 2, nodes) == expected


@pytest.mark.parametrize(
    "taken, expected",
    [
        ((), "demo-worker-1"),
        (("demo-worker-1",), "demo-worker-1-1"),
        (("demo-worker-1", "demo-worker-1-1"), "demo-worker-1-2"),
        (("demo-worker-1-1",), "demo-worker-1"),
    ],
    ids=["free", "held-by-a-lingering-pod", "two-lingering", "only-an-older-replacement-left"],
)
def test_a_replacement_gets_a_name_no_existing_pod_holds(taken, expected):
    assert names.unused_worker_name("demo", 1, taken) == expected


def test_merge_patch_removes_keys_with_null():
    assert patches.merge_patch({"a": 1, "b": {"c": 1, "d": 2}}, {"b": {"c": 1}, "e": 3}) == {
        "a": None,
        "b": {"d": None},
        "e": 3,
    }


# ---------------------------------------------------------------------------------------------- creation


def test_a_new_job_gets_its_agent_and_replicas_workers():
    world = World(job_manifest(replicas=3))
    actions = world.step()
    assert actions.create_agent
    assert created(actions) == [0, 1, 2]
    assert world.status["desiredNodes"] == 3
    assert world.status["phase"] == "Pending"
    assert world.status["selector"] == "disttrain.dev/job-name=demo,disttrain.dev/role=worker"
    assert "Created" in world.reasons()
    assert world.control["targetNodes"] == 3


def test_reconcile_is_idempotent_once_applied():
    world = World(job_manifest(replicas=2)).running_world(2)
    again = world.step()
    assert again.status_patch == {}
    assert created(again) == [] and not again.create_agent and again.delete_pods == ()
    assert again.events == ()


def test_running_with_progress_sets_phase_running_and_rendezvous_complete():
    world = World(job_manifest(replicas=2)).running_world(2)
    assert world.status["phase"] == "Running"
    assert world.condition("Running")["reason"] == "RendezvousComplete"
    assert world.condition("Scheduled")["status"] == "True"
    assert "RendezvousComplete" in world.reasons() and "Scheduled" in world.reasons()


def test_condition_transition_time_is_kept_while_the_status_holds():
    world = World(job_manifest(replicas=2)).running_world(2)
    first = world.condition("Running")["lastTransitionTime"]
    world.progress(2, step=9).step(100)
    assert world.condition("Running")["lastTransitionTime"] == first


def test_checkpoint_commit_is_announced_once():
    world = World(job_manifest(replicas=2)).running_world(2)
    world.checkpoint(10).step(1)
    world.step(1)
    assert world.reasons().count("CheckpointCommitted") == 1
    world.checkpoint(20).step(1)
    assert world.reasons().count("CheckpointCommitted") == 1


# ---------------------------------------------------------------------------------------------- anchors


def test_anchor_1638_deleting_one_worker_replaces_only_that_worker_and_reforms_once():
    world = World(job_manifest(replicas=3)).running_world(3)
    survivors = {n: p.uid for n, p in world.workers.items() if n != "demo-worker-1"}
    generation = world.control["generation"]
    world.vanish(1)
    actions = world.step(1)
    assert actions.delete_pods == ()
    assert world.control["action"] == "reform" and world.control["generation"] == generation + 1
    assert world.infrastructure_losses() == {"total": 1, "byReason": {"PodDeleted": 1}}
    assert world.status["restarts"] == NO_RESTART, "a deletion is not the user's failure"
    # Backoff first, then exactly one replacement; the survivors are never touched.
    assert created(actions) == []
    actions = world.step(5)
    assert created(actions) == [1]
    for _ in range(3):
        world.step(1)
    assert world.infrastructure_losses()["total"] == 1
    assert {n: world.workers[n].uid for n in survivors} == survivors


def test_anchor_1638_a_failed_worker_is_counted_once_across_repeated_reconciles():
    world = World(job_manifest(replicas=2)).running_world(2)
    world.set_worker(1, phase="Failed", exit_code=1)
    world.step(1)
    world.step(0)
    world.step(0)
    assert world.status["restarts"]["total"] == 1
    assert world.status["restarts"]["byReason"] == {"PodFailed": 1}


def test_anchor_1509_scale_down_drains_then_deletes_only_the_victims():
    world = World(job_manifest(replicas=3)).running_world(3)
    survivors = {n: p.uid for n, p in world.workers.items() if n != "demo-worker-2"}
    world.spec("nodes.replicas", 2)
    assert world.step(1).delete_pods == ()  # debounce
    actions = world.step(10)
    assert world.control["action"] == "drain" and world.control["reason"] == "ScaledDown"
    assert world.control["targetNodes"] == 2 and world.control["exclude"] == ["demo-worker-2"]
    assert actions.delete_pods == ()  # no checkpoint yet
    world.checkpoint(6).step(1)
    assert [d.name for d in world.last.delete_pods] == ["demo-worker-2"]
    world.step(1)  # the victim Terminating after its drain's checkpoint: never in a group again
    assert world.control.get("lost", []) == [] and world.control["exclude"] == ["demo-worker-2"]
    world.finish_terminations()
    world.progress(2, step=7).step(1)
    assert world.control["action"] == "none" and world.status["phase"] == "Running"
    assert world.status["restarts"]["total"] == 0
    assert {n: world.workers[n].uid for n in survivors} == survivors
    assert world.status["lastReform"]["to"] == 2 and world.status["lastReform"]["reason"] == "ScaledDown"
    assert "Draining" in world.reasons() and "Reformed" in world.reasons() and "ScaledDown" in world.reasons()


def test_a_scale_up_while_a_scale_down_victim_still_terminates_charges_no_loss():
    """The victim's grace period outlasts the reform, and a scale-up comes meanwhile (local mode's forked newcomer
    is Ready within a second): the victim stays excluded, and its end is no loss."""
    world = World(job_manifest(replicas=3)).running_world(3)
    world.spec("nodes.replicas", 2).step(0)
    world.step(10)
    world.checkpoint(6).step(1)
    assert [d.name for d in world.last.delete_pods] == ["demo-worker-2"]
    world.progress(2, step=7).step(1)  # the group re-formed at 2; the victim is still Terminating
    assert world.control["action"] == "none" and world.control["exclude"] == ["demo-worker-2"]
    world.spec("nodes.replicas", 3).step(0)
    assert [w.name for w in world.step(10).create_workers] == ["demo-worker-2-1"]
    world.run_all().step(1)
    assert world.control["action"] == "drain" and world.control["reason"] == "ScaledUp"
    assert world.control["exclude"] == ["demo-worker-2"], "the victim still terminating stays out of the round"
    world.step(1)
    world.finish_terminations().step(1)
    assert world.status["restarts"]["total"] == 0, world.reasons()
    world.checkpoint(8).progress(3, step=9).step(1)
    assert world.control["action"] == "none" and world.control["exclude"] == []
    assert world.status["restarts"]["total"] == 0 and "PodDeleted" not in world.reasons()


def test_scale_down_victims_are_deleted_after_the_drain_timeout_without_a_checkpoint():
    world = World(job_manifest(replicas=3)).running_world(3)
    world.spec("nodes.replicas", 2).step(0)
    world.step(10)
    assert world.step(119).delete_pods == ()
    assert [d.name for d in world.step(1).delete_pods] == ["demo-worker-2"]
    assert "DrainTimeout" in world.reasons()
    world.step(1)  # deleted without a checkpoint: it may still be in the running group, so the survivors drop it
    assert world.control["lost"] == ["demo-worker-2"]


def test_anchor_1751_a_pod_stuck_pending_does_not_leave_the_job_waiting_or_running_forever():
    world = World(job_manifest(replicas=3, min=2))
    world.step()
    world.run_all().set_worker(2, phase="Pending", ready=False, node_name=None)
    world.step(1)
    assert world.status["phase"] == "Pending"
    assert world.condition("Scheduled")["status"] == "False"
    assert world.control["targetNodes"] == 3
    assert world.last.requeue_after is not None and world.last.requeue_after <= 600
    world.step(600)
    assert world.control["targetNodes"] == 2
    assert "PendingTimeout" in world.reasons()
    world.progress(2, step=1).step(1)
    assert world.status["phase"] == "Running"
    assert world.condition("Scheduled")["status"] == "False"
    assert "2 nodes" in world.status["message"]


def test_anchor_2072_a_dead_node_loses_its_pod_force_deletes_it_and_reforms_with_survivors():
    world = World(job_manifest(replicas=3, min=2))
    world.nodes = {f"node-{i}": NodeView(f"node-{i}") for i in range(3)} | {"node-agent": NodeView("node-agent")}
    world.running_world(3)
    world.nodes["node-1"] = NodeView("node-1", ready=False)
    actions = world.step(1)
    assert [d.name for d in actions.delete_pods] == ["demo-worker-1"] and not actions.delete_pods[0].force
    assert world.control["action"] == "reform" and world.control["reason"] == "NodeNotReady"
    assert world.workers["demo-worker-1"].is_terminating  # the kubelet is dead: it stays Terminating
    world.step(5)
    replacement = [n for n in world.workers if n not in ("demo-worker-0", "demo-worker-1", "demo-worker-2")]
    assert replacement == ["demo-worker-1-1"], "the replacement must not wait for the stuck pod's name"
    assert world.workers["demo-worker-1-1"].node_index == 1, "it takes the lost node's index (and so its ranks)"
    # The replacement is never scheduled (it stays Pending).
    world.step(25)
    assert world.control["targetNodes"] == 2, "after replacementWaitSeconds the survivors re-form"
    world.progress(2, step=6).step(1)
    assert world.status["phase"] == "Running"
    world.step(300)
    assert any(d.name == "demo-worker-1" and d.force for d in world.last.delete_pods)
    assert "ForceDeleted" in world.reasons()
    assert world.infrastructure_losses()["byReason"]["NodeNotReady"] == 1


@pytest.mark.parametrize("lost", [0, 1, 2])
def test_a_replacement_takes_the_lost_nodes_index_while_the_lost_pod_lingers(lost):
    """The rendezvous orders ranks by node index: every survivor keeps its ranks, the replacement takes the lost
    node's (issue: worker-1 became rank 0 when worker-0 was replaced by a worker-3)."""
    world = World(job_manifest(replicas=3, min=2))
    world.nodes = {f"node-{i}": NodeView(f"node-{i}") for i in range(3)} | {"node-agent": NodeView("node-agent")}
    world.running_world(3)
    survivors = {n: p.node_index for n, p in world.workers.items() if p.node_index != lost}
    world.nodes[f"node-{lost}"] = NodeView(f"node-{lost}", ready=False)
    world.step(1)
    actions = world.step(5)
    assert [(w.node_index, w.name) for w in actions.create_workers] == [(lost, f"demo-worker-{lost}-1")]
    assert world.workers[f"demo-worker-{lost}"].is_terminating
    assert {n: world.workers[n].node_index for n in survivors} == survivors


NO_RESTART = {"total": 0, "byReason": {}}


def incident(world: World) -> Incident:
    return DistTrainJobStatus.model_validate(world.status).incident


def test_anchor_elastic_115_losing_the_agent_recreates_it_and_the_workers_train_on():
    """The agent's loss is no restart: no incident, no counter, no directive; the workers keep their pods (they
    reconnect to the new agent behind the same Service name). It is announced, and remembered until the workers
    report progress through the new agent at least AGENT_RECONNECT_GRACE_S after the loss."""
    world = World(job_manifest(replicas=2)).running_world(2)
    uids = {n: p.uid for n, p in world.workers.items()}
    generation = world.control["generation"]
    world.agent = None
    actions = world.step(1)
    lost_at = cond.parse_time(world.status["agentLostAt"])
    assert actions.create_agent
    assert actions.delete_pods == () and created(actions) == []
    assert world.control["action"] == "none" and world.control["generation"] == generation
    assert world.status["restarts"] == NO_RESTART and "incident" not in world.status
    assert world.status["phase"] == "Running" and "nextRestartTime" not in world.status
    assert {n: p.uid for n, p in world.workers.items()} == uids
    [message] = [m for r, m in world.events if r == "AgentRestarted"]
    assert "no restart" in message and "Reforming" not in world.reasons()
    world.run_all().step(1)  # the new agent runs
    world.now = lost_at + core.AGENT_RECONNECT_GRACE_S - 1
    world.progress(2, step=6, same_round=True).step(0)
    assert world.status["agentLostAt"], "progress stamped within the grace: the loss is still recent"
    world.now = lost_at + core.AGENT_RECONNECT_GRACE_S
    world.progress(2, step=7, same_round=True).step(0)
    assert "agentLostAt" not in world.status
    assert world.status["restarts"] == NO_RESTART and world.control["generation"] == generation
    assert {n: p.uid for n, p in world.workers.items()} == uids


@pytest.mark.parametrize(
    "node",
    [NodeView("node-agent", ready=False), NodeView("node-agent", ready=None), None],
    ids=["notready", "unreachable", "deleted"],
)
def test_an_agent_on_a_dead_node_is_force_deleted_and_recreated_at_once(node):
    # No kubelet confirms the deletion: waiting for it (stuckPodTimeoutSeconds) left the workers without a store.
    world = World(job_manifest(replicas=2)).running_world(2)
    world.nodes = {"node-0": NodeView("node-0"), "node-1": NodeView("node-1")}
    if node is not None:
        world.nodes["node-agent"] = node
    old = world.agent.uid
    actions = world.step(1)
    assert [(d.name, d.force) for d in actions.delete_pods] == [("demo-agent", True)]
    assert actions.create_agent and world.agent.uid != old
    assert world.status["restarts"] == NO_RESTART and world.control["action"] == "none"
    assert "node node-agent" in dict(world.events)["AgentRestarted"]


def test_an_agent_on_a_draining_node_is_deleted_gracefully():
    world = World(job_manifest(replicas=2)).running_world(2)
    world.nodes = {
        "node-0": NodeView("node-0"),
        "node-1": NodeView("node-1"),
        "node-agent": NodeView("node-agent", unschedulable=True, draining=True),
    }
    actions = world.step(1)
    assert [(d.name, d.force) for d in actions.delete_pods] == [("demo-agent", False)]
    assert not actions.create_agent


def test_a_worker_lost_with_the_agents_node_is_one_node_loss_and_no_restart():
    """The agent's node took a worker with it: that worker's loss is a node loss like any other (an infrastructure
    loss, a reform without it), the agent's loss another, and the survivor's store failure right after is part of
    that incident. Nothing is charged to maxRestarts."""
    world = World(job_manifest(replicas=3)).running_world(3)
    world.agent = dataclasses.replace(world.agent, node_name="node-1")  # the agent shares worker 1's node
    world.nodes = {f"node-{i}": NodeView(f"node-{i}") for i in range(3)} | {"node-1": NodeView("node-1", ready=None)}
    actions = world.step(1)
    assert actions.create_agent and "demo-worker-1" in {d.name for d in actions.delete_pods}
    both = {"total": 2, "byReason": {"AgentRestarted": 1, "NodeUnreachable": 1}}
    assert world.infrastructure_losses() == both and world.status["restarts"] == NO_RESTART
    assert world.control["action"] == "reform" and world.control["reason"] == "NodeUnreachable"
    assert "NodeLost" in world.reasons() and incident(world).first_pod == "demo-worker-1"
    world.set_worker(2, phase="Failed", exit_code=1).step(1)  # its torchrun was joining the next round
    assert world.infrastructure_losses() == both and world.status["restarts"] == NO_RESTART
    assert incident(world).folded == {"demo-worker-2"}


def test_workers_that_fail_after_an_agent_loss_are_replaced_uncharged():
    """A torchrun inside a rendezvous join exits 1 when its store vanishes: each such failure of a pod that existed
    at the loss is replaced and the group re-formed as for any loss, in one uncharged incident, even with no
    restart left in the budget. Once the workers progress through the new agent, a failure is charged again."""
    world = World(job_manifest(replicas=3, restartPolicy__maxRestarts=0)).running_world(3)
    old_uids = {p.uid for p in world.workers.values()}
    world.agent = None
    world.step(1)
    world.run_all().step(1)  # the new agent runs
    world.set_worker(0, phase="Failed", exit_code=1).step(1)
    assert world.control["action"] == "reform" and world.control["reason"] == "AgentRestarted"
    assert not incident(world).charged and "nextRestartTime" not in world.status
    for index in (1, 2):
        world.set_worker(index, phase="Failed", exit_code=1)
    world.step(1)
    assert world.status["restarts"] == NO_RESTART and world.status["phase"] == "Reforming"
    assert incident(world).folded == {"demo-worker-1", "demo-worker-2"}
    assert not {"NodeLost", "PodFailed"} & set(world.reasons())
    assert sorted(p.node_index for p in world.workers.values()) == [0, 1, 2], "no backoff: replaced at once"
    assert not {p.uid for p in world.workers.values()} & old_uids, "every worker pod was recreated"
    world.run_all().step(core.AGENT_RECONNECT_GRACE_S)
    world.progress(3, step=6).step(1)
    assert world.status["phase"] == "Running" and world.control["action"] == "none"
    assert world.status["restarts"] == NO_RESTART
    assert "agentLostAt" not in world.status and "incident" not in world.status
    # After the workers progressed through the new agent, a worker failure is charged (here: no budget left).
    world.set_worker(0, phase="Failed", exit_code=1).step(1)
    assert world.status["phase"] == "Failed"
    assert world.condition("Failed")["reason"] == "RestartBudgetExhausted"


def test_a_hot_spare_that_fails_after_an_agent_loss_is_replaced_uncharged_and_the_group_trains_on():
    """A hot spare waits inside a rendezvous join, so its torchrun is the one that exits when the store vanishes:
    replaced, not charged, and the running group is not re-formed."""
    world = World(job_manifest(replicas=3, min=2, nodes__spares=1)).running_world(3)
    world.status["roundMembers"] = sorted(world.worker(i).name for i in range(3))
    world.agent = None
    world.step(1)
    world.run_all().step(1)
    spare = world.worker(3).name
    actions = world.set_worker(3, phase="Failed", exit_code=1).step(1)
    assert world.status["restarts"] == NO_RESTART and world.control["action"] == "none"
    assert "OutsideTheGroup" in world.reasons() and spare in {d.name for d in actions.delete_pods}
    assert created(actions) == [3]


def test_a_replacement_that_fails_after_an_agent_loss_is_counted():
    """Only pods that existed when the agent was lost fail because of it: a crash-looping new pod still counts."""
    world = World(job_manifest(replicas=2)).running_world(2)
    world.agent = None
    world.step(1)
    old = set(world.workers)
    world.set_worker(1, phase="Failed", exit_code=1).step(1)
    assert world.status["restarts"] == NO_RESTART
    world.step(1)
    world.run_all().step(1)
    [new] = [p for n, p in world.workers.items() if n not in old]
    assert new.created_at > cond.parse_time(world.status["agentLostAt"])
    world.set_worker(new.node_index, phase="Failed", exit_code=1).step(1)
    assert world.status["restarts"] == {"total": 1, "byReason": {"PodFailed": 1}}


def test_progress_of_the_old_group_after_a_directive_does_not_complete_it():
    """The old group keeps stepping for a moment after a reform; only a new rendezvous round completes it."""
    world = World(job_manifest(replicas=3)).running_world(3)
    world.set_worker(2, phase="Failed", exit_code=1)
    world.step(1)
    issued = cond.parse_time(world.control["issuedAt"])
    assert world.control["issuedRound"] == world.status["rendezvousRound"] == 1
    world.step(10)  # backoff over: the replacement is created and runs
    world.run_all().step(1)
    assert world.status["phase"] == "Reforming"
    # Reports of the old round (still at the target size 3, after the issue) do not complete the reform.
    world.now += 0.3
    world.progress(3, step=7, same_round=True).step(0)
    assert world.control["action"] == "reform" and world.status["phase"] == "Reforming"
    assert "Reformed" not in world.reasons()
    # The new round's first report completes it; its duration runs from the issue to that report.
    world.now = issued + 4.5
    world.progress(3, step=6)
    world.step(0.75)
    world.progress(3, step=7, same_round=True).step(0.25)
    assert world.control["action"] == "none" and world.status["phase"] == "Running"
    assert "Reformed" in world.reasons()
    assert world.status["lastReform"]["to"] == 3
    assert world.status["lastReform"]["durationSeconds"] == pytest.approx(4.5, abs=0.002)


def test_a_completed_reform_reports_its_phases_from_the_new_groups_startup():
    """lastReform.phases and the Reformed Event come from the startup stamps the agent relayed with the round."""
    world = World(job_manifest(replicas=3)).running_world(3)
    world.set_worker(2, phase="Failed", exit_code=1)
    world.step(1)
    issued = cond.parse_time(world.control["issuedAt"])
    world.step(10)
    world.run_all().step(1)
    world.now = issued + 4.5
    world.progress(3, step=6)
    world.status["workerStartup"] = {
        "oldExitFirst": issued - 0.5,
        "oldExitLast": issued + 0.5,
        "spawned": issued + 1.5,
        "imported": issued + 2.5,
        "setupBegin": issued + 3.0,
        "groupReady": issued + 3.5,
        "resumed": issued + 4.0,
        "firstStep": issued + 4.5,
    }
    world.step(0.5)
    assert world.control["action"] == "none"
    phases = world.status["lastReform"]["phases"]
    assert phases == {
        "detection": 0.5,
        "directive": 0.5,
        "restart": 1.0,
        "imports": 1.0,
        "modelBuild": 0.5,
        "processGroup": 0.5,
        "checkpointLoad": 0.5,
        "firstStep": 0.5,
        "total": 5.0,
    }
    [message] = [message for reason, message in world.events if reason == "Reformed"]
    assert "phases: detection 0.50s, directive 0.50s, restart 1.00s" in message


def test_a_new_round_at_the_wrong_size_does_not_complete_a_directive():
    world = World(job_manifest(replicas=3)).running_world(3)
    world.set_worker(2, phase="Failed", exit_code=1).step(1)
    world.progress(2, step=6).step(1)  # a new round, but below the target of 3
    assert world.control["action"] == "reform"
    world.step(10)
    world.run_all().step(1)
    world.progress(3, step=7).step(1)
    assert world.control["action"] == "none" and world.status["lastReform"]["to"] == 3


def test_a_replacement_running_after_the_wait_does_not_strand_the_reform_at_the_lower_target():
    """The target dropped to the survivors, a round may have formed at it; a late replacement joins by a drain."""
    world = World(job_manifest(replicas=3, min=2))
    world.nodes = {f"node-{i}": NodeView(f"node-{i}") for i in range(3)} | {"node-agent": NodeView("node-agent")}
    world.running_world(3)
    world.set_worker(1, phase="Failed", exit_code=1).step(1)
    assert world.control["action"] == "reform" and world.control["targetNodes"] == 3
    world.step(31)  # replacementWaitSeconds passed with the replacement not running
    assert world.control["targetNodes"] == 2
    world.run_all().step(1)  # the replacement runs before the agent reports the round the survivors formed
    assert world.control["targetNodes"] == 2, "a published lower target is never raised while in flight"
    world.progress(2, step=6).step(1)
    assert "Reformed" in world.reasons(), "the reform completed at the size the round formed with"
    # The completed reform's record is published before the next directive replaces it (watchers, metrics).
    assert world.status["lastReform"]["to"] == 2 and world.status["lastReform"]["durationSeconds"] is not None
    assert world.control["action"] == "none" and world.last.requeue_after == 0
    world.step(0)
    assert world.control["action"] == "drain" and world.control["reason"] == "ScaledUp"
    assert world.control["targetNodes"] == 3
    world.step(1)
    world.checkpoint(6).progress(3, step=7).step(1)
    assert world.control["action"] == "none" and world.status["phase"] == "Running"
    assert world.status["lastReform"]["to"] == 3


def test_anchor_111646_survivors_are_told_to_reform_in_the_same_reconcile_that_sees_the_loss():
    world = World(job_manifest(replicas=3)).running_world(3)
    world.set_worker(2, phase="Failed", exit_code=1)
    world.step(0)
    assert world.control["action"] == "reform"
    assert world.control["issuedAt"] == cond.format_time(world.now)
    assert world.status["phase"] == "Reforming"


def test_anchor_any_worker_succeeded_is_not_success():
    world = World(job_manifest(replicas=2)).running_world(2)
    world.set_worker(0, phase="Succeeded", exit_code=0).step(1)
    assert world.status["phase"] != "Succeeded"
    world.set_worker(1, phase="Succeeded", exit_code=0).step(1)
    assert world.status["phase"] == "Succeeded"
    assert "Succeeded" in world.reasons() and world.status["completionTime"]


def test_rank_zero_policy_needs_the_training_length_reached():
    world = World(job_manifest(replicas=2, successPolicy="RankZero")).running_world(2)
    world.set_worker(0, phase="Succeeded", exit_code=0).step(1)
    assert world.status["phase"] != "Succeeded"
    world.progress(2, step=100).step(1)
    assert world.status["phase"] == "Succeeded"


# ---------------------------------------------------------------------------------------------- failures


def test_a_permanent_exit_code_fails_the_job_with_the_reason():
    world = World(job_manifest(replicas=2)).running_world(2)
    world.set_worker(1, phase="Failed", exit_code=85).step(1)
    assert world.status["phase"] == "Failed"
    failed = world.condition("Failed")
    assert failed["reason"] == "PermanentExitCode" and "85" in failed["message"]
    assert {d.name for d in world.last.delete_pods} == {"demo-worker-0", "demo-worker-1", "demo-agent"}


def test_a_permanent_failure_reported_through_the_agent_fails_the_job():
    world = World(job_manifest(replicas=2)).running_world(2)
    world.status["workerFailure"] = {
        "exitCode": 85,
        "node": "demo-worker-0",
        "message": "dataset changed",
        "time": cond.format_time(world.now),
    }
    world.step(1)
    assert world.status["phase"] == "Failed"
    assert "dataset changed" in world.condition("Failed")["message"]


def test_the_restart_budget_fails_the_job_when_exhausted():
    world = World(job_manifest(replicas=2)).running_world(2)
    for attempt in range(4):
        world.set_worker(1, phase="Failed", exit_code=1).step(100)
        world.finish_terminations()
        world.step(100)
        world.run_all()
        if attempt < 3:
            assert world.status["phase"] != "Failed"
    assert world.status["phase"] == "Failed"
    assert world.condition("Failed")["reason"] == "RestartBudgetExhausted"


def test_a_crash_loop_of_user_code_spends_the_budget_and_fails_with_the_traceback_line():
    # The launcher ends the pod with the user's real exit code and writes the traceback's last line as the
    # container's termination message: each failure is one restart, with backoff, until the budget is spent; the
    # failure that finds it spent fails the job and is no restart.
    world = World(
        job_manifest(replicas=1, restartPolicy__maxRestarts=2, restartPolicy__backoffSeconds=5)
    ).running_world(1)
    crash = "worker rank 0 failed with exit code 1: RuntimeError: injected bug at step 5"
    for attempt in range(3):
        world.set_worker(0, phase="Failed", exit_code=1, termination_message=f"{crash}\n").step(0)
        assert world.status["restarts"]["total"] == min(attempt + 1, 2)
        assert crash in world.status["lastFailure"]
        if attempt < 2:
            assert world.status["phase"] != "Failed"
            world.finish_terminations()
            assert world.step(0).create_workers == (), "the replacement waits out the backoff"
            world.step(5 * 2**attempt)
            world.run_all()
    assert world.status["phase"] == "Failed"
    failed = world.condition("Failed")
    assert failed["reason"] == "RestartBudgetExhausted"
    assert "RuntimeError: injected bug at step 5" in failed["message"]
    assert "RuntimeError: injected bug at step 5" in world.status["message"]
    assert any(e.reason == "RestartBudgetExhausted" and "injected bug" in e.message for e in world.last.events)


def test_a_spent_budget_names_the_users_failure_when_a_retry_failed_otherwise():
    """A crash loop whose last retry never reached the user's code (exit 1: it timed out joining) still names the
    user's own failure, exit code 3, in the Failed condition."""
    world = World(
        job_manifest(replicas=1, restartPolicy__maxRestarts=1, restartPolicy__backoffSeconds=0)
    ).running_world(1)
    world.set_worker(0, phase="Failed", exit_code=3, termination_message="user code exited with 3\n").step(0)
    world.finish_terminations().step(0)
    world.run_all()
    world.set_worker(0, phase="Failed", exit_code=1, termination_message="timeout waiting for MASTER_ADDR\n").step(0)
    failed = world.condition("Failed")
    assert failed["reason"] == "RestartBudgetExhausted"
    assert "exit code 1" in failed["message"] and "exit code 3" in failed["message"], failed["message"]


def test_a_failure_before_any_group_formed_shows_in_the_pending_message():
    world = World(job_manifest(replicas=1, restartPolicy__backoffSeconds=30))
    world.step(0)
    world.run_all()
    world.set_worker(0, phase="Failed", exit_code=3, termination_message="worker rank 0 failed with exit code 3").step(
        1
    )
    assert world.status["phase"] == "Pending" and world.status["restarts"]["byReason"] == {"PodFailed": 1}
    assert "last: worker pod demo-worker-0 lost: PodFailed, exit code 3" in world.status["message"]


def test_the_exit_code_classes_apply_to_the_users_code_and_name_the_cause():
    world = World(job_manifest(replicas=2, restartPolicy__exitCodes={"permanent": [3]})).running_world(2)
    world.set_worker(
        1, phase="Failed", exit_code=3, termination_message="worker rank 1 failed with exit code 3: SystemExit: 3"
    ).step(1)
    assert world.status["phase"] == "Failed"
    failed = world.condition("Failed")
    assert failed["reason"] == "PermanentExitCode" and failed["message"].endswith("SystemExit: 3")
    assert world.status["restarts"]["total"] == 0


def test_a_trainer_without_a_command_fails_at_once_instead_of_retrying_forever():
    # Admitted before the CRD had the rule (or by a CRD without it): no pod can be built from it.
    manifest = job_manifest(replicas=2)
    del manifest["spec"]["template"]["spec"]["containers"][0]["command"]
    world = World(manifest)
    actions = world.step()
    assert world.status["phase"] == "Failed"
    failed = world.condition("Failed")
    assert failed["reason"] == "InvalidSpec" and "containers[0].command" in failed["message"]
    assert actions.create_workers == () and not actions.create_agent
    assert any(e.reason == "InvalidSpec" and "needs a command" in e.message for e in actions.events)


def test_a_pod_the_api_server_refuses_is_named_in_a_condition_and_one_event():
    world = World(job_manifest(replicas=2))
    world.step()
    answer = (
        'pods "demo-worker-0" is forbidden: violates PodSecurity "baseline:latest": privileged '
        '(container "trainer" must not set securityContext.privileged=true)'
    )
    world.refused = answer
    actions = world.step(1)
    scheduled = world.condition("Scheduled")
    assert scheduled["status"] == "False" and scheduled["reason"] == "PodRejected" and answer in scheduled["message"]
    assert answer in world.status["message"]
    assert [e.reason for e in actions.events if e.type == "Warning"] == ["PodRejected"]
    assert actions.requeue_after is not None and actions.requeue_after <= core.REFUSED_RETRY_SECONDS
    assert not [e for e in world.step(10).events if e.reason == "PodRejected"], "one event per answer"
    world.refused = None
    world.run_all().step(1)
    assert world.condition("Scheduled")["reason"] == "Scheduled"


def test_backoff_delays_replacements_and_doubles_with_consecutive_failures():
    world = World(job_manifest(replicas=2)).running_world(2)
    world.set_worker(1, phase="Failed", exit_code=1).step(0)
    world.finish_terminations()
    assert created(world.step(4)) == []
    assert created(world.step(1)) == [1]
    world.run_all().set_worker(1, phase="Failed", exit_code=1).step(0)
    world.finish_terminations()
    assert created(world.step(9)) == []
    assert created(world.step(1)) == [1]


def test_evicted_pods_are_counted_by_reason():
    world = World(job_manifest(replicas=2)).running_world(2)
    world.set_worker(0, phase="Failed", reason="Evicted").step(1)
    assert world.infrastructure_losses()["byReason"] == {"Evicted": 1}
    assert world.status["restarts"] == NO_RESTART


def test_a_pod_on_a_deleted_node_is_force_deleted_at_once():
    world = World(job_manifest(replicas=2))
    world.nodes = {"node-0": NodeView("node-0"), "node-1": NodeView("node-1"), "node-agent": NodeView("node-agent")}
    world.running_world(2)
    del world.nodes["node-1"]
    actions = world.step(1)
    assert [(d.name, d.force) for d in actions.delete_pods] == [("demo-worker-1", True)]
    assert world.infrastructure_losses()["byReason"] == {"NodeDeleted": 1}


def test_below_min_the_job_waits_for_nodes_and_says_so():
    world = World(job_manifest(replicas=2, min=2)).running_world(2)
    world.set_worker(1, phase="Failed", exit_code=1).step(1)
    world.finish_terminations().step(5)
    world.step(60)
    assert world.control["targetNodes"] == 2  # one survivor is below min: keep waiting for the replacement


# ---------------------------------------------------------------------------------------------- scaling


def test_scale_up_adds_pods_then_drains_so_the_group_reforms_with_them():
    world = World(job_manifest(replicas=2)).running_world(2)
    world.spec("nodes.replicas", 3).step(0)
    actions = world.step(10)
    assert created(actions) == [2]
    assert world.control["action"] == "none"  # the new pod is not running yet
    world.run_all().step(1)
    assert world.control["action"] == "drain" and world.control["reason"] == "ScaledUp"
    assert world.control["targetNodes"] == 3
    world.step(1)
    world.checkpoint(6).progress(3, step=7).step(1)
    assert world.control["action"] == "none" and world.status["phase"] == "Running"
    assert world.status["restarts"]["total"] == 0
    assert "ScaledUp" in world.reasons()


def test_a_running_newcomer_is_drained_in_only_once_ready_so_the_group_never_waits_for_its_imports():
    """Ready = its workers start warm (disttrain.trainer.launch.readiness); before that the group trains on."""
    world = World(job_manifest(replicas=2)).running_world(2)
    world.spec("nodes.replicas", 3).step(0)
    world.step(10)
    world.run_all().set_worker(2, ready=False).step(1)  # its container runs, its workers' imports do not
    assert world.control["action"] == "none" and world.status["readyReplicas"] == 2
    world.step(5)
    assert world.control["action"] == "none"
    world.set_worker(2, ready=True).step(1)
    assert world.control["action"] == "drain" and world.control["reason"] == "ScaledUp"
    assert world.control["targetNodes"] == 3


def test_a_newcomer_never_ready_is_given_up_after_the_pending_timeout():
    world = World(job_manifest(replicas=2)).running_world(2)
    world.spec("elastic.pendingTimeoutSeconds", 30).spec("nodes.replicas", 3).step(0)
    world.step(10)
    world.run_all().set_worker(2, ready=False).step(1)
    world.step(31)
    assert world.control["action"] == "none" and world.control["targetNodes"] == 2
    assert "PendingTimeout" in world.reasons()


def test_a_replacement_that_makes_the_round_as_its_wait_runs_out_completes_the_reform():
    """The target drops to the survivors when the replacement's wait expires; if the replacement joined the round in
    that instant, the group runs at the full size, and the reform is done all the same."""
    world = World(job_manifest(replicas=3, min=2)).running_world(3)
    world.spec("elastic.replacementWaitSeconds", 5)
    world.set_worker(2, phase="Failed", exit_code=137).step(1)
    assert world.control["action"] == "reform"
    world.finish_terminations().step(6)  # the replacement is not running yet: the wait expires
    assert world.control["targetNodes"] == 2
    world.run_all().progress(3, step=7).step(1)  # ... but it had joined: the new round runs at 3 nodes
    assert world.control["action"] == "none" and world.status["phase"] == "Running"
    assert "Reformed" in world.reasons() and world.status["lastReform"]["to"] == 3


def test_scale_requests_above_max_are_clamped():
    world = World(job_manifest(replicas=4, max=3))
    world.step()
    assert world.status["desiredNodes"] == 3


# ---------------------------------------------------------------------------------------------- run policy


def test_suspend_deletes_all_pods_keeps_status_and_resume_continues_from_the_checkpoint():
    world = World(job_manifest(replicas=2)).running_world(2)
    world.checkpoint(40).step(1)
    world.set_worker(1, phase="Failed", exit_code=1).step(1)
    world.finish_terminations().step(10)
    world.run_all().step(0)
    world.spec("runPolicy.suspend", True)
    actions = world.step(1)
    assert {d.name for d in actions.delete_pods} == {"demo-worker-0", "demo-worker-1", "demo-agent"}
    assert world.status["phase"] == "Suspended"
    assert world.status["lastCheckpoint"]["step"] == 40 and world.status["restarts"]["total"] == 1
    world.finish_terminations().step(1)
    assert created(world.last) == [] and not world.last.create_agent
    assert world.status["restarts"]["total"] == 1, "suspending is not a failure"
    world.spec("runPolicy.suspend", False)
    actions = world.step(1)
    assert actions.create_agent and created(actions) == [0, 1]
    assert world.status["phase"] == "Pending"
    assert "Resumed" in world.reasons() and "ResumedFromStep" in world.reasons()
    assert world.condition("Suspended")["status"] == "False"


def test_active_deadline_fails_the_job():
    world = World(job_manifest(replicas=2, runPolicy={"activeDeadlineSeconds": 100})).running_world(2)
    assert 0 < world.last.requeue_after <= 100
    world.step(100)
    assert world.status["phase"] == "Failed" and world.condition("Failed")["reason"] == "DeadlineExceeded"


@pytest.mark.parametrize(
    "suspended_for, run_after_resume, failed",
    [
        (0, 59, False),
        (0, 60, True),
        (500, 59, False),
        (500, 60, True),
        (5000, 59, False),
    ],
    ids=[
        "no-suspension-before-deadline",
        "no-suspension-at-deadline",
        "suspended-time-not-counted",
        "deadline-after-suspension",
        "long-suspension-not-counted",
    ],
)
def test_active_deadline_does_not_count_time_spent_suspended(suspended_for, run_after_resume, failed):
    """Deadline 100 s: 40 s running, suspended ``suspended_for`` s, then ``run_after_resume`` s more."""
    world = World(job_manifest(replicas=2, runPolicy={"activeDeadlineSeconds": 100})).running_world(2)
    world.step(40)
    world.spec("runPolicy.suspend", True)
    world.step(0)
    world.finish_terminations()
    assert world.status["phase"] == "Suspended"
    world.step(suspended_for)
    assert world.status["phase"] == "Suspended", "a suspended job never fails its deadline"
    world.spec("runPolicy.suspend", False)
    world.step(0)
    assert world.status["suspendedSeconds"] == suspended_for and "suspendedSince" not in world.status
    world.run_all().step(0)
    world.progress(2, step=6).step(0)
    assert world.status["phase"] == "Running"
    assert world.last.requeue_after is not None and world.last.requeue_after <= 60
    world.step(run_after_resume)
    assert (world.status["phase"] == "Failed") is failed, world.status["phase"]
    if failed:
        assert world.condition("Failed")["reason"] == "DeadlineExceeded"


def test_the_world_column_shows_the_group_against_the_desired_world():
    world = World(job_manifest(replicas=2, nprocPerNode=2)).running_world(2)
    world.progress(2, step=6, nproc=2).step(0)
    assert world.status["world"] == "4/4"
    world.spec("nodes.replicas", 3).step(0)
    world.step(10)
    assert world.status["world"] == "4/6"


def test_a_gang_job_writes_its_pod_group_before_its_pods_and_follows_nodes_min():
    world = World(job_manifest(replicas=2, gang={"scheduler": "volcano"}))
    first = world.step()
    assert first.apply_pod_group and [c.node_index for c in first.create_workers] == [0, 1]
    assert world.status["podGroupMinMember"] == 1
    world.run_all()
    assert not world.step().apply_pod_group, "nothing changed: no write"
    world.spec("nodes.min", 2)
    assert world.step().apply_pod_group and world.status["podGroupMinMember"] == 2
    assert not world.step().apply_pod_group


def test_a_job_without_gang_writes_no_pod_group():
    world = World(job_manifest(replicas=2))
    assert not world.step().apply_pod_group
    assert "podGroupMinMember" not in world.status or world.status["podGroupMinMember"] == 0


def test_ttl_after_finish_deletes_the_job():
    world = World(job_manifest(replicas=1, runPolicy={"ttlSecondsAfterFinished": 60})).running_world(1)
    world.set_worker(0, phase="Succeeded", exit_code=0).step(1)
    assert world.status["phase"] == "Succeeded"
    assert not world.last.delete_job and world.last.requeue_after == 60
    assert not world.step(59).delete_job
    assert world.step(1).delete_job


@pytest.mark.parametrize(
    "policy, deleted",
    [
        ("All", {"demo-worker-0", "demo-worker-1", "demo-agent"}),
        ("Running", {"demo-worker-1", "demo-agent"}),
        ("None", {"demo-agent"}),
    ],
    ids=["all", "running-only", "none"],
)
def test_clean_pod_policy_on_finish(policy, deleted):
    world = World(job_manifest(replicas=2, runPolicy={"cleanPodPolicy": policy})).running_world(2)
    world.set_worker(0, phase="Failed", exit_code=85).step(1)
    assert {d.name for d in world.last.delete_pods} == deleted


def test_a_restarted_operator_mid_reform_changes_nothing():
    world = World(job_manifest(replicas=3)).running_world(3)
    world.spec("nodes.replicas", 2).step(0)
    world.step(10)
    before = dict(world.status)
    # A fresh operator: nothing but the job (with its status) and the pods. Same decision, no duplicates.
    again = core.reconcile(DistTrainJob.model_validate(world.manifest), world.observed(), world.now)
    assert again.status_patch == {} and created(again) == [] and not again.create_agent
    assert world.status == before


def test_requeue_after_reports_the_nearest_timer():
    world = World(job_manifest(replicas=2)).running_world(2)
    world.spec("nodes.replicas", 3)
    assert world.step(2).requeue_after == 10
    assert world.step(3).requeue_after == 7


def test_observed_without_nodes_defaults():
    actions = core.reconcile(DistTrainJob.model_validate(job_manifest()), Observed(), T0)
    assert actions.create_agent and created(actions) == [0, 1]


def test_a_lost_pod_is_listed_for_the_survivors_rendezvous_until_the_next_group_runs():
    """``control.lost`` lets the survivors drop a dead node from the finished rendezvous round at once. It must stay
    listed while they re-join, even once the pod is gone, and be forgotten once the new group runs."""
    world = World(job_manifest(replicas=3, min=2))
    world.nodes = {f"node-{i}": NodeView(f"node-{i}") for i in range(3)} | {"node-agent": NodeView("node-agent")}
    world.running_world(3)
    assert world.control.get("lost", []) == []
    world.nodes["node-1"] = NodeView("node-1", ready=False)
    world.step(1)
    assert world.control["action"] == "reform" and world.control["lost"] == ["demo-worker-1"]
    world.finish_terminations().step(1)
    assert "demo-worker-1" not in world.workers
    assert world.control["lost"] == ["demo-worker-1"], "gone, but the survivors may not have re-joined yet"
    world.run_all().progress(3, step=6).step(1)
    assert world.status["phase"] == "Running" and world.control["action"] == "none"
    assert world.control.get("lost", []) == []


def test_an_agent_whose_pulse_stopped_is_replaced_a_second_later_while_its_lease_is_still_fresh():
    """The pulse finds the agent's node dead in about a second, long before the Lease's three periods."""
    world = World(job_manifest(replicas=2)).running_world(2)
    world.nodes = {name: NodeView(name) for name in ("node-0", "node-1", "node-agent")}
    old = world.agent.uid
    world.renew_agent_lease().step(1)
    world.renew_agent_lease()
    for _ in range(5):
        world.agent_pulses().step(0.2)
    world.step(world.beats.pulse_silent_s - 0.3)
    assert world.agent.uid == old and world.last.delete_pods == (), "silent for less than a second"
    actions = world.step(0.3)
    assert [(d.name, d.force) for d in actions.delete_pods] == [("demo-agent", True)]
    assert actions.create_agent and actions.agent_avoid_nodes == ("node-agent",)
    assert world.status["restarts"] == NO_RESTART and world.control["action"] == "none"
    assert "its pulse stopped" in dict(world.events)["AgentRestarted"]
    world.run_all().step(5)  # the new agent has not pulsed yet: the old silence is not its own
    assert world.last.delete_pods == () and not world.last.create_agent


def test_an_agent_silent_in_its_lease_is_force_deleted_and_recreated_before_its_node_is_notready():
    """Its node still looks Ready (Kubernetes has not noticed yet): the Lease's silence is enough. No restart, no
    directive; the replacement, a new pod, is not judged by its predecessor's silence."""
    world = World(job_manifest(replicas=2)).running_world(2)
    world.nodes = {name: NodeView(name) for name in ("node-0", "node-1", "node-agent")}
    old = world.agent.uid
    world.renew_agent_lease().step(1)
    world.renew_agent_lease().step(world.beats.silent_s - 0.5)
    assert world.agent.uid == old and world.last.delete_pods == (), "silent for less than SILENT_S"
    actions = world.step(1)
    assert [(d.name, d.force) for d in actions.delete_pods] == [("demo-agent", True)]
    assert actions.create_agent and world.agent.uid != old
    assert actions.agent_avoid_nodes == ("node-agent",), "the scheduler still has the dead node Ready"
    assert world.status["restarts"] == NO_RESTART and world.control["action"] == "none"
    assert "silent in its Lease" in dict(world.events)["AgentRestarted"]
    world.run_all().step(world.beats.silent_s * 3)  # the new agent has not renewed yet: the old silence is not its own
    assert world.last.delete_pods == () and not world.last.create_agent
