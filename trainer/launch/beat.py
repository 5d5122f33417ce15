"""Each node's liveness beat to the job agent: a signed timestamp under its own key, ten times a second (less often
in a job of more than 409 nodes: :func:`disttrain.api.spec.beat_interval_seconds`).

Why not torch's heartbeats alone: torch writes a node's heartbeat into the shared rendezvous state by
compare-and-set of the whole state. At four a second from every node the writes contended: on a loaded 2-core
machine the nodes' compare-and-sets failed one another until a round never completed. A beat is a blind write of
the node's own key, so beats never contend, and the agent (:class:`disttrain.trainer.agent.heartbeats.HeartbeatWatch`)
reads them beside torch's heartbeats for its silence rule (``spec.rendezvous.silentAfterSeconds``).

The beat runs in the launcher (torchrun's agent process), not in a training process, so a long step never
silences it; it writes through the signed store, so a stranger can neither forge a node alive nor garble its beat
(the agent refuses an unsigned value). A write that fails (the agent's store is away) is skipped; the next one goes
to the replacement. When the launcher shuts down (its workers finished or failed), its last beat says so
(:meth:`NodeBeat.leave`): the agent then leaves the verdict to the pod's exit rather than to the silence.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from disttrain.api.spec import BEAT_INTERVAL_S
from disttrain.trainer.agent.heartbeats import encode_beat

log = logging.getLogger("disttrain.rendezvous")

LEAVE_TIMEOUT_S = 1.0
"""The longest :meth:`NodeBeat.leave` holds the launcher's shutdown for the last beat's write."""


class NodeBeat:
    """A daemon thread writing the node's time (``heartbeats.encode_beat``) under ``key`` every ``interval_s``,
    until :meth:`stop` or :meth:`leave`."""

    def __init__(self, store: Any, key: str, interval_s: float = BEAT_INTERVAL_S) -> None:
        self._store = store
        self._key = key
        self.interval_s = interval_s
        """The period; a simulation may change it while the beat runs."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disttrain-node-beat", daemon=True)
        self._failing = False
        self._leaving = False

    def start(self) -> None:
        self._thread.start()

    @property
    def beating(self) -> bool:
        """Whether this node's beats are being written: started, not stopped, and the last write went through."""
        return self._thread.is_alive() and not self._stop.is_set() and not self._failing

    def stop(self) -> None:
        """Stop beating without a word (the beat of a node whose machine died stops so)."""
        self._stop.set()

    def leave(self) -> None:
        """Stop beating with a last beat that says the launcher is shutting down (waits up to
        :data:`LEAVE_TIMEOUT_S` for its write)."""
        self._leaving = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(LEAVE_TIMEOUT_S)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._write(leaving=False)
            self._stop.wait(self.interval_s)
        if self._leaving:  # set before the stop: seen here whenever leave() ended the loop
            self._write(leaving=True)

    def _write(self, *, leaving: bool) -> None:
        try:
            self._store.set(self._key, encode_beat(time.time(), leaving=leaving))
            self._failing = False
        except Exception as exc:  # noqa: BLE001 - the store is away or the process exits: skip this beat
            if not self._failing:
                log.debug("beat %s not written: %r", self._key, exc)
            self._failing = True
