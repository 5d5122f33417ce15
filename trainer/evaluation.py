"""Evaluation in the loop: a held-out map-style dataset, every N steps or seconds, run by every rank together.

``evaluation=EvalOptions(dataset=held_out, fn=loss_sums, every_steps=100)``: at the step boundary of a due step,
every rank puts the model in eval mode, runs ``fn(model, batch)`` over its share of ``dataset`` (batches dealt out
round-robin by data rank, so a TP group shares one; a rank whose share ran out runs a padding batch whose result is
dropped, so wrapped models that talk during ``forward`` stay in lockstep), sums what ``fn`` returned, and the sums
are all-reduced over the group. The
result is exported as metrics and declared as the side effect ``disttrain.eval`` of that step
(:mod:`disttrain.trainer.effects`): the checkpoint covering the step records it, and rank 0 hands it to
``on_result`` with its key exactly once per committed step. The loop evaluates before it saves at the same boundary,
so a run that resumes from the checkpoint of an evaluated step starts after it and never evaluates it again.

When: ``every_steps`` is decided from the step alone, alike on every rank. ``every_seconds`` is rank 0's clock,
agreed by a one-int all-reduce started at one boundary and read at the next (as the checkpoint's own boundary
agreement does), so every rank evaluates at the same step, one step after rank 0's clock said so.

Called by the loop at step boundaries; never decides anything about checkpoints.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, Optional

import prometheus_client as prom
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset, default_collate

from disttrain.trainer.step import to_device

log = logging.getLogger("disttrain.trainer")

EVAL_EFFECT = "disttrain.eval"
"""The side effect that records an evaluation's result with the checkpoint of its step."""

EvalFn = Callable[[torch.nn.Module, Any], Mapping[str, Any]]
"""``fn(model, batch) -> {name: sum}``: sums over the batch (a loss sum, a sample count), numbers or 0-d tensors."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalOptions:
    """Periodic evaluation on a held-out dataset (the ``evaluation`` option of the trainer)."""

    dataset: Any
    """Map-style (a length and samples by index), the same on every rank."""
    fn: EvalFn
    """Called on the wrapped model (eval mode, no grad) with each collated batch; returns sums by name."""
    every_steps: int = 0
    """Evaluate at every step that is a multiple of this (0: not by steps)."""
    every_seconds: float = 0.0
    """Evaluate when this many seconds passed since the last evaluation by rank 0's clock (0: not by time)."""
    batch_size: int = 32
    """Samples per ``fn`` call on one rank."""
    collate_fn: Callable[[list[Any]], Any] = default_collate
    """Turns the samples of a batch into one batch (not used for a ``TensorDataset``)."""
    summarize: Optional[Callable[[dict[str, float]], Mapping[str, float]]] = None
    """Turns the global sums into the reported metrics (``loss_sum / count``); None: the sums themselves."""
    on_result: Optional[Callable[[str, dict[str, Any]], None]] = None
    """``on_result(key, {"step": N, "metrics": {...}})`` on rank 0, once per committed evaluated step."""

    def __post_init__(self) -> None:
        if self.every_steps < 0 or self.every_seconds < 0 or not (self.every_steps or self.every_seconds):
            raise ValueError(
                f"evaluation: every_steps={self.every_steps}, every_seconds={self.every_seconds}: set at least one "
                "to a positive value"
            )
        if self.batch_size < 1:
            raise ValueError(f"evaluation: batch_size={self.batch_size} must be >= 1")
        if len(self.dataset) < 1:
            raise ValueError("evaluation: the dataset is empty")


def rank_batches(length: int, batch_size: int, world_size: int, rank: int) -> list[list[int]]:
    """This rank's batches of a dataset of ``length``: round ``b`` gives rank ``r`` the slice starting at
    ``(b * world_size + r) * batch_size``. Every rank gets the same number of rounds; an empty list is a round whose
    samples ran out before this rank (it runs a padding batch)."""
    per_round = world_size * batch_size
    rounds = math.ceil(length / per_round)
    out = []
    for b in range(rounds):
        start = (b * world_size + rank) * batch_size
        out.append(list(range(start, min(start + batch_size, length))))
    return out


def jsonable(metrics: Mapping[str, float]) -> dict[str, float | str]:
    """Metrics as JSON can hold them (a NaN loss is recorded as ``"nan"``, not refused)."""
    return {k: (float(v) if math.isfinite(v) else str(v)) for k, v in metrics.items()}


