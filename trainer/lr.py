"""Applying the plan's LR after every (re)start: the declared rule decides, never the restored optimizer state.

``lr = lr.base x ramped world-size factor x schedule(samples consumed) x group multiplier``. The world-size factor
comes from :func:`disttrain.api.plan.plan`; after a change of world size it moves from the factor in effect at the
checkpoint to the new one over ``lr.rampSteps`` optimizer steps. The schedule is evaluated on samples consumed,
so its length does not depend on the world size. Param groups may carry ``lr_mult`` (default 1.0) for
per-group ratios; the absolute ``lr`` stored in the optimizer state is overwritten on load.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

from disttrain.api.plan import learning_rate, ramped_lr_scale
from disttrain.api.spec import TrainingSpec


@dataclass
class LRState:
    """The ramp: the factor when the world size last changed, the target, and the step of that change."""

    start_scale: float
    target_scale: float
    change_step: int

    def scale_at(self, step: int, ramp_steps: int) -> float:
        """Factor for the optimizer step that follows ``step`` completed steps."""
        return ramped_lr_scale(self.start_scale, self.target_scale, step - self.change_step, ramp_steps)


def ramp_after_resume(
    saved_scale: Optional[float],
    saved_target: Optional[float],
    saved_change_step: int,
    new_target: float,
    step: int,
    ramp_steps: int,
) -> LRState:
    """The ramp to follow from ``step`` on, given what the checkpoint recorded and the new plan's factor.

    A fresh start ramps from the target itself (no ramp: there is nothing to move from). A resume at the same
    factor continues the saved ramp unchanged; a changed factor starts a new ramp from the factor in effect
    when the checkpoint was taken.
    """
    if saved_scale is None or saved_target is None:
        return LRState(start_scale=new_target, target_scale=new_target, change_step=step)
    if saved_target == new_target:
        return LRState(start_scale=saved_scale, target_scale=saved_target, change_step=saved_change_step)
    in_effect = (
        ramped_lr_scale(saved_scale, saved_target, step - 1 - saved_change_step, ramp_steps)
        if step > saved_change_step
        else saved_scale
    )
    return LRState(start_scale=in_effect, target_scale=new_target, change_step=step)


def apply_lr(optimizer: Any, scheduler: Any, training: TrainingSpec, samples_consumed: int, scale: float) -> float:
    """Write the LR into every param group (and the scheduler's base LRs); returns the LR of multiplier 1."""
    lr = learning_rate(training, samples_consumed, scale)
    base = training.lr.base * scale
    for group in optimizer.param_groups:
        mult = float(group.get("lr_mult", 1.0))
        group["lr"] = lr * mult
        group["initial_lr"] = base * mult
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [base * float(g.get("lr_mult", 1.0)) for g in optimizer.param_groups]
    return lr


def apply_scheduler_factor(optimizer: Any, scheduler: Any) -> None:
    """The scheduler's own factor on top of the base LRs :func:`apply_lr` just recomputed from the rule (no
    scheduler: nothing)."""
    if scheduler is None:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # get_lr() outside step() warns; we call it deliberately
        closed = getattr(scheduler, "_get_closed_form_lr", None)
        lrs = closed() if closed is not None else scheduler.get_lr()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
