"""The job agent's pulse: a byte every ``period`` seconds to whoever holds a connection, the operator's to notice.

Why: the agent's Lease (:mod:`disttrain.trainer.agent.lease`) is one API write per period, so it renews every
second and the operator needs three silent periods (3-4 s) before it takes the agent for lost; a worker's node is
found in about 1 s. A pulse costs no API write: the operator connects to the agent pod's IP (which it read from the
API server, so no stranger can stand in for the agent) and takes the agent for lost when no pulse came for
:data:`~disttrain.api.constants.AGENT_PULSE_SILENT_SECONDS` (:mod:`disttrain.operator.agentbeat`).

The wire (:mod:`disttrain.api.pulse`) goes one way: the server reads nothing. Its first line names the agent pod's
uid, so the operator refuses a pulse from another pod that holds the IP now. Whoever connects learns only that the
agent lives, and its pod uid (no secret: any reader of the pod sees it). The server holds at most
:data:`MAX_PER_SOURCE` connections per source address (more are refused at once) and :data:`MAX_CLIENTS` in all;
when all are taken, a new connection takes the place of the newest one of the address holding the most
(:func:`evictee`), so a stranger holding connections from a few addresses never keeps the operator (one or two
connections from its pod's address) from linking again. Loopback sources are the machine's own (local mode) and
are not capped per address. It drops a client that sends anything (the operator never does) or that stops reading
(its socket buffer full), so no client can hold the thread. The chart's NetworkPolicy
admits only the operator's pods to this port where the network plugin enforces it.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import selectors
import socket
import threading
import time
from typing import Optional

from disttrain.api.pulse import BYE, PULSE, hello

log = logging.getLogger("disttrain.agent")

MAX_CLIENTS = 64
"""Connections held at once: the operator needs one; a new operator (restart, upgrade) a second for a moment."""
MAX_PER_SOURCE = 2
"""Connections one source address may hold (the operator's pod: its link, and a second while it re-links)."""


def is_loopback(source: str) -> bool:
    """Whether ``source`` is this machine's loopback (v4, v6 or v4-mapped)."""
    try:
        address = ipaddress.ip_address(source)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


def evictee(sources: list[str], new_source: str, max_clients: int = MAX_CLIENTS) -> Optional[int]:
    """Which held connection (an index into ``sources``, oldest first) a new one from ``new_source`` replaces:
    None while there is room; else the newest connection of the address holding the most (the new one counted),
    -1 when that is the new one itself (it is refused)."""
    if len(sources) < max_clients:
        return None
    counts: dict[str, int] = {}
    for source in [*sources, new_source]:
        counts[source] = counts.get(source, 0) + 1
    busiest = max(counts, key=lambda source: counts[source])
    if busiest == new_source and counts[new_source] > 1:
        for index in range(len(sources) - 1, -1, -1):
            if sources[index] == new_source:
                return index
    if counts[busiest] == 1:
        return -1  # every address holds one: the newcomer waits for a slot
    return max(index for index, source in enumerate(sources) if source == busiest)


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
        self._order: list[tuple[socket.socket, str]] = []
        """Held connections and their source addresses, oldest first."""
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
            client, peer = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.debug("pulse: accept failed: %s", exc)
            return
        source = str(peer[0]) if peer else "?"
        sources = [held for _sock, held in self._order]
        if not is_loopback(source) and sources.count(source) >= MAX_PER_SOURCE:
            client.close()
            return
        victim = evictee(sources, source)
        if victim == -1:
            client.close()
            return
        if victim is not None:
            self._drop(self._order[victim][0])
        client.setblocking(False)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._clients.add(client)
        self._order.append((client, source))
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
        self._order = [(held, source) for held, source in self._order if held is not client]
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
