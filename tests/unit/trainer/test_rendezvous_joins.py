"""Per-node joins: each node writes a join record of its own, and one node closes the round in one write of torch's
state (:mod:`disttrain.trainer.launch.joins`). The choice is pure; the rounds run the real handler
(:func:`rendezvous.create_handler`, signed store, beats) in threads against a real TCPStore."""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters, c10d_rendezvous_backend
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

from disttrain.api import control, env
from disttrain.common.ports import free_port
from disttrain.trainer.agent import heartbeats
from disttrain.trainer.launch import joins, rendezvous
from disttrain.trainer.store import channel

pytestmark = [pytest.mark.timeout(60)]

RUN = "joins"


def record(pid: int, index: int | None, name: str = "", round_: int = 0) -> joins.JoinRecord:
    return joins.JoinRecord(round_, "host", pid, 0, name or f"worker-{pid}", index)


@pytest.mark.unit
def test_the_round_takes_the_first_live_nodes_by_index_up_to_the_target() -> None:
    joined = {f"n{pid}": record(pid, index) for pid, index in ((1, 3), (2, 0), (3, 2), (4, 1), (5, None))}

    chosen = joins.choose([], joined, 3, refused=(), alive=lambda node: node != "n4")

    assert chosen == ["n2", "n3", "n1"], "index 1 is silent: the next indices fill the round"


@pytest.mark.unit
def test_participants_already_in_the_state_stay_and_count() -> None:
    joined = {"n1": record(1, 1), "n2": record(2, 2)}

    assert joins.choose(["old"], joined, 2, refused=(), alive=lambda node: True) == ["old", "n1"]


@pytest.mark.unit
def test_excluded_lost_and_silent_nodes_never_make_up_the_target() -> None:
    joined = {"n1": record(1, 0, "worker-a"), "n2": record(2, 1, "worker-b"), "n3": record(3, 2)}

    assert joins.choose([], joined, 2, refused={"worker-a"}, alive=lambda node: node != "n3") is None
    assert joins.choose([], joined, 2, refused={"worker-a"}, alive=lambda node: True) == ["n2", "n3"]


@pytest.mark.unit
def test_a_record_round_trips_and_anything_else_is_no_record() -> None:
    made = record(7, 4, "worker-7", round_=3)

    assert joins.JoinRecord.from_json(made.to_json().encode()) == made
    assert made.node_name == "host_7_0"
    for junk in (b"", b"[]", b'{"round": "3"}', b'{"round": 1, "addr": "h", "pid": 1.5, "local_id": 0}'):
        assert joins.JoinRecord.from_json(junk) is None, junk


@pytest.mark.unit
def test_a_bucket_counter_counts_the_slots_of_its_round_only() -> None:
    counter = joins.parse_counter(joins.counter_value(4, 3, "host_7_0").encode())

    assert joins.slots_taken(counter, 4) == 3
    assert joins.slots_taken(counter, 5) == 0, "a counter of an earlier round counts nothing in the next"
    assert joins.slots_taken(None, 0) == 0
    assert joins.parse_counter(b"3") is None and joins.parse_counter(b"x:1:n") is None


@pytest.mark.unit
def test_consecutive_node_indices_spread_over_the_buckets() -> None:
    buckets = [joins.bucket_of(record(pid, pid)) for pid in range(4 * joins.BUCKETS)]

    assert all(buckets.count(bucket) == 4 for bucket in range(joins.BUCKETS))
    assert 0 <= joins.bucket_of(record(1, None)) < joins.BUCKETS


@pytest.mark.unit
@pytest.mark.parametrize("wanted, period", [(1, joins.CLOSE_TRY_MIN_S), (1024, 1024 / joins.CLOSE_TRIES_PER_S)])
def test_the_tries_to_close_a_round_stay_a_few_a_second_however_many_nodes_wait(wanted: int, period: float) -> None:
    assert joins.close_try_period(wanted) == pytest.approx(period)
    assert wanted / joins.close_try_period(wanted) <= joins.CLOSE_TRIES_PER_S + 1e-9


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, Any]]:
    """A real store and the job's scoped client of it, with the target plan of 3 nodes published."""
    monkeypatch.setenv(env.STORE_SECRET, "joins-test-" + "5" * 48)
    monkeypatch.setenv(env.JOB_UID, "joins-job")
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False)
    client = channel.scoped(TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)))
    client.set(control.TARGET_KEY, control.TargetPlan(generation=1, nodes=3, job_uid="joins-job").model_dump_json())
    yield port, client
    del server


