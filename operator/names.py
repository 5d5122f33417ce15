"""Deterministic names of the objects the operator creates for a job.

Deterministic names are what makes the operator idempotent: a restarted operator that re-creates an object
gets 409 Conflict instead of a duplicate.
"""

from __future__ import annotations


def worker_name(job: str, index: int) -> str:
    return f"{job}-worker-{index}"


def agent_name(job: str) -> str:
    return f"{job}-agent"


def agent_service_name(job: str) -> str:
    return f"{job}-agent"


def headless_service_name(job: str) -> str:
    return f"{job}-workers"


def service_account_name(job: str) -> str:
    return f"{job}-agent"


def role_name(job: str) -> str:
    return f"{job}-agent"


def store_secret_name(job: str) -> str:
    return f"{job}-store"


def network_policy_name(job: str) -> str:
    return f"{job}-agent"
