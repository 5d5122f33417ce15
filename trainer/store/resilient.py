"""A client of the job agent's store that outlives the agent: it reconnects behind the same address.

Why: the agent's store carries the rendezvous and the control channel, but the training itself does not need it
once the communicators exist (the process-group store is hosted by global rank 0's torchrun). When the agent's pod
is lost, the operator recreates it behind the same Service name; a raw ``TCPStore`` client never reconnects, and a
client whose server died without a reset (a powered-off node) blocks every caller for its whole timeout, since torch
serialises a client's operations. :class:`ResilientStore` keeps both from reaching training:

* each connection has its own lock, taken with a bound (:data:`LOCK_WAIT_S`, shorter for best-effort writes through
  :meth:`ResilientStore.quick`), so a caller never queues behind an operation stuck on a dead server; once an
  operation has been stuck for :data:`STUCK_S` the connection is taken for dead and callers fail at once;
* an operation that fails drops the connection, and a background thread reconnects to the same address every
  :data:`RETRY_S` until a server answers; meanwhile every operation fails at once with :class:`StoreUnavailable`
  (a ``DistStoreError``, which every caller already treats as the agent being away);
* the connection's :attr:`generation` counts reconnections, and ``on_reconnect`` callbacks run (on the reconnecting
  thread) once a new server answers, so callers can put back what the new store lacks.

Values stay sealed and verified above this class (:mod:`disttrain.trainer.store.signedstore`): it sees only bytes and
never reads them. The logical timeout of ``get``/``wait`` is :attr:`timeout` (the caller's); each operation on the
wire is waited for at most ``op_timeout_s`` (plus a ``wait``'s own timeout) by the caller, on a thread of the
connection's own, since torch's client does not bound every read.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Optional

from torch.distributed import DistStoreError, Store

log = logging.getLogger("disttrain.store")

LOCK_WAIT_S = 1.5
"""How long an operation waits for the connection another thread is using (the signed store's longest single
operation is a one-second server-side wait)."""
QUICK_WAIT_S = 0.25
"""The same for a best-effort write (:meth:`ResilientStore.quick`: progress, beacons) on the training thread."""
STUCK_S = 3.0
"""An operation in flight this long marks its connection dead for every other caller (it ends itself at the
connection's own timeout)."""
RETRY_S = 0.5
"""Pause between two reconnection attempts."""
PROBE_S = 0.5
"""How long the plain connect that precedes each attempt may take."""
CONNECT_GRACE_S = 1.0
"""How long past its own timeout a connection attempt is waited for (see :func:`_connect_within`)."""
EXIT_JOIN_S = 3.0
"""How long the interpreter's exit waits for a reconnection attempt in flight (see :func:`_close_all`)."""

_ALL: weakref.WeakSet[ResilientStore] = weakref.WeakSet()
_CONNECTING: set[threading.Thread] = set()
"""Connection attempts in flight, abandoned ones included: the interpreter's exit waits for them too."""

OP_TIMEOUT_S = 10.0
"""Each operation's own bound on the wire (the raw client's timeout after its first connection): a server that does
not answer within it is taken for gone. The signed store never asks the server for a longer single wait."""

Connect = Callable[[timedelta], Any]
"""Makes a raw client (a ``TCPStore`` with ``is_master=False``) connected within the given time, or raises."""


class StoreUnavailable(DistStoreError):
    """The agent's store is not reachable now; a reconnection is under way."""


class _Pending:
    def __init__(self, op: str, args: tuple[Any, ...]) -> None:
        self.op, self.args = op, args
        self.done = threading.Event()
        self.value: Any = None
        self.error: Optional[BaseException] = None


class _Connection:
    """One raw client and the daemon thread that makes its calls. torch's client does not bound every read by its
    timeout (a server that was frozen, not reset, kept a ``compare_set`` waiting for good in tests), so the caller
    waits for the answer with a bound of its own; a call that outlasts it leaves only this thread waiting, and the
    connection is dropped."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.lock = threading.Lock()
        self.busy_since: Optional[float] = None
        self._calls: queue.SimpleQueue[Optional[_Pending]] = queue.SimpleQueue()
        self._queue = threading.Lock()
        self._closed = False
        threading.Thread(target=self._serve, name="disttrain-store-client", daemon=True).start()

    def _serve(self) -> None:
        while True:
            pending = self._calls.get()
            if pending is None:
                return
            try:
                pending.value = getattr(self.raw, pending.op)(*pending.args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who decides
                pending.error = exc
            pending.done.set()

    def call(self, op: str, args: tuple[Any, ...], limit_s: float) -> Any:
        """The call's result; raises its error, or :class:`StoreUnavailable` when no answer came within ``limit_s``."""
        pending = _Pending(op, args)
        with self._queue:  # a call queued after close() would wait out limit_s for a thread that has ended
            if self._closed:
                raise _Closed(f"{op} on a connection already dropped")
            self._calls.put(pending)
        if not pending.done.wait(limit_s):
            raise _NoAnswer(f"no answer to {op} within {limit_s:.1f} s")
        if pending.error is not None:
            raise pending.error
        return pending.value

    def close(self) -> None:
        with self._queue:
            self._closed = True
            self._calls.put(None)


def _connect_within(connect: Connect, timeout: timedelta) -> Any:
    """``connect(timeout)``, abandoned when it outlasts ``timeout`` plus :data:`CONNECT_GRACE_S`.

    torch's client constructor pings the server with no bound on the read: against a server whose kernel accepted the
    connection while its process does not run (stopped, frozen, partitioned after the handshake), the attempt waits
    until the peer resets, which may be never. The attempt runs on a daemon thread; one that finishes after it was
    abandoned leaves its client to the garbage collector."""
    outcome: dict[str, Any] = {}
    finished = threading.Event()

    def attempt() -> None:
        try:
            outcome["raw"] = connect(timeout)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who decides
            outcome["error"] = exc
        finally:
            finished.set()
            _CONNECTING.discard(threading.current_thread())

    thread = threading.Thread(target=attempt, name="disttrain-store-connect", daemon=True)
    _CONNECTING.add(thread)
    thread.start()
    if not finished.wait(timeout.total_seconds() + CONNECT_GRACE_S):
        raise StoreUnavailable(f"no answer while connecting within {timeout.total_seconds():.1f} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["raw"]


class _NoAnswer(Exception):
    """The server did not answer a call in time (internal: becomes :class:`StoreUnavailable`)."""


class _Closed(Exception):
    """A caller took the connection just as another dropped it (internal: becomes :class:`StoreUnavailable`)."""


class ResilientStore(Store):
    """The raw-client layer under the signed store (see the module docstring). ``connect`` is called once here
    (its errors propagate: a store that is not there at start is a configuration or start-up error) and again in the
    background after each loss."""

    def __init__(
        self,
        connect: Connect,
        timeout: timedelta,
        name: str = "agent store",
        op_timeout_s: float = OP_TIMEOUT_S,
        address: Optional[tuple[str, int]] = None,
    ) -> None:
        super().__init__()
        self._connect = connect
        self._address = address
        self._name = name
        self._op_timeout = timedelta(seconds=min(op_timeout_s, timeout.total_seconds()))
        self._state = threading.Lock()
        self._conn: Optional[_Connection] = _Connection(self._first_connection(timeout))
        self._reconnecting: Optional[threading.Thread] = None
        self._closed = threading.Event()
        self._local = threading.local()
        self.generation = 0
        """Reconnections so far."""
        self.lost_at: Optional[float] = None
        """Monotonic time the current outage began (None while connected)."""
        self.on_reconnect: list[Callable[[], None]] = []
        self.set_timeout(timeout)
        _ALL.add(self)

    # --- connection state -----------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        conn = self._conn
        return conn is not None and not self._stuck(conn)

    @property
    def busy_seconds(self) -> float:
        """How long the operation in flight on the connection has been waiting (0 when none is)."""
        conn = self._conn
        since = conn.busy_since if conn is not None else None
        return 0.0 if since is None else time.monotonic() - since

    def close(self, join_s: float = 0.0) -> None:
        """Stop reconnecting (the process is ending); wait up to ``join_s`` for an attempt in flight."""
        self._closed.set()
        thread = self._reconnecting
        if join_s > 0 and thread is not None and thread is not threading.current_thread():
            thread.join(join_s)

    @contextlib.contextmanager
    def quick(self) -> Iterator[None]:
        """Operations on this thread inside the block wait at most :data:`QUICK_WAIT_S` for the connection."""
        previous = getattr(self._local, "wait_s", None)
        self._local.wait_s = QUICK_WAIT_S
        try:
            yield
        finally:
            self._local.wait_s = previous

    def _first_connection(self, timeout: timedelta) -> Any:
        """A raw client within ``timeout``, made of attempts bounded by the operation timeout: torch's client keeps the
        timeout it was built with for every read on its socket, so a client built with the caller's long timeout
        would let one unanswered read hold its thread that long."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                return _connect_within(self._connect, self._op_timeout)
            except Exception:  # retried until the caller's timeout, then raised
                if time.monotonic() + RETRY_S >= deadline:
                    raise
                time.sleep(RETRY_S)

    @staticmethod
    def _stuck(conn: _Connection) -> bool:
        since = conn.busy_since
        return since is not None and time.monotonic() - since > STUCK_S

    def _drop(self, conn: _Connection, why: str) -> None:
        with self._state:
            if self._conn is not conn:
                return
            self._conn = None
            conn.close()  # its thread ends after the call it may still be waiting in
            self.lost_at = time.monotonic()
            log.warning("%s lost (%s): training goes on; reconnecting every %.1f s", self._name, why, RETRY_S)
            self._start_reconnecting()

    def _start_reconnecting(self) -> None:
        if self._closed.is_set() or (self._reconnecting is not None and self._reconnecting.is_alive()):
            return
        self._reconnecting = threading.Thread(target=self._reconnect, name="disttrain-store-reconnect", daemon=True)
        self._reconnecting.start()

    def _answers(self) -> bool:
        """Whether something accepts connections at the store's address: a plain TCP connect, bounded by
        :data:`PROBE_S`. torch's client retries a refused connect with a random back-off of seconds, which would
        delay the reconnection by as much after the replacement is up; it is only built once this holds."""
        if self._address is None:
            return True
        try:
            socket.create_connection(self._address, timeout=PROBE_S).close()
        except OSError:
            return False
        return True

    def _reconnect(self) -> None:
        while not self._closed.is_set():
            if not self._answers():
                self._closed.wait(RETRY_S)
                continue
            try:
                raw = _connect_within(self._connect, self._op_timeout)
            except Exception as exc:  # noqa: BLE001 - any failure to connect means: not there yet
                log.debug("%s: reconnection failed: %s", self._name, exc)
                self._closed.wait(RETRY_S)
                continue
            with self._state:
                lost_at = self.lost_at
                self._conn = _Connection(raw)
                self.generation += 1
                self.lost_at = None
            away = time.monotonic() - lost_at if lost_at is not None else 0.0
            log.warning("%s reconnected after %.1f s (reconnection %d)", self._name, away, self.generation)
            for callback in list(self.on_reconnect):
                try:
                    callback()
                except Exception as exc:  # noqa: BLE001 - a callback must not stop the others
                    log.warning("%s: after reconnecting: %s", self._name, exc)
            return

    def _call(self, op: str, *args: Any) -> Any:
        conn = self._conn
        if conn is None:
            raise StoreUnavailable(f"{self._name} unreachable; reconnecting")
        if self._stuck(conn):
            self._drop(conn, f"an operation got no answer for {STUCK_S:.0f} s")
            raise StoreUnavailable(f"{self._name} not answering; reconnecting")
        wait_s = getattr(self._local, "wait_s", None) or LOCK_WAIT_S
        if not conn.lock.acquire(timeout=wait_s):
            raise StoreUnavailable(f"{self._name} busy for {wait_s:.2f} s (another operation is waiting on it)")
        if self._conn is not conn:  # dropped by the caller this one waited for
            conn.lock.release()
            raise StoreUnavailable(f"{self._name} lost; reconnecting")
        limit_s = self._op_timeout.total_seconds()
        if op == "wait" and len(args) > 1:
            limit_s += args[1].total_seconds()  # the caller's own wait, plus the answer's bound
        try:
            conn.busy_since = time.monotonic()
            return conn.call(op, args, limit_s)
        except _NoAnswer as exc:
            self._drop(conn, str(exc))
            raise StoreUnavailable(f"{self._name}: {exc}; reconnecting") from exc
        except _Closed as exc:
            raise StoreUnavailable(f"{self._name} lost; reconnecting") from exc
        except DistStoreError as exc:
            if op == "wait" and "timeout" in str(exc).lower():
                raise  # a key not there within the caller's own wait: an answer, not a loss
            self._drop(conn, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            raise
        except (RuntimeError, OSError) as exc:
            self._drop(conn, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            raise DistStoreError(str(exc)) from exc
        finally:
            conn.busy_since = None
            conn.lock.release()

    # --- the Store API the signed store uses (names as pybind's trampoline calls them) --------------------------

    def set(self, key: str, value: Any) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._call("get", key))

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        return bytes(self._call("compare_set", key, expected_value, desired_value))

    def add(self, key: str, value: int) -> int:
        return int(self._call("add", key, value))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """One round trip for all of ``keys`` (torch's base class would make one ``get`` each)."""
        return [bytes(value) for value in self._call("multi_get", keys)]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        """One round trip for all of ``keys`` (torch's base class would make one ``set`` each)."""
        self._call("multi_set", keys, values)

    def wait(self, keys: list[str], timeout: Optional[timedelta] = None) -> None:
        if timeout is None:
            self._call("wait", keys)
        else:
            self._call("wait", keys, timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", key))

    def deleteKey(self, key: str) -> bool:  # the name pybind's trampoline calls (torch 2.13)
        return self.delete_key(key)

    def num_keys(self) -> int:
        return int(self._call("num_keys"))

    def getNumKeys(self) -> int:  # the name pybind's trampoline calls (torch 2.13)
        return self.num_keys()

    def list_keys(self) -> list[str]:
        return list(self._call("list_keys"))


def resilient_of(store: Any) -> Optional[ResilientStore]:
    """The :class:`ResilientStore` under ``store`` (through PrefixStores and the signed store), None when none."""
    current = store
    for _ in range(8):
        if isinstance(current, ResilientStore):
            return current
        current = getattr(current, "raw", None) or getattr(current, "underlying_store", None)
        if current is None:
            return None
    return None


@atexit.register
def _close_all() -> None:
    """Before the interpreter finalises, stop every reconnection: a daemon thread inside torch's C++ connect when
    finalisation starts aborts the process (as :func:`disttrain.trainer.store.signedstore._drain_at_exit` explains)."""
    stores = list(_ALL)
    for store in stores:
        store.close()
    deadline = time.monotonic() + EXIT_JOIN_S
    for store in stores:
        store.close(max(0.0, deadline - time.monotonic()))
    for thread in list(_CONNECTING):
        thread.join(max(0.0, deadline - time.monotonic()))
