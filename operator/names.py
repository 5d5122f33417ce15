"""Deterministic names of the objects the operator creates for a job.

Deterministic names are what makes the operator idempotent: a restarted operator that re-creates an object
gets 409 Conflict instead of a duplicate.
"""

from __future__ import annotations

from collections.abc import Collection


def worker_name(job: str, index: int, incarnation: int = 0) -> str:
    """``<job>-worker-<index>`` for the first pod of a node index, ``<job>-worker-<index>-<n>`` for the n-th
    replacement created while an older pod (Terminating on a dead node, say) still holds the plain name."""
    return f"{job}-worker-{index}" if incarnation == 0 else f"{job}-worker-{index}-{incarnation}"


def unused_worker_name(job: str, index: int, taken: Collection[str]) -> str:
    """The first :func:`worker_name` of ``index`` that no existing pod holds (deterministic: idempotent creates)."""
    incarnation = 0
    while worker_name(job, index, incarnation) in taken:
        incarnation += 1
    return worker_name(job, index, incarnation)


def agent_name(job: str) -> str:
    """``<job>-agent``: the job agent's pod, and its Service, ServiceAccount and Role (one name for all four: the
    chart's status guard knows the agent by its ServiceAccount ``<job>-agent``)."""
    return f"{job}-agent"


agent_service_name = service_account_name = role_name = agent_name


def agent_lease_name(job: str) -> str:
    """The Lease the job's agent renews (its own heartbeat, :mod:`disttrain.operator.agentbeat`)."""
    return f"{job}-agent-heartbeat"


def headless_service_name(job: str) -> str:
    return f"{job}-workers"


def store_secret_name(job: str, uid: str) -> str:
    """``<job>-store-<uid>``: the job's UID in the name makes an existing Secret of that name the job's own (a
    restarted operator's repeat create), so the operator never needs to read Secrets to tell (its role has no
    ``get`` on them). Anyone else would have to create it between the job's creation and the operator's create,
    knowing the UID: a principal that may create Secrets in the job's namespace, inside its trust boundary
    (docs/security.md)."""
    return f"{job}-store-{uid}" if uid else f"{job}-store"


def network_policy_name(job: str) -> str:
    return f"{job}-agent"


def agent_pulse_port(rendezvous_port: int) -> int:
    """The port the job agent pulses on: the one after its store's (the agent pod runs nothing else)."""
    return rendezvous_port + 1 if rendezvous_port < 65535 else rendezvous_port - 1
