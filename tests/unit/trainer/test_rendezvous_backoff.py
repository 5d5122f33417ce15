"""A node whose write of the shared rendezvous state lost the race pauses, with jitter, before it decides again on a
fresh read: the herd of retries that made large rounds never complete (``bench/scale_sim.py``) is spread out.

The holder runs torch's own state holder over a real store; two holders play two nodes."""

from __future__ import annotations

import pickle
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

from disttrain.common.ports import free_port
from disttrain.trainer.launch import rendezvous

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_no_pause_before_a_write_was_lost() -> None:
    assert rendezvous.lost_write_backoff(0, nodes=8, draw=lambda: 1.0) == 0.0


def test_the_span_doubles_with_each_lost_write_in_a_row_up_to_its_cap() -> None:
    spans = [rendezvous.lost_write_backoff(lost, nodes=8, draw=lambda: 1.0) for lost in range(1, 12)]
    assert spans[0] == rendezvous.LOST_WRITE_BACKOFF_S
    assert spans[1] == 2 * spans[0] and spans[2] == 4 * spans[0]
    assert max(spans) == rendezvous.LOST_WRITE_BACKOFF_MAX_S, "no cap for a small job"
    assert spans == sorted(spans)


def test_the_cap_grows_with_the_nodes_so_a_large_round_spreads_its_writes() -> None:
    small = rendezvous.lost_write_backoff(40, nodes=8, draw=lambda: 1.0)
    large = rendezvous.lost_write_backoff(40, nodes=32 * rendezvous.SYNC_POLL_NODES, draw=lambda: 1.0)
    assert large == 32 * small


def test_the_pause_is_drawn_over_the_whole_span() -> None:
    assert rendezvous.lost_write_backoff(5, nodes=8, draw=lambda: 0.0) == 0.0
    half = rendezvous.lost_write_backoff(5, nodes=8, draw=lambda: 0.5)
    assert half == rendezvous.lost_write_backoff(5, nodes=8, draw=lambda: 1.0) / 2


@pytest.fixture
def backend():
    store = TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    return c10d_rendezvous_backend.C10dRendezvousBackend(store, "backoff")


def holder_over(backend) -> rendezvous._ReconnectingStateHolder:
    settings = dyn.RendezvousSettings(
        "backoff", 1, 3, dyn.RendezvousTimeout(), keep_alive_interval=timedelta(seconds=5), keep_alive_max_attempt=3
    )
    return rendezvous._ReconnectingStateHolder(backend, settings, generation=lambda: 0)


def join(holder: rendezvous._ReconnectingStateHolder, node: dyn._NodeDesc) -> None:
    holder.state.participants[node] = 0
    holder.mark_dirty()


def test_a_lost_write_pauses_then_reads_the_state_as_it_is_after_the_pause(backend, monkeypatch) -> None:
    first, second = holder_over(backend), holder_over(backend)
    first.sync(), second.sync()  # both read the empty state
    a, b, c = (dyn._NodeDesc(f"host{i}", 100 + i, 0) for i in range(3))
    third = holder_over(backend)
    pauses: list[float] = []

    def pause(seconds: float) -> None:  # the first time, another node writes while this one pauses
        pauses.append(seconds)
        if len(pauses) > 1:
            return
        third.sync()
        join(third, c)
        assert third.sync() is True

    monkeypatch.setattr(rendezvous.time, "sleep", pause)
    monkeypatch.setattr(rendezvous.random, "random", lambda: 1.0)
    join(first, a)
    assert first.sync() is True
    join(second, b)

    assert second.sync() is False, "the write on a stale state won"
    assert pauses == [rendezvous.LOST_WRITE_BACKOFF_S]
    assert set(second.state.participants) == {a, c}, "decides on the state as the pause left it"
    assert set(pickle.loads(backend.get_state()[0]).participants) == {a, c}

    join(second, b)
    assert second.sync() is True, "the write on the fresh state lost"
    rendezvous.sync_fresh(first)
    join(first, dyn._NodeDesc("host3", 103, 0))
    assert first.sync() is True
    second.mark_dirty()
    assert second.sync() is False
    assert pauses == [rendezvous.LOST_WRITE_BACKOFF_S] * 2, "the count of lost writes starts again after a won one"
