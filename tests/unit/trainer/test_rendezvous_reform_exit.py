"""In a reform the survivors leave the finished round together, in one write of the shared state, and a node that
waits in a join while its own beat runs writes no keep-alive into the state.

Stock c10d, each survivor removes itself and the next round opens once the last one did; with every keep-alive a
compare-and-set of the whole state too, a reform of 128 simulated nodes took a minute (``bench/scale_sim.py``).
These tests run the handler's executor on torch's own state and operations."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Optional

import pytest
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

from disttrain.api import control
from disttrain.trainer.launch import rendezvous

pytestmark = [pytest.mark.unit]

SETTINGS = dyn.RendezvousSettings(
    "reform", 1, 8, dyn.RendezvousTimeout(), keep_alive_interval=timedelta(seconds=5), keep_alive_max_attempt=3
)
NODES = [dyn._NodeDesc(f"host{i}", 100 + i, 0) for i in range(3)]


def finished_round(number: int) -> dyn._RendezvousState:
    state = dyn._RendezvousState()
    state.round, state.complete = number, True
    now = datetime.now(timezone.utc)
    for rank, node in enumerate(NODES):
        state.participants[node] = rank
        state.last_heartbeats[node] = now
    return state


def executor(target: Optional[control.TargetPlan], beating: bool = False) -> rendezvous._TargetAwareOpExecutor:
    made = rendezvous._TargetAwareOpExecutor(NODES[0], None, SETTINGS, lambda: target, "worker-0", None, 0, "uid-0")
    made.beating = lambda: beating
    return made


def reform(round_: int, lost: tuple[str, ...] = ("worker-2",)) -> control.TargetPlan:
    return control.TargetPlan(generation=2, nodes=2, lost=list(lost), job_uid="uid", round=round_)


def leave(target: Optional[control.TargetPlan], state: dyn._RendezvousState) -> dyn._Action:
    ctx = dyn._RendezvousContext(NODES[0], state, SETTINGS)
    return executor(target)._exit_with_target(dyn._RendezvousExitOp(), ctx, deadline=float("inf"))


def test_the_first_survivor_of_a_reform_takes_every_participant_out_and_opens_the_next_round() -> None:
    state = finished_round(3)

    action = leave(reform(3), state)

    assert action is dyn._Action.KEEP_ALIVE, "the state must be written"
    assert state.participants == {} and state.round == 4 and not state.complete
    assert not set(state.last_heartbeats) & set(NODES[1:]), "the others' heartbeats stay behind"


def test_a_survivor_that_finds_the_round_left_writes_nothing() -> None:
    state = finished_round(3)
    leave(reform(3), state)

    assert leave(reform(3), state) is dyn._Action.FINISH


@pytest.mark.parametrize(
    "target",
    [None, reform(2), control.TargetPlan(generation=2, nodes=3, job_uid="uid", round=3)],
    ids=["no-target", "a-directive-of-an-earlier-round", "no-node-lost"],
)
def test_otherwise_each_node_leaves_alone_as_torch_does(target: Optional[control.TargetPlan]) -> None:
    state = finished_round(3)

    assert leave(target, state) is dyn._Action.REMOVE_FROM_PARTICIPANTS
    assert set(state.participants) == set(NODES) and state.round == 3 and state.complete


def test_a_round_still_forming_is_left_as_torch_does() -> None:
    state = finished_round(3)
    state.complete = False

    assert leave(reform(3), state) is dyn._Action.REMOVE_FROM_PARTICIPANTS
    assert set(state.participants) == set(NODES)


def waiting_for_its_round(stale_by: timedelta) -> dyn._RendezvousContext:
    """A node in the forming round 4 with two more to come, its heartbeat in the state ``stale_by`` old."""
    state = dyn._RendezvousState()
    state.round = 4
    state.participants[NODES[0]] = 0
    state.last_heartbeats[NODES[0]] = datetime.now(timezone.utc) - stale_by
    return dyn._RendezvousContext(NODES[0], state, SETTINGS)


@pytest.mark.parametrize("beating, wanted", [(True, dyn._Action.SYNC), (False, dyn._Action.KEEP_ALIVE)])
def test_a_waiting_node_keeps_alive_in_the_state_only_without_its_own_beat(beating: bool, wanted) -> None:
    target = control.TargetPlan(generation=2, nodes=3, job_uid="uid", round=3)
    ctx = waiting_for_its_round(stale_by=timedelta(seconds=6))

    assert executor(target, beating)._join_with_target(dyn._RendezvousJoinOp(), ctx, float("inf")) is wanted


def test_a_fresh_heartbeat_needs_no_keep_alive_either_way() -> None:
    target = control.TargetPlan(generation=2, nodes=3, job_uid="uid", round=3)
    ctx = waiting_for_its_round(stale_by=timedelta(seconds=1))

    assert executor(target, False)._join_with_target(dyn._RendezvousJoinOp(), ctx, float("inf")) is dyn._Action.SYNC
