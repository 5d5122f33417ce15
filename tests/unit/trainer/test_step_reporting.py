"""The values a step reports are read lazily (no device sync per backward or per clip) and are still exact; its
beacon comes once, before the last backward."""

from __future__ import annotations

import contextlib
import types

import torch

from disttrain.trainer import parallel, precision
from disttrain.trainer.step import Step


def _trainer(model: torch.nn.Module, accum_steps: int = 2, micro_batch: int = 3) -> types.SimpleNamespace:
    """The parts of an ElasticTrainer a Step reads: plan, parallel model, precision, ordered reduction, and the
    in-place reform's failure note (none: a failure is raised)."""
    return types.SimpleNamespace(
        keeping_group_failures=contextlib.nullcontext,
        group_failure=None,
        plan=types.SimpleNamespace(accum_steps=accum_steps, micro_batch=micro_batch, global_batch=6),
        parallel=parallel.ParallelModel(model, parallel.Parallelism.DDP, sums_gradients=True),
        precision=precision.PrecisionState(parallel.Precision.FP32, torch.device("cpu")),
        ordered=None,
        world_size=1,
    )


def test_the_step_loss_is_the_sum_of_every_micro_batch_loss_and_holds_no_graph():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    step = Step(_trainer(model), 0, list(range(6)))
    expected = 0.0
    for k in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(k))
        loss = model(x).pow(2).sum()
        expected += float(loss.detach())
        step.backward(loss)
    assert step.loss_sum == expected
    assert step.loss_count == 6
    assert all(not t.requires_grad for t in step._losses)


def test_clipping_returns_the_norm_before_clipping_as_a_tensor_and_clips_to_the_limit():
    model = torch.nn.Linear(4, 1)
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    before = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    norm = precision.clip_global_grad_norm(model, 1.0)
    assert isinstance(norm, torch.Tensor) and not norm.requires_grad
    assert float(norm) == float(before)
    assert abs(float(norm) - 3.0 * 5**0.5) < 1e-5
    after = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert abs(float(after) - 1.0) < 1e-5


def test_the_beacon_comes_once_before_the_last_backward():
    """The step tells its beacon the step number once, just before the backward of its last micro batch (the one
    that starts the gradient reduction), so a rank stuck anywhere before it is seen behind its peers."""
    model = torch.nn.Linear(4, 1)
    owner = _trainer(model, accum_steps=3, micro_batch=2)
    told: list[tuple[int, int]] = []
    step = Step(owner, 4, list(range(6)), on_reduction=lambda n: told.append((n, len(step._losses))))
    for _ in range(3):
        step.backward(model(torch.randn(2, 4)).pow(2).sum())
    assert told == [(5, 2)], "step 5, after two of the three backwards"
