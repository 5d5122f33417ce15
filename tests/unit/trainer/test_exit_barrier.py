"""torchrun's exit barrier as the launcher builds it (:meth:`CountingAgent._exit_barrier`), on a real signed store
with the agent's guardian, while an outsider deletes every key: a finished job's nodes still leave together, and
none waits for the barrier's timeout."""

from __future__ import annotations

import threading
import time
import types
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from disttrain.trainer import channel
from disttrain.trainer.guardian import Guardian
from disttrain.trainer.launch import CountingAgent

SECRET, UID = "e" * 64, "uid-exit"
WORLD = 3
TIMEOUT_S = 60.0


def _node(port: int, rank: int) -> Any:
    """What ``_exit_barrier`` reads of its agent: the round's store (as torch's rendezvous hands it), the group."""
    raw = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
    store = dist.PrefixStore("torch.rendezvous.run.0", channel.scoped(raw, SECRET, UID))
    group = types.SimpleNamespace(
        spec=types.SimpleNamespace(role="default"), state="SUCCEEDED", group_world_size=WORLD, group_rank=rank
    )
    return types.SimpleNamespace(
        _store=store, _worker_group=group, _exit_barrier_timeout=TIMEOUT_S, _in_exit_barrier=False
    )


def test_the_exit_barrier_completes_while_an_outsider_deletes_every_key() -> None:
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True, timeout=timedelta(seconds=10)
    )
    guardian_client = dist.TCPStore(
        "127.0.0.1", server.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    guardian = Guardian(guardian_client, SECRET, UID)
    guardian.start()
    outsider = dist.TCPStore(
        "127.0.0.1", server.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    stop, deletions = threading.Event(), [0]

    def delete_everything() -> None:
        while not stop.is_set():
            for key in outsider.list_keys():
                deletions[0] += outsider.delete_key(key)

    attacker = threading.Thread(target=delete_everything, daemon=True)
    attacker.start()
    left: dict[int, float] = {}

    def arrive(rank: int) -> None:
        time.sleep(0.7 * rank)  # the nodes' workers finish at different times
        CountingAgent._exit_barrier(_node(server.port, rank))  # type: ignore[arg-type]
        left[rank] = time.monotonic()

    start = time.monotonic()
    nodes = [threading.Thread(target=arrive, args=(rank,), daemon=True) for rank in range(WORLD)]
    for node in nodes:
        node.start()
    try:
        for node in nodes:
            node.join(TIMEOUT_S + 10)
        assert sorted(left) == list(range(WORLD)), f"nodes still in the barrier: {set(range(WORLD)) - set(left)}"
        assert max(left.values()) - start < TIMEOUT_S / 2, "a node waited for the barrier's timeout"
        assert min(left.values()) - start >= 0.7 * (WORLD - 1) - 0.1, "a node left before the last one arrived"
        assert deletions[0] > 0, "the outsider deleted nothing: the test proved nothing"
    finally:
        stop.set()
        attacker.join(5)
        guardian.stop()
