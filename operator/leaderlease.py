"""Leader election on a ``coordination.k8s.io/v1`` Lease: the pure rules (when a Lease may be taken, when a leader
must stop), apart from the API calls of :mod:`disttrain.operator.election`.

Only durations measured on one process's own monotonic clock are compared, never a timestamp written by another
machine (as client-go's leader election): a standby counts the Lease's duration from the moment *it* saw the
record change, and a leader counts its renew deadline from the moment *it* sent its last successful renewal. The
clocks of the two machines may then disagree by any offset; only their rates must agree (within
``lease - renew_deadline`` over one lease).

Why a leader is stopped before any standby may take over: a renewal that succeeded was sent at ``t`` (leader's
clock) and reached the API server after ``t``, so every standby saw it at ``t`` or later, and may take the Lease
only ``lease_s`` after that. The leader stops at ``t + renew_deadline_s``, earlier by ``lease_s -
renew_deadline_s``.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Mapping
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class ElectionTiming:
    """The three durations of an election, in seconds (client-go's names).

    ``lease_s``: how long a standby waits after the last renewal it saw before it takes the Lease.
    ``renew_deadline_s``: how long a leader may go without a successful renewal before it stops acting.
    ``retry_s``: how often the leader renews and a standby looks.
    """

    lease_s: float = 3.0
    renew_deadline_s: float = 2.0
    retry_s: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.retry_s < self.renew_deadline_s < self.lease_s:
            raise ValueError(
                f"leader election: need 0 < retry ({self.retry_s:g} s) < renew deadline ({self.renew_deadline_s:g} s)"
                f" < lease ({self.lease_s:g} s), so that a leader stops before a standby may take its Lease"
            )

    @property
    def lease_duration_field(self) -> int:
        """``spec.leaseDurationSeconds`` (whole seconds, rounded up): what ``kubectl get lease`` shows."""
        return max(1, math.ceil(self.lease_s))


@dataclasses.dataclass(frozen=True)
class ElectionOptions:
    """Which Lease, who this replica is in it, and the timing."""

    namespace: str
    name: str
    identity: str
    timing: ElectionTiming = dataclasses.field(default_factory=ElectionTiming)


@dataclasses.dataclass(frozen=True)
class Sighting:
    """The Lease record a standby last saw, and when (its own monotonic clock) it first saw it."""

    holder: str
    record: tuple[Any, ...]
    """What changes with every renewal: the holder, renewTime and leaseTransitions."""
    seen_at: float


def holder(spec: Mapping[str, Any]) -> str:
    return str(spec.get("holderIdentity") or "")


def record_of(spec: Mapping[str, Any]) -> tuple[Any, ...]:
    return (holder(spec), spec.get("renewTime"), spec.get("acquireTime"), spec.get("leaseTransitions"))


def observe(previous: Optional[Sighting], spec: Mapping[str, Any], now: float) -> Sighting:
    """The sighting after reading ``spec`` at ``now``: the old one while the record is unchanged (the lease keeps
    running from when it was first seen), a new one from ``now`` when it changed."""
    record = record_of(spec)
    if previous is not None and previous.record == record:
        return previous
    return Sighting(holder(spec), record, now)


def may_take(sighting: Sighting, identity: str, now: float, timing: ElectionTiming) -> bool:
    """Whether ``identity`` may write itself as the holder: nobody holds the Lease, it holds it already (a restart
    of the same pod: the old process is gone), or the holder has not renewed for a whole lease since seen."""
    return sighting.holder in ("", identity) or now - sighting.seen_at >= timing.lease_s


def leading(renewed_at: Optional[float], now: float, timing: ElectionTiming) -> bool:
    """Whether a leader whose last successful renewal was *sent* at ``renewed_at`` may still act at ``now``."""
    return renewed_at is not None and now - renewed_at < timing.renew_deadline_s


def micro_time(wall: float) -> str:
    """A ``MicroTime`` as the API server writes it (RFC 3339, microseconds, UTC)."""
    return datetime.datetime.fromtimestamp(wall, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def claimed(spec: Mapping[str, Any], identity: str, wall: float, timing: ElectionTiming) -> dict[str, Any]:
    """The Lease spec that makes ``identity`` the holder: a renewal keeps acquireTime and the transition count, a
    takeover sets acquireTime and counts one more transition (a new Lease starts at 0)."""
    renewing = holder(spec) == identity
    transitions = int(spec.get("leaseTransitions") or 0)
    return {
        "holderIdentity": identity,
        "leaseDurationSeconds": timing.lease_duration_field,
        "acquireTime": spec.get("acquireTime") if renewing and spec.get("acquireTime") else micro_time(wall),
        "renewTime": micro_time(wall),
        "leaseTransitions": transitions if renewing or not spec else transitions + 1,
    }


def released(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The spec a leader leaves on a graceful stop: no holder, so a standby takes over at its next look rather than
    a lease later."""
    return {**spec, "holderIdentity": "", "leaseDurationSeconds": 1}
