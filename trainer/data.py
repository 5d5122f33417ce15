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
from typing import Any, Optional, Protocol, runtime_checkable

from torch.utils.data import DataLoader, Dataset, IterableDataset

from disttrain.trainer import sampler as sampler_mod


@runtime_checkable
class SeekableStream(Protocol):
    """The protocol an ``IterableDataset`` follows to be trained on: a length, and a ``seek`` after which the next
    ``iter()`` yields the samples at ``index``, ``index + 1``, ... in order.

    Why a seek: every sample is read at its position of the global permutation (that is what keeps a resume at
    any world size exact), so a stream must be able to start anywhere. Record files with an index of offsets,
    Arrow/Parquet row groups and numbered shards all can. Iteration after a seek must not split itself by
    DataLoader worker (``get_worker_info``): the trainer decides which process reads which sample.
    """

    def __len__(self) -> int: ...

    def seek(self, index: int) -> None: ...

    def __iter__(self) -> Iterator[Any]: ...


class SeekingDataset(Dataset[Any]):
    """Random access over a :class:`SeekableStream`: a run of consecutive indices costs one seek, any other index
    a seek of its own (so the cost of a random order is the stream's seek time per sample)."""

    def __init__(self, stream: SeekableStream) -> None:
        self.stream = stream
        self._samples: Optional[Iterator[Any]] = None
        self._next_index = -1
        self.seeks = 0
        """How many seeks were made (the cost a stream pays for the global order)."""

    def __len__(self) -> int:
        return len(self.stream)

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        out = []
        for index in indices:
            if self._samples is None or index != self._next_index:
                self.stream.seek(index)
                self._samples = iter(self.stream)
                self.seeks += 1
            try:
                out.append(next(self._samples))
            except StopIteration:
                self._samples = None
                raise IndexError(
                    f"{type(self.stream).__name__} ended before sample {index} although its len() is "
                    f"{len(self.stream)}: seek({index}) must lead to that sample"
                ) from None
            self._next_index = index + 1
        return out

    def __getstate__(self) -> dict[str, Any]:
        """A DataLoader worker gets the stream without the open iterator (generators do not pickle)."""
        return {**self.__dict__, "_samples": None, "_next_index": -1}


def random_access(dataset: Any) -> Any:
    """The dataset as the global cursor reads it: a map-style dataset as is, a :class:`SeekableStream` through
    :class:`SeekingDataset`; anything else is refused, saying what the trainer needs."""
    if isinstance(dataset, IterableDataset):
        if isinstance(dataset, SeekableStream):
            return SeekingDataset(dataset)
        missing = [name for name in ("__len__", "seek") if not callable(getattr(dataset, name, None))]
        raise TypeError(
            f"dataset: {type(dataset).__name__} is an IterableDataset without {' and '.join(missing)}; the "
            "trainer reads every sample at its position of the global permutation, so a stream must follow the "
            "SeekableStream protocol (disttrain.trainer.data): __len__() and seek(index), after which iter() "
            "yields the samples from that index on. Otherwise index your samples (for example an array of file "
            "offsets) and read them in __getitem__ of a map-style dataset"
        )
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError(
            f"dataset: {type(dataset).__name__} has no random access; the trainer needs a map-style dataset "
            "(__len__ and __getitem__, e.g. torch.utils.data.Dataset or TensorDataset) or an IterableDataset "
            "that follows the SeekableStream protocol (__len__ and seek(index)), because every sample is read at "
            "its position of the global permutation"
        )
    return dataset


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
