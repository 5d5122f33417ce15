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
