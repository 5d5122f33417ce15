"""What keeps a large round's traffic on the agent's store from growing with the square of its nodes: the agent's
beat summary read instead of one beat per node, no keep-alive writes of the whole state after a large round while
the node's own beat runs, a loss checked only in the round it was declared for, and a monitor loop that reads the
state less often the more nodes it holds. Real stores, torch's own state and operations."""

from __future__ import annotations

import pickle
import time
from datetime import datetime, timedelta, timezone

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters, c10d_rendezvous_backend
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

from disttrain.api import control
from disttrain.trainer.agent import heartbeats
from disttrain.trainer.launch import rendezvous

pytestmark = [pytest.mark.unit]

RUN = "scale"
SETTINGS = dyn.RendezvousSettings(
    RUN, 1, 2048, dyn.RendezvousTimeout(), keep_alive_interval=timedelta(seconds=1), keep_alive_max_attempt=3
)


@pytest.fixture
def store() -> TCPStore:
    # port 0: the kernel's, no race with another process for a port found free
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def nodes(count: int) -> list[dyn._NodeDesc]:
    return [dyn._NodeDesc(f"10.0.{i // 250}.{i % 250}", 100 + i, 0) for i in range(count)]


def beat(store: TCPStore, node: object, at: float) -> None:
    store.set(heartbeats.beat_key(RUN, node), heartbeats.encode_beat(at))


def test_a_large_round_takes_the_beats_from_the_agents_fresh_summary_and_reads_only_the_others(store) -> None:
    members = [str(node) for node in nodes(40)]
    summary_at = time.time() - 0.3
    held = dict.fromkeys(members[:-1], summary_at - 0.1)
    heartbeats.write_beat_summary(store, RUN, heartbeats.BeatSummary(time.time(), held))
    beat(store, members[0], summary_at - 100)  # the node's own key is not read: the summary answers for it
    beat(store, members[-1], summary_at)  # not in the summary: its own key is read

    found = rendezvous.beats_reader(store, RUN)(frozenset(members))

    assert set(found) == set(members)
    assert abs(found[members[0]].timestamp() - held[members[0]]) < 0.01
    assert abs(found[members[-1]].timestamp() - summary_at) < 0.01


def test_a_stale_summary_is_not_used(store) -> None:
    members = [str(node) for node in nodes(40)]
    old = time.time() - 2 * rendezvous.SUMMARY_FRESH_S - 1
    heartbeats.write_beat_summary(store, RUN, heartbeats.BeatSummary(old, dict.fromkeys(members, old)))
    beat(store, members[0], time.time())

    found = rendezvous.beats_reader(store, RUN)(frozenset(members))

    assert set(found) == {members[0]}, "only a beat the node wrote itself; the old summary says nothing"


@pytest.mark.parametrize(
    "raw", [b"", b"[]", b'{"time": 1}', b'{"time": "x", "ages_ms": {}}', b'{"time": 1, "ages_ms": {"a": 0.5}}']
)
def test_a_summary_that_is_not_one_is_none(raw: bytes) -> None:
    assert heartbeats.BeatSummary.decode(raw) is None


def finished_round(backend, members: list[dyn._NodeDesc], heartbeat_age_s: float) -> None:
    state = dyn._RendezvousState()
    state.round, state.complete = 5, True
    at = datetime.now(timezone.utc) - timedelta(seconds=heartbeat_age_s)
    for rank, node in enumerate(members):
        state.participants[node] = rank
        state.last_heartbeats[node] = at
    token = backend.get_state()
    backend.set_state(pickle.dumps(state), token[1] if token else None)


@pytest.mark.parametrize("size, beating, written", [(40, True, False), (40, False, True), (3, True, True)])
def test_after_a_large_round_a_beating_node_writes_no_keep_alive(store, size, beating, written) -> None:
    backend = c10d_rendezvous_backend.C10dRendezvousBackend(store, RUN)
    members = nodes(size)
    finished_round(backend, members, heartbeat_age_s=1.5)  # a keep-alive is due, none expired yet
    holder = rendezvous._ReconnectingStateHolder(backend, SETTINGS, generation=lambda: 0)
    holder.sync()
    executor = rendezvous._TargetAwareOpExecutor(members[0], holder, SETTINGS, lambda: None, "", store, 0)
    executor.beating = lambda: beating
    before = backend.get_state()

    executor.run(dyn._RendezvousKeepAliveOp(), time.monotonic() + 10)

    after = backend.get_state()
    assert (after != before) == written
    if written:
        state = pickle.loads(after[0])
        assert state.last_heartbeats[members[0]] > datetime.now(timezone.utc) - timedelta(seconds=1)


