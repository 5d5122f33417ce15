"""The job agent's own heartbeat: a Lease it renews every second, and the rule that finds it silent.

Why: the agent's node can die like any other, and without this rule Kubernetes is the only one to notice, when it
marks the node NotReady (``node-monitor-grace-period``: 40 s by default). Meanwhile no progress, checkpoint or
silent worker reaches the status and no directive reaches the workers (they train on: the agent is not on the
training's path). The workers' launchers beat into the agent's store, which dies with it, so the agent beats
where the operator reads: the Lease ``<job>-agent-heartbeat`` (``coordination.k8s.io``), which the operator creates
with the agent and the agent may only patch (:func:`disttrain.operator.pods.build_role`).

The rule errs towards missing a dead agent (Kubernetes' NotReady still catches it) rather than replacing a live
one, and a wrong verdict costs a replacement, never a step or a restart (the workers reconnect to the new agent):

* the agent renews every ``renew_s`` (the operator's ``--agent-heartbeat-seconds``, 1 s by default; each renewal
  is one small write to the API server per job);
* only the current agent pod's beats count (``holderIdentity`` is its uid), and only once it has renewed twice;
* silent means no renewal seen for :data:`SILENT_RENEWALS` periods and for :data:`GAP_FACTOR` times the longest
  gap between two renewals seen from this pod, so an API server that slows every write stretches the verdict with it;
* times are the operator's own (when it saw a renewal), never the agent's clock.

Pure: the adapter (:mod:`disttrain.operator.handlers`) feeds the Lease watch into :class:`AgentBeats`, wakes the
jobs :meth:`AgentBeats.newly_silent` names, and asks :meth:`AgentBeats.is_silent` when it builds a reconcile's
:class:`~disttrain.operator.observed.Observed`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Optional

from disttrain.api import constants
from disttrain.operator.observed import PodView

JobKey = tuple[str, str]
"""(namespace, job name)"""

SILENT_RENEWALS = 3
"""The least time without a renewal that makes the agent silent, in renewal periods."""
GAP_FACTOR = 3.0
"""Silent also needs this many times the longest gap between two renewals seen from the same agent pod."""
CHECK_S = 0.5
"""How often the adapter looks for silent agents."""


@dataclasses.dataclass
class Beat:
    """What the operator last saw of one job's Lease."""

    holder: str
    """``spec.holderIdentity``: the uid of the agent pod that renewed it."""
    renew_time: str
    seen_at: float
    """The operator's monotonic time when it saw this ``renew_time`` first."""
    renewals: int = 1
    """Renewals seen from this holder."""
    longest_gap: float = 0.0
    """The longest time between two renewals seen from this holder."""
    announced: bool = False
    """:meth:`AgentBeats.newly_silent` named this silence already."""


class AgentBeats:
    """The newest beat of every job's agent, as the Lease watch delivered them."""

    def __init__(self, renew_s: float = constants.AGENT_LEASE_RENEW_SECONDS) -> None:
        self._beats: dict[JobKey, Beat] = {}
        self.silent_s = SILENT_RENEWALS * renew_s
        """The least silence judged (three periods)."""

    def renewed(self, key: JobKey, lease: Mapping[str, Any], now: float) -> None:
        """A watch event of the job's Lease (``now``: the operator's monotonic time)."""
        spec = lease.get("spec") or {}
        holder, renew_time = str(spec.get("holderIdentity") or ""), str(spec.get("renewTime") or "")
        if not holder or not renew_time:
            return  # created by the operator, not renewed yet
        beat = self._beats.get(key)
        if beat is None or beat.holder != holder:
            self._beats[key] = Beat(holder, renew_time, now)
        elif beat.renew_time != renew_time:
            beat.longest_gap = max(beat.longest_gap, now - beat.seen_at)
            beat.renew_time, beat.seen_at, beat.renewals = renew_time, now, beat.renewals + 1
            beat.announced = False

    def forget(self, key: JobKey) -> None:
        """The Lease is gone: nothing is judged until it is renewed again."""
        self._beats.pop(key, None)

    def is_silent(self, key: JobKey, agent: Optional[PodView], now: float) -> bool:
        """Whether ``agent`` (the job's current agent pod) has stopped renewing its Lease (see the module)."""
        beat = self._beats.get(key)
        return agent is not None and beat is not None and is_silent(beat, agent.uid, now, self.silent_s)

    def newly_silent(self, agent_of: Callable[[JobKey], Optional[PodView]], now: float) -> list[JobKey]:
        """The jobs whose current agent (``agent_of``) became silent since the last call, each silence once: a
        silence brings no watch event, so the adapter asks here on a timer and wakes these jobs."""
        found = []
        for key, beat in self._beats.items():
            if beat.announced:
                continue
            agent = agent_of(key)
            if agent is not None and is_silent(beat, agent.uid, now, self.silent_s):
                beat.announced = True
                found.append(key)
        return found


def is_silent(beat: Beat, agent_uid: str, now: float, silent_s: float) -> bool:
    """The rule of the module docstring, for the beat last seen, the current agent pod's uid and the least silence."""
    if not agent_uid or beat.holder != agent_uid or beat.renewals < 2:
        return False
    return now - beat.seen_at > max(silent_s, GAP_FACTOR * beat.longest_gap)
