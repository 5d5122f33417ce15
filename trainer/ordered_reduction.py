"""Gradients summed in a fixed order of micro-batch index: the same bits at every world size.

``spec.training.gradientReduction: ordered``. Why: DDP all-reduces W per-rank gradients, and the order of
that float sum depends on W, so after a world-size change the trajectory leaves the one an uninterrupted run
would follow by a few ulps per step (bound measured in docs/trainer.md). Here the step's gradient is
``g_0 + g_1 + ... + g_{M-1}``, added left to right, where ``g_j`` is the gradient of micro batch ``j`` of the
step and ``M = global batch / micro batch``. Micro batch ``j`` always holds the same samples whatever the world
size: the stream offsets ``j, j + M, j + 2M, ...`` of the step. At world size W, rank r owns the micro
batches ``j = k*W + r`` (k < accumulation steps): exactly the samples the sampler hands it (offsets
``i*W + r``), regrouped as ``indices[k::accum]`` (:func:`micro_indices`). Fixed mode keeps M constant, so a
run resumed at another world size sums the very same terms in the very same order.

How: while micro batch k runs, the parameters' ``.grad`` are views into row k of a ``[accum, P]`` buffer, so
its backward lands there alone. At the end of the step one all_to_all gives every rank its shard (P/W
elements) of every micro batch's gradient; the rank adds its shard of the M gradients in j order; one
all_gather assembles the sum into ``.grad``. Per rank that moves about ``(accum + 1) * P * (W-1)/W`` elements,
against ``2 * P * (W-1)/W`` for DDP's ring all-reduce, and holds ``2 * accum * P + P`` extra elements. No
communication overlaps the backward pass. The cost is measured by ``bench/loop_overhead.py``
(docs/trainer.md, "Ordered gradient reduction").

Used by :class:`disttrain.trainer.loop.ElasticTrainer` (``Step`` asks for the micro batches, points the
gradients before each one, and the trainer reduces before ``optimizer.step()``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

from disttrain.api.plan import Plan
from disttrain.api.spec import GradientReduction, TrainingSpec
from disttrain.trainer.parallel import Parallelism, Precision


def micro_indices(indices: Sequence[int], accum_steps: int) -> list[list[int]]:
    """This rank's micro batches in ordered mode: local micro batch k is global micro batch ``k*W + rank``."""
    return [list(indices[k::accum_steps]) for k in range(accum_steps)]


def for_training(
    training: TrainingSpec, model: torch.nn.Module, parallelism: Parallelism, precision: Precision, plan: Plan
) -> Optional[OrderedReducer]:
    """The reducer ``spec.training.gradientReduction`` asks for (None for ``ddp``); ValueError naming the field
    when the trainer options cannot honour it (FSDP2 shards the gradients; autocast sums in another precision)."""
    if training.gradient_reduction is not GradientReduction.ORDERED:
        return None
    if parallelism is not Parallelism.DDP or precision is not Precision.FP32:
        raise ValueError(
            "spec.training.gradientReduction=ordered needs the trainer options parallelism='ddp' and "
            f"precision='fp32'; this worker runs parallelism={parallelism.value!r}, precision={precision.value!r}"
        )
    return OrderedReducer(list(model.parameters()), plan.accum_steps, plan.world_size)


class OrderedReducer:
    """Per-micro-batch gradient slots, and their sum in micro-batch order across all ranks."""

    def __init__(
        self,
        parameters: Sequence[torch.nn.Parameter],
        accum_steps: int,
        world_size: int,
        group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        self.params = [p for p in parameters if p.requires_grad]
        kinds = sorted({(str(p.dtype), str(p.device)) for p in self.params})
        if len(kinds) != 1:
            raise ValueError(
                "spec.training.gradientReduction=ordered needs every trainable parameter in one dtype "
                f"on one device; this model has {', '.join(f'{d} on {v}' for d, v in kinds) or 'none'}"
            )
        dtype, device = self.params[0].dtype, self.params[0].device
        self.accum_steps = accum_steps
        self.world_size = world_size
        self.group = group
        self.numel = sum(p.numel() for p in self.params)
        self.shard = math.ceil(self.numel / world_size)
        padded = self.shard * world_size
        self.slots = torch.zeros(accum_steps, padded, dtype=dtype, device=device)
        self.received = torch.empty(world_size, accum_steps, self.shard, dtype=dtype, device=device)
        self.total = torch.empty(padded, dtype=dtype, device=device)

    def before_backward(self, k: int) -> None:
        """Clear slot k and make it the parameters' gradient: micro batch k's backward accumulates there alone."""
        slot = self.slots[k]
        slot.zero_()
        self._point_grads_at(slot)

    def reduce(self) -> None:
        """Sum every rank's micro-batch gradients in global micro-batch order into ``.grad``. Collective."""
        if self.world_size == 1:
            self.received.view(self.accum_steps, self.shard).copy_(self.slots)
        else:
            # Row r of the send buffer goes to rank r: its shard of each of this rank's micro batches.
            send = self.slots.view(self.accum_steps, self.world_size, self.shard).transpose(0, 1).contiguous()
            dist.all_to_all_single(self.received, send, group=self.group)
        mine = self.total.view(self.world_size, self.shard)[dist.get_rank(self.group) if self.world_size > 1 else 0]
        mine.copy_(self.received[0, 0])
        for j in range(1, self.accum_steps * self.world_size):
            mine.add_(self.received[j % self.world_size, j // self.world_size])  # j = k*W + r: from rank r, slot k
        if self.world_size > 1:
            dist.all_gather_single(self.total, mine.clone(), group=self.group)
        self._point_grads_at(self.total)

    def _point_grads_at(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
