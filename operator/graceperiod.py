"""The worker pods' terminationGracePeriodSeconds: how long a SIGTERM'd worker may take to drain. Pure.

A worker that gets SIGTERM (eviction, preemption, a deletion) drains: it finishes its step, writes a checkpoint and
exits (``disttrain.trainer.control``). The kubelet kills it when the grace period runs out, so a period shorter than
one step plus one save loses everything since the last checkpoint. The rule, first match wins:

1. the template's own ``terminationGracePeriodSeconds`` (the pod builder keeps it);
2. ``spec.checkpoint.terminationGracePeriodSeconds``;
3. ``spec.elastic.drainTimeoutSeconds`` (the operator already gives a planned drain, the same work, that long), or
   :data:`SAFETY_FACTOR` x (step seconds + save seconds) when that is longer. Both are measured by the trainer and
   relayed in ``status.checkpointInterval`` (``intervalSteps: auto`` only); an async save's blocking part is not its
   write time, so async jobs take the drain timeout alone.

The status names no checkpoint size or write speed; a save's seconds are what they would give. The period of a pod
is fixed when it is created: a job's first pods get the drain timeout, replacements what was measured by then.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional

from disttrain.api.spec import DistTrainJobSpec

SAFETY_FACTOR = 2.0
"""Margin over the measured step + save: a drain's save may run slower than the routine save measured (every node
writes at once to shared storage, the page cache is full)."""
MAX_SECONDS = 86_400
"""Upper bound of a derived period (a day, the drain timeout's own bound): a corrupt measurement never keeps a pod
Terminating for longer."""


def measured_drain_seconds(status: Optional[Mapping[str, Any]]) -> Optional[float]:
    """Step + save seconds from ``status.checkpointInterval``; None when the status has no usable measurement."""
    interval = (status or {}).get("checkpointInterval")
    if not isinstance(interval, Mapping):
        return None
    step, save = interval.get("stepSeconds"), interval.get("saveSeconds")
    numbers = [v for v in (step, save) if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(numbers) != 2 or not all(math.isfinite(v) and v >= 0 for v in numbers):
        return None
    return float(numbers[0] + numbers[1])


def worker_grace_seconds(spec: DistTrainJobSpec, status: Optional[Mapping[str, Any]]) -> int:
    """Rules 2 and 3 of the module's docstring (rule 1 is the pod builder's): the period a new worker pod gets."""
    if spec.checkpoint.termination_grace_period_seconds is not None:
        return spec.checkpoint.termination_grace_period_seconds
    floor = spec.elastic.drain_timeout_seconds
    measured = None if spec.checkpoint.async_save else measured_drain_seconds(status)
    if measured is None:
        return floor
    return min(MAX_SECONDS, max(floor, math.ceil(SAFETY_FACTOR * measured)))
