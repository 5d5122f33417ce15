"""torchrun's exit barrier as the launcher builds it (:meth:`CountingAgent._exit_barrier`,
:mod:`disttrain.trainer.launch.exitbarrier`), on a real signed store with the agent's guardian: a finished job's
nodes leave
together, promptly without a stranger and before the barrier's timeout while one deletes every key."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from disttrain.trainer.agent.guardian import Guardian
from disttrain.trainer.launch import exitbarrier
from disttrain.trainer.launch.launcher import CountingAgent
from disttrain.trainer.store import channel

SECRET, UID = "e" * 64, "uid-exit"
WORLD = 3
TIMEOUT_S = 120.0
ARRIVAL_GAP_S = 0.7


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))


def _node(port: int, rank: int) -> Any:
    """What ``_exit_barrier`` reads of its agent: the round's store (as torch's rendezvous hands it), the group."""
    store = dist.PrefixStore("torch.rendezvous.run.0", channel.scoped(_client(port), SECRET, UID))
    group = types.SimpleNamespace(
        spec=types.SimpleNamespace(role="default"), state="SUCCEEDED", group_world_size=WORLD, group_rank=rank
    )
    return types.SimpleNamespace(
        _store=store, _worker_group=group, _exit_barrier_timeout=TIMEOUT_S, _in_exit_barrier=False
    )


@pytest.fixture
def port() -> Iterator[int]:
    """The agent's store server with its guardian."""
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True, timeout=timedelta(seconds=10)
    )
    guardian = Guardian(_client(server.port), SECRET, UID)
    guardian.start()
    yield server.port
    guardian.stop()


def _run_barrier(port: int, ranks: range) -> tuple[float, dict[int, float]]:
    """Every node in ``ranks`` enters the barrier, ``ARRIVAL_GAP_S`` apart; (start, when each left)."""
    left: dict[int, float] = {}

    def arrive(rank: int) -> None:
        time.sleep(ARRIVAL_GAP_S * rank)  # the nodes' workers finish at different times
        CountingAgent._exit_barrier(_node(port, rank))  # type: ignore[arg-type]
        left[rank] = time.monotonic()

    start = time.monotonic()
    nodes = [threading.Thread(target=arrive, args=(rank,), daemon=True) for rank in ranks]
    for node in nodes:
        node.start()
    for node in nodes:
        node.join(TIMEOUT_S + 10)
    assert sorted(left) == list(ranks), f"nodes still in the barrier: {set(ranks) - set(left)}"
    return start, left


def test_without_a_stranger_every_node_leaves_as_soon_as_the_last_one_arrives(port: int) -> None:
    start, left = _run_barrier(port, range(WORLD))
    last_arrival = start + ARRIVAL_GAP_S * (WORLD - 1)
    assert min(left.values()) >= last_arrival - 0.1, "a node left before the last one arrived"
    assert max(left.values()) - last_arrival < exitbarrier.LINGER_S / 2, f"a node lingered: {left}"


ATTACKER = """
import os, sys, datetime, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=10))
deleted = reported = 0
print("ready", flush=True)
while True:
    for key in store.list_keys():
        deleted += store.delete_key(key)
    if deleted > reported:  # the count replaced at once: the test never reads a file half written
        with open(sys.argv[2] + ".tmp", "w") as out:
            out.write(str(deleted))
        os.replace(sys.argv[2] + ".tmp", sys.argv[2])
        reported = deleted
"""


def test_the_exit_barrier_completes_while_an_outsider_deletes_every_key(port: int, tmp_path: Path) -> None:
    """The stranger is a process of its own (as on a cluster), deleting every key as fast as the server lists them."""
    count = tmp_path / "deleted"
    attacker = subprocess.Popen(
        [sys.executable, "-c", ATTACKER, str(port), str(count)],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert attacker.stdout is not None and attacker.stdout.readline().strip() == "ready"
        start, left = _run_barrier(port, range(WORLD))
        assert max(left.values()) - start < TIMEOUT_S / 2, f"a node waited for the barrier's timeout: {left}"
        assert min(left.values()) - start >= ARRIVAL_GAP_S * (WORLD - 1) - 0.1, "a node left before the last arrived"
        assert count.exists() and int(count.read_text() or 0) > 0, "the outsider deleted nothing: it proved nothing"
    finally:
        attacker.kill()
        attacker.communicate(timeout=10)


def test_a_node_that_never_arrives_holds_the_others_until_the_timeout(port: int) -> None:
    """Nobody leaves early: a node whose workers still run keeps the group's agents (and its store) in place."""
    stores = [channel.scoped(_client(port), SECRET, UID) for _ in range(2)]
    started = time.monotonic()
    results = [False, False]

    def enter(rank: int) -> None:
        results[rank] = exitbarrier.wait_for_all(stores[rank], WORLD, rank, timeout_s=2.0)

    threads = [threading.Thread(target=enter, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == [False, False]
    assert time.monotonic() - started >= 2.0


class Handler:
    """The rendezvous handler's ``target()``: the operator's directive generation, as the agent relays it."""

    def __init__(self) -> None:
        self.generation = 4

    def target(self) -> Any:
        return types.SimpleNamespace(generation=self.generation)


def test_a_directive_while_the_others_wait_for_a_lost_node_ends_the_barrier_at_once(port: int) -> None:
    """Every worker finished and waits in the barrier for a node that was lost (it never arrives): the operator's
    reform directive for the loss ends the barrier for the survivors instead of its timeout, so the job does not
    stay Running for minutes after its training ended."""
    handler = Handler()
    survivors = [_node(port, rank) for rank in range(WORLD - 1)]
    for node in survivors:
        node._worker_group.spec.rdzv_handler = handler
        node._exit_barrier_timeout = 600.0
    threads = [
        threading.Thread(target=CountingAgent._exit_barrier, args=(node,), daemon=True)  # type: ignore[arg-type]
        for node in survivors
    ]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    assert all(thread.is_alive() for thread in threads), "nobody leaves before the directive"
    handler.generation = 5  # the operator's reform for the lost node
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a survivor still waits for the lost node"
