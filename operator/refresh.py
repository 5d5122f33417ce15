"""How often a job's status is written while nothing the operator acts on changes: one period per job, for the
goodput account and the Checkpointed condition's message together. Pure."""

from __future__ import annotations

import hashlib

from disttrain.api import goodput


def refresh_seconds(job_key: str) -> float:
    """The job's own period between two refreshes: between 1 and 1.5 x :data:`disttrain.api.goodput.REFRESH_SECONDS`,
    fixed per job (from its uid).

    Why one period for both: each refresh is a status write, and two periods per job (the checkpoint message's and
    the account's) cost two writes where one carries both. Why a period per job: jobs started together commit
    together, and with one period for all their refreshes would stay in step: at 500 jobs, 500 reconciles and
    status writes in the same second, and a directive decided or written then queued behind them. Different
    periods spread the refreshes over the interval within a few cycles."""
    fraction = int.from_bytes(hashlib.sha256(job_key.encode()).digest()[:4], "big") / 2**32
    return goodput.REFRESH_SECONDS * (1.0 + 0.5 * fraction)
