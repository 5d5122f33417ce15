"""The watchdog against a real TCPStore: each signal generation is acted on once, history is ignored."""

from datetime import timedelta

import pytest
import torch.distributed as dist

from disttrain.api import control, env
from disttrain.api.exitcodes import ExitCode
from disttrain.trainer.control import Watchdog, parse_endpoint, read_signal
from disttrain.trainer.store import channel


@pytest.fixture
def store(monkeypatch):
    # Port 0: the server binds a port of its own choosing. A port probed free and then bound left a window in
    # which another listener (a CI run's leftover store) could take it, and the watchdog then read that store's
    # signals: a failed CI run saw the drain of generation 1 ignored as history.
    raw = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    monkeypatch.setenv(env.STORE_SECRET, "w" * 64)  # the watchdog's channel is signed with the job's secret
    monkeypatch.delenv(env.STORE_SECRET_FILE, raising=False)
    monkeypatch.setenv(env.JOB_UID, "uid-w")
    yield channel.scoped(raw, "w" * 64, "uid-w"), f"127.0.0.1:{raw.port}"
    del raw


def signal(server, generation: int, action: str) -> None:
    server.set(control.SIGNAL_KEY, control.ControlSignal(generation=generation, action=action).model_dump_json())
    # TCPStore's set sends without waiting for an answer, so the watchdog's own connection could read before the server
    # had taken it (a CI run saw the drain of generation 1 "ignored": the store held it a moment later). A get on the
    # same connection is answered only after the set: the signal is in the store when this returns.
    server.get(control.SIGNAL_KEY)


def test_a_generation_present_at_startup_is_history(store):
    server, endpoint = store
    signal(server, 5, "reform")
    exits: list[int] = []
    dog = Watchdog(endpoint, exit_fn=exits.append)
    dog.connect()
    dog.start()
    dog.stop()
    dog.poll_once()
    assert exits == [] and not dog.drain_requested


def test_a_replayed_older_directive_cannot_lower_a_fresh_workers_history(store):
    """A stranger put generation 5 back under the signal key while the agent's plan says 6 (the reform that formed
    this worker's round): the worker takes 6 as history, and when the signal is put right it does not reform again."""
    server, endpoint = store
    plan = control.TargetPlan(generation=6, nodes=2, job_uid="uid-w")
    server.set(control.TARGET_KEY, plan.model_dump_json())
    signal(server, 5, "reform")  # the replay, seen first
    exits: list[int] = []
    dog = Watchdog(endpoint, exit_fn=exits.append)
    dog.connect()
    assert dog.seen_generation == 6
    signal(server, 6, "reform")  # the agent's guardian puts the newest directive back
    dog.poll_once()
    assert exits == [] and not dog.drain_requested
    signal(server, 7, "reform")  # a new directive is still acted on
    dog.poll_once()
    assert exits == [int(ExitCode.REFORM)]


def test_a_generation_recorded_in_the_checkpoint_is_history(store):
    server, endpoint = store
    exits: list[int] = []
    dog = Watchdog(endpoint, exit_fn=exits.append)
    dog.connect()
    signal(server, 7, "drain")  # written after start, but the checkpoint says we already drained for it
    dog.seen_generation = max(dog.seen_generation, 7)
    dog.poll_once()
    assert not dog.drain_requested


def test_drain_sets_the_flag_and_reform_exits_at_once_each_only_once(store):
    server, endpoint = store
    exits: list[int] = []
    dog = Watchdog(endpoint, exit_fn=exits.append)
    dog.connect()
    dog.poll_once()
    assert not dog.drain_requested  # no key yet: check() instead of a blocking get()
    signal(server, 1, "drain")
    dog.poll_once()
    assert dog.drain_requested, f"seen generation {dog.seen_generation}, store holds {read_signal(dog.store)}"
    assert "generation 1" in dog.drain_reason
    signal(server, 2, "reform")
    dog.poll_once()
    dog.poll_once()
    assert exits == [int(ExitCode.REFORM)]


def test_no_endpoint_means_no_channel():
    dog = Watchdog(None)
    dog.connect()
    dog.start()
    assert dog.store is None


@pytest.mark.parametrize("bad", ["nohost", "host:port", ":123"])
def test_a_malformed_endpoint_is_named(bad):
    with pytest.raises(ValueError, match="host:port"):
        parse_endpoint(bad)


def stamped(server, generation: int, action: str, round_: int, *, plan: bool = False) -> None:
    """The directive as the agent publishes it: stamped with the round it was issued for (and its target plan)."""
    if plan:
        target = control.TargetPlan(generation=generation, nodes=2, job_uid="uid-w", round=round_)
        server.set(control.TARGET_KEY, target.model_dump_json())
    value = control.ControlSignal(generation=generation, action=action, job_uid="uid-w", round=round_)
    server.set(control.SIGNAL_KEY, value.model_dump_json())
    server.get(control.SIGNAL_KEY)


def test_a_replay_of_both_the_signal_and_the_plan_cannot_make_a_worker_of_a_later_round_reform(store, monkeypatch):
    """Generation 6 (issued in round 3) formed this worker's round 4. A process past the front replayed generation 5
    under both keys, so the fresh worker's history is 5; when generation 6 comes back it is not acted on: it was
    issued for round 3. It is counted, logged once, and becomes history; generation 7, issued in round 4, is obeyed."""
    server, endpoint = store
    monkeypatch.setenv(env.RENDEZVOUS_ROUND, "4")
    stamped(server, 5, "reform", 2, plan=True)  # the replay, seen first
    exits: list[int] = []
    dog = Watchdog(endpoint, exit_fn=exits.append)
    dog.connect()
    assert dog.round == 4 and dog.seen_generation == 5
    stamped(server, 6, "reform", 3, plan=True)  # the agent's guardian puts the newest back
    dog.poll_once()
    dog.poll_once()
    assert exits == [] and not dog.drain_requested
    assert dog.refused["earlier-round"] == 1 and dog.seen_generation == 6, "counted once: then it is history"
    stamped(server, 5, "reform", 2)  # replayed again: now below the history
    dog.poll_once()
    assert exits == [] and dog.refused["older"] == 1 and dog.seen_generation == 6, "the history never goes down"
    stamped(server, 7, "reform", 4)
    dog.poll_once()
    assert exits == [int(ExitCode.REFORM)]


def test_a_worker_that_joins_a_new_round_in_place_takes_its_round(store, monkeypatch):
    """In place the process outlives its round: the launcher hands it the next round's environment, and a directive
    of the round it left is no longer its own."""
    server, endpoint = store
    monkeypatch.setenv(env.RENDEZVOUS_ROUND, "1")
    exits: list[int] = []
    dog = Watchdog(endpoint, exit_fn=exits.append)
    dog.connect()
    monkeypatch.setenv(env.RENDEZVOUS_ROUND, "2")  # what the handover puts in os.environ
    dog.mark_history()
    assert dog.round == 2
    stamped(server, 3, "drain", 1)
    dog.poll_once()
    assert not dog.drain_requested and dog.refused["earlier-round"] == 1
    stamped(server, 4, "drain", 2)
    dog.poll_once()
    assert dog.drain_requested
