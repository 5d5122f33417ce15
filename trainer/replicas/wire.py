"""Exchanges between the ranks of a group for in-memory recovery: JSON documents and raw bytes, never pickles.

What a peer sends is only ever decoded as JSON or reinterpreted as the tensor dtype the catalogue names, so a
corrupt or hostile peer can make a recovery fail (and the group fall back to its checkpoint), never run code.
All of it runs on CPU tensors over a gloo group.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist

MAX_DOCUMENT_BYTES = 64 * 1024 * 1024
"""The largest JSON document a rank accepts from a peer (a catalogue of a very large model is a few MB)."""


def all_gather_json(document: Any, group: Optional[dist.ProcessGroup], world_size: int) -> list[Any]:
    """Every rank's ``document`` (JSON-serialisable), in rank order. Collective on ``group``."""
    raw = json.dumps(document, separators=(",", ":")).encode()
    size = torch.tensor([len(raw)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    if max(lengths) > MAX_DOCUMENT_BYTES or min(lengths) < 0:
        raise ValueError(f"a peer announced a document of {max(lengths)} bytes (at most {MAX_DOCUMENT_BYTES})")
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if raw:
        mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    buffers = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(buffers, mine, group=group)
    return [json.loads(bytes(b[:n].numpy().tobytes()).decode()) for b, n in zip(buffers, lengths, strict=True)]


def exchange(
    outgoing: Mapping[int, torch.Tensor],
    incoming: Mapping[int, int],
    group: Optional[dist.ProcessGroup],
) -> dict[int, torch.Tensor]:
    """Send ``outgoing[peer]`` (uint8) to each peer and receive ``incoming[peer]`` bytes from each peer, all at once.
    Peers are global ranks (``group`` spans the world). Returns the received buffers. Collective between the pairs
    named."""

    works = []
    received: dict[int, torch.Tensor] = {}
    for peer, count in sorted(incoming.items()):
        if count:
            received[peer] = torch.empty(count, dtype=torch.uint8)
            works.append(dist.irecv(received[peer], src=peer, group=group))
        else:
            received[peer] = torch.empty(0, dtype=torch.uint8)
    for peer, payload in sorted(outgoing.items()):
        if payload.numel():
            works.append(dist.isend(payload.contiguous(), dst=peer, group=group))
    for work in works:
        if work is not None:
            work.wait()
    return received


def safe_load(raw: bytes) -> Any:
    """A state a peer sent: plain data only (tensors, containers, numbers, strings and NumPy's RNG state), never
    unpickled freely (``weights_only=True`` with NumPy's array reconstruction allowed)."""
    allowed: list[Any] = []
    try:
        import numpy as np

        core = getattr(np, "_core", None) or np.core  # NumPy 2 renamed its core; 1.x has only np.core
        allowed = [np.ndarray, np.dtype, np.dtypes.UInt32DType, core.multiarray._reconstruct]
    except (ImportError, AttributeError):
        pass
    with torch.serialization.safe_globals(allowed):
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
