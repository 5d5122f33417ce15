"""One optimizer step as the user's loop sees it: its micro batches and a normalised backward.

:class:`Step` reads the trainer's plan, wrapper, precision and ordered reducer through :class:`StepOwner`, and keeps a
collective failure inside the user's code from the user (:meth:`StepOwner.keeping_group_failures`), so a step a
broken group did not finish is redone by the next group. It never steps the optimizer: the trainer does, when the loop
comes back to it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

from disttrain.api.plan import Plan
from disttrain.trainer import ordered_reduction
from disttrain.trainer import parallel as parallel_mod
from disttrain.trainer import precision as precision_mod
from disttrain.trainer.randomness import sample_seed


class StepOwner(Protocol):
    """What a :class:`Step` reads of its trainer."""

    plan: Plan
    parallel: parallel_mod.ParallelModel
    precision: precision_mod.PrecisionState
    ordered: Optional[ordered_reduction.OrderedReducer]
    world_size: int

    @property
    def seed(self) -> int: ...

    @property
    def group_failure(self) -> Optional[BaseException]: ...

    def keeping_group_failures(self) -> AbstractContextManager[None]: ...

    def fetch(self, indices: list[int]) -> Any: ...


class MicroBatch:
    """One forward/backward worth of samples: the collated ``data``, their dataset ``indices`` and per-sample
    ``seeds`` for keyed randomness (see :mod:`disttrain.trainer.randomness`; computed on first use)."""

    __slots__ = ("data", "indices", "_seed", "_step", "_seeds")

    def __init__(self, data: Any, indices: list[int], seed: int, step: int) -> None:
        self.data, self.indices, self._seed, self._step = data, indices, seed, step
        self._seeds: Optional[list[int]] = None

    @property
    def seeds(self) -> list[int]:
        if self._seeds is None:
            self._seeds = [sample_seed(self._seed, self._step, j) for j in self.indices]
        return self._seeds


class Step:
    """One optimizer step on this rank: iterate it for micro batches, call :meth:`backward` once per micro batch.

    Iteration turns gradient sync (DDP, FSDP2) off for all but the last micro batch (forward included, as DDP
    needs).
    """

    def __init__(
        self,
        trainer: StepOwner,
        index: int,
        indices: list[int],
        on_reduction: Optional[Callable[[int], None]] = None,
    ) -> None:
        self.trainer = trainer
        self.on_reduction = on_reduction
        """Told the step number just before the last micro batch's backward (the stall rule's beacon)."""
        self.index = index
        self.indices = indices
        p = trainer.plan
        if trainer.ordered is not None:
            self.micro_indices = ordered_reduction.micro_indices(indices, p.accum_steps)
        else:
            self.micro_indices = [indices[i * p.micro_batch : (i + 1) * p.micro_batch] for i in range(p.accum_steps)]
        self._losses: list[torch.Tensor] = []  # detached, read once when reported (no device sync per backward)
        self.loss_count = 0

    @property
    def global_batch(self) -> int:
        return self.trainer.plan.global_batch

    @property
    def loss_sum(self) -> float:
        """This rank's summed loss of the step so far. Read lazily: on an accelerator ``float()`` waits for the
        device, so the loop only reads it when a value is reported (rank 0's log and progress record)."""
        return sum(float(t) for t in self._losses)

    def __iter__(self) -> Iterator[MicroBatch]:
        parallel = self.trainer.parallel
        ordered = self.trainer.ordered
        last = len(self.micro_indices) - 1
        seed = self.trainer.seed
        try:
            for i, idx in enumerate(self.micro_indices):
                if self.trainer.group_failure is not None:
                    return  # the group broke (kept from the user's code): the step is redone in the next group
                parallel.set_gradient_sync(i == last and ordered is None)  # ordered: reduced before the step
                if ordered is not None:
                    ordered.before_backward(i)
                yield MicroBatch(self.trainer.fetch(idx), idx, seed, self.index)
        finally:
            parallel.set_gradient_sync(True)

    def global_count(self, local_count: float | int | torch.Tensor) -> float:
        """Sum of a count over all ranks (e.g. non-padding tokens in this step): the denominator of a
        token-weighted loss. Collective: every rank calls it once per step, before its backward passes."""
        t = torch.as_tensor(local_count, dtype=torch.float64).reshape(1).clone()
        with self.trainer.keeping_group_failures():
            dist.all_reduce(t)
            return float(t.item())
        return float(t.item()) * self.trainer.world_size  # the group broke: any value (this step is redone)

    def backward(
        self, loss_sum: torch.Tensor, denominator: Optional[float] = None, count: Optional[int] = None
    ) -> None:
        """Backward of a loss *summed* over this micro batch, normalised by the global count of the step.

        ``denominator`` defaults to the global batch (sample-weighted); pass :meth:`global_count` of your token
        counts for a token-weighted loss. Where the reduction averages over the W ranks (fp32 DDP) the loss is
        multiplied by W first; FSDP2 and mixed-precision DDP sum (:class:`~disttrain.trainer.parallel.ParallelModel`).
        Either way the result is exactly sum(all samples' losses) / global count, whatever the split into ranks
        and micro batches. Under fp16 the loss is scaled by the GradScaler first.
        """
        denom = float(denominator if denominator is not None else self.global_batch)
        factor = 1.0 if self.trainer.ordered is not None else self.trainer.parallel.loss_factor(self.trainer.world_size)
        if self.on_reduction is not None and len(self._losses) == len(self.micro_indices) - 1:
            self.on_reduction(self.index + 1)
        with self.trainer.keeping_group_failures():
            self.trainer.precision.scale(loss_sum * (factor / denom)).backward()
        self._losses.append(loss_sum.detach())
        self.loss_count += int(count if count is not None else len(self.micro_indices[0]) if self.micro_indices else 0)


def to_device(data: Any, device: torch.device) -> Any:
    """``data`` (a tensor, or lists, tuples and dicts of them) on ``device``; other values as they are."""
    if device.type == "cpu":
        return data
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=True)
    if isinstance(data, (list, tuple)):
        return type(data)(to_device(d, device) for d in data)
    if isinstance(data, dict):
        return {k: to_device(v, device) for k, v in data.items()}
    return data
