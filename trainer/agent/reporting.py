"""When the job agent writes its status fields: at once when the operator acts on what changed, otherwise at most
every ``spec.reporting.progressIntervalSeconds``.

Why: every status write is a request to the API server and a watch event for the operator, and a trainer steps
several times a second; relaying each step cost hundreds of writes per job and minute. The operator acts on
a few things only, and those never wait:

* a new rendezvous round (with its world size and first progress): a directive completes on it (every drain
  and reform makes the workers exit, so a new round always follows one), and a first round makes the job
  Running;
* the first checkpoint committed after a drain was issued (not one from before it, which the store may still hold
  when the directive arrives): the drain's victims are deleted once the operator sees it;
* a worker failure: a permanent exit code fails the job;
* a node silent in the rendezvous heartbeats (or no longer silent): the operator treats it as lost;
* a node behind a stalled step (or no longer): the operator evicts it;
* the end of training: the success rule reads the final step.

Everything else (steps and samples within a round, a routine checkpoint) goes out with the next periodic
write; every step is on the workers' /metrics in between. Progress within a round is never urgent, not even
during a directive: a group that keeps stepping then (a trainer that ignores a drain until the drain timeout)
would otherwise cost a write per step. Pure: the caller passes the time.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping
from typing import Any, Optional

from disttrain.api import timestamps
from disttrain.api.control import DirectiveAction, is_drain_checkpoint
from disttrain.api.spec import TrainingSpec


def urgent_reason(changes: Mapping[str, Any], status: Mapping[str, Any], training: TrainingSpec) -> Optional[str]:
    """Why the agent-owned ``changes`` (wire names) must be written now; None when they can wait.

    ``status`` is the job's status as last seen (the directive in flight is read there), ``training`` the job's
    ``spec.training`` (its length)."""
    if "rendezvousRound" in changes:
        return "new rendezvous round"
    action = (status.get("control") or {}).get("action") or DirectiveAction.NONE.value
    if (
        "lastCheckpoint" in changes
        and action == DirectiveAction.DRAIN.value
        and not drain_checkpoint_reported(status)
        and not predates_the_directive(changes["lastCheckpoint"], status)
    ):
        return "checkpoint during a drain"
    if "workerFailure" in changes:
        return "worker failure"
    if "silentNodes" in changes:
        return "silent node in the rendezvous heartbeats"
    if "stalledNodes" in changes:
        return "stalled step"
    if "roundMembers" in changes:
        return "new members of the rendezvous round"
    if is_training_complete({**status, **changes}, training):
        return "training complete"
    return None


def drain_checkpoint_reported(status: Mapping[str, Any]) -> bool:
    """The status already names a checkpoint committed after the directive was issued: what the operator waits for
    before it deletes a drain's victims (:func:`disttrain.api.control.is_drain_checkpoint`, the operator's rule too).
    Later checkpoints of the same drain (a group that keeps training until its new round forms) change nothing
    there, and go out with the next periodic write. Unreadable times: not reported (write at once)."""
    times = _directive_and_commit_times(status, status.get("lastCheckpoint"))
    return times is not None and is_drain_checkpoint(*times)


def predates_the_directive(checkpoint: Any, status: Mapping[str, Any]) -> bool:
    """The relayed checkpoint was committed before the directive was issued: not the one a drain waits for.

    Why: the agent learns of a drain at once and relays what its store holds, often a routine checkpoint from
    before the directive. The operator deletes the victims only on one committed after it, so writing that older one
    at once bought nothing and cost one write per drain (measured on the real control plane: a write 20 ms after
    the directive, then the drain's own checkpoint 0.3 s later). Unknown times: not known to predate it."""
    times = _directive_and_commit_times(status, checkpoint)
    if times is None or None in times:
        return False
    return not is_drain_checkpoint(*times)


def _directive_and_commit_times(
    status: Mapping[str, Any], checkpoint: Any
) -> Optional[tuple[Optional[float], Optional[float]]]:
    """``control.issuedAt`` of ``status`` and the ``time`` of ``checkpoint`` as Unix times; None when unreadable."""
    try:
        issued = timestamps.parse_time((status.get("control") or {}).get("issuedAt"))
        committed = timestamps.parse_time((checkpoint or {}).get("time"))
    except (AttributeError, TypeError, ValueError):
        return None
    return issued, committed


def is_training_complete(status: Mapping[str, Any], training: TrainingSpec) -> bool:
    """The relayed progress reached the training length (the rule of :meth:`TrainingSpec.is_complete`)."""
    return training.is_complete(int(status.get("step", 0)), int(status.get("samplesConsumed", 0)))


FIRST = "first write"
"""The reason of an agent's first status write: a started agent reports what its store holds at once."""
PERIODIC = "periodic"
"""The reason of a write that waited for the progress interval."""
UNTHROTTLED = "unthrottled"
"""The reason of every write to a source that costs no API request (local mode)."""

JITTER = 0.1
"""A periodic write comes 0-10 % later than the interval (and the first one 0-100 % later), never sooner."""
SLOW_WRITE_S = 0.1
"""A write slower than this means a loaded API server: the progress interval stretches by ``duration / SLOW_WRITE_S``
(at the default 60 s: a 0.3 s write -> 180 s); an unloaded one answers a status PATCH in 10-50 ms."""
MAX_BACKOFF = 6.0
"""A slow API server stretches the progress interval to at most this many times ``progressIntervalSeconds``, and to
no more than :data:`MAX_STRETCHED_S`: how stale step and samples in the job's status may get, at worst, under load."""
MAX_STRETCHED_S = 180.0
"""The longest a slow API server stretches the progress interval to (an interval set longer stays as set): 3 minutes
at the default 60 s, the 6 intervals of :data:`MAX_BACKOFF` for intervals up to 30 s. Why a bound in seconds: a
minute's interval already writes as seldom as a 10 s one at its full back-off, and six minutes of a stale status
after one slow write (an agent started while the API server was busy) is longer than anyone watching will wait."""
LATENCY_SMOOTHING = 0.5
"""Weight of the newest write's duration in the moving average the back-off follows (a slow write half counts)."""
MAX_COUNTED_WRITE_S = 1.0
"""A write counts as at most this long: a timed-out one (30 s) already means the cap, and would otherwise keep the
average, and the cap, for a dozen writes after the server recovered."""


@dataclasses.dataclass
class ProgressThrottle:
    """Remembers the last write; a write is due when urgent, first, or an interval (stretched at random) after it.

    Why the stretch: jobs started together (a sweep, an operator restart, the benchmark) would otherwise write in
    step, every agent in the same second of each interval, and the operator would take each burst as one queue of
    hundreds of reconciles: a scale request arriving behind it waits for all of them. The first periodic write
    after a start lands anywhere in a second interval, which spreads the agents' phases over the whole interval;
    later ones add up to 10 % (client-go's ``JitterUntil`` habit), so they do not fall back in step. The interval
    stays a floor: no agent writes progress more often than ``progressIntervalSeconds``.

    Why the back-off: a saturated API server answers every request late, the operator's directives included, and
    hundreds of agents writing on a fixed period keep it saturated (on a 2-core control plane, 500 jobs' progress
    alone took 1.2 cores and directives stopped within a minute). Each agent spaces its periodic writes by how
    long its own writes take (:data:`SLOW_WRITE_S`, up to :data:`MAX_BACKOFF`), so the fleet's write rate falls as
    the server's latency rises and comes back when it recovers. Urgent writes are never held back.
    """

    last_write: Optional[float] = None
    """Monotonic time of the last write; None before the first (a restarted agent reports at once)."""
    draw: Callable[[], float] = random.random
    """Uniform in [0, 1): how far into its jitter range the next periodic write falls."""
    stretch: float = 1.0
    """The next periodic write is due ``period x stretch`` after the last write."""
    write_seconds: float = 0.0
    """Moving average of how long the writes took (:data:`LATENCY_SMOOTHING`)."""

    def period(self, interval_s: float) -> float:
        """Seconds between periodic writes before the jitter: the interval, stretched while writes are slow."""
        stretched = interval_s * min(MAX_BACKOFF, max(1.0, self.write_seconds / SLOW_WRITE_S))
        return min(stretched, max(interval_s, MAX_STRETCHED_S))

    def is_due(self, *, urgent: bool, interval_s: float, now: float) -> bool:
        return urgent or self.last_write is None or now - self.last_write >= self.period(interval_s) * self.stretch

    def write_reason(self, *, urgent: Optional[str], interval_s: float, now: float) -> Optional[str]:
        """Why a write is due now (``urgent``, :data:`FIRST` or :data:`PERIODIC`); None when it is not."""
        if urgent is not None:
            return urgent
        if self.last_write is None:
            return FIRST
        return PERIODIC if self.is_due(urgent=False, interval_s=interval_s, now=now) else None

    def wrote(self, now: float, took: float = 0.0) -> None:
        """A write finished at ``now`` after ``took`` seconds."""
        first = self.last_write is None
        self.last_write = now
        self.stretch = 1.0 + (1.0 if first else JITTER) * self.draw()
        took = min(MAX_COUNTED_WRITE_S, max(0.0, took))
        self.write_seconds = took if first else self.write_seconds + LATENCY_SMOOTHING * (took - self.write_seconds)
