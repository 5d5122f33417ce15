"""The global-cursor sampler: one position in one global sample stream, never a per-rank state.

The stream is the concatenation of per-epoch permutations: position ``p`` is sample
``permutation(seed, p // N)[p % N]``. One optimizer step at world size W consumes the positions
``[cursor, cursor + global_batch)``; rank ``r`` reads ``cursor + i*W + r``. The cursor advances by exactly the
global batch per step, so a resume at any world size continues where the last committed step stopped: zero
samples replayed, zero skipped. The epoch tail rule is simply "positions span the epoch boundary": a step
that straddles it takes the last samples of epoch e and the first of epoch e+1; nothing is dropped or padded.

Pure logic except for the permutation, which uses ``torch.randperm`` with a seeded CPU generator
(``PERMUTATION_VERSION`` names that algorithm; changing it must bump the version).
"""

from __future__ import annotations

import functools

import torch

from disttrain.api.manifest import DatasetFingerprint

PERMUTATION_VERSION = 1
"""Version 1: ``torch.randperm(N, generator=manual_seed(seed * 1_000_003 + epoch))`` per epoch, concatenated."""


class DatasetChangedError(ValueError):
    """The checkpoint's sample stream is not the one this run would read; resuming would silently skew data."""


def fingerprint(length: int, seed: int) -> DatasetFingerprint:
    """The identity of the stream this code produces for a dataset of ``length`` samples and ``seed``."""
    return DatasetFingerprint(length=length, seed=seed, permutation_version=PERMUTATION_VERSION)


def check_fingerprint(saved: DatasetFingerprint, current: DatasetFingerprint) -> None:
    """Refuse a resume whose stream differs, naming every field that changed."""
    changed = [
        f"{name}: checkpoint has {getattr(saved, name)}, this run has {getattr(current, name)}"
        for name in ("length", "seed", "permutation_version")
        if getattr(saved, name) != getattr(current, name)
    ]
    if changed:
        raise DatasetChangedError(
            "cannot resume: the dataset stream changed since the checkpoint ("
            + "; ".join(changed)
            + "). Restore the original dataset/seed or start a new job with a fresh checkpoint directory."
        )


def rank_positions(cursor: int, global_batch: int, world_size: int, rank: int) -> list[int]:
    """Global stream positions rank ``rank`` reads for the step starting at ``cursor`` (in micro-batch order)."""
    if global_batch % world_size:
        raise ValueError(f"global batch {global_batch} is not a multiple of world size {world_size}")
    return list(range(cursor + rank, cursor + global_batch, world_size))


def data_rank(rank: int, world_size: int, data_degree: int) -> int:
    """The sampler's rank of global ``rank`` when only ``data_degree`` of the ``world_size`` ranks read different
    samples: consecutive runs of world / data ranks (a TP group, :mod:`disttrain.trainer.mesh`) share one."""
    return rank // (world_size // data_degree)


class GlobalSampler:
    """Maps stream positions to dataset indices; holds no position itself (the cursor lives in trainer state)."""

    def __init__(self, length: int, seed: int) -> None:
        if length < 1:
            raise ValueError("the dataset is empty: a training stream needs at least one sample")
        self.length = length
        self.seed = seed

    @property
    def fingerprint(self) -> DatasetFingerprint:
        return fingerprint(self.length, self.seed)

    @functools.lru_cache(maxsize=2)  # noqa: B019 - one sampler per process, alive as long as the cache anyway
    def permutation(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.length, generator=generator)

    def indices(self, positions: list[int]) -> list[int]:
        """Dataset indices of ``positions`` (vectorised per epoch: this runs every step on the hot path)."""
        if not positions:
            return []
        pos = torch.as_tensor(positions, dtype=torch.long)
        epochs = pos // self.length
        first, last = int(epochs.min()), int(epochs.max())
        if first == last:
            return self.permutation(first)[pos - first * self.length].tolist()
        out = torch.empty_like(pos)
        for epoch in range(first, last + 1):
            sel = epochs == epoch
            out[sel] = self.permutation(epoch)[pos[sel] - epoch * self.length]
        return out.tolist()
