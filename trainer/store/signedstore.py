"""The signed store: a ``torch.distributed.Store`` that seals every value it writes and verifies every value it reads.

Every client of the job agent's TCPStore (the agent itself, torchrun's rendezvous through
:func:`disttrain.trainer.launch.rendezvous.create_handler`, the watchdog, failure reports, heartbeat reads) holds a
:class:`SignedStore` around its raw TCPStore client, usually under the job's ``PrefixStore``
(:func:`disttrain.trainer.store.channel.scoped`). torch's C++ ``PrefixStore`` calls a Python ``Store`` subclass through
pybind's trampoline, so torch's own keys (the rendezvous state, the per-round ``MASTER_ADDR``/``MASTER_PORT`` keys,
barrier and rank-info keys) pass through here too, with the callers unchanged.

Values are envelopes of :mod:`disttrain.api.storeauth` bound to the job UID and the *full* key name as the server
sees it. A value that does not verify (forged, garbled, another key's or job's, or a replay of a value older than
one this process saw: ``seq`` below the per-key high-water mark) is **absent** to every caller: ``get`` and
``wait`` keep waiting for a valid value up to the store timeout, ``check`` says absent, ``compare_set`` compares
against the plain value of the valid content, ``add`` is a ``compare_set`` loop over sealed integers. Unverified
bytes never leave this class, so nothing downstream (torch's ``pickle.loads`` of the rendezvous state, the
agent's restricted unpickler) ever sees them.

Sequence numbers: ``set`` is a blind write (as TCPStore's: no round trip, rank 0 publishes progress every step)
with ``seq = max(time.time_ns(), this process's high-water mark + 1)``, so a key deleted and written again still
moves forward; ``compare_set`` and ``add`` are compare-and-set on the raw envelope the writer read, with ``seq`` at
least the current one + 1 as well, so they serialise in store order. Two processes ``set``-ting one key are
ordered by their clocks: a reader that saw the later-stamped value refuses an earlier-stamped one as a replay until
a newer one comes (keys torch and this project ``set`` have one writer at a time, or carry times only).

Restoring: where torch cannot cope with absence (the rendezvous state: a missing state is re-created at round 0
and strands the running group), a reader that saw a valid value and now finds the key deleted, garbled or
replayed writes its last valid value back with a fresh seq, by compare-and-set on what it found, so it never
clobbers a newer valid value. :func:`is_rendezvous_state_key` decides which keys; the agent's guardian restores
the others.

Reads are non-blocking at the server: ``compare_set(key, probe, probe)`` with a random per-instance probe returns
the current raw value, or the probe when the key is absent, in one round trip.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import hashlib
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, Optional, Union

from torch.distributed import DistStoreError, PrefixStore, Store

from disttrain.api import storeauth

POLL_S = 0.05
"""First pause before a reader looks again at a key whose value did not verify (doubles up to :data:`POLL_MAX_S`)."""
POLL_MAX_S = 1.0
WAIT_SLICE_S = 1.0
"""Longest single server-side wait for an absent key (so a value that turns up invalid is looked at again)."""
MAX_WRITE_ATTEMPTS = 64
"""Compare-and-set rounds ``compare_set``/``add``/a restore try before giving up (only an outsider rewriting the key
in a tight loop makes them lose that often)."""
RESTORE_GRACE_S = 3.0
"""How long a compare_set on a restorable key that holds an invalid value waits for a valid one to come back before it
takes the key for absent (see :meth:`SignedStore._await_restore`); a delay that only an outsider's write causes."""
_STATE_KEY = re.compile(r"(^|/)torch\.rendezvous\.[^/]+$")

_ALIVE: list[SignedStore] = []
"""Every SignedStore ever made, for the life of the process. torch's C++ ``PrefixStore`` holds only the C++ half of a
Python ``Store``: once the Python object is collected, pybind's trampoline finds no override and every call fails
("Not implemented", torch 2.13). A process makes a handful (one per connection), so keeping them costs nothing."""
_ALIVE_LOCK = threading.Lock()
EXIT_DRAIN_S = 5.0
"""How long the interpreter's exit waits for threads still inside a SignedStore call (see :func:`_drain_at_exit`)."""
_CLOSING = threading.Event()
_CALLS = threading.Condition()
_in_flight = 0

Value = Union[str, bytes]
RejectHook = Callable[[str, str], None]


def is_rendezvous_state_key(key: str) -> bool:
    """Whether ``key`` (full name) is torch's rendezvous state ``[<prefix>/]torch.rendezvous.<run id>``: the key
    whose absence torch cannot cope with (it would start a fresh state at round 0)."""
    return bool(_STATE_KEY.search(key))


