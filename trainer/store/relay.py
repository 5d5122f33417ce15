"""A process's relay to the agent's store front: torch's client speaks to it on the loopback, it proves the job's
secret to the front (:mod:`disttrain.trainer.store.front`) and passes the bytes on.

Why: torch's ``TCPStore`` client cannot run a handshake of its own. Each process that talks to the agent's store
(torchrun's rendezvous handler, a worker's control channel) starts one relay per store address, on a thread of
its own, and hands torch the relay's loopback address instead of the agent's (:func:`route`). The relay accepts
only connections from sockets of its own process (``/proc/net/tcp`` names the peer socket's inode, which must be
one of this process's descriptors), so another process of the machine or pod cannot borrow its proof.

Only the calls torch runs without the GIL may go through it (every call of the signed store's does; torch 2.13's
``list_keys`` and ``queue_*`` hold the GIL while they wait, which the relay's thread needs: they would wait out
their timeout, and the front refuses queues anyway).

``$DISTTRAIN_STORE_FRONT=1`` (set by the operator in every pod of a job and by the local runtime) says the agent
serves its store behind the front; without it a client connects straight to ``host:port`` (a plain TCPStore, as the
tests' own servers are).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Optional

from disttrain.api import env
from disttrain.trainer.store import splice, wire
from disttrain.trainer.store.front import DEFAULT_LIMITS, FrontLimits, _cancel, _track_current_task, _transport

log = logging.getLogger("disttrain.store.relay")


def enabled() -> bool:
    """Whether this process reaches the agent's store through a relay (``$DISTTRAIN_STORE_FRONT``)."""
    return os.environ.get(env.STORE_FRONT, "") == "1"


class Relay:
    """Listens on ``127.0.0.1:<free port>``; each connection of this process is relayed to the front at
    ``upstream`` once the relay proved the secret there."""

    def __init__(self, upstream: tuple[str, int], secret: str, limits: FrontLimits = DEFAULT_LIMITS) -> None:
        self.upstream, self.limits = upstream, limits
        self._key = wire.front_key(secret)
        self._loop = asyncio.new_event_loop()
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0, limit=limits.pending_bytes)
        )
        self.address: tuple[str, int] = ("127.0.0.1", int(self._server.sockets[0].getsockname()[1]))
        self.refused = 0
        """Connections refused (not of this process, or the front did not prove the secret)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        log.info("store relay %s:%d -> the front at %s:%d", *self.address, *upstream)
        self._thread = threading.Thread(target=self._loop.run_forever, name="store-relay", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop listening and end every relayed connection (a process's relays otherwise live as long as it)."""

        async def close() -> None:
            self._server.close()
            await _cancel(self._tasks, self._writers)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _track_current_task(self._tasks)
        upstream: Optional[asyncio.StreamWriter] = None
        self._writers.add(writer)
        try:
            peer = writer.get_extra_info("peername")
            if not owns_peer(peer, self.address):
                self.refused += 1
                log.warning("store relay: refused a connection from %s: not a socket of this process", peer)
                return
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*self.upstream, limit=self.limits.pending_bytes), self.limits.handshake_s
            )
            upstream = up_writer
            self._writers.add(up_writer)
            greeting = await asyncio.wait_for(up_reader.readexactly(wire.GREETING_LEN), self.limits.handshake_s)
            answer = wire.answer(self._key, greeting)
            up_writer.write(answer)
            proof = await asyncio.wait_for(up_reader.readexactly(wire.PROOF_LEN), self.limits.handshake_s)
            if not wire.check_proof(self._key, greeting, answer, proof):
                self.refused += 1
                log.warning("store relay: %s:%d did not prove the job's secret", *self.upstream)
                return
            pair = splice.Pair(_transport(writer), _transport(up_writer), splice.Timing(self.limits.stall_s))
            pair.send(True, splice.leftover(reader))
            pair.send(False, splice.leftover(up_reader))
            await pair.done
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, wire.HandshakeFailed) as exc:
            log.debug("store relay to %s:%d: %s", *self.upstream, exc)
        except asyncio.CancelledError:
            pass  # close(): end quietly (asyncio 3.11's streams log a cancelled connection task as an error)
        finally:
            for each in (writer, upstream):
                if each is not None:
                    each.transport.abort()
                    self._writers.discard(each)


_RELAYS: dict[tuple[int, str, int, bytes], Relay] = {}
_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child (a warm worker) may find the lock held by a thread it does not have. Its parent's relays stay
    in the table (keyed by the parent's pid, never used here) rather than be collected half alive."""
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def route(host: str, port: int, secret: str) -> tuple[str, int]:
    """The address a torch client of the agent's store at ``host:port`` connects to: this process's relay to it
    when the front is on (:func:`enabled`), else ``host:port`` itself."""
    if not enabled():
        return host, port
    if not secret:
        raise ValueError(
            f"${env.STORE_FRONT}=1 but the job's store secret is not set (${env.STORE_SECRET_FILE} or "
            f"${env.STORE_SECRET}): the agent's store front admits only clients that prove it"
        )
    key = (os.getpid(), host, port, wire.front_key(secret))
    with _LOCK:
        relay = _RELAYS.get(key)
        if relay is None:  # a forked child finds its parent's relays here without their threads: a fresh one
            relay = _RELAYS[key] = Relay((host, port), secret)
        return relay.address


def _tcp_inode(peer_port: int, listener_port: int) -> Optional[str]:
    """The inode of the loopback socket from ``peer_port`` to ``listener_port``, from ``/proc/net/tcp`` or
    ``tcp6`` (torch's client socket is dual-stack: it shows there with a v4-mapped address), None if not found."""
    wanted = (f":{peer_port:04X}", f":{listener_port:04X}")
    for table_path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table_path, encoding="ascii") as table:
                next(table)
                for line in table:
                    fields = line.split()
                    if fields[1].endswith(wanted[0]) and fields[2].endswith(wanted[1]):
                        return fields[9]
        except OSError:
            continue
    return None


def owns_peer(peer: Optional[tuple[str, int]], listener: tuple[str, int]) -> bool:
    """Whether the socket at ``peer`` (connected to ``listener``) is one of this process's descriptors. Where
    ``/proc`` cannot tell (not Linux), True: the relay then trusts the loopback, as a pod's containers share it."""
    if not os.path.exists("/proc/net/tcp"):
        return True
    if peer is None:
        return False
    inode = _tcp_inode(int(peer[1]), int(listener[1]))
    if inode is None:
        return False
    target = f"socket:[{inode}]"
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}") == target:
                return True
        except OSError:
            continue
    return False
