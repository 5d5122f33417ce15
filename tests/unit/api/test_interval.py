"""The rule of intervalSteps: auto (Young/Daly), its priors and its bounds."""

from __future__ import annotations

import math

import pytest

from disttrain.api import interval


def test_young_daly_is_the_optimum_of_save_cost_plus_expected_loss():
    """sqrt(2 C M) minimises C/T + T/(2M), the overhead per second of saving every T seconds."""
    save, mtbf = 0.5, 600.0
    best = interval.young_daly_seconds(save, mtbf)
    assert best == pytest.approx(math.sqrt(2 * 0.5 * 600))

    def overhead(t: float) -> float:
        return save / t + t / (2 * mtbf)

    assert all(overhead(best) <= overhead(best * f) for f in (0.5, 0.9, 1.1, 2.0))


def test_interval_in_steps_uses_the_step_time():
    # sqrt(2 * 0.2 s * 90 s) = 6 s of training; at 0.05 s a step that is 120 steps
    assert interval.interval_steps(0.2, 0.05, 90.0) == 120
    assert interval.interval_steps(0.2, 0.5, 90.0) == 12


def test_bounds():
    assert interval.interval_steps(0.0, 0.05, 90.0) == interval.MIN_STEPS  # a free save: every step
    assert interval.interval_steps(1e-6, 10.0, 1.0) == 1
    assert interval.interval_steps(1.0, 0.0, 90.0) == 1  # no step time measured: never more than one step at risk
    # never more than MAX_SECONDS of training at risk: 100 s saves, a year between failures, 1 s steps
    assert interval.interval_steps(100.0, 1.0, 3.15e7) == int(interval.MAX_SECONDS)
    assert interval.interval_steps(100.0, 1e-6, 3.15e7) == interval.MAX_STEPS


def test_mtbf_from_failures_and_the_prior_without_any():
    assert interval.mtbf_seconds(600.0, 10) == 60.0
    assert interval.mtbf_seconds(600.0, 0) == interval.PRIOR_MTBF_SECONDS  # young job: the prior
    assert interval.mtbf_seconds(86_400.0, 0) == 86_400.0  # a day without failure is trusted for a day
    assert interval.mtbf_seconds(-5.0, 0, prior_seconds=100.0) == 100.0


def test_choose_more_failures_means_shorter_intervals():
    calm = interval.choose(0.2, 0.05, age_seconds=600.0, failures=1)
    stormy = interval.choose(0.2, 0.05, age_seconds=600.0, failures=10)
    assert calm.mtbf_seconds == 600.0 and stormy.mtbf_seconds == 60.0
    assert stormy.steps < calm.steps
    assert stormy.steps == round(math.sqrt(2 * 0.2 * 60.0) / 0.05)


def test_choose_before_the_first_save_assumes_one_step_of_save_cost():
    choice = interval.choose(None, 0.1, age_seconds=10.0, failures=0)
    assert choice.save_seconds == 0.1 and choice.mtbf_seconds == interval.PRIOR_MTBF_SECONDS
    assert choice.steps == round(math.sqrt(2 * 0.1 * interval.PRIOR_MTBF_SECONDS) / 0.1)


def test_with_a_bucket_the_cost_is_the_upload_that_makes_a_step_durable():
    """A 0.1 s local save and an 8 s upload, 0.05 s steps, no failure yet (the 600 s prior): the interval is
    Young/Daly's for 8 s, not for 0.1 s, and the choice reports the 8 s it planned with."""
    on_a_volume = interval.choose(0.1, 0.05, 0.0, 0)
    in_a_bucket = interval.choose(0.1, 0.05, 0.0, 0, upload_seconds=8.0)
    assert on_a_volume.steps == interval.interval_steps(0.1, 0.05, 600.0) == 219
    assert in_a_bucket.steps == interval.interval_steps(8.0, 0.05, 600.0) == 1960
    assert in_a_bucket.save_seconds == 8.0
    # A save that blocks longer than its upload takes: the blocking part is the cost.
    assert interval.choose(3.0, 0.05, 0.0, 0, upload_seconds=2.0).save_seconds == 3.0


def test_with_a_bucket_the_interval_is_never_shorter_than_one_upload():
    """Failures every 10 s and a 300 s upload: Young/Daly says 77 s (77 one-second steps), but saves that come
    faster than the uploads queue behind them; the interval is the upload's 300 steps."""
    assert interval.interval_steps(300.0, 1.0, 10.0) == 77
    assert interval.choose(0.5, 1.0, 100.0, 10, upload_seconds=300.0).steps == 300
    assert interval.choose(0.5, 1.0, 100.0, 10, upload_seconds=1e9).steps == interval.MAX_STEPS


def test_the_durable_cost_is_what_was_measured():
    assert interval.durable_save_seconds(None, None) is None  # the prior applies
    assert interval.durable_save_seconds(0.5, None) == 0.5  # a volume, or no upload finished yet
    assert interval.durable_save_seconds(None, 2.0) == 2.0
    assert interval.durable_save_seconds(0.5, 2.0) == 2.0
