"""The operator's end of the job agents' pulses: one connection to each current agent pod, read into
:class:`~disttrain.operator.agentbeat.AgentBeats`.

Why a connection from the operator, and not a report from the agent: the operator connects to the pod IP it read
from the API server, so what answers there is the agent's network namespace; the operator exposes no port and reads
no Secret. It proves the job's pulse key (:func:`disttrain.api.pulse.job_key`, derived from the operator's own key
and the job's uid) with :mod:`disttrain.api.handshake`, which gets it a link no stranger's connection can take, and
checks the agent's proof back. What the connection delivers is still checked: after the proof, the first line must
name the pod the operator meant (:func:`disttrain.api.pulse.hello`; an IP is reused by later pods, and
:data:`HELLO_LIMIT` bounds it), and after it only pulses and the agent's last word count.

The links follow the pod watch: :meth:`PulseLinks.follow` for every agent pod event (a Running pod with an IP and a
pulse port gets a link, anything else loses it), :meth:`PulseLinks.forget` when the pod is gone. A link that fails
(refused, reset, closed, a wrong first line) tries again every :data:`RETRY_S` while its pod is current; it never
judges: :mod:`disttrain.operator.agentbeat` does, from the pulses' times and the answers to :meth:`PulseLinks.probe`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import struct
import time
from collections.abc import Callable, Mapping
from typing import Any, Optional

from disttrain.api import constants, handshake, pulse
from disttrain.operator import access
from disttrain.operator.agentbeat import AgentBeats, JobKey

log = logging.getLogger("disttrain.operator")

CONNECT_TIMEOUT_S = 1.0
HELLO_TIMEOUT_S = 2.0
RETRY_S = 0.5
HELLO_LIMIT = 128
"""The longest first line taken: the magic and a pod uid."""
PROBE_TIMEOUT_S = 1.0
"""How long a probe waits for the agent's node to accept its connection."""


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one agent pod pulses."""

    key: JobKey
    uid: str
    host: str
    port: int
    job_uid: str = ""
    """The job's uid (the pod's ``disttrain.dev/job-uid`` label): what its pulse key is derived from."""


def target_of(key: JobKey, pod: Mapping[str, Any]) -> Optional[Target]:
    """The pulse of agent pod ``pod`` of job ``key``: None unless it runs, has an IP and declares a pulse port (an
    agent built with ``--agent-pulse-seconds=0``, or by an older operator, declares none)."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return None
    for container in spec.get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == constants.AGENT_PULSE_PORT_NAME and isinstance(port.get("containerPort"), int):
                job_uid = str((meta.get("labels") or {}).get(access.LABEL_JOB_UID) or "")
                return Target(key, str(meta.get("uid") or ""), str(status["podIP"]), port["containerPort"], job_uid)
    return None


class PulseLinks:
    """The connections to the agents' pulses, one task each, keyed by the agent pod's uid."""

    def __init__(self, beats: AgentBeats, operator_key: bytes) -> None:
        self.beats = beats
        self._operator_key = operator_key
        """The operator's own key: each job's pulse key is derived from it (:func:`disttrain.api.pulse.job_key`)."""
        self._links: dict[str, tuple[Target, asyncio.Task[None]]] = {}
        self._probes: set[asyncio.Task[None]] = set()

    def follow(self, key: JobKey, pod: Mapping[str, Any]) -> None:
        """An event of the job's agent pod: link to its pulse when it has one, unlink it when it no longer does."""
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        target = target_of(key, pod)
        current = self._links.get(uid)
        if current is not None and current[0] == target:
            return
        self.forget(uid)
        if target is not None and target.uid:
            self._links[uid] = (target, asyncio.create_task(self._link(target), name=f"pulse {key[0]}/{key[1]}"))

    def forget(self, uid: str) -> None:
        """The pod is gone (or no longer pulses): close its link."""
        link = self._links.pop(uid, None)
        if link is not None:
            link[1].cancel()

    def prune(self, current: Callable[[JobKey], Optional[str]]) -> None:
        """Close the links of pods that are no longer their job's agent (``current``: the agent pod's uid, None when
        it has none): a deletion the watch never delivered (it was relisted meanwhile) leaves no link behind."""
        for uid, (target, _task) in list(self._links.items()):
            if current(target.key) != uid:
                self.forget(uid)

    def probe(self, key: JobKey, uid: str, began: float) -> None:
        """Ask whether agent pod ``uid``'s node accepts a connection on its pulse port (:func:`answers`), and tell
        :meth:`AgentBeats.probed`; a pod without a link answers nothing."""
        link = self._links.get(uid)
        if link is None:
            self.beats.probed(key, uid, began, answered=False)
            return

        async def run(target: Target) -> None:
            self.beats.probed(key, uid, began, await answers(target.host, target.port, PROBE_TIMEOUT_S))

        task = asyncio.create_task(run(link[0]), name=f"probe {key[0]}/{key[1]}")
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def close(self) -> None:
        """Close every link and wait until they are closed."""
        tasks = [task for _target, task in self._links.values()] + list(self._probes)
        for task in self._probes:
            task.cancel()
        for uid in list(self._links):
            self.forget(uid)
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def count(self) -> int:
        return len(self._links)

    def _is_linked(self, target: Target) -> bool:
        link = self._links.get(target.uid)
        return link is not None and link[0] is target

    async def _link(self, target: Target) -> None:
        """Connect, read pulses until the connection ends, connect again, for as long as ``target`` is followed.

        The loop also ends on its own once :meth:`forget` dropped the target: on Python < 3.12 ``asyncio.wait_for``
        can swallow the cancellation that arrives as its connection completes, and the task would retry for ever."""
        loop = asyncio.get_running_loop()
        key = pulse.job_key(self._operator_key, target.job_uid)
        while self._is_linked(target):
            transport: Optional[asyncio.BaseTransport] = None
            try:
                transport, reader = await asyncio.wait_for(
                    loop.create_connection(lambda: _PulseReader(target, self.beats, key), target.host, target.port),
                    CONNECT_TIMEOUT_S,
                )
                await reader.closed
            except (OSError, asyncio.TimeoutError):
                pass  # refused, reset, timed out: try again
            finally:
                if transport is not None:
                    transport.close()
            await asyncio.sleep(RETRY_S)


