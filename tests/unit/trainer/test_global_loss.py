"""The reported loss is the step's global loss: every rank's summed loss over the step's one denominator, never
rank 0's own mean. Two Steps stand for two ranks; their loss totals are summed as the all-reduce sums them."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from disttrain.trainer import parallel, precision
from disttrain.trainer.step import Step, global_loss

pytestmark = pytest.mark.unit

PAD = -1
PADDING_LOSS = 100.0  # what a padding position would add if it were counted


def _trainer(model: torch.nn.Module, world_size: int = 2) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        keeping_group_failures=contextlib.nullcontext,
        group_failure=None,
        plan=types.SimpleNamespace(accum_steps=2, micro_batch=1, global_batch=2 * world_size, data_degree=world_size),
        parallel=parallel.ParallelModel(model, parallel.Parallelism.DDP, sums_gradients=True),
        precision=precision.PrecisionState(parallel.Precision.FP32, torch.device("cpu")),
        ordered=None,
        world_size=world_size,
        seed=0,
        fetch=lambda indices: indices,
    )


def _run_rank(model: torch.nn.Module, tokens: int, per_token: float, denominator: float) -> Step:
    """One rank's step: two micro batches of ``tokens // 2`` real tokens each, padded to 64, loss ``per_token`` per
    real token (PADDING_LOSS per padding position, excluded by the mask as a user's loss does)."""
    step = Step(_trainer(model), 0, [0, 1], reduce_loss=True)
    for _ in step:
        targets = torch.full((64,), PAD)
        targets[: tokens // 2] = 1
        mask = targets != PAD
        per_position = torch.where(mask, per_token, PADDING_LOSS) + 0.0 * model(torch.ones(64, 1)).squeeze(1)
        step.backward((per_position * mask).sum(), denominator=denominator, count=int(mask.sum()))
    return step


def test_unequal_token_counts_give_the_token_weighted_loss_not_the_mean_of_the_ranks():
    model = torch.nn.Linear(1, 1)
    tokens = 100 + 10  # the step's global_count of real tokens
    rank0 = _run_rank(model, 100, 1.0, tokens)
    rank1 = _run_rank(model, 10, 3.0, tokens)
    reduced = (rank0.loss_totals() + rank1.loss_totals()).tolist()
    assert reduced == [130.0, 220.0, 2.0]
    assert global_loss(reduced) == 130 / 110
    assert round(130 / 110, 2) == 1.18
    assert (rank0.loss_count, rank1.loss_count) == (100, 10)  # padding is not counted
    assert rank0.loss_sum / rank0.loss_count == 1.0  # rank 0's own mean, which the log must not report


def test_a_single_process_step_reports_its_loss_over_the_denominator():
    model = torch.nn.Linear(1, 1)
    step = _run_rank(model, 100, 1.0, 110.0)
    assert step.global_loss == 100 / 110
    unreduced = Step(_trainer(model), 0, [0, 1], reduce_loss=False)
    for _ in unreduced:
        unreduced.backward(model(torch.ones(1, 1)).sum())
    assert unreduced.global_loss is None  # nothing reads the loss at this step: no reduction, no device read


@pytest.mark.parametrize(
    ("reduced", "expected"),
    [
        pytest.param([12.0, 8.0, 2.0], 3.0, id="sample-weighted: the global batch is every rank's denominator"),
        pytest.param([5.0, 4.0, 1.0], 1.25, id="one rank"),
        pytest.param([0.0, 0.0, 0.0], None, id="no rank ran a backward"),
        pytest.param([-6.0, 12.0, 3.0], -1.5, id="a negative objective"),
    ],
)
def test_global_loss_divides_the_summed_loss_by_the_step_denominator(reduced, expected):
    assert global_loss(reduced) == expected


def test_ranks_of_one_tensor_parallel_group_count_their_shared_loss_once():
    model = torch.nn.Linear(1, 1)
    trainer = _trainer(model, world_size=4)
    trainer.plan.data_degree = 2  # two TP groups of two ranks: each group's ranks hold the same loss
    totals = []
    for per_token in (1.0, 1.0, 3.0, 3.0):
        step = Step(trainer, 0, [0, 1], reduce_loss=True)
        for _ in step:
            step.backward(per_token * 5 + 0.0 * model(torch.ones(1, 1)).sum(), denominator=20.0)
        totals.append(step.loss_totals())
    assert global_loss(sum(totals).tolist()) == (10 + 30) / 20
