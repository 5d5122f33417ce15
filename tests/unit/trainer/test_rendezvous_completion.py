"""torch's heartbeat expiry drops no node that is alive: not a participant slow to read that its round completed,
nor a node whose heartbeat write lost the race for the shared state while its launcher still beats.

torch's sanitizer drops a participant whose heartbeat expired, on whichever node reads the state. A participant
learns of its round's completion only at its next read; dropped before that (a starved launcher, a new pod's first
seconds), it waited for the next round while the others waited out the store's read timeout for the ``MASTER_ADDR``
it was to publish as rank 0. These tests run torch's own state holder and sanitizer over a real store."""

from __future__ import annotations

import pickle
from datetime import datetime, timedelta, timezone

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

from disttrain.common.ports import free_port
from disttrain.trainer.agent import heartbeats
from disttrain.trainer.launch import rendezvous

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

EXPIRY = timedelta(seconds=2)  # keep_alive_interval 1 s x keep_alive_max_attempt 2


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


@pytest.fixture
def backend(store: TCPStore):
    return c10d_rendezvous_backend.C10dRendezvousBackend(store, "completion")


def holder_over(backend, beats: rendezvous.NodeBeats | None = None) -> rendezvous._ReconnectingStateHolder:
    settings = dyn.RendezvousSettings(
        "completion",
        min_nodes=1,
        max_nodes=3,
        timeout=dyn.RendezvousTimeout(),
        keep_alive_interval=timedelta(seconds=1),
        keep_alive_max_attempt=2,
    )
    return rendezvous._ReconnectingStateHolder(backend, settings, generation=lambda: 0, beats=beats)


def nodes() -> list[dyn._NodeDesc]:
    return [dyn._NodeDesc(f"host{i}", 100 + i, 0) for i in range(3)]


def publish(backend, *, complete: bool, slow: dyn._NodeDesc, members: list[dyn._NodeDesc]) -> None:
    """A round of ``members`` (complete or forming) whose ``slow`` member's heartbeat expired while it waited."""
    state = dyn._RendezvousState()
    state.round = 4
    state.complete = complete
    now = datetime.now(timezone.utc)
    for rank, node in enumerate(members):
        state.participants[node] = rank
        state.last_heartbeats[node] = now - (EXPIRY + timedelta(seconds=3)) if node == slow else now
    token = backend.get_state()
    backend.set_state(pickle.dumps(state), token[1] if token else None)


def test_a_completed_rounds_slow_participant_stays_in_it_for_the_grace(backend) -> None:
    members = nodes()
    slow = members[0]  # rank 0: the one that publishes the round's MASTER_ADDR
    publish(backend, complete=True, slow=slow, members=members)
    holder = holder_over(backend)

    holder.sync()

    assert holder.state.complete and set(holder.state.participants) == set(members), "the slow rank 0 was dropped"
    written = pickle.loads(backend.get_state()[0])
    assert written.last_heartbeats[slow] < datetime.now(timezone.utc) - EXPIRY, "the hold wrote heartbeats"
    assert holder.state.last_heartbeats[slow] == written.last_heartbeats[slow], "the held heartbeat was not restored"


def test_after_the_grace_torchs_expiry_applies_again(backend, monkeypatch: pytest.MonkeyPatch) -> None:
    members = nodes()
    publish(backend, complete=True, slow=members[1], members=members)
    holder = holder_over(backend)
    holder.sync()
    assert members[1] in holder.state.participants

    monkeypatch.setattr(rendezvous, "COMPLETION_GRACE_S", 0.0)
    rendezvous.sync_fresh(holder)  # a read now, not the holder's one-second cache

    assert members[1] not in holder.state.participants
    assert set(holder.state.participants) == {members[0], members[2]}


def test_a_round_still_forming_drops_an_expired_participant_as_torch_does(backend) -> None:
    members = nodes()
    publish(backend, complete=False, slow=members[2], members=members)
    holder = holder_over(backend)

    holder.sync()

    assert set(holder.state.participants) == {members[0], members[1]}


def beat(store: TCPStore, node: dyn._NodeDesc, age_s: float, *, leaving: bool = False) -> None:
    """The node's launcher beat ``age_s`` ago, under its own key (its last, as it left, with ``leaving``)."""
    at = datetime.now(timezone.utc).timestamp() - age_s
    store.set(heartbeats.beat_key("completion", node), heartbeats.encode_beat(at, leaving=leaving))


def test_a_node_that_still_beats_stays_whatever_its_heartbeat_in_the_state(backend, store) -> None:
    members = nodes()
    publish(backend, complete=False, slow=members[0], members=members)
    beat(store, members[0], age_s=0.2)  # its keep-alive lost the race for the state; its launcher beats on
    holder = holder_over(backend, rendezvous.beats_reader(store, "completion"))

    holder.sync()

    assert set(holder.state.participants) == set(members)


@pytest.mark.parametrize("how", ["silent", "left", "never beat"])
def test_a_node_whose_beat_stopped_or_never_came_is_dropped_at_torchs_expiry(backend, store, how: str) -> None:
    members = nodes()
    publish(backend, complete=False, slow=members[0], members=members)
    if how == "silent":
        beat(store, members[0], age_s=(EXPIRY + timedelta(seconds=1)).total_seconds())
    elif how == "left":
        beat(store, members[0], age_s=0.2, leaving=True)
    for other in members[1:]:
        beat(store, other, age_s=0.2)
    holder = holder_over(backend, rendezvous.beats_reader(store, "completion"))

    holder.sync()

    assert set(holder.state.participants) == {members[1], members[2]}
