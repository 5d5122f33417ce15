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


def read_each(store: Any, keys: Sequence[str]) -> list[Optional[bytes]]:
    """The values of ``keys``, None for each that is absent: one ``check`` and one ``multi_get`` per
    :data:`READ_CHUNK` keys when all of a chunk are there (the usual case), else key by key (a ``check`` first:
    ``get`` waits for an absent key)."""
    values: list[Optional[bytes]] = []
    for first in range(0, len(keys), READ_CHUNK):
        chunk = list(keys[first : first + READ_CHUNK])
        if len(chunk) > 1 and store.check(chunk):
            values.extend(bytes(value) for value in store.multi_get(chunk))
        else:
            values.extend(bytes(store.get(key)) if store.check([key]) else None for key in chunk)
    return values
