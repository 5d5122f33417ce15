"""The job agent's pulse: a byte every ``period`` seconds to whoever proved the job's pulse key, the operator's to
notice.

Why: the agent's Lease (:mod:`disttrain.trainer.agent.lease`) is one API write per period, so it renews every
second and the operator needs three silent periods (3-4 s) before it takes the agent for lost; a worker's node is
found in about 1 s. A pulse costs no API write: the operator connects to the agent pod's IP (which it read from the
API server) and takes the agent for lost when no pulse came for
:data:`~disttrain.api.constants.AGENT_PULSE_SILENT_SECONDS`, unless this pod's node accepted a connection of its
meanwhile (a probe: this process is starved, not dead; :mod:`disttrain.operator.agentbeat`).

The wire (:mod:`disttrain.api.pulse`): the server greets every connection with a nonce; a connection *links* once
it answered with the job's pulse key (:mod:`disttrain.api.handshake`), and only links get the server's proof, the
pod's uid and the pulses. The two kinds never compete:

* **Unproven connections** wait at most :data:`~disttrain.api.pulse.HANDSHAKE_S` for their answer (then they are
  closed), at most :data:`MAX_PENDING_PER_SOURCE` per source address (more are refused; loopback, the machine's
  own, excepted) and :data:`MAX_PENDING` in all (a newcomer then closes the oldest). The answer is 68 bytes; more
  is never read.
* **Links** (at most :data:`MAX_LINKS`: the operator's, and a new leader's or a re-link's for a moment) are never
  taken by an unproven connection; a new link closes the oldest when all are taken. A link that sends anything
  (the operator never does after its answer) or stops reading (its socket buffer full) is dropped, so no client can
  hold the thread.

So a stranger holding every connection it can costs the operator nothing: its answer, one round trip after it
connects, makes it a link whatever the stranger holds. The chart's NetworkPolicy admits only the operator's pods to
this port where the network plugin enforces it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import math
import selectors
import socket
import threading
import time
from typing import Optional

from disttrain.api import handshake
from disttrain.api.pulse import BYE, HANDSHAKE_S, PULSE, hello

log = logging.getLogger("disttrain.agent")

MAX_LINKS = 8
"""Proven connections held at once: the operator needs one; a new leader (restart, upgrade) a second for a moment."""
MAX_PENDING = 64
"""Connections still to prove the key, from every source together."""
MAX_PENDING_PER_SOURCE = 8
"""Connections still to prove the key from one source address."""
LATE_S = 0.5
"""A pulse this late is logged: the process was starved (its node busy, its interpreter paused)."""


def is_loopback(source: str) -> bool:
    """Whether ``source`` is this machine's loopback (v4, v6 or v4-mapped)."""
    try:
        address = ipaddress.ip_address(source)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


@dataclasses.dataclass
class _Pending:
    """A connection greeted and waiting for its answer."""

    source: str
    greeting: bytes
    deadline: float
    answer: bytearray = dataclasses.field(default_factory=bytearray)


def next_boundary(now: float, period: float) -> float:
    """The first multiple of ``period`` on the wall clock after ``now``. Every agent pulses on the same instants (the
    nodes' clocks agree to milliseconds), so the operator's event loop wakes once a period for all its links rather
    than once per link; after a stall the next pulse is the next instant, never a burst."""
    return (math.floor(now / period) + 1) * period


