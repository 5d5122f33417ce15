"""The plan: batch and LR for a world size. Property-based: the invariants hold for every contract."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disttrain.api.plan import (
    InvalidWorldSizeError,
    lr_factor,
    plan,
    ramped_lr_scale,
    schedule_factor,
    valid_world_sizes,
)
from disttrain.api.spec import LRScaling, LRSpec, TrainingSpec


def training(global_batch: int, micro: int, policy: str = "fixed", scaling: str = "linear", **kw) -> TrainingSpec:
    return TrainingSpec(
        globalBatchSize=global_batch,
        microBatchSize=micro,
        batchPolicy=policy,
        lr={"base": 0.1, "scaling": scaling, **kw.pop("lr", {})},
        maxSteps=10,
        **kw,
    )


fixed_contracts = st.builds(
    lambda micro, mult: training(micro * mult, micro),
    st.integers(1, 16),
    st.integers(1, 256),
)


@given(fixed_contracts)
def test_fixed_mode_micro_times_accum_times_world_is_the_global_batch_for_every_valid_size(t):
    sizes = valid_world_sizes(t)
    assert sizes, "the world of one process can always run a batch that the micro batch divides"
    for w in sizes:
        p = plan(t, w)
        assert p.micro_batch * p.accum_steps * p.world_size == t.global_batch_size == p.global_batch
        assert p.lr_scale == 1.0  # the global batch never changes, so neither does the LR


@given(fixed_contracts, st.integers(1, 600))
def test_fixed_mode_refuses_exactly_the_sizes_that_cannot_divide_and_lists_the_valid_ones(t, w):
    if t.global_batch_size % (t.micro_batch_size * w) == 0:
        assert plan(t, w).accum_steps == t.global_batch_size // (t.micro_batch_size * w)
    else:
        with pytest.raises(InvalidWorldSizeError) as caught:
            plan(t, w)
        assert caught.value.valid == valid_world_sizes(t)
        assert f"world size {w} is invalid" in str(caught.value)


@given(st.integers(1, 64), st.integers(1, 8), st.integers(1, 8), st.integers(1, 512))
def test_scaled_mode_grows_the_batch_with_the_world_and_linear_scaling_follows_it(micro, accum, ref_world, w):
    reference = micro * accum * ref_world
    t = training(reference, micro, "scaled", accumulationSteps=accum)
    p = plan(t, w)
    assert p.global_batch == micro * accum * w
    assert p.lr_scale == pytest.approx(w / ref_world)
    assert plan(t, ref_world).lr_scale == pytest.approx(1.0)


@given(st.sampled_from(list(LRScaling)), st.integers(1, 10_000))
def test_lr_factor_is_one_at_the_reference_batch(scaling, reference):
    assert lr_factor(scaling, reference, reference) == pytest.approx(1.0)


@given(
    st.sampled_from([LRScaling.LINEAR, LRScaling.SQRT]),
    st.integers(1, 1000),
    st.integers(1, 1000),
    st.integers(1, 1000),
)
def test_lr_factor_is_monotone_in_the_batch(scaling, reference, a, b):
    small, large = sorted((a, b))
    assert lr_factor(scaling, small, reference) <= lr_factor(scaling, large, reference)


@given(st.integers(1, 1000), st.integers(1, 1000))
def test_linear_and_sqrt_factors_are_the_ratio_and_its_root(batch, reference):
    assert lr_factor(LRScaling.LINEAR, batch, reference) == pytest.approx(batch / reference)
    assert lr_factor(LRScaling.SQRT, batch, reference) == pytest.approx(math.sqrt(batch / reference))
    assert lr_factor(LRScaling.NONE, batch, reference) == 1.0


def test_scaled_mode_two_to_four_doubles_the_batch_with_factor_two_or_root_two():
    linear = training(8, 4, "scaled")
    sqrt = training(8, 4, "scaled", scaling="sqrt")
    assert (plan(linear, 2).global_batch, plan(linear, 4).global_batch) == (8, 16)
    assert plan(linear, 4).lr_scale == pytest.approx(2.0)
    assert plan(sqrt, 4).lr_scale == pytest.approx(math.sqrt(2))


@given(st.floats(0.1, 10), st.floats(0.1, 10), st.integers(1, 100))
def test_ramp_moves_monotonically_from_start_to_target_in_ramp_steps(start, target, ramp):
    values = [ramped_lr_scale(start, target, k, ramp) for k in range(ramp + 3)]
    assert values[ramp - 1] == target and values[-1] == target
    steps = [b - a for a, b in itertools.pairwise(values)]
    assert all(s >= -1e-12 for s in steps) or all(s <= 1e-12 for s in steps)


def test_no_ramp_means_the_target_at_once():
    assert ramped_lr_scale(1.0, 2.0, 0, 0) == 2.0


@given(st.integers(0, 10_000))
def test_schedule_depends_on_samples_only_and_stays_within_floor_and_one(samples):
    lr = LRSpec(base=1.0, schedule="cosine", warmupSamples=100, minFactor=0.1)
    value = schedule_factor(lr, samples, 10_000)
    assert 0.0 <= value <= 1.0
    if samples >= 100:
        assert value >= 0.1 - 1e-12
    assert schedule_factor(lr, 10_000, 10_000) == pytest.approx(0.1)


def test_world_size_zero_is_refused():
    with pytest.raises(InvalidWorldSizeError):
        plan(training(8, 1), 0)
