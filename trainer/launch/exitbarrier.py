"""torchrun's exit barrier (no node's agent leaves before every node's workers finished), built so that a stranger
who deletes its keys only delays it.

torch's barrier counts arrivals with one ``add`` on a shared counter and waits for a "last member" key: a stranger
who deletes the counter between two nodes' ``add`` makes the second count from 0 again, the count never reaches the
group's size and every node waits the barrier's timeout (300 s) after a finished training.

Here every fact is one node's own key, written again on every look, and a fact once seen stays seen:

1. arrival: node ``r`` writes ``<prefix>/arrived/<r>`` until it has seen every node's arrival;
2. departure: it then writes ``<prefix>/done/<r>`` (which also proves every node arrived) and lingers until it has
   seen every other node's ``done`` key, or for at most :data:`LINGER_S` while they stay unseen: a node that leaves
   at once could take with it the only copy of a key a slower node has not seen yet.

Looks are blocking waits, woken by the store's server when a key is set: a key is seen even when the stranger
deletes it as soon as it is written. Without a stranger no key disappears, and nobody lingers."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed import DistStoreError

PREFIX = "disttrain/exit-barrier"
POLL_S = 0.2
"""Longest blocking look at one key before the node writes its own keys again."""
LINGER_S = 5.0
"""Longest a node that saw every arrival stays to be seen by the others."""
SWEEP_EVERY = 10
"""Every this many looks, one quick look at every missing key (one round trip each); the looks between wait on one
key each, so a large group does not poll the agent's store with world x world calls per look."""


class Progress:
    """What one node knows: the ranks it saw arrive, the ranks it saw leave."""

    def __init__(self, world: int, me: int) -> None:
        self.world, self.me = world, me
        self.arrived = {me}
        self.done: set[int] = set()

    def all_arrived(self) -> bool:
        return len(self.arrived) == self.world or bool(self.done)

    def all_done(self) -> bool:
        return len(self.done | {self.me}) == self.world


def _key(kind: str, rank: int) -> str:
    return f"{PREFIX}/{kind}/{rank}"


def _seen(store: Any, key: str, wait_s: float) -> bool:
    """Whether a valid ``key`` is there now (``wait_s`` 0) or shows up within ``wait_s``."""
    try:
        if wait_s <= 0:
            return bool(store.check([key]))
        store.wait([key], timedelta(seconds=wait_s))
        return True
    except DistStoreError:
        return False


def _write(store: Any, key: str) -> bool:
    """Write this node's ``key``; False while the store cannot be reached (the next turn writes it again)."""
    try:
        store.set(key, "1")
    except DistStoreError:
        return False
    return True


def _look(store: Any, kind: str, ranks: set[int], found: set[int], turn: int) -> None:
    """Add to ``found`` the ranks in ``ranks`` whose ``kind`` key is seen: a quick look at all on a sweep's turn, then
    a blocking look at one of the rest (a different one on each turn)."""
    if turn % SWEEP_EVERY == 0:
        found.update(rank for rank in sorted(ranks - found) if _seen(store, _key(kind, rank), 0))
    missing = sorted(ranks - found)
    if missing and _seen(store, _key(kind, missing[turn % len(missing)]), POLL_S):
        found.add(missing[turn % len(missing)])


def _never() -> bool:
    return False


def wait_for_all(store: Any, world: int, me: int, timeout_s: float, abandon: Callable[[], bool] = _never) -> bool:
    """Block until every node of the group reached the barrier; False when ``timeout_s`` passed first, or when
    ``abandon()`` says, before every node arrived, that the ones missing will not come (looked at once a turn)."""
    progress, everyone = Progress(world, me), set(range(world))
    start, turn, linger_until = time.monotonic(), 0, None
    while True:
        if not _write(store, _key("arrived", me)):
            if time.monotonic() - start >= timeout_s:
                return progress.all_arrived()
            time.sleep(POLL_S)  # the agent's store is away: its replacement comes behind the same address
            continue
        if not progress.all_arrived():
            _look(store, "done", everyone - {me}, progress.done, turn)
            _look(store, "arrived", everyone, progress.arrived, turn)
        if progress.all_arrived():
            _write(store, _key("done", me))
            linger_until = time.monotonic() + LINGER_S if linger_until is None else linger_until
            _look(store, "done", everyone - {me}, progress.done, turn)
            if progress.all_done() or time.monotonic() >= linger_until:
                return True
        if time.monotonic() - start >= timeout_s or (not progress.all_arrived() and abandon()):
            return progress.all_arrived()
        turn += 1
