"""The LR rule after a (re)start, loss normalisation's premise, and keyed randomness."""

import pytest
import torch

from disttrain.api.spec import LRSpec, TrainingSpec
from disttrain.trainer import lr, randomness


def training(**lr_kw) -> TrainingSpec:
    return TrainingSpec(global_batch_size=8, micro_batch_size=2, lr=LRSpec(base=0.1, **lr_kw), max_steps=100)


def test_a_fresh_start_has_no_ramp():
    state = lr.ramp_after_resume(None, None, 0, new_target=2.0, step=0, ramp_steps=5)
    assert state.scale_at(0, 5) == 2.0


def test_a_changed_factor_ramps_from_the_factor_in_effect_at_the_checkpoint():
    state = lr.ramp_after_resume(1.0, 1.0, 0, new_target=2.0, step=10, ramp_steps=4)
    assert [state.scale_at(s, 4) for s in range(10, 15)] == pytest.approx([1.25, 1.5, 1.75, 2.0, 2.0])


def test_a_resume_in_the_middle_of_a_ramp_at_the_same_factor_continues_it():
    state = lr.ramp_after_resume(1.0, 2.0, 10, new_target=2.0, step=12, ramp_steps=4)
    assert state.scale_at(12, 4) == pytest.approx(1.75)


def test_the_restored_optimizer_lr_is_overwritten_by_the_rule():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD(
        [{"params": [p], "lr": 123.0}, {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 5.0, "lr_mult": 0.5}]
    )
    spec = training(schedule="linear", warmup_samples=0)
    value = lr.apply_lr(opt, None, spec, samples_consumed=400, scale=2.0)  # half way through 800 samples
    assert value == pytest.approx(0.1 * 2.0 * 0.5)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1, 0.05])


def test_keyed_dropout_masks_a_sample_the_same_way_in_any_batch():
    x = torch.ones(3, 16)
    seeds = [randomness.sample_seed(0, 5, i) for i in (7, 8, 9)]
    together = randomness.keyed_dropout(x, 0.5, seeds)
    alone = randomness.keyed_dropout(x[1:2], 0.5, seeds[1:2])
    torch.testing.assert_close(together[1:2], alone)
    assert randomness.sample_seed(0, 5, 7) != randomness.sample_seed(0, 6, 7)
