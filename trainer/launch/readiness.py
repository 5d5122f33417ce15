"""The worker pod's readiness: a TCP port that listens once the node can start its workers at once.

Why: a node that joins a running group (a scale-up, or the replacement of a lost node once the group went on
without it) waits in the rendezvous while the group trains; the operator then drains the group so that it
re-forms with the newcomer. If the drain comes as soon as the newcomer's container runs, the whole group stops
and waits for the newcomer's workers to import torch and the trainer (seconds on a CPU, more with CUDA): measured
3.5 s of stall per scale-up on the 2-core development machine (``scale_up_stall_seconds`` in ``bench/reform.py``).
So the launcher opens :data:`disttrain.api.env.READY_PORT` only once its warm worker interpreters
(:mod:`disttrain.trainer.launch.warmstart`) finished their imports, the pod's ``readinessProbe`` (a TCP check) passes
from then on, and the operator brings in only Ready pods (``_choose_target`` in the reconcile core). A node whose
workers cannot start warm is ready as soon as its launcher runs. Once ready, the pod stays ready: the port stays
open for the launcher's life (its workers running, or their interpreters warm again).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Optional

from disttrain.api import env as env_names

log = logging.getLogger("disttrain.launch")

POLL_SECONDS = 0.05
"""How often the readiness condition is checked until it holds (a probe runs every second at most)."""


def ready_port(environ: Mapping[str, str] = os.environ) -> int:
    """The port to listen on (0: the pod has no readiness port, as under plain torchrun)."""
    try:
        return max(0, int(environ.get(env_names.READY_PORT, "0") or 0))
    except ValueError:
        log.warning(
            "%s=%r is not a port number: no readiness port", env_names.READY_PORT, environ[env_names.READY_PORT]
        )
        return 0


class Readiness:
    """Listens on ``port`` (default: :func:`ready_port` when armed) from the moment ``is_ready()`` first holds;
    accepts and closes every probe connection (an unaccepted backlog would fill up and make later probes fail)."""

    def __init__(self, port: Optional[int] = None) -> None:
        self.port = port
        self._armed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server: Optional[socket.socket] = None
        self.listening = threading.Event()

    def arm(self, is_ready: Callable[[], bool]) -> None:
        """Start waiting for ``is_ready`` in the background (once; later calls do nothing)."""
        with self._lock:
            if self._armed:
                return
            self._armed = True
            if self.port is None:
                self.port = ready_port()
            if not self.port:
                return
        threading.Thread(target=self._serve, args=(is_ready,), name="disttrain-readiness", daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        server = self._server
        if server is not None:
            try:
                server.close()
            except OSError:
                pass

    def _serve(self, is_ready: Callable[[], bool]) -> None:
        while not self._stop.is_set() and not is_ready():
            self._stop.wait(POLL_SECONDS)
        if self._stop.is_set():
            return
        port = self.port or 0
        try:
            server = socket.create_server(("", port))
        except OSError as exc:
            log.error("cannot listen on readiness port %d (%s): this pod never reads Ready", port, exc)
            return
        server.settimeout(1.0)
        self._server = server
        self.listening.set()
        log.info("node ready: workers start warm; listening on readiness port %d", port)
        while not self._stop.is_set():
            try:
                connection, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            connection.close()
