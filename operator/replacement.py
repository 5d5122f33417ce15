"""How long the survivors of an unplanned loss wait for its replacement before they re-form without it.

Why a choice at all: waiting keeps the world size (one reform, the replacement in it) but idles the whole group
until the replacement is Ready; not waiting costs a second, planned reform when the replacement joins (about
1-2 s: docs/benchmarks.md) but trains on at once. Where pods start in seconds (local mode, warm nodes) waiting is
cheaper; where a pod takes longer than a reform to be scheduled, pulled and started (most clusters: 8-10 s on
the test control plane, minutes with a cold image), going on at once is. ``replacementWaitSeconds: auto`` (the
default) decides from how long this job's newest Ready pod took to start. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

from disttrain.api.spec import ElasticSpec
from disttrain.operator.observed import PodView

AUTO_WAIT_SECONDS = 3.0
"""``auto``'s wait, when this job's pods start within it: about what the second reform would cost (a planned
reform measured 1.2-2.3 s), so a replacement that is later than expected costs at most that much more."""
SPARE_JOIN_SECONDS = 30.0
"""How long a loss that Ready hot spares cover holds its replacement back while the group re-forms with them (the
replacement is then created as the next spare), unless ``replacementWaitSeconds`` is longer."""


def start_seconds(pods: Iterable[PodView]) -> Optional[float]:
    """Creation to Ready of the newest Ready pod among ``pods`` (the latest evidence of how fast this job's pods
    start here: scheduling, image, imports); None when none is Ready with both times known."""
    started = [p for p in pods if p.ready and p.created_at is not None and p.ready_at is not None]
    if not started:
        return None
    newest = max(started, key=lambda p: p.created_at or 0.0)
    return max(0.0, (newest.ready_at or 0.0) - (newest.created_at or 0.0))


def wait_seconds(elastic: ElasticSpec, pods: Iterable[PodView]) -> float:
    """``elastic.replacementWaitSeconds``, with ``auto`` resolved against the job's live ``pods``."""
    if elastic.replacement_wait_seconds != "auto":
        return float(elastic.replacement_wait_seconds)
    start = start_seconds(pods)
    return AUTO_WAIT_SECONDS if start is not None and start <= AUTO_WAIT_SECONDS else 0.0
