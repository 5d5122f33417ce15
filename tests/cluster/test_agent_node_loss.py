"""On the real-control-plane tier: the job agent's node dies under real trainers.

Real processes (:mod:`tests.cluster.process_kubelet`: the job agent, torchrun and the trainer of every pod) on a real
control plane; the agent runs alone on its node. That node dies (processes SIGKILLed, Lease no longer renewed): the
workers train on without their store, the agent's pulse stops and the operator recreates the agent before the
node-lifecycle controller marks the node NotReady, the workers' store clients reconnect to it behind the same
address, and the job ends with every step run once, no restart charged and no reform. The scenario itself is
:func:`tests.cluster.harness.agent_node_loss` (``bench/agent_loss_cluster.py`` times it).
"""

from __future__ import annotations

import math

import pytest

from tests.cluster.harness import agent_node_loss

pytestmark = [pytest.mark.usefixtures("crd"), pytest.mark.timeout(600)]


def test_the_group_trains_through_the_loss_of_its_agents_node_and_ends_with_every_step_run_once(
    process_cluster, tmp_path
):
    seen = agent_node_loss(process_cluster, tmp_path)
    status = seen.status
    assert status["phase"] == "Succeeded", status
    assert status["restarts"] == {"total": 0, "byReason": {}}, status["restarts"]
    assert status["infrastructureLosses"]["byReason"] == {"AgentRestarted": 1}, status["infrastructureLosses"]
    assert status.get("lastReform") == seen.before.get("lastReform"), "the agent's loss re-formed the group"
    assert status.get("rendezvousRound") == seen.before.get("rendezvousRound"), (seen.before, status)
    assert not status.get("silentNodes"), status
    assert status.get("step") == seen.max_steps, "the last step is relayed by the new agent"

    # The agent was replaced, the workers were not.
    old_uid, new_uid = seen.agent_uids
    assert new_uid != old_uid
    assert seen.workers_when_back == seen.workers_before, "the workers' pods stay"
    reasons = [e["reason"] for e in seen.events]
    assert "AgentRestarted" in reasons, reasons
    assert seen.agent_log.count("serving the store") == 2, "the agent was not recreated"
    assert "silent in the rendezvous heartbeats" not in seen.agent_log, "the new agent took the survivors for dead"
    assert "reconnected after" in seen.worker_logs

    # Every step ran exactly once, by one group of 2 ranks.
    groups = {r["group"] for r in seen.records}
    assert len(groups) == 1, f"the group re-formed: {groups}"
    ranks_by_step: dict[int, list[int]] = {}
    for record in seen.records:
        ranks_by_step.setdefault(record["step"], []).append(record["rank"])
    assert sorted(ranks_by_step) == list(range(1, seen.max_steps + 1)), "a step is missing"
    twice = {step: ranks for step, ranks in ranks_by_step.items() if sorted(ranks) != [0, 1]}
    assert not twice, f"steps run twice or by one rank only: {twice}"

    # The agent's own signs of life told the operator (its pulse, or its Lease: three 1 s periods), not
    # Kubernetes' NotReady (the node-lifecycle controller's grace period is 20 s here). How soon each path notices
    # is measured by bench/agent_loss_cluster.py.
    not_ready = seen.node_not_ready_at  # nan: still Ready when the new agent ran
    assert math.isnan(not_ready) or seen.agent_deleted_at < not_ready, "replaced only once its node was NotReady"
    [message] = [e["message"] for e in seen.events if e["reason"] == "AgentRestarted"]
    assert "its pulse stopped" in message or "silent in its Lease" in message, message

    # Training went on through the outage, without a pause: steps right after the power-off and right before the new
    # agent ran, no gap near a store timeout.
    off, back = seen.powered_off_at, seen.agent_back_at
    assert off < seen.agent_deleted_at <= back, seen
    assert seen.steps_between(off, off + 3), "training paused at the power-off"
    assert seen.steps_between(back - 3, back), "training paused before the new agent came"
    assert seen.steps_between(back, float("inf")), "the job ended before the new agent came"
    gap = seen.longest_step_gap(off, max(back, seen.reconnected_at or back))
    assert gap < 5, f"training paused {gap:.1f} s during the outage"
    print(
        f"power-off -> agent pod deleted {seen.agent_deleted_at - seen.powered_off_at:.1f} s, -> new agent Running "
        f"{seen.agent_back_at - seen.powered_off_at:.1f} s, -> reconnected "
        f"{(seen.reconnected_at or float('nan')) - seen.powered_off_at:.1f} s; "
        f"{len(seen.steps_between(seen.powered_off_at, seen.agent_back_at))} steps during the outage"
    )
