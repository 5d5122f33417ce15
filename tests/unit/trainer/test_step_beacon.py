"""A step tells its beacon the step number once, just before the backward of its last micro batch (the one that
starts the gradient reduction), so a rank stuck anywhere before it is seen behind its peers."""

from __future__ import annotations

import contextlib
import types

import torch

from disttrain.trainer import parallel, precision
from disttrain.trainer.step import Step


def test_the_beacon_comes_once_before_the_last_backward():
    model = torch.nn.Linear(4, 1)
    owner = types.SimpleNamespace(
        keeping_group_failures=contextlib.nullcontext,
        group_failure=None,
        plan=types.SimpleNamespace(accum_steps=3, micro_batch=2, global_batch=6),
        parallel=parallel.ParallelModel(model, parallel.Parallelism.DDP, sums_gradients=True),
        precision=precision.PrecisionState(parallel.Precision.FP32, torch.device("cpu")),
        ordered=None,
        world_size=1,
    )
    told: list[tuple[int, int]] = []
    step = Step(owner, 4, list(range(6)), on_reduction=lambda n: told.append((n, len(step._losses))))
    for _ in range(3):
        step.backward(model(torch.randn(2, 4)).pow(2).sum())
    assert told == [(5, 2)], "step 5, after two of the three backwards"
