"""Evaluation in the loop on a real one-rank gloo group: when it is due, and what it computes."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import TensorDataset

from disttrain.trainer.evaluation import EvalOptions, Evaluator


def loss_sums(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor | int]:
    x, y = batch
    assert not model.training and not torch.is_grad_enabled()
    return {"loss": torch.nn.functional.mse_loss(model(x).squeeze(-1), y, reduction="sum"), "count": len(y)}


def options(**kw) -> EvalOptions:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(5, 3, generator=g), torch.randn(5, generator=g))
    return EvalOptions(dataset=data, fn=loss_sums, **{"batch_size": 2, **kw})


def test_an_evaluation_sums_every_sample_once_and_leaves_the_model_training(one_process_group):
    opts = options(every_steps=2, summarize=lambda s: {"loss": s["loss"] / s["count"], "count": s["count"]})
    model = torch.nn.Linear(3, 1)
    ev = Evaluator(opts, torch.device("cpu"))
    result = ev.evaluate(model, step=2, world_size=1, rank=0)
    x, y = opts.dataset.tensors
    with torch.no_grad():
        expected = float(torch.nn.functional.mse_loss(model(x).squeeze(-1), y))
    assert result == pytest.approx({"loss": expected, "count": 5.0})
    assert model.training and ev.last_step == 2 and ev.last_result == result


def test_steps_decide_alike_everywhere_and_a_step_is_never_evaluated_twice(one_process_group):
    ev = Evaluator(options(every_steps=2), torch.device("cpu"))
    assert [s for s in range(1, 7) if ev.is_due(s, rank=0)] == [2, 4, 6]
    ev.evaluate(torch.nn.Linear(3, 1), step=4, world_size=1, rank=0)
    assert not ev.is_due(4, rank=0)  # a resumed or re-formed group at the step it evaluated


def test_seconds_are_rank_0s_clock_agreed_one_boundary_late_and_not_twice_in_a_row(one_process_group):
    ev = Evaluator(options(every_seconds=0.05), torch.device("cpu"))
    assert not ev.is_due(1, rank=0)  # nothing agreed yet
    time.sleep(0.06)
    assert not ev.is_due(2, rank=0)  # rank 0's clock says due: the group reads it at the next boundary
    assert ev.is_due(3, rank=0)
    ev.evaluate(torch.nn.Linear(3, 1), step=3, world_size=1, rank=0)
    assert not ev.is_due(4, rank=0)  # the flag read here was taken before the evaluation
    assert not ev.is_due(5, rank=0)
    ev.reset()  # a new group drops the agreement in flight
    assert not ev.is_due(6, rank=0)


@pytest.mark.parametrize(
    "kw, message",
    [({}, "at least one"), ({"every_steps": 1, "batch_size": 0}, "batch_size"), ({"every_steps": -1}, "at least")],
    ids=["no-schedule", "no-batch", "negative"],
)
def test_invalid_evaluation_options_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        options(**kw)
