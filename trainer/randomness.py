"""Model randomness keyed by (seed, step, sample), never by rank, so a resume at another world size is exact.

A sample's dropout mask must not depend on which rank reads it or on how many samples that rank read before,
or the interrupted run and the reference diverge. Each sample gets its own generator seed derived from the
job seed, the optimizer step and the sample's dataset index.
"""

from __future__ import annotations

import hashlib

import torch


def sample_seed(seed: int, step: int, index: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{step}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def keyed_dropout(x: torch.Tensor, p: float, seeds: list[int], training: bool = True) -> torch.Tensor:
    """Dropout over ``x`` (batch first) whose mask for row ``i`` comes from ``seeds[i]`` alone."""
    if not training or p <= 0.0:
        return x
    if len(seeds) != x.shape[0]:
        raise ValueError(f"keyed_dropout needs one seed per sample: {len(seeds)} seeds, batch of {x.shape[0]}")
    masks = []
    for s in seeds:
        g = torch.Generator().manual_seed(s)
        masks.append(torch.rand(x.shape[1:], generator=g) >= p)
    mask = torch.stack(masks).to(device=x.device, dtype=x.dtype)
    return x * mask / (1.0 - p)
