"""Ordered gradient reduction: micro batch j holds the same samples at every world size, and the sum runs in j order."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from disttrain.trainer import ordered_reduction, sampler


def canonical_micro_batches(cursor: int, global_batch: int, micro: int) -> dict[int, list[int]]:
    """Micro batch j of the step: stream offsets j, j + M, j + 2M, ... (M micro batches per step)."""
    m = global_batch // micro
    return {j: [cursor + j + t * m for t in range(micro)] for j in range(m)}


@given(cursor=st.integers(0, 10_000), micro=st.integers(1, 5), m=st.sampled_from([1, 2, 3, 4, 6, 8, 12]))
def test_every_world_size_forms_the_same_micro_batches(cursor, micro, m):
    global_batch = micro * m
    expected = canonical_micro_batches(cursor, global_batch, micro)
    for world in (w for w in range(1, m + 1) if m % w == 0):
        accum = m // world
        got = {}
        for rank in range(world):
            positions = sampler.rank_positions(cursor, global_batch, world, rank)
            for k, batch in enumerate(ordered_reduction.micro_indices(positions, accum)):
                got[k * world + rank] = batch  # j = k*W + r: the order OrderedReducer sums in
        assert got == expected, f"world size {world}"


def test_each_micro_batch_lands_in_its_own_slot_and_the_sum_runs_in_order(one_process_group):
    model = torch.nn.Linear(3, 2)
    reducer = ordered_reduction.OrderedReducer(list(model.parameters()), accum_steps=3, world_size=1)
    inputs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    separate = []
    for k, x in enumerate(inputs):
        reducer.before_backward(k)
        model(x).pow(2).sum().backward()
        separate.append([p.grad.clone() for p in model.parameters()])
    reducer.reduce()
    for i, p in enumerate(model.parameters()):
        expected = separate[0][i].clone()
        expected += separate[1][i]
        expected += separate[2][i]
        assert torch.equal(p.grad, expected)


def test_parameters_of_mixed_dtypes_are_refused_with_the_field_named():
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    with pytest.raises(ValueError, match=r"gradientReduction=ordered.*float32.*float64"):
        ordered_reduction.OrderedReducer(params, accum_steps=1, world_size=1)


def training(reduction: str):
    from disttrain.api.spec import TrainingSpec

    return TrainingSpec.model_validate(
        {"globalBatchSize": 12, "microBatchSize": 2, "lr": {"base": 0.1}, "maxSteps": 1, "gradientReduction": reduction}
    )


@pytest.mark.parametrize("parallelism, precision", [("fsdp2", "fp32"), ("ddp", "bf16"), ("ddp", "fp16")])
def test_ordered_reduction_is_refused_where_the_trainer_options_cannot_honour_it(parallelism, precision):
    from disttrain.api.plan import plan
    from disttrain.trainer.parallel import Parallelism, Precision

    spec = training("ordered")
    with pytest.raises(ValueError, match=f"gradientReduction=ordered.*parallelism='{parallelism}'"):
        ordered_reduction.for_training(
            spec, torch.nn.Linear(2, 2), Parallelism(parallelism), Precision(precision), plan(spec, 3)
        )


def test_ddp_reduction_needs_no_reducer_and_ordered_sizes_its_slots_by_the_plan():
    from disttrain.api.plan import plan
    from disttrain.trainer.parallel import Parallelism, Precision

    model = torch.nn.Linear(2, 2)
    assert (
        ordered_reduction.for_training(
            training("ddp"), model, Parallelism.DDP, Precision.FP32, plan(training("ddp"), 3)
        )
        is None
    )
    reducer = ordered_reduction.for_training(
        training("ordered"), model, Parallelism.DDP, Precision.FP32, plan(training("ordered"), 3)
    )
    assert reducer is not None and reducer.slots.shape[0] == 2  # 12 / (2 x 3) micro batches per rank
