"""The rule of ``spec.checkpoint.intervalSteps: auto``: Young/Daly's optimal checkpoint interval, in steps.

A save stops training for ``C`` seconds (its blocking part; an async save's background write does not stop
training); a failure loses on average half the work since the last save. The interval that minimises the sum of
both is Young's first-order optimum ``T = sqrt(2 * C * MTBF)`` (Daly 2006 adds terms that matter only when ``C``
approaches the MTBF). Pure Python: the trainer applies it, tests and ``bench/goodput.py`` check it.

Inputs, and what stands in for them before they are measured:

* ``C``: the cost of making a step durable (:func:`durable_save_seconds`). On a volume, the blocking seconds of
  the newest save in this process. With a bucket (``checkpoint.uri``), the seconds the newest save's upload took
  (the local tier's copy goes with its node, so a step is durable only once its upload is done), or the blocking
  part when that is longer; and the interval is never shorter than one upload, or saves would queue behind the
  uploads and the oldest be dropped unuploaded. Before the first save, one step (:data:`PRIOR_SAVE_STEPS` steps).
* MTBF: running time of the job (since ``status.startTime``, suspensions excluded) divided by the failures the
  operator counted (``status.restarts.total`` and the infrastructure losses that redo steps); with no failure yet,
  :data:`PRIOR_MTBF_SECONDS` or the job's age, whichever is longer (a job that ran a day without failing is
  trusted for a day).
* the step time: measured by the trainer (save time excluded).

The result is clamped to ``[MIN_STEPS, MAX_STEPS]`` and to at most :data:`MAX_SECONDS` of training.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Final

AUTO: Final = "auto"
"""The ``intervalSteps`` value that asks for this rule."""
MIN_STEPS: Final = 1
MAX_STEPS: Final = 100_000
"""Upper bound of the interval in steps, whatever the estimate (a job that never fails still saves)."""
MAX_SECONDS: Final = 3_600.0
"""Upper bound of the interval in seconds of training: at most an hour of work is ever at risk."""
PRIOR_MTBF_SECONDS: Final = 600.0
"""MTBF assumed while no failure has been seen (or the job's age, when longer). Short on purpose: a prior that is
too short costs at most ``sqrt(C / (2 * prior))`` of the training time in extra saves (under 1 % for a 1 s save),
and less as the job's age takes over; one that is too long loses up to the whole interval at the first failure."""
PRIOR_SAVE_STEPS: Final = 1.0
"""Save cost assumed before the first save is measured, in steps."""


@dataclasses.dataclass(frozen=True)
class IntervalChoice:
    steps: int
    """The chosen interval in optimizer steps."""
    save_seconds: float
    """Blocking seconds of one save that went into it."""
    step_seconds: float
    """Seconds of one step that went into it."""
    mtbf_seconds: float
    """Mean time between failures that went into it."""


def mtbf_seconds(age_seconds: float, failures: int, prior_seconds: float = PRIOR_MTBF_SECONDS) -> float:
    """Observed mean time between failures: running time / failures; the prior (or the age, if longer) without any."""
    age = max(0.0, age_seconds)
    if failures <= 0:
        return max(prior_seconds, age)
    return max(age / failures, 1e-3)


def young_daly_seconds(save_seconds: float, mtbf: float) -> float:
    """Young's optimal interval ``sqrt(2 * C * MTBF)`` in seconds."""
    return math.sqrt(2.0 * max(save_seconds, 0.0) * max(mtbf, 0.0))


def interval_steps(save_seconds: float, step_seconds: float, mtbf: float) -> int:
    """The optimal interval converted to whole steps and clamped (see the module docstring for the bounds)."""
    if not step_seconds > 0 or not math.isfinite(step_seconds):
        return MIN_STEPS
    seconds = min(young_daly_seconds(save_seconds, mtbf), MAX_SECONDS)
    steps = seconds / step_seconds
    if not math.isfinite(steps):
        return MAX_STEPS
    return int(min(MAX_STEPS, max(MIN_STEPS, round(steps))))


def durable_save_seconds(blocking_seconds: float | None, upload_seconds: float | None) -> float | None:
    """``C``: the longer of a save's blocking part and its upload (None for one not measured or not made); None
    while neither is known."""
    known = [s for s in (blocking_seconds, upload_seconds) if s is not None]
    return max(known) if known else None


def choose(
    save_seconds: float | None,
    step_seconds: float,
    age_seconds: float,
    failures: int,
    prior_mtbf_seconds: float = PRIOR_MTBF_SECONDS,
    upload_seconds: float | None = None,
) -> IntervalChoice:
    """The whole rule: the priors for what is not measured yet, Young/Daly, steps, bounds. ``save_seconds``: the
    newest save's blocking part; ``upload_seconds``: its upload to the bucket (None on a volume)."""
    durable = durable_save_seconds(save_seconds, upload_seconds)
    save = durable if durable is not None else PRIOR_SAVE_STEPS * step_seconds
    mtbf = mtbf_seconds(age_seconds, failures, prior_mtbf_seconds)
    steps = interval_steps(save, step_seconds, mtbf)
    if upload_seconds is not None and step_seconds > 0 and math.isfinite(upload_seconds / step_seconds):
        steps = min(MAX_STEPS, max(steps, math.ceil(upload_seconds / step_seconds)))  # no save waits on the last
    return IntervalChoice(steps, save, step_seconds, mtbf)