@contextlib.contextmanager
def _call() -> Iterator[None]:
    """Counts a call in flight; once the interpreter exits (:func:`_drain_at_exit`), a new call fails at once."""
    global _in_flight
    with _CALLS:
        if _CLOSING.is_set():
            raise DistStoreError("SignedStore: the process is exiting; no store call is made any more")
        _in_flight += 1
    try:
        yield
    finally:
        with _CALLS:
            _in_flight -= 1
            _CALLS.notify_all()


def _pause(seconds: float) -> None:
    """Sleep between looks at a key, cut short (with an error) when the interpreter exits."""
    if _CLOSING.wait(seconds):
        raise DistStoreError("SignedStore: the process is exiting; the wait for a valid value is abandoned")


@atexit.register
def _drain_at_exit(timeout_s: float = EXIT_DRAIN_S) -> bool:
    """Before the interpreter finalises, end every SignedStore call still in flight; whether none was left.

    Why: a call through torch's C++ ``PrefixStore`` runs this class's Python methods under C++ frames (pybind's
    trampoline). A daemon thread (the watchdog, a keep-alive) caught in one when the interpreter finalises dies
    taking the GIL back inside those frames: ``terminate`` (SIGABRT) or a SIGSEGV, so a worker that finished its
    training exits 134/139 and the pod counts as failed. A waiting call (an invalid value, a restore grace) can last
    the store timeout; from here on it raises :class:`DistStoreError` at its next look, and new calls raise at once,
    so the threads are back in plain Python (where finalisation stops them cleanly) before it starts."""
    _CLOSING.set()
    deadline = time.monotonic() + timeout_s
    with _CALLS:
        while _in_flight:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            _CALLS.wait(left)
    return True