async def answers(host: str, port: int, timeout: float) -> bool:
    """Whether ``host:port`` accepts a TCP connection within ``timeout``. The agent's kernel completes it from the
    listening socket's backlog however starved the agent's process is, so an answer says the node is up and the
    process holds its port; a dead process's port refuses, a dead node answers nothing. The connection is reset at
    once: the agent, when it runs, finds it gone."""
    loop = asyncio.get_running_loop()
    try:
        transport, _protocol = await asyncio.wait_for(loop.create_connection(asyncio.Protocol, host, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset: no TIME_WAIT here
    transport.abort()
    return True


class _PulseReader(asyncio.Protocol):
    """One connection to an agent's pulse, read in the event loop's own callback (a pulse costs no task wake-up:
    the operator reads five a second from every job). It answers the agent's greeting with the job's pulse key and
    checks the agent's proof; any deviation from the wire closes the connection."""

    def __init__(self, target: Target, beats: AgentBeats, key: bytes) -> None:
        self.target, self.beats, self.key = target, beats, key
        self.expected = pulse.hello(target.uid)
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._transport: Optional[asyncio.Transport] = None
        self._first = b""
        self._greeting = b""
        self._answer = b""
        self._proven = False
        self._greeted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        asyncio.get_running_loop().call_later(HELLO_TIMEOUT_S, self._check_greeted)

    def data_received(self, data: bytes) -> None:
        if not self._greeted:
            data = self._handshake(data)
            if not self._proven:
                return
            self._first += data
            if b"\n" not in self._first:
                if len(self._first) >= HELLO_LIMIT:
                    self._close("a first line over the limit")
                return
            line, _, data = self._first.partition(b"\n")
            if line + b"\n" != self.expected:
                self._close(f"an unexpected first line {line[:HELLO_LIMIT]!r}")
                return
            self._greeted = True
            if not data:
                return
        rest = data.replace(pulse.PULSE, b"")
        if rest == pulse.BYE and data.endswith(pulse.BYE):
            self.beats.ended(self.target.key, self.target.uid)  # a clean stop: no silence to judge
            self._close("")
        elif rest:
            self._close("bytes that are no pulse")
        else:
            self.beats.pulsed(self.target.key, self.target.uid, time.monotonic())

    def _handshake(self, data: bytes) -> bytes:
        """Take the greeting (answer it) and the agent's proof from ``data``; what follows them."""
        if not self._greeting:
            self._first += data
            if len(self._first) < handshake.GREETING_LEN:
                return b""
            self._greeting, data = self._first[: handshake.GREETING_LEN], self._first[handshake.GREETING_LEN :]
            self._first = b""
            try:
                self._answer = handshake.answer(self.key, self._greeting)
            except handshake.HandshakeFailed:
                self._close("a greeting that is no pulse server's")
                return b""
            if self._transport is not None:
                self._transport.write(self._answer)
        if not self._proven:
            self._first += data
            if len(self._first) < handshake.PROOF_LEN:
                return b""
            proof, data = self._first[: handshake.PROOF_LEN], self._first[handshake.PROOF_LEN :]
            self._first = b""
            if not handshake.check_proof(self.key, self._greeting, self._answer, proof):
                self._close("a proof without the job's pulse key")
                return b""
            self._proven = True
        return data

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def _check_greeted(self) -> None:
        if not self._greeted:
            self._close("no first line")

    def _close(self, why: str) -> None:
        if why:
            target = self.target
            log.debug("pulse of %s at %s:%d: %s", target.key, target.host, target.port, why)
        if self._transport is not None:
            self._transport.close()
