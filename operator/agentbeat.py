"""The job agent's own heartbeat: its pulse and its Lease, and the rules that find it silent.

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

The **pulse** (:mod:`disttrain.trainer.agent.pulse`) finds a dead agent in about a second, as fast as a worker, with
no API write: the operator holds a TCP connection to the agent pod's IP and the agent sends a byte every 0.2 s. The
agent is silent when the pulse of the current agent pod (its uid, in the connection's first line) came at least
twice and then not for :data:`~disttrain.api.constants.AGENT_PULSE_SILENT_SECONDS`, unless its last word said it
stops (a clean exit: its job ended; the pod's phase tells the rest), or its pod's node answered meanwhile. A pulse
silent for :data:`PROBE_AFTER_S` makes the adapter *probe* the agent pod: it opens a TCP connection to its pulse port
(:func:`disttrain.operator.pulses.answers`), which the node's kernel accepts from the listening socket's backlog
without any CPU time of the agent's process. So an answer proves the node is up and the agent's process holds its
socket (a dead process's port refuses, a dead node answers nothing): the agent is alive but starved (a busy node, a
long pause of its interpreter), and its silence counts from the probe's start, as if it had pulsed then. An agent
whose node answers but that has not pulsed for :data:`HUNG_S` is hung, and silent. A pulse that never came (no
connection: an older agent, a NetworkPolicy without the operator, a network plugin in the way) judges nothing, and
the Lease's rule still holds. The operator's own stalls are not the agent's: after the adapter's checks paused for
:data:`STALL_S` (its event loop busy, its process starved), every pulse's silence counts from the end of the pause,
when what arrived meanwhile has been read.

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
CHECK_S = 0.1
"""How often the adapter looks for silent agents (a pulse's silence is judged to this)."""
STALL_S = 0.5
"""A pause of the adapter's checks this long is the operator's stall: the pulses' silences restart after it."""
PROBE_AFTER_S = 0.5
"""A pulse silent this long gets its node probed (half the least silence judged: the answer is in before it)."""
HUNG_S = 10.0
"""An agent whose node answers the probes but that has not pulsed for this long is hung: silent all the same."""
LEASE = "silent in its Lease"
PULSE = "its pulse stopped"
"""Why an agent was found silent (:meth:`AgentBeats.silence`), for its Event."""


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


@dataclasses.dataclass
class Pulse:
    """What the operator last heard of one job's agent pulse."""

    uid: str
    """The agent pod whose pulse this is (the first line of the connection)."""
    seen_at: float
    """The operator's monotonic time of its last pulse."""
    pulses: int = 1
    announced: bool = False
    ended: bool = False
    """The agent said it stops (a clean exit): its silence is no loss."""
    answered_at: Optional[float] = None
    """When the latest probe that the agent's node answered began (the operator's monotonic time)."""
    probing: bool = False
    """A probe of the agent's node is under way."""

    @property
    def alive_at(self) -> float:
        """The latest sign of life: a pulse, or the start of a probe that the agent's node answered."""
        return self.seen_at if self.answered_at is None else max(self.seen_at, self.answered_at)


class AgentBeats:
    """The newest beat of every job's agent, as the Lease watch and the pulse connections delivered them."""

    def __init__(
        self,
        renew_s: float = constants.AGENT_LEASE_RENEW_SECONDS,
        pulse_silent_s: float = constants.AGENT_PULSE_SILENT_SECONDS,
    ) -> None:
        self._beats: dict[JobKey, Beat] = {}
        self._pulses: dict[JobKey, Pulse] = {}
        self._checked_at: Optional[float] = None
        self.silent_s = SILENT_RENEWALS * renew_s
        """The least silence judged (three periods)."""
        self.pulse_silent_s = pulse_silent_s

    def pulsed(self, key: JobKey, uid: str, now: float) -> None:
        """A pulse of agent pod ``uid`` of the job arrived (``now``: the operator's monotonic time)."""
        pulse = self._pulses.get(key)
        if pulse is None or pulse.uid != uid:
            self._pulses[key] = Pulse(uid, now)
        else:
            pulse.seen_at, pulse.pulses, pulse.announced, pulse.ended = now, pulse.pulses + 1, False, False

    def ended(self, key: JobKey, uid: str) -> None:
        """Agent pod ``uid`` of the job said it stops: its pulse's silence judges nothing (its pod's phase will)."""
        pulse = self._pulses.get(key)
        if pulse is not None and pulse.uid == uid:
            pulse.ended = True

    def to_probe(self, now: float) -> list[tuple[JobKey, str]]:
        """The agent pods (job, uid) whose pulse is silent for :data:`PROBE_AFTER_S` since their latest sign of life
        and whose node is not being probed yet: the adapter probes each and reports with :meth:`probed`."""
        due = []
        for key, pulse in self._pulses.items():
            if not pulse.probing and not pulse.ended and pulse.pulses >= 2 and now - pulse.alive_at > PROBE_AFTER_S:
                pulse.probing = True
                due.append((key, pulse.uid))
        return due

    def probed(self, key: JobKey, uid: str, began: float, answered: bool) -> None:
        """The probe of agent pod ``uid`` begun at ``began`` is over: its node accepted the connection or not."""
        pulse = self._pulses.get(key)
        if pulse is None or pulse.uid != uid:
            return
        pulse.probing = False
        if answered:
            pulse.answered_at = began if pulse.answered_at is None else max(pulse.answered_at, began)

    def checked(self, now: float) -> None:
        """The adapter looks now; after a pause of :data:`STALL_S` the pulses' silences restart (see the module)."""
        if self._checked_at is not None and now - self._checked_at > STALL_S:
            for pulse in self._pulses.values():
                pulse.seen_at = max(pulse.seen_at, now)
        self._checked_at = now

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

    def forget_job(self, key: JobKey) -> None:
        """The job is gone: its Lease's and its pulse's records with it."""
        self._beats.pop(key, None)
        self._pulses.pop(key, None)

    def silence(self, key: JobKey, agent: Optional[PodView], now: float) -> str:
        """Why ``agent`` (the job's current agent pod) is taken for lost (:data:`PULSE`, :data:`LEASE`), or ""."""
        if agent is None:
            return ""
        pulse = self._pulses.get(key)
        if pulse is not None and pulse_is_silent(pulse, agent.uid, now, self.pulse_silent_s):
            return PULSE
        beat = self._beats.get(key)
        if beat is not None and is_silent(beat, agent.uid, now, self.silent_s):
            return LEASE
        return ""

    def is_silent(self, key: JobKey, agent: Optional[PodView], now: float) -> bool:
        """Whether ``agent`` (the job's current agent pod) has gone silent (see the module)."""
        return bool(self.silence(key, agent, now))

    def newly_silent(self, agent_of: Callable[[JobKey], Optional[PodView]], now: float) -> list[tuple[JobKey, str]]:
        """The jobs whose current agent (``agent_of``) became silent since the last call, with why, each silence
        once: a silence brings no watch event, so the adapter asks here on a timer and wakes these jobs."""
        found = []
        for key in {*self._pulses, *self._beats}:
            pulse, beat = self._pulses.get(key), self._beats.get(key)
            pulse_due = pulse is not None and not pulse.announced and now - pulse.seen_at > self.pulse_silent_s
            beat_due = beat is not None and not beat.announced and now - beat.seen_at > self.silent_s
            if not (pulse_due or beat_due):
                continue  # nothing silent long enough to judge: the common case, ten times a second per job
            why = self.silence(key, agent_of(key), now)
            if why:
                for record in (pulse, beat):
                    if record is not None:
                        record.announced = True
                found.append((key, why))
        return found


def pulse_is_silent(pulse: Pulse, agent_uid: str, now: float, silent_s: float) -> bool:
    """The pulse rule of the module docstring, for the last pulse heard and the current agent pod's uid."""
    if not agent_uid or pulse.uid != agent_uid or pulse.pulses < 2 or pulse.ended:
        return False
    return now - pulse.alive_at > silent_s or now - pulse.seen_at > HUNG_S


def is_silent(beat: Beat, agent_uid: str, now: float, silent_s: float) -> bool:
    """The rule of the module docstring, for the beat last seen, the current agent pod's uid and the least silence."""
    if not agent_uid or beat.holder != agent_uid or beat.renewals < 2:
        return False
    return now - beat.seen_at > max(silent_s, GAP_FACTOR * beat.longest_gap)