def _as_bytes(value: Value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class SignedStore(Store):
    """A Store over ``raw`` (a TCPStore client) that seals writes and verifies reads; see the module docstring.

    Rejections: each distinct invalid value seen under a key is counted once in :attr:`rejections` (a
    ``Counter`` by full key name, read under :attr:`lock` or through :meth:`rejection_counts`) and reported to
    :attr:`on_reject` as ``(key, reason)`` with reason one of ``"invalid"`` (not a valid envelope for this key and
    job: forged, garbled, copied), ``"replay"`` (valid but older than a value this process saw). The hook runs on
    the reading thread, outside the lock; it must be quick and must not raise (an exception is swallowed).
    """

    verifies_values = True
    """Marks a store that hands out only verified values (:func:`disttrain.trainer.agent.heartbeats.is_verifying`)."""

    def __init__(
        self,
        raw: Store,
        secret: str,
        job_uid: str,
        *,
        on_reject: Optional[RejectHook] = None,
        restore: Callable[[str], bool] = is_rendezvous_state_key,
    ) -> None:
        super().__init__()
        if not secret:
            raise ValueError("SignedStore: secret is empty; the job's store secret is required to sign values")
        self.raw: Any = raw  # torch's stubs type values as str; the client takes bytes too
        self.job_uid = job_uid
        self.on_reject: Optional[RejectHook] = on_reject
        """Called with (key, reason) for each newly seen invalid value (see the class docstring)."""
        self.restore = restore
        """Which keys a reader writes back when it finds them deleted or invalid after it saw a valid value."""
        self.rejections: collections.Counter[str] = collections.Counter()
        self.restores: collections.Counter[str] = collections.Counter()
        """Times this process wrote its last valid value of a key back (found deleted, invalid or replayed)."""
        self.lock = threading.Lock()
        self._mac_key = storeauth.mac_key(secret)
        self._probe = b"\0disttrain-probe\0" + secrets.token_bytes(16)
        self._high: dict[str, int] = {}  # key -> highest seq seen valid
        self._last: dict[str, tuple[int, bytes]] = {}  # key -> (seq, plain value) of the newest valid value seen
        self._rejected: dict[str, bytes] = {}  # key -> digest of the last invalid raw value reported
        self._checked = threading.local()
        """Per thread: the keys of the last ``check`` that found all valid, and their values, for the ``multi_get``
        of the same keys that follows (:meth:`check`)."""
        with _ALIVE_LOCK:
            _ALIVE.append(self)
        raw_timeout = getattr(raw, "timeout", None)
        if isinstance(raw_timeout, timedelta):
            self.set_timeout(raw_timeout)

    # --- the envelope -------------------------------------------------------------------------------------------

    def rejection_counts(self) -> dict[str, int]:
        """A copy of the rejection counter (full key name -> invalid values seen)."""
        with self.lock:
            return dict(self.rejections)

    def tamper_counts(self) -> dict[str, int]:
        """Full key name -> invalid values seen plus restores made: grows whenever this process saw the key
        tampered with (:func:`disttrain.trainer.agent.heartbeats.tamper_count` distrusts heartbeats meanwhile)."""
        with self.lock:
            return dict(self.rejections + self.restores)

    def _timeout_s(self) -> float:
        timeout: timedelta = getattr(self, "timeout")  # noqa: B009 - C++ property, absent from torch's stubs
        return float(timeout.total_seconds())

    def _peek(self, key: str) -> Optional[bytes]:
        """The raw value under ``key`` now, None when absent; one round trip, never blocks on an absent key."""
        current = bytes(self.raw.compare_set(key, self._probe, self._probe))
        return None if current == self._probe else current

    def _reject(self, key: str, raw: bytes, reason: str) -> None:
        digest = hashlib.sha256(raw).digest()
        with self.lock:
            if self._rejected.get(key) == digest:
                return
            self._rejected[key] = digest
            self.rejections[key] += 1
        hook = self.on_reject
        if hook is not None:
            try:
                hook(key, reason)
            except Exception:  # noqa: BLE001 - a broken hook must not break the store
                pass

    def _verify(self, key: str, raw: Optional[bytes]) -> Optional[storeauth.Sealed]:
        """The valid content of ``raw`` for ``key``, None when absent or not valid (counted)."""
        if raw is None:
            return None
        sealed = storeauth.unseal_with(self._mac_key, self.job_uid, key, raw)
        if sealed is None:
            self._reject(key, raw, "invalid")
            return None
        with self.lock:
            high = self._high.get(key, -1)
            if sealed.seq < high:
                replay = True
            else:
                replay = False
                self._high[key] = sealed.seq
                self._last[key] = (sealed.seq, sealed.value)
        if replay:
            self._reject(key, raw, "replay")
            return None
        return sealed

    def _next_seq(self, key: str, current: Optional[storeauth.Sealed]) -> int:
        with self.lock:
            high = self._high.get(key, -1)
        return max(time.time_ns(), high + 1, (current.seq + 1) if current is not None else 0)

    def _seal(self, key: str, value: bytes, seq: int) -> bytes:
        return storeauth.seal_with(self._mac_key, self.job_uid, key, value, seq)

    def _wrote(self, key: str, seq: int, value: bytes) -> None:
        with self.lock:
            if seq >= self._high.get(key, -1):
                self._high[key] = seq
                self._last[key] = (seq, value)

    def _swap(
        self, key: str, found: Optional[bytes], value: bytes, current: Optional[storeauth.Sealed]
    ) -> Optional[storeauth.Sealed]:
        """Replace ``found`` (the raw value read; None: absent) by ``value`` sealed with a fresh seq, by
        compare-and-set on ``found``; what was written, or None when someone else wrote first."""
        seq = self._next_seq(key, current)
        envelope = self._seal(key, value, seq)
        if found == b"":
            # an empty raw value: the server's compare_set reads expected "" as "absent", so replace it blindly
            self.raw.set(key, envelope)
        elif bytes(self.raw.compare_set(key, b"" if found is None else found, envelope)) != envelope:
            return None
        self._wrote(key, seq, value)
        return storeauth.Sealed(value, seq)

    def _current(self, key: str) -> tuple[Optional[bytes], Optional[storeauth.Sealed]]:
        """(raw value now or None, its valid content or None); where :attr:`restore` says, a key found deleted or
        invalid after this process saw a valid value is first written back (by compare-and-set on what was found)."""
        found: Optional[bytes] = None
        for _ in range(MAX_WRITE_ATTEMPTS):
            found = self._peek(key)
            current = self._verify(key, found)
            if current is not None:
                return found, current
            with self.lock:
                last = self._last.get(key)
            if last is None or not self.restore(key):
                return found, None
            restored = self._swap(key, found, last[1], None)
            if restored is not None:
                with self.lock:
                    self.restores[key] += 1
                return self._seal(key, restored.value, restored.seq), restored
        return found, None

    # --- the Store API (names as pybind's trampoline calls them) ---------------------------------------------

    def set(self, key: str, value: Value) -> None:
        """A blind write, as TCPStore's (sent without waiting for an answer: rank 0 publishes progress every step),
        sealed with ``seq = max(time_ns, own high-water mark + 1)``."""
        with _call():
            self._take_checked()
            data = _as_bytes(value)
            seq = self._next_seq(key, None)
            self.raw.set(key, self._seal(key, data, seq))
            self._wrote(key, seq, data)

    def get(self, key: str) -> bytes:
        with _call():
            self._take_checked()
            return self._wait_for(key, self._timeout_s())

    def _wait_for(self, key: str, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        pause = POLL_S
        while True:
            found, current = self._current(key)
            if current is not None:
                return current.value
            left = deadline - time.monotonic()
            if _CLOSING.is_set():
                raise DistStoreError(f"SignedStore: the process is exiting; no longer waiting for key {key!r}")
            if left <= 0:
                raise DistStoreError(
                    f"SignedStore: timeout after {timeout_s:.1f}s waiting for a valid value of key {key!r}"
                )
            if found is not None:
                _pause(min(pause, left))  # present but not valid: look again later
                pause = min(pause * 2, POLL_MAX_S)
                continue
            try:
                self.raw.wait([key], timedelta(seconds=min(WAIT_SLICE_S, left)))
            except DistStoreError:
                pass  # not there yet: the loop decides whether the deadline passed

    def add(self, key: str, value: int) -> int:
        with _call():
            self._take_checked()
            for _ in range(MAX_WRITE_ATTEMPTS * 4):
                found, current = self._current(key)
                base = 0
                if current is not None:
                    try:
                        base = int(current.value)
                    except ValueError as error:
                        raise ValueError(
                            f"SignedStore.add: key {key!r} holds {current.value[:32]!r}, not an integer"
                        ) from error
                total = base + int(value)
                if self._swap(key, found, str(total).encode(), current) is not None:
                    return total
            raise DistStoreError(
                f"SignedStore.add: key {key!r} kept changing; no add after {MAX_WRITE_ATTEMPTS * 4} tries"
            )

    def compare_set(self, key: str, expected_value: Value, desired_value: Value) -> bytes:
        with _call():
            self._take_checked()
            expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
            for _ in range(MAX_WRITE_ATTEMPTS):
                found, current = self._current(key)  # restores the rendezvous state first where it was lost
                if current is None and found is not None and self.restore(key):
                    found, current = self._await_restore(key, found)
                if current is None:
                    if expected:
                        return expected  # the server's answer for an absent key and a non-empty expectation
                elif current.value != expected:
                    return current.value
                if self._swap(key, found, desired, current) is not None:
                    return desired
            raise DistStoreError(
                f"SignedStore.compare_set: key {key!r} kept changing; no swap after {MAX_WRITE_ATTEMPTS} tries"
            )

    def _await_restore(self, key: str, found: Optional[bytes]) -> tuple[Optional[bytes], Optional[storeauth.Sealed]]:
        """A restorable key holds an invalid value and this process has nothing to restore: give the processes that
        saw the valid value (the other nodes, the agent's guardian) :data:`RESTORE_GRACE_S` to write it back before
        the value is taken for absent, so a node that just started does not replace a running group's state."""
        deadline = time.monotonic() + RESTORE_GRACE_S
        current: Optional[storeauth.Sealed] = None
        while current is None and found is not None and time.monotonic() < deadline:
            _pause(POLL_S * 2)
            found, current = self._current(key)
        return found, current

    def _batched(self, keys: list[str]) -> Optional[list[Optional[storeauth.Sealed]]]:
        """The valid content of every one of ``keys`` in two round trips (a ``check``, then one ``multi_get``),
        None for each value not valid; None when some key is absent or one is to be restored (the per-key path
        decides those). Why: the job agent reads one beat per node and one beacon per rank; one round trip per key
        each time made its loop grow with the job (thousands of nodes: seconds per round).

        A key deleted between the two trips makes the ``multi_get`` wait for it up to the client's timeout: only
        holders of the job's secret reach the store, and the job's own clients never delete a beat or a beacon."""
        if len(keys) < 2 or any(self.restore(key) for key in keys) or not self.raw.check(keys):
            return None
        return [self._verify(key, bytes(raw)) for key, raw in zip(keys, self.raw.multi_get(keys), strict=True)]

    def check(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` holds a valid value. When all do, their values are kept for this thread's
        next call if it is the ``multi_get`` of the same keys (``if check(keys): multi_get(keys)``, as the agent
        reads beats and beacons): it answers with them, as read at the check, instead of reading and verifying
        every value a second time. Any other call of the thread drops them (a write is then read back)."""
        with _call():
            self._checked.keys = None
            batch = self._batched(keys)
            if batch is not None and all(sealed is not None for sealed in batch):
                self._checked.keys, self._checked.values = list(keys), [sealed.value for sealed in batch if sealed]
                return True
            return all(self._current(key)[1] is not None for key in keys)  # what is missing or invalid, key by key

    def _take_checked(self, keys: Optional[list[str]] = None) -> Optional[list[bytes]]:
        """The values the last ``check`` of this thread kept, if it was of ``keys``; drops them either way."""
        checked, values = getattr(self._checked, "keys", None), getattr(self._checked, "values", None)
        self._checked.keys = self._checked.values = None
        return values if checked is not None and checked == keys else None

    def wait(self, keys: list[str], timeout: Optional[timedelta] = None) -> None:
        with _call():
            self._take_checked()
            timeout_s = self._timeout_s() if timeout is None else timeout.total_seconds()
            deadline = time.monotonic() + timeout_s
            for key in keys:
                self._wait_for(key, max(0.0, deadline - time.monotonic()))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Valid values of ``keys``, waiting for each as :meth:`get`; when all are there and valid, in two round
        trips (:meth:`_batched`)."""
        with _call():
            checked = self._take_checked(keys)
            if checked is not None:
                return checked
            deadline = time.monotonic() + self._timeout_s()
            batch = self._batched(keys) or [None] * len(keys)
            return [
                sealed.value if sealed is not None else self._wait_for(key, max(0.0, deadline - time.monotonic()))
                for key, sealed in zip(keys, batch, strict=True)
            ]

    def multi_set(self, keys: list[str], values: Sequence[Value]) -> None:
        with _call():
            self._take_checked()
            if len(keys) != len(values):
                raise ValueError(f"SignedStore.multi_set: {len(keys)} keys but {len(values)} values; they must pair up")
            sealed = []
            for key, value in zip(keys, values, strict=True):
                data = _as_bytes(value)
                seq = self._next_seq(key, None)
                sealed.append((key, seq, data, self._seal(key, data, seq)))
            self.raw.multi_set(keys, [envelope for *_, envelope in sealed])  # one round trip, as many blind writes
            for key, seq, data, _ in sealed:
                self._wrote(key, seq, data)

    def delete_key(self, key: str) -> bool:
        with _call():
            self._take_checked()
            with self.lock:
                self._high.pop(key, None)
                self._last.pop(key, None)
                self._rejected.pop(key, None)
            return bool(self.raw.delete_key(key))

    def deleteKey(self, key: str) -> bool:  # the name pybind's trampoline calls (torch 2.13)
        return self.delete_key(key)

    def num_keys(self) -> int:
        """Keys on the server, valid or not (torch uses it only as a count)."""
        with _call():
            self._take_checked()
            return int(self.raw.num_keys())

    def getNumKeys(self) -> int:  # the name pybind's trampoline calls (torch 2.13)
        return self.num_keys()

    def list_keys(self) -> list[str]:
        """Every key on the server (names are public; only values are authenticated)."""
        with _call():
            self._take_checked()
            return list(self.raw.list_keys())


class ExitSafePrefixStore(PrefixStore):
    """A ``PrefixStore`` whose calls from Python count as SignedStore calls in flight for :func:`_drain_at_exit`.

    Why: a Python thread calling a C++ ``PrefixStore`` over a SignedStore is inside C++ frames twice: torch's
    binding, then pybind's trampoline back into Python. The SignedStore method's own count ends when the inner
    Python returns, while the thread still has to take the GIL back in the outer binding; if the exit drain sees no
    call in flight in between, the interpreter finalises under that thread and the process aborts (exit 134,
    "terminate called without an active exception"). Counted here, the call ends only back in plain Python. C++
    callers (a process group's store) see an ordinary ``PrefixStore``."""


def _counted(name: str) -> Callable[..., Any]:
    method = getattr(PrefixStore, name)

    def call(self: ExitSafePrefixStore, *args: Any, **kwargs: Any) -> Any:
        with _call():
            return method(self, *args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = method.__doc__
    return call


for _name in (
    "add", "append", "barrier", "check", "compare_set", "delete_key", "get", "list_keys", "multi_get", "multi_set",
    "num_keys", "queue_len", "queue_pop", "queue_push", "set", "wait",
):  # fmt: skip
    if hasattr(PrefixStore, _name):  # an older torch may lack a few (queue_*, list_keys)
        setattr(ExitSafePrefixStore, _name, _counted(_name))
