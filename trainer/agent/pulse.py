"""The job agent's pulse: a byte every ``period`` seconds to whoever holds a connection, the operator's to notice.

Why: the agent's Lease (:mod:`disttrain.trainer.agent.lease`) is one API write per period, so it renews every
second and the operator needs three silent periods (3-4 s) before it takes the agent for lost; a worker's node is
found in about 1 s. A pulse costs no API write: the operator connects to the agent pod's IP (which it read from the
API server, so no stranger can stand in for the agent) and takes the agent for lost when no pulse came for
:data:`~disttrain.api.constants.AGENT_PULSE_SILENT_SECONDS` (:mod:`disttrain.operator.agentbeat`).

The wire (:mod:`disttrain.api.pulse`) goes one way: the server reads nothing. Its first line names the agent pod's
uid, so the operator refuses a pulse from another pod that holds the IP now. Whoever connects learns only that the
agent lives, and its pod uid (no secret: any reader of the pod sees it). The server holds at most
:data:`MAX_CLIENTS` connections and refuses more at once; it drops a client that sends anything (the operator never
does) or that stops reading (its socket buffer full), so no client can hold the thread. The chart's NetworkPolicy
admits only the operator's pods to this port where the network plugin enforces it.
"""

from __future__ import annotations

import logging
import math
import selectors
import socket
import threading
import time
from typing import Optional

from disttrain.api.pulse import BYE, PULSE, hello

log = logging.getLogger("disttrain.agent")

MAX_CLIENTS = 8
"""Connections held at once: the operator needs one; a new operator (restart, upgrade) a second for a moment."""


def next_boundary(now: float, period: float) -> float:
    """The first multiple of ``period`` on the wall clock after ``now``. Every agent pulses on the same instants (the
    nodes' clocks agree to milliseconds), so the operator's event loop wakes once a period for all its links rather
    than once per link; after a stall the next pulse is the next instant, never a burst."""
    return (math.floor(now / period) + 1) * period


class PulseServer:
    """Pulses every ``period`` seconds to every connection on ``(host, port)``, on a thread of its own."""

    def __init__(self, host: str, port: int, pod_uid: str, period: float) -> None:
        self.pod_uid, self.period = pod_uid, period
        family = socket.AF_INET6 if ":" in host else socket.AF_INET  # the pod's IP may be IPv6
        self._listener = socket.create_server((host, port), family=family, backlog=MAX_CLIENTS)
        self._listener.setblocking(False)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._clients: set[socket.socket] = set()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="agent-pulse", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop pulsing, saying so (:data:`~disttrain.api.pulse.BYE`): a clean stop is no silence to judge."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.period + 1)
        for client in list(self._clients):
            self._send(client, BYE)
            self._drop(client)
        self._selector.close()
        self._listener.close()

    @property
    def clients(self) -> int:
        return len(self._clients)

    def _run(self) -> None:
        next_pulse = time.time()
        while not self._stop.is_set():
            now = time.time()
            if next_pulse - now > self.period:  # the wall clock was set back: never a gap in the pulse
                next_pulse = next_boundary(now, self.period)
            timeout = max(0.0, next_pulse - now)
            for key, _events in self._selector.select(timeout):
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    self._drop(key.fileobj)  # type: ignore[arg-type]  # it sent something, or closed
            now = time.time()
            if now >= next_pulse:
                self._send_all(PULSE)
                next_pulse = next_boundary(now, self.period)

    def _accept(self) -> None:
        try:
            client, _peer = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.debug("pulse: accept failed: %s", exc)
            return
        if len(self._clients) >= MAX_CLIENTS:
            client.close()
            return
        client.setblocking(False)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._clients.add(client)
        self._selector.register(client, selectors.EVENT_READ)
        self._send(client, hello(self.pod_uid))

    def _send_all(self, data: bytes) -> None:
        for client in list(self._clients):
            self._send(client, data)

    def _send(self, client: socket.socket, data: bytes) -> None:
        try:
            if client.send(data) == len(data):
                return
        except OSError:
            pass
        self._drop(client)  # gone, or not reading: its buffer is full

    def _drop(self, client: socket.socket) -> None:
        if client in self._clients:
            self._clients.discard(client)
            try:
                self._selector.unregister(client)
            except (KeyError, ValueError):
                pass
        client.close()


def start(host: str, port: int, pod_uid: str, period: float) -> Optional[PulseServer]:
    """The agent's pulse server, started; None when ``port`` or ``period`` is 0 or the address cannot be bound
    (logged: the operator then judges the agent by its Lease alone)."""
    if port <= 0 or period <= 0 or not pod_uid:
        return None
    try:
        server = PulseServer(host, port, pod_uid, period)
    except OSError as exc:
        log.warning(
            "cannot serve the pulse on %s:%d (%s): the operator will judge this agent by its Lease", host, port, exc
        )
        return None
    server.start()
    log.info("pulsing every %.2g s on %s:%d", period, *server.address)
    return server