class EvalMetrics:
    def __init__(self, registry: Optional[prom.CollectorRegistry]) -> None:
        self.value = prom.Gauge(
            "disttrain_trainer_eval", "The newest evaluation's metrics, by name", ["metric"], registry=registry
        )
        self.step = prom.Gauge("disttrain_trainer_eval_step", "Step of the newest evaluation", registry=registry)
        self.seconds = prom.Gauge(
            "disttrain_trainer_eval_seconds", "Wall time of the newest evaluation", registry=registry
        )


class Evaluator:
    """When to evaluate, and the evaluation itself (collective: every rank runs it at the same boundary)."""

    def __init__(self, options: EvalOptions, device: torch.device, metrics: Optional[EvalMetrics] = None) -> None:
        self.options = options
        self.device = device
        self.metrics = metrics
        self.last_step = -1
        """The newest step evaluated in this process (or recorded by the checkpoint it resumed from)."""
        self.last_time = time.monotonic()
        self.last_result: Optional[dict[str, float]] = None
        self._in_flight: Optional[tuple[torch.Tensor, dist.Work]] = None

    def reset(self) -> None:
        """A new group: drop the agreement in flight on the old one and restart the clock."""
        self._in_flight = None
        self.last_time = time.monotonic()

    def is_due(self, step: int, rank: int, last: bool = False) -> bool:
        """Whether the boundary of ``step`` evaluates; the same answer on every rank. Collective when
        ``every_seconds`` is set (every rank calls it at every boundary)."""
        o = self.options
        by_time = False
        if o.every_seconds:
            mine = rank == 0 and time.monotonic() - self.last_time >= o.every_seconds
            by_time = self._agree(mine, read_now=last) and step - self.last_step > 1
        if step <= 0 or step == self.last_step:
            return False
        return by_time or bool(o.every_steps and step % o.every_steps == 0)

    def _agree(self, flag: bool, read_now: bool) -> bool:
        tensor = torch.tensor([int(flag)], dtype=torch.int64, device=self.device)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True)
        previous, self._in_flight = self._in_flight, (tensor, work)
        if read_now:
            previous, self._in_flight = self._in_flight, None
        if previous is None:
            return False
        previous[1].wait()
        return bool(int(previous[0].item()))

    def evaluate(
        self, model: torch.nn.Module, step: int, world_size: int, rank: int, shards: int = 0, shard: int = -1
    ) -> dict[str, float]:
        """Run the evaluation of ``step`` on every rank and return the global result (the same on every rank).

        ``shards``/``shard``: how many different shares of the dataset there are and which one this rank reads
        (default: one per rank). On an FSDP x TP mesh the ranks of a TP group read the same share (the sampler's
        data rank) and each reports the same sums, so the global sums are divided by the group's size."""
        o = self.options
        shards, shard = (shards, shard) if shards > 0 else (world_size, rank)
        t0 = time.monotonic()
        sums: dict[str, float] = {}
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for indices in rank_batches(len(o.dataset), o.batch_size, shards, shard):
                    out = o.fn(model, self._batch(indices or [0]))
                    if indices:
                        for name, value in out.items():
                            sums[name] = sums.get(name, 0.0) + float(value)
        finally:
            model.train(was_training)
        names: list[Any] = [None] * world_size
        dist.all_gather_object(names, sorted(sums))
        agreed = sorted(set().union(*names))
        total = torch.tensor([sums.get(n, 0.0) for n in agreed], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        copies = world_size // shards
        result = dict(zip(agreed, (float(v) / copies for v in total.tolist()), strict=True))
        if o.summarize is not None:
            result = {k: float(v) for k, v in o.summarize(result).items()}
        self.last_step, self.last_time, self.last_result = step, time.monotonic(), result
        if self.metrics is not None:
            for name, value in result.items():
                self.metrics.value.labels(metric=name).set(value)
            self.metrics.step.set(step)
            self.metrics.seconds.set(time.monotonic() - t0)
        if rank == 0:
            log.info("evaluation at step %d (%.2f s): %s", step, time.monotonic() - t0, result)
        return result

    def _batch(self, indices: list[int]) -> Any:
        ds = self.options.dataset
        if isinstance(ds, TensorDataset):
            idx = torch.as_tensor(indices, dtype=torch.long)
            return to_device(tuple(t[idx] for t in ds.tensors), self.device)
        return to_device(self.options.collate_fn([ds[i] for i in indices]), self.device)


def result_handler(options: EvalOptions) -> Callable[[str, dict[str, Any]], None]:
    """The handler of :data:`EVAL_EFFECT`: the user's ``on_result`` (or nothing: the metrics were exported when
    the evaluation ran)."""

    def handle(key: str, payload: dict[str, Any]) -> None:
        if options.on_result is not None:
            options.on_result(key, payload)

    return handle
