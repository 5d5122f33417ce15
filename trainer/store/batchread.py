"""Reads of many keys of the agent's store in few round trips.

Why: each read is a round trip through the node's relay, the agent's front and the store's loop, tens of
milliseconds on a busy agent. A node that reads one key per peer (identities, indices) of a 1,024-node round
spends seconds in them, while every other node does the same. Pure but for the store it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

READ_CHUNK = 512
"""Keys per batched read (the agent's front passes at most 1,024 in one request)."""
ONE_BY_ONE_BELOW = 8
"""A part of a chunk this small with a key absent is read key by key rather than halved again."""


def read_each(store: Any, keys: Sequence[str]) -> list[Optional[bytes]]:
    """The values of ``keys``, None for each that is absent: one ``check`` and one ``multi_get`` per
    :data:`READ_CHUNK` keys when all of a chunk are there (the usual case); a chunk with a key absent is halved
    until its parts are whole or small (``get`` and ``multi_get`` wait for an absent key, ``check`` says only
    whether all are there). One absent key among 256 then costs 31 round trips, not 511."""
    values: list[Optional[bytes]] = []
    for first in range(0, len(keys), READ_CHUNK):
        values.extend(_read_part(store, list(keys[first : first + READ_CHUNK])))
    return values


def _read_part(store: Any, part: list[str]) -> list[Optional[bytes]]:
    if len(part) > 1 and store.check(part):
        return [bytes(value) for value in store.multi_get(part)]
    if len(part) <= ONE_BY_ONE_BELOW:
        return [bytes(store.get(key)) if store.check([key]) else None for key in part]
    middle = len(part) // 2
    return _read_part(store, part[:middle]) + _read_part(store, part[middle:])