def test_a_loss_is_checked_only_in_the_round_it_was_declared_for() -> None:
    members = nodes(3)
    state = dyn._RendezvousState()
    state.round, state.complete = 4, True
    for rank, node in enumerate(members):
        state.participants[node] = rank
    executor = rendezvous._TargetAwareOpExecutor(members[0], None, SETTINGS, lambda: None, "", None, 0)
    declared_before = control.TargetPlan(generation=2, nodes=2, lost=["worker-2"], job_uid="uid", round=3)

    # No store: reading the participants' names would raise. The round was formed after the loss was declared.
    assert executor._lost_participants(state, declared_before, members[0]) == []


def test_the_monitor_loop_reads_a_large_rounds_state_less_often() -> None:
    assert rendezvous.monitor_read_seconds(3) == rendezvous.monitor_read_seconds(32) == 1.0
    assert rendezvous.monitor_read_seconds(1024) == 1024 / rendezvous.MONITOR_READS_PER_S


def test_one_waiting_node_at_a_time_tries_to_close_a_round(store) -> None:
    from disttrain.trainer.launch import joins

    now = time.time()
    assert joins.claim_closing(store, RUN, 7, "node-a", now)
    assert not joins.claim_closing(store, RUN, 7, "node-b", now + 1), "node-a's try holds the others off"
    assert joins.claim_closing(store, RUN, 7, "node-a", now + 1), "the holder tries again"
    assert joins.claim_closing(store, RUN, 8, "node-b", now + 1), "a claim of an earlier round holds nothing"
    assert joins.claim_closing(store, RUN, 8, "node-a", now + 2 + joins.CLOSING_HOLD_S), "a dead holder's expires"


def test_a_claim_given_up_frees_the_round_for_the_next_try(store) -> None:
    from disttrain.trainer.launch import joins

    now = time.time()
    assert joins.claim_closing(store, RUN, 3, "node-a", now)
    joins.release_closing(store, RUN, "node-b")  # not its claim: nothing changes
    assert not joins.claim_closing(store, RUN, 3, "node-b", now)
    joins.release_closing(store, RUN, "node-a")
    assert joins.claim_closing(store, RUN, 3, "node-b", now)


@pytest.mark.parametrize(
    ("max_nodes", "silence", "period"),
    [
        (3, 1.0, 0.1),  # small jobs beat ten times a second
        (256, 1.0, 0.1),
        (1024, 1.0, 0.25),  # 4,096 beats a second at the agent
        (2048, 1.0, 0.25),  # the silence caps it: 4 beats within it
        (2048, 5.0, 0.5),
        (1024, 0.5, 0.125),
    ],
)
def test_a_large_job_beats_less_often_but_four_times_within_its_silence(max_nodes, silence, period) -> None:
    params = RendezvousParameters("disttrain", "127.0.0.1:1", "run", 1, max_nodes, silent_after=str(silence))
    assert rendezvous.beat_interval(params) == pytest.approx(period)


@pytest.mark.parametrize("raw", ["soon", "0", "-1"])
def test_a_bad_silence_in_the_rdzv_conf_is_named(raw) -> None:
    params = RendezvousParameters("disttrain", "127.0.0.1:1", "run", 1, 8, silent_after=raw)
    with pytest.raises(ValueError, match=f"rdzv-conf silent_after is '{raw}'"):
        rendezvous.beat_interval(params)


def test_the_agent_reads_the_beats_once_per_beat_period() -> None:
    """Every agent round (0.1 s) for a job that beats ten times a second; every other round at 1,024 nodes."""
    assert heartbeats.read_due(10.0, 10.1, 256, 1.0)
    assert not heartbeats.read_due(10.0, 10.1, 1024, 1.0)
    assert heartbeats.read_due(10.0, 10.21, 1024, 1.0)
