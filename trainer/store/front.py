"""The agent's store front: the only way in to the job's TCPStore, open to whoever proves the job's secret.

Why: torch's TCPStore server accepts any client and its protocol can be abused without touching a signed value
(queues the guardian cannot list, pipelined reads that pile up in the server, half-sent 8 MiB values, idle
connections that stall the accept loop). So the server listens on the agent's loopback only
(:func:`listener`), and this front, on the store's public port, relays a connection's bytes to it only
after the client proved the job's secret (:mod:`disttrain.trainer.store.wire`). Every client speaks through a relay
of its own process that proves it (:mod:`disttrain.trainer.store.relay`).

Bounds, per connection: a client has :attr:`FrontLimits.handshake_s` to prove the secret, and sends at most the
handshake's 68 bytes before it has; once proven, a request that has begun must end within
:attr:`FrontLimits.half_sent_s`, every request is scanned and ``append``/queue commands are refused (the connection
is closed), and at most :attr:`FrontLimits.pending_bytes` wait in the front each way (asyncio's flow control: the
front stops reading one side while the other does not drain, and closes a connection whose reader stalls for
:attr:`FrontLimits.stall_s`). Per source address, at most :attr:`FrontLimits.unproven_per_source` connections may
be waiting to prove the secret, :attr:`FrontLimits.unproven_total` in all: a new one evicts the oldest, so a
stranger holding connections open never keeps a worker out (its relay proves the secret in one round trip). Proven
connections are not timed out while idle: they are the job's own clients (torchrun's, the watchdog's), which hold
them for the life of a process.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import socket
import threading
from typing import Optional

from disttrain.trainer.store import splice, wire

log = logging.getLogger("disttrain.store.front")

CHUNK = 64 * 1024
READ_LIMIT = 4 * 1024
"""What the front buffers from a client that has not proven the secret before it pauses reading it (asyncio holds
up to twice this; proven connections are spliced, without this buffer): a stranger's bytes cost at most this much
per connection until it is closed."""
ACCEPT_BACKLOG = 128
"""The listen backlog, which is also how many connections asyncio accepts at once: a stranger's burst waits in the
kernel, not as a thousand fresh transports in the agent's memory."""
UNPROVEN_RECV = 1024
"""The most one ``recv`` takes from a client that has not proven the secret (the handshake is 68 bytes)."""


@dataclasses.dataclass(frozen=True)
class FrontLimits:
    """What one client may hold at the front."""

    handshake_s: float = 5.0
    """Time to prove the secret after connecting."""
    half_sent_s: float = 30.0
    """Time a begun request has to arrive whole."""
    stall_s: float = 30.0
    """Time a side may leave the front's pending bytes for it unread."""
    pending_bytes: int = 256 * 1024
    """Bytes the front holds for a connection, each way."""
    unproven_per_source: int = 16
    unproven_total: int = 128
    proven_per_source: int = 1024
    """The job's processes on one pod: a rank's watchdog, torchrun's handler, the launcher's tools."""


DEFAULT_LIMITS = FrontLimits()


def listener(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening socket for torch's server (``master_listen_fd``), by default on the loopback's free port: torch's
    libuv server binds every address when given a port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=1024)


