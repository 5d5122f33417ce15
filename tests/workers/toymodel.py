"""The small model every multi-process test trains, shared by ``toy.py`` (trainer tests) and ``recorder.py``
(end-to-end tests and the local-mode benchmarks).

Those programs are started by path (``torchrun ... tests/workers/toy.py``), so Python puts this folder first on
``sys.path`` and they import this module as plain ``toymodel``; no PYTHONPATH is needed in any launcher.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import IO, Any, Optional

import torch

from disttrain.trainer import randomness
from disttrain.trainer.loop import ElasticTrainer, Step


class TinyMLP(torch.nn.Module):
    """8 -> 16 -> 1 with keyed dropout (so exactness tests cover model randomness across world sizes)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)  # identical init on every rank and every run
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, seeds: Optional[list[int]] = None) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        if seeds is not None:
            h = randomness.keyed_dropout(h, 0.1, seeds)
        return self.l2(h).squeeze(-1)


class StepCounter:
    """User state for the checkpoint tests: a count of the steps this job ran, global (the same on every rank)."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, Any]:
        return {"count": torch.tensor(self.count)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.count = int(state_dict["count"])


def regression_dataset(n: int) -> torch.utils.data.TensorDataset:
    """``n`` samples of a noisy linear target, the same on every rank and every run."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 8, generator=g)
    y = x.sum(-1) * 0.3 + torch.randn(n, generator=g) * 0.1
    return torch.utils.data.TensorDataset(x, y)


class RegressionStream(torch.utils.data.IterableDataset):
    """The regression samples as a stream that can seek (the trainer's ``SeekableStream`` protocol), the way an
    indexed record file would be read."""

    def __init__(self, samples: torch.utils.data.TensorDataset) -> None:
        self.samples = samples
        self.start = 0

    def __len__(self) -> int:
        return len(self.samples)

    def seek(self, index: int) -> None:
        self.start = index

    def __iter__(self):
        for i in range(self.start, len(self.samples)):
            yield self.samples[i]


def train_step(
    trainer: ElasticTrainer, step: Step, before_sync: Optional[Callable[[float, int], None]] = None
) -> tuple[float, int]:
    """Forward and backward of every micro batch of ``step`` (MSE summed over samples, keyed dropout).
    Returns this rank's loss sum and sample count.

    ``before_sync(loss_sum, count)`` runs after the last forward, before the backward that sends this rank's
    gradient to its peers: a program records the step there, so a rank killed after its gradient counted has
    recorded it. (Recorded after the step instead, a member killed between the all-reduce and its write left a
    step that a survivor had applied, and the group kept, with that member's record missing.)"""
    loss_sum, count = 0.0, 0
    last = len(step.micro_indices) - 1
    for i, mb in enumerate(step):
        xb, yb = mb.data
        loss = torch.nn.functional.mse_loss(trainer.model(xb, mb.seeds), yb, reduction="sum")
        loss_sum += float(loss.detach())
        count += len(mb.indices)
        if i == last and before_sync is not None:
            before_sync(loss_sum, count)
        step.backward(loss)
    return loss_sum, count


def step_record(trainer: ElasticTrainer, step: Step) -> dict[str, Any]:
    """What every test program records about a step it ran: the step, who ran it at which world size and plan,
    the dataset indices this rank consumed, the checkpoint it resumed from and the param-group LRs."""
    return {
        "step": step.index + 1,
        "rank": trainer.rank,
        "world": trainer.world_size,
        "global_batch": trainer.plan.global_batch,
        "indices": step.indices,
        "resumed_from": trainer.resumed_from,
        "lrs": [grp["lr"] for grp in trainer.optimizer.param_groups],
        "grad_norm": trainer.last_grad_norm,
        **trainer.precision.scaler_record(),
    }


def open_records(out_dir: str, name: str) -> IO[str]:
    """This process's JSON-lines file ``<out_dir>/<name>-<pid>.jsonl``, line-buffered so a kill loses no line."""
    os.makedirs(out_dir, exist_ok=True)
    return open(os.path.join(out_dir, f"{name}-{os.getpid()}.jsonl"), "a", buffering=1)


def write_record(records: IO[str], record: dict[str, Any]) -> None:
    records.write(json.dumps(record) + "\n")
