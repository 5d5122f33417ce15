"""Batches through a ``torch.utils.data.DataLoader`` (worker processes, prefetching, pinned memory on GPU),
driven by the global cursor so that exact resume still holds.

The loader gets no sampler of its own: :class:`CursorBatchSampler` yields this rank's micro batches of dataset
indices, step after step, computed from the global cursor exactly as :class:`disttrain.trainer.loop.Step` does
(``sampler.rank_positions`` → ``GlobalSampler.indices``). The workers therefore fetch ahead what the loop will
ask for next, in order, and a resume at another world size starts a fresh loader at the restored cursor: the
multiset of consumed samples stays exact whatever ``num_workers`` is. Every batch carries its indices back from
the worker, and :meth:`LoaderFeed.next_batch` checks them against the step's, so a mismatch fails loudly instead
of training on the wrong samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Optional

from torch.utils.data import DataLoader, Dataset, IterableDataset

from disttrain.trainer import sampler as sampler_mod


def check_random_access(dataset: Any) -> None:
    """Refuse a dataset the global cursor cannot drive: it needs samples by index (``len`` and ``[i]``).

    An ``IterableDataset`` can only be read in its own order, so resuming at another world size could not
    give every rank its positions of the global permutation.
    """
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError(
            f"dataset: {type(dataset).__name__} has no random access; the trainer needs a map-style dataset "
            "(__len__ and __getitem__, e.g. torch.utils.data.Dataset or TensorDataset), because every sample is "
            "read at its position of the global permutation. IterableDataset is not supported: index your samples "
            "(for example an array of file offsets) and read them in __getitem__"
        )


class CursorBatchSampler:
    """This rank's micro batches of dataset indices, from ``cursor`` on, without end (the loop decides when to
    stop; the loader only prefetches a bounded number ahead)."""

    def __init__(
        self,
        sampler: sampler_mod.GlobalSampler,
        cursor: int,
        global_batch: int,
        world_size: int,
        rank: int,
        micro_batch: int,
        accum_steps: int,
    ) -> None:
        self.sampler = sampler
        self.cursor = cursor
        self.global_batch = global_batch
        self.world_size = world_size
        self.rank = rank
        self.micro_batch = micro_batch
        self.accum_steps = accum_steps

    def __iter__(self) -> Iterator[list[int]]:
        cursor = self.cursor
        while True:
            positions = sampler_mod.rank_positions(cursor, self.global_batch, self.world_size, self.rank)
            indices = self.sampler.indices(positions)
            for i in range(self.accum_steps):  # the split Step.micro_indices makes
                yield indices[i * self.micro_batch : (i + 1) * self.micro_batch]
            cursor += self.global_batch


class _IndexedDataset(Dataset[tuple[int, Any]]):
    """The user's dataset, each sample paired with its index (so a batch can prove which samples it holds)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return index, self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list[tuple[int, Any]]:
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(indices) if getitems is not None else [self.dataset[i] for i in indices]
        return list(zip(indices, samples, strict=True))


class _IndexedCollate:
    """The user's ``collate_fn`` over the samples, with their indices set aside (picklable for spawn workers)."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, pairs: list[tuple[int, Any]]) -> tuple[list[int], Any]:
        return [i for i, _ in pairs], self.collate_fn([s for _, s in pairs])


class LoaderFeed:
    """One DataLoader for the life of this process (the world size, hence the plan, is fixed until a restart)."""

    def __init__(
        self,
        dataset: Any,
        collate_fn: Callable[[list[Any]], Any],
        batch_sampler: CursorBatchSampler,
        num_workers: int,
        prefetch_factor: Optional[int],
        pin_memory: bool,
    ) -> None:
        self.loader: DataLoader[Any] = DataLoader(
            _IndexedDataset(dataset),
            batch_sampler=batch_sampler,
            collate_fn=_IndexedCollate(collate_fn),
            num_workers=num_workers,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            pin_memory=pin_memory,
            persistent_workers=False,
        )
        self._batches: Iterator[tuple[list[int], Any]] = iter(self.loader)

    def next_batch(self, expected: list[int]) -> Any:
        """The collated micro batch of ``expected`` indices, the next one the loader has fetched."""
        indices, data = next(self._batches)
        if indices != expected:
            raise RuntimeError(
                f"the data loader delivered samples {indices[:8]}... where the step expected {expected[:8]}...: "
                "its batch sampler and the step's cursor disagree"
            )
        return data

    def close(self) -> None:
        """Stop the worker processes (the iterator's shutdown joins them)."""
        shutdown = getattr(self._batches, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