def handler(port: int, index: int, monkeypatch: pytest.MonkeyPatch) -> rendezvous.DisttrainRendezvousHandler:
    monkeypatch.setenv(env.NODE_NAME, f"worker-{index}")
    monkeypatch.setenv(env.NODE_INDEX, str(index))
    params = RendezvousParameters(
        "disttrain",
        f"127.0.0.1:{port}",
        RUN,
        1,
        8,
        is_host="false",
        read_timeout=10,
        join_timeout=30,
        per_node_joins_above=0,
    )
    made = rendezvous.create_handler(params)
    assert isinstance(made, rendezvous.DisttrainRendezvousHandler)
    return made


def join_all(handlers: list[rendezvous.DisttrainRendezvousHandler]) -> dict[int, tuple[int, int]]:
    """Every handler's next_rendezvous at once: (rank, world size) by position."""
    found: dict[int, tuple[int, int]] = {}
    failures: list[BaseException] = []

    def join(position: int) -> None:
        try:
            info = handlers[position].next_rendezvous()
            found[position] = (info.rank, info.world_size)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(handlers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(40)
    assert not failures, failures
    return found


def stop(handlers: list[rendezvous.DisttrainRendezvousHandler]) -> None:
    for made in handlers:
        made._stop_heartbeats()
        if made.beat is not None:
            made.beat.stop()


def test_nodes_joining_by_record_form_one_round_in_torchs_state_with_ranks_by_index(job, monkeypatch) -> None:
    port, client = job
    handlers = [handler(port, index, monkeypatch) for index in (2, 0, 1)]
    try:
        found = join_all(handlers)

        assert found == {0: (2, 3), 1: (0, 3), 2: (1, 3)}, "ranks follow the node indices"
        view = heartbeats.read_state(client, RUN)  # the job agent's reader of torch's state
        assert view is not None and view.complete and view.round == 0
        assert view.participants == {heartbeats.node_name(made._this_node) for made in handlers}
        assert joins.is_closed(client, RUN, 0)
    finally:
        stop(handlers)


def test_a_node_whose_beat_fell_silent_after_its_join_record_is_left_out(job, monkeypatch) -> None:
    port, client = job
    ghost = dyn._NodeDesc("127.0.0.1", 999_999, 0)  # index 0 would come first; it never beats
    ghost_record = joins.JoinRecord(0, ghost.addr, ghost.pid, 0, "worker-ghost", 0)
    bucket = joins.bucket_of(ghost_record)
    joins.write_record(client, RUN, bucket, joins.take_slot(client, RUN, bucket, ghost_record), ghost_record)
    handlers = [handler(port, index, monkeypatch) for index in (1, 2, 3)]
    try:
        found = join_all(handlers)

        assert found == {0: (0, 3), 1: (1, 3), 2: (2, 3)}
        view = heartbeats.read_state(client, RUN)
        assert view is not None and heartbeats.node_name(ghost) not in view.participants
        assert joins.is_closed(client, RUN, 0), "closed by a node that joined by record"
    finally:
        stop(handlers)


def test_nodes_taking_slots_of_one_bucket_at_once_each_get_a_slot_of_their_own(job) -> None:
    port, _ = job
    taken: list[int] = []

    def take(pid: int) -> None:
        store = channel.scoped(TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)))
        taken.append(joins.take_slot(store, RUN, 0, record(pid, 0, round_=2)))

    threads = [threading.Thread(target=take, args=(pid,)) for pid in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert sorted(taken) == list(range(1, 9))


def test_a_node_that_comes_after_the_round_closed_waits_for_the_next_in_torchs_wait_list(job, monkeypatch) -> None:
    port, client = job
    client.set(control.TARGET_KEY, control.TargetPlan(generation=2, nodes=2, job_uid="joins-job").model_dump_json())
    handlers = [handler(port, index, monkeypatch) for index in (0, 1, 2)]
    try:
        assert join_all(handlers[:2]) == {0: (0, 2), 1: (1, 2)}
        ended: list[BaseException] = []

        def join_late() -> None:
            try:
                handlers[2].next_rendezvous()
            except RendezvousClosedError as exc:
                ended.append(exc)

        late = threading.Thread(target=join_late, daemon=True)
        late.start()
        backend = c10d_rendezvous_backend.C10dRendezvousBackend(client, RUN)
        deadline = time.monotonic() + 20
        state = None
        while time.monotonic() < deadline:
            state = pickle.loads(backend.get_state()[0])
            if handlers[2]._this_node in state.wait_list:
                break
            time.sleep(0.1)
        assert state is not None and handlers[2]._this_node in state.wait_list, "the late node waits for round 1"
        assert state.round == 0 and state.complete and len(state.participants) == 2
        handlers[0].set_closed()  # the job ends: the late node's join ends with it
        late.join(20)
        assert ended, "the late node's join ended when the rendezvous closed"
    finally:
        stop(handlers)