class StoreFront:
    """Serves the front on ``listen`` for the store at ``upstream`` (both ``(host, port)``), on a thread of its own."""

    def __init__(
        self,
        listen: tuple[str, int],
        upstream: tuple[str, int],
        secret: str,
        limits: FrontLimits = DEFAULT_LIMITS,
    ) -> None:
        self.limits = limits
        self._listen, self._upstream = listen, upstream
        self._key = wire.front_key(secret)
        self._loop = asyncio.new_event_loop()
        self._server: Optional[asyncio.AbstractServer] = None
        self._unproven: collections.OrderedDict[asyncio.StreamWriter, str] = collections.OrderedDict()
        self._proven: collections.Counter[str] = collections.Counter()
        self.counts: collections.Counter[str] = collections.Counter()
        """What the front refused, by reason (read from any thread; values only grow)."""
        self.address: tuple[str, int] = listen
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Listen (errors, e.g. a port in use, raise here) and serve on a daemon thread."""
        started = self._loop.run_until_complete(self._start())
        self.address = started
        self._thread = threading.Thread(target=self._loop.run_forever, name="store-front", daemon=True)
        self._thread.start()

    async def _start(self) -> tuple[str, int]:
        host = None if self._listen[0] in ("", "0.0.0.0", "::") else self._listen[0]
        self._server = await asyncio.start_server(
            self._serve, host, self._listen[1], limit=READ_LIMIT, backlog=ACCEPT_BACKLOG, reuse_address=True
        )
        sockname = self._server.sockets[0].getsockname()
        return (str(sockname[0]), int(sockname[1]))

    def stop(self) -> None:
        if self._thread is None:
            return

        async def close() -> None:
            if self._server is not None:
                self._server.close()
            await _cancel(self._tasks, self._writers)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._thread = None
        self._loop.close()

    def _admit(self, writer: asyncio.StreamWriter, source: str) -> None:
        """Count ``writer`` as unproven, evicting the oldest unproven of its source (then of all) beyond the caps."""
        self._unproven[writer] = source
        same = [w for w, s in self._unproven.items() if s == source]
        if len(same) > self.limits.unproven_per_source:
            self._evict(same[0])
        if len(self._unproven) > self.limits.unproven_total:
            self._evict(next(iter(self._unproven)))

    def _evict(self, writer: asyncio.StreamWriter) -> None:
        self._unproven.pop(writer, None)
        self.counts["evicted"] += 1
        writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _track_current_task(self._tasks)
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if peer else "?"
        self._writers.add(writer)
        writer.transport.set_write_buffer_limits(high=self.limits.pending_bytes)
        _read_at_most(writer.transport, UNPROVEN_RECV)  # until proven: asyncio's own reads are 256 KiB
        self._admit(writer, source)
        held = _Held()
        try:
            await self._session(reader, writer, source, held)
        except asyncio.TimeoutError:
            self.counts["timeout" if held.proven else "unproven"] += 1
        except asyncio.IncompleteReadError:
            self.counts["closed" if held.proven else "unproven"] += 1
        except wire.Refused as exc:
            self.counts["refused"] += 1
            log.warning("store front: closed a connection from %s: %s", source, exc)
        except OSError:
            self.counts["closed" if held.proven else "unproven"] += 1
        except asyncio.CancelledError:
            pass  # stop(): end quietly (asyncio 3.11's streams log a cancelled connection task as an error)
        finally:
            self._unproven.pop(writer, None)
            if held.proven:
                self._proven[source] -= 1
                if self._proven[source] <= 0:
                    del self._proven[source]
            for each in (writer, held.upstream):
                if each is not None:
                    each.transport.abort()
                    self._writers.discard(each)

    async def _session(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, source: str, held: _Held
    ) -> None:
        """One connection: the handshake, then the bounded splice to torch's server (what ``held`` records is
        released by :meth:`_serve`)."""
        greeting = wire.greeting()
        writer.write(greeting)
        answer = await asyncio.wait_for(reader.readexactly(wire.ANSWER_LEN), self.limits.handshake_s)
        proof = wire.check_answer(self._key, greeting, answer)
        if writer not in self._unproven:
            return  # evicted meanwhile
        del self._unproven[writer]
        if proof is None:
            self.counts["unproven"] += 1
            return
        if self._proven[source] >= self.limits.proven_per_source:
            self.counts["over_cap"] += 1
            return
        self._proven[source] += 1
        held.proven = True
        _read_at_most(writer.transport, None)
        up_reader, upstream = await asyncio.open_connection(*self._upstream, limit=self.limits.pending_bytes)
        held.upstream = upstream
        self._writers.add(upstream)
        upstream.transport.set_write_buffer_limits(high=self.limits.pending_bytes)
        writer.write(proof)
        timing = splice.Timing(self.limits.stall_s, self.limits.half_sent_s)
        pair = splice.Pair(_transport(writer), _transport(upstream), timing, wire.RequestScanner())
        pair.send(True, splice.leftover(reader))
        pair.send(False, splice.leftover(up_reader))
        why = await pair.done
        if why in ("half-sent", "stalled"):
            self.counts["timeout"] += 1
        elif why != "closed":
            self.counts["refused"] += 1
            log.warning("store front: closed a connection from %s: %s", source, why)


@dataclasses.dataclass
class _Held:
    """What one connection holds, for its release: a proven slot of its source, the upstream connection."""

    proven: bool = False
    upstream: Optional[asyncio.StreamWriter] = None


def _transport(writer: asyncio.StreamWriter) -> asyncio.Transport:
    transport = writer.transport
    assert isinstance(transport, asyncio.Transport)
    return transport


def _read_at_most(transport: asyncio.BaseTransport, size: Optional[int]) -> None:
    """Make the selector transport read at most ``size`` bytes per ``recv`` (None: asyncio's default), where it has
    that knob (``max_size``, an attribute of CPython's socket transports)."""
    if size is not None and hasattr(transport, "max_size"):
        vars(transport)["max_size"] = size
    elif size is None:
        vars(transport).pop("max_size", None)


def _track_current_task(tasks: set[asyncio.Task[None]]) -> None:
    """Keep the connection's task in ``tasks`` while it runs, so that :func:`_cancel` can end it."""
    task = asyncio.current_task()
    if task is not None:
        tasks.add(task)
        task.add_done_callback(tasks.discard)


async def _cancel(tasks: set[asyncio.Task[None]], writers: set[asyncio.StreamWriter]) -> None:
    """End a server's connections: abort their ``writers``, cancel their ``tasks`` and wait for them to end."""
    for writer in list(writers):
        writer.transport.abort()
    current = asyncio.current_task()
    pending = [task for task in tasks if task is not current]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=2.0)