class PulseServer:
    """Pulses every ``period`` seconds to every link on ``(host, port)``, on a thread of its own; ``key`` is the
    job's pulse key, which a connection must prove to become a link."""

    def __init__(self, host: str, port: int, pod_uid: str, period: float, key: bytes) -> None:
        self.pod_uid, self.period, self._key = pod_uid, period, key
        family = socket.AF_INET6 if ":" in host else socket.AF_INET  # the pod's IP may be IPv6
        self._listener = socket.create_server((host, port), family=family, backlog=MAX_PENDING)
        self._listener.setblocking(False)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._links: list[socket.socket] = []
        """Proven connections, oldest first."""
        self._pending: dict[socket.socket, _Pending] = {}
        """Unproven connections, oldest first (dicts keep their order)."""
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
        for client in list(self._links):
            self._send(client, BYE)
            self._drop(client)
        for client in list(self._pending):
            self._drop(client)
        self._selector.close()
        self._listener.close()

    @property
    def clients(self) -> int:
        """Links: connections that proved the key."""
        return len(self._links)

    @property
    def pending(self) -> int:
        """Connections still to prove the key."""
        return len(self._pending)

    def _run(self) -> None:
        next_pulse = time.time()
        while not self._stop.is_set():
            now = time.time()
            if next_pulse - now > self.period:  # the wall clock was set back: never a gap in the pulse
                next_pulse = next_boundary(now, self.period)
            timeout = max(0.0, next_pulse - now)
            if self._pending:  # the oldest unproven connection's deadline comes first (dicts keep their order)
                first = next(iter(self._pending.values()))
                timeout = min(timeout, max(0.0, first.deadline - time.monotonic()))
            for key, _events in self._selector.select(timeout):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj in self._pending:
                    self._read_answer(key.fileobj)
                else:
                    self._drop(key.fileobj)  # type: ignore[arg-type]  # a link sent something, or closed
            self._expire(time.monotonic())
            now = time.time()
            if now >= next_pulse:
                if now - next_pulse > LATE_S:
                    log.warning(
                        "pulse %.2f s late: this process was starved (the operator probes its port before it takes it "
                        "for lost)",
                        now - next_pulse,
                    )
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
        from_source = sum(1 for held in self._pending.values() if held.source == source)
        if not is_loopback(source) and from_source >= MAX_PENDING_PER_SOURCE:
            client.close()
            return
        if len(self._pending) >= MAX_PENDING:
            self._drop(next(iter(self._pending)))  # the oldest unproven connection makes room
        client.setblocking(False)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        greeting = handshake.greeting()
        self._pending[client] = _Pending(source, greeting, time.monotonic() + HANDSHAKE_S)
        self._selector.register(client, selectors.EVENT_READ)
        if not self._sent(client, greeting):
            self._drop(client)

    def _read_answer(self, client: socket.socket) -> None:
        """Read what is left of the answer (never more); a wrong one closes the connection, a right one links it."""
        held = self._pending[client]
        try:
            data = client.recv(handshake.ANSWER_LEN - len(held.answer))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(client)
            return
        held.answer += data
        if len(held.answer) < handshake.ANSWER_LEN:
            return
        proof = handshake.check_answer(self._key, held.greeting, bytes(held.answer))
        del self._pending[client]
        if proof is None:
            self._drop(client)
            return
        if len(self._links) >= MAX_LINKS:
            self._drop(self._links[0])  # a new link replaces the oldest: the operator's re-link, or a new leader
        self._links.append(client)
        self._send(client, proof + hello(self.pod_uid))

    def _expire(self, now: float) -> None:
        """Close the unproven connections whose answer is late."""
        for client in [client for client, held in self._pending.items() if held.deadline <= now]:
            self._drop(client)

    def _send_all(self, data: bytes) -> None:
        for client in list(self._links):
            self._send(client, data)

    @staticmethod
    def _sent(client: socket.socket, data: bytes) -> bool:
        try:
            return client.send(data) == len(data)
        except OSError:
            return False

    def _send(self, client: socket.socket, data: bytes) -> None:
        if not self._sent(client, data):
            self._drop(client)  # gone, or not reading: its buffer is full

    def _drop(self, client: socket.socket) -> None:
        self._pending.pop(client, None)
        if client in self._links:
            self._links.remove(client)
        try:
            self._selector.unregister(client)
        except (KeyError, ValueError):
            pass
        client.close()


def start(host: str, port: int, pod_uid: str, period: float, key: Optional[bytes]) -> Optional[PulseServer]:
    """The agent's pulse server, started; None when ``port`` or ``period`` is 0, there is no pulse key, or the
    address cannot be bound (logged: the operator then judges the agent by its Lease alone)."""
    if port <= 0 or period <= 0 or not pod_uid:
        return None
    if key is None:
        log.warning("no pulse key in the job's Secret: no pulse; the operator will judge this agent by its Lease")
        return None
    try:
        server = PulseServer(host, port, pod_uid, period, key)
    except OSError as exc:
        log.warning(
            "cannot serve the pulse on %s:%d (%s): the operator will judge this agent by its Lease", host, port, exc
        )
        return None
    server.start()
    log.info("pulsing every %.2g s on %s:%d", period, *server.address)
    return server
