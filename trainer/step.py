"""One optimizer step as the user's loop sees it: its micro batches and a normalised backward.

:class:`Step` reads the trainer's plan, wrapper, precision and ordered reducer through :class:`StepOwner`, and keeps a
collective failure inside the user's code from the user (:meth:`StepOwner.keeping_group_failures`), so a step a
broken group did not finish is redone by the next group. It never steps the optimizer: the trainer does, when the loop
comes back to it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
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

    precision: precision_mod.PrecisionState

    @property
    def plan(self) -> Plan: ...

    @property
    def parallel(self) -> parallel_mod.ParallelModel: ...

    @property
    def ordered(self) -> Optional[ordered_reduction.OrderedReducer]: ...

    @property
    def world_size(self) -> int: ...

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


def global_loss(reduced: Sequence[float]) -> Optional[float]:
    """The step's global loss from its :data:`LOSS_TOTALS` summed over the ranks: every rank's summed loss over the
    step's denominator (the same on every rank that ran a backward). None when no rank ran one."""
    loss_sum, denominators, ranks = reduced
    if ranks <= 0 or denominators <= 0:
        return None
    return loss_sum / (denominators / ranks)


LOSS_TOTALS = ("loss_sum", "denominator", "ranks")
"""What each rank adds to the step's loss reduction: its summed loss, the step's denominator and 1 (0 for each when
it ran no backward), so the sum over the ranks gives :func:`global_loss`."""


class Step:
    """One optimizer step on this rank: iterate it for micro batches, call :meth:`backward` once per micro batch.

    Iteration turns gradient sync (DDP, FSDP2) off for all but the last micro batch (forward included, as DDP
    needs). With ``reduce_loss`` (the loop decides it from the step number alone, so every rank agrees) the end of
    the iteration starts an asynchronous all-reduce of this rank's :data:`LOSS_TOTALS` on the loss's device; it runs
    beside the optimizer step and :attr:`global_loss` waits for it.
    """

    def __init__(
        self,
        trainer: StepOwner,
        index: int,
        indices: list[int],
        on_reduction: Optional[Callable[[int], None]] = None,
        reduce_loss: bool = False,
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
        """This rank's count of loss terms (``count`` of :meth:`backward`); informational, the global loss divides
        by the denominator."""
        self.denominator: Optional[float] = None
        """The denominator of the step's backward passes (None before the first)."""
        self.reduce_loss = reduce_loss
        self._reduction: Optional[tuple[torch.Tensor, Optional[dist.Work]]] = None
        self._global_loss: Optional[float] = None

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
        if self.reduce_loss and self.trainer.group_failure is None:
            self._start_loss_reduction()

    @property
    def global_loss(self) -> Optional[float]:
        """The step's loss over every rank: (sum over ranks and micro batches of the summed loss) / the step's
        denominator (the global batch, or :meth:`global_count`'s result). None when the step did not reduce it
        (``reduce_loss`` off, the group broke, no backward). Waits for the reduction and reads it from the device
        the first time (the device is idle then: the step's completion waited for it)."""
        if self._reduction is not None:
            tensor, work = self._reduction
            self._reduction = None
            with self.trainer.keeping_group_failures():
                if work is not None:
                    work.wait()
                self._global_loss = global_loss(tensor.tolist())
        return self._global_loss

    def loss_totals(self) -> torch.Tensor:
        """This rank's :data:`LOSS_TOTALS` of the step, float64 on the model's device (the same backend on every
        rank); summed over the ranks, :func:`global_loss` turns them into the step's loss."""
        device = _model_device(self.trainer.parallel.module)
        if not self._losses:
            return torch.zeros(len(LOSS_TOTALS), dtype=torch.float64, device=device)
        local = torch.stack([t.to(device, torch.float64).reshape(()) for t in self._losses]).sum()
        # Ranks that read the same samples (one tensor-parallel group) each hold that group's whole loss.
        replicas = self.trainer.world_size // self.trainer.plan.data_degree
        if replicas > 1:
            local = local / replicas
        rest = torch.tensor([float(self.denominator or 0.0), 1.0], dtype=torch.float64, device=device)
        return torch.cat([local.reshape(1), rest])

    def _start_loss_reduction(self) -> None:
        """Start summing :meth:`loss_totals` over the group (collective: every rank that reduces the step's loss
        calls it once, after its last backward)."""
        tensor = self.loss_totals()
        with self.trainer.keeping_group_failures():
            work = dist.all_reduce(tensor, async_op=True) if dist.is_initialized() else None
            self._reduction = (tensor, work)

    def global_count(self, local_count: float | int | torch.Tensor) -> float:
        """Sum of a count over all ranks (e.g. non-padding tokens in this step): the denominator of a
        token-weighted loss. Collective: every rank calls it once per step, before its backward passes."""
        t = torch.as_tensor(local_count, dtype=torch.float64).reshape(1).clone()
        readers = self.trainer.world_size // self.trainer.plan.data_degree  # TP ranks count the same samples
        with self.trainer.keeping_group_failures():
            dist.all_reduce(t)
            return float(t.item()) / readers
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
        self.denominator = denom
        factor = 1.0 if self.trainer.ordered is not None else self.trainer.parallel.loss_factor(self.trainer.world_size)
        if self.on_reduction is not None and len(self._losses) == len(self.micro_indices) - 1:
            self.on_reduction(self.index + 1)
        with self.trainer.keeping_group_failures():
            self.trainer.precision.scale(loss_sum * (factor / denom)).backward()  # type: ignore[no-untyped-call]
        self._losses.append(loss_sum.detach())
        self.loss_count += int(count if count is not None else len(self.micro_indices[0]) if self.micro_indices else 0)


def _model_device(model: torch.nn.Module) -> torch.device:
    """Where the model computes (its first parameter's device; the CPU for a model without parameters)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


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
