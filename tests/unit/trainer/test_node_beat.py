"""The launcher's beat (trainer/launch/beat.py) on a real store: it beats until stopped, and its last beat says
whether the launcher left (shut down) or just went quiet (a dead machine writes nothing more)."""

from __future__ import annotations

import time

import torch.distributed as dist

from disttrain.trainer.agent import heartbeats as hb
from disttrain.trainer.launch.beat import NodeBeat

KEY = "torch.rendezvous.run/disttrain.beat/node"


def last_beat(store: dist.Store) -> bytes:
    return bytes(store.get(KEY))


def test_a_launcher_that_shuts_down_leaves_a_last_beat_that_says_so() -> None:
    store = dist.HashStore()
    beat = NodeBeat(store, KEY, interval_s=0.01)
    beat.start()
    deadline = time.monotonic() + 5
    while not store.check([KEY]) and time.monotonic() < deadline:
        time.sleep(0.01)
    before = hb.parse_beat(last_beat(store))
    assert before is not None and not before[1]
    beat.leave()
    assert not beat._thread.is_alive()
    last = hb.parse_beat(last_beat(store))
    assert last is not None and last[1] and last[0] >= before[0]


def test_a_beat_stopped_without_leaving_writes_no_last_beat() -> None:
    store = dist.HashStore()
    beat = NodeBeat(store, KEY, interval_s=0.01)
    beat.start()
    time.sleep(0.05)
    beat.stop()
    beat._thread.join(5)
    parsed = hb.parse_beat(last_beat(store))
    assert parsed is not None and not parsed[1]


def test_a_last_beat_the_store_refuses_does_not_hold_the_shutdown() -> None:
    class Away:
        def set(self, key: str, value: str) -> None:
            raise RuntimeError("the agent's store is away")

    beat = NodeBeat(Away(), KEY, interval_s=0.01)
    beat.start()
    started = time.monotonic()
    beat.leave()
    assert time.monotonic() - started < 1.5 and not beat._thread.is_alive()
