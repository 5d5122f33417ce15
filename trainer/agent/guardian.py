"""The job agent as its store's guardian: sweeps out what a stranger put in, restores what a stranger broke.

Why: the agent hosts the job's TCPStore in its own process, and anything that can reach the port may list, write,
delete and replay every key (torch >= 2.10 lists keys; see :mod:`disttrain.api.storeauth`). Sealing stops a forged
value from being *acted on*; it does not stop a stranger from (a) filling the agent's memory with 8 MiB values
until the pod is OOM-killed (every OOM is a restart), nor (b) deleting or garbling a sealed value, which the readers
then treat as absent and wait for. The :class:`Guardian` sweeps the store from the server's own client:

* every key outside the job's namespace (``<prefix>/``) is deleted without being read;
* every key inside it is read (at most :attr:`Guardian.max_read_bytes` per sweep) and checked with
  :func:`~disttrain.api.storeauth.unseal`: a valid value is remembered (the last one per key, bounded in count and
  bytes), anything else is replaced by the remembered value (``compare_set`` against exactly what was read, so a
  newer valid value written meanwhile is never clobbered) or, for a key never seen valid, deleted;
* a valid value with a lower ``seq`` than the one remembered (a replay) is replaced the same way;
* a remembered key that vanished is written back (``compare_set`` from absent), except the keys the job's own code
  deletes on purpose (:data:`NOT_RESTORED`; torch's elastic code deletes no key of the rendezvous store).

Each rejection is counted by (key class, reason): both label sets are closed (:data:`KEY_CLASSES`,
:data:`REASONS`), so a stranger cannot mint time series with key names. The agent relays the counts and the most
recent rejected keys into ``status.storeRejections``; the operator turns them into
``disttrain_store_rejected_values_total`` and a rate-limited Warning Event naming the key.

Memory: the libuv server frees a value's buffer when the key is deleted, but glibc keeps freed 8 MiB chunks in
the heap once its dynamic mmap threshold has risen past them, so RSS would stay at the flood's high-water mark;
:func:`pin_mmap_threshold` fixes the threshold so that every large value is its own mapping, returned to the
kernel when it is freed (measured in ``bench/store_flood.py``).
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Final, Optional

from disttrain.api import control as keys
from disttrain.api import status, storeauth

log = logging.getLogger("disttrain.agent.guardian")

KEY_CLASSES: Final = status.STORE_KEY_CLASSES
REASONS: Final = status.STORE_REJECT_REASONS
NOT_RESTORED: Final = (keys.EXIT_FIRST_KEY, keys.EXIT_LAST_KEY)
"""Keys the job's own code deletes on purpose (:func:`disttrain.trainer.startup.take_exit_times`): never written
back. torch's elastic code calls no ``delete_key`` on the rendezvous store (checked in torch 2.13)."""
RENDEZVOUS_PREFIX: Final = "torch.rendezvous."
NULL_SENTINEL: Final = b"Y2FuaW1hZGFt"
"""What torch's ``C10dRendezvousBackend`` writes under ``torch.rendezvous.<run id>`` when it is built. torch's
``create_backend`` builds one over the raw client before :func:`disttrain.trainer.launch.rendezvous.create_handler` puts
the signed store around it, so every node leaves this unsigned key outside the namespace: deleted, but not counted
as a rejection (it would raise a Warning on every job)."""
MAX_RECENT: Final = 8
"""Distinct rejected keys reported in the status (newest first)."""
MAX_KEY_SHOWN: Final = 120
"""Characters of a key name shown in the status and the Event (a stranger chooses the name)."""
SWEEP_INTERVAL_S: Final = 0.2
"""Pause between two sweeps that found nothing wrong; a sweep that deleted something is followed at once."""
MAX_READ_BYTES: Final = 64 << 20
"""Bytes of values one sweep reads at most (one value over 8 MiB is refused by the libuv server)."""
MAX_REMEMBERED_KEYS: Final = 16384
"""A 1,024-node job's keys: 8,192 ranks' beacons, a beat, identity and join record per node, torch's own."""
MAX_REMEMBERED_BYTES: Final = 32 << 20
MAX_REMEMBERED_VALUE: Final = 1 << 20
"""A larger sealed value is checked but not kept for repair (the job's own values are a few KiB)."""
MMAP_THRESHOLD_BYTES: Final = 1 << 20
BATCH_KEYS: Final = 256
"""Keys read in one ``check`` and one ``multi_get``: a sweep of a large job's store costs a few round trips, not one
per key (one round trip per key would be 10,000 per sweep at 1,024 nodes, the agent's largest cost)."""
BATCH_VALUE_MAX: Final = 64 << 10
"""Only keys whose last valid value was at most this large are read in a batch (a batch holds at most 16 MiB of
them); any other key, and every key not yet seen valid, is read alone within the sweep's byte budget."""
SWEEP_SHARE: Final = 0.25
"""The most of its time the sweeper spends sweeping: after a sweep of ``d`` seconds it waits at least
``d * (1 - share) / share``, so a store of many keys is swept less often rather than taking a core."""


@dataclasses.dataclass(frozen=True)
class Rejection:
    """One rejected value: the key as shown (namespace prefix replaced by ``~``), its class and the reason."""

    key: str
    key_class: str
    reason: str
    time: float


@dataclasses.dataclass
class SweepResult:
    """What one sweep did (for tests and the bench)."""

    listed: int = 0
    deleted: int = 0
    restored: int = 0
    read_bytes: int = 0
    truncated: bool = False
    """The read budget ran out before every key was checked (the next sweep follows at once)."""


class Guardian:
    """Sweeps one job's store through ``server`` (the raw TCPStore client of the agent's own server).

    ``job_uid`` must be the one every signed store of the job seals with (``$DISTTRAIN_JOB_UID``, as
    :func:`disttrain.trainer.store.channel.scoped` takes it). Thread-safe: :meth:`snapshot` may be called while the
    sweeper thread runs.
    """

    def __init__(
        self,
        server: Any,
        secret: str,
        job_uid: str,
        *,
        max_read_bytes: int = MAX_READ_BYTES,
        max_remembered_keys: int = MAX_REMEMBERED_KEYS,
        max_remembered_bytes: int = MAX_REMEMBERED_BYTES,
        interval_s: float = SWEEP_INTERVAL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not secret:
            raise ValueError("secret is empty: the guardian checks values with the job's store secret")
        self.server = server
        self.secret = secret
        self.job_uid = job_uid
        self.namespace = storeauth.key_prefix(secret) + "/"
        self.max_read_bytes = max_read_bytes
        self.max_remembered_keys = max_remembered_keys
        self.max_remembered_bytes = max_remembered_bytes
        self.interval_s = interval_s
        self.clock = clock
        self._last: collections.OrderedDict[str, tuple[bytes, int]] = collections.OrderedDict()
        """key -> (raw sealed bytes, seq) of the last valid value seen; least recently confirmed first."""
        self._last_bytes = 0
        self._counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._recent: collections.OrderedDict[str, Rejection] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._cursor = 0
        self._probe = b"\0disttrain-guardian-probe\0" + secrets.token_bytes(16)
        self.stop_event = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- what the agent reports ---------------------------------------------------------------------------
    def counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)

    def snapshot(self) -> Optional[dict[str, Any]]:
        """``status.storeRejections`` (wire form), or None while nothing was rejected."""
        from disttrain.api.timestamps import format_time

        with self._lock:
            if not self._counts:
                return None
            counts = {f"{c}/{r}": n for (c, r), n in sorted(self._counts.items())}
            recent = [
                {"key": j.key, "keyClass": j.key_class, "reason": j.reason, "time": format_time(j.time)}
                for j in reversed(self._recent.values())
            ]
            return {"total": sum(self._counts.values()), "counts": counts, "recent": recent}

    # ---- the sweep ------------------------------------------------------------------------------------------
    def key_class(self, key: str) -> str:
        if not key.startswith(self.namespace):
            return "foreign"
        name = key[len(self.namespace) :]
        if name.startswith(RENDEZVOUS_PREFIX):
            return "rendezvous"
        if name.startswith(keys.PREFIX):
            return "control"
        return "torch"

    def shown(self, key: str) -> str:
        """The key as reported: the namespace prefix as ``~/``, non-printable characters escaped, truncated."""
        if key.startswith(self.namespace):
            key = "~/" + key[len(self.namespace) :]
        text = key.encode("unicode_escape", "backslashreplace").decode("ascii", "replace")
        return text if len(text) <= MAX_KEY_SHOWN else text[: MAX_KEY_SHOWN - 3] + "..."

    def sweep(self) -> SweepResult:
        """One pass over every key of the store (reads bounded by :attr:`max_read_bytes`)."""
        result = SweepResult()
        names = list(self.server.list_keys())
        result.listed = len(names)
        present = set(names)
        mine: list[str] = []
        for key in names:
            if key.startswith(self.namespace):
                mine.append(key)
            elif self._is_torchs_own_leftover(key, result):
                self._drop(key, result)
            else:
                self._delete(key, "foreign", result)
        # the read budget may cut a sweep short: start where the last one stopped, so every key gets its turn
        if mine:
            start = self._cursor % len(mine)
            mine = mine[start:] + mine[:start]
        checked = 0
        for group in self._groups(mine):
            if result.read_bytes >= self.max_read_bytes:
                result.truncated = True
                self._cursor += checked
                break
            for key, raw in zip(group, self._read_group(group), strict=True):
                self._check(key, raw, result)
            checked += len(group)
        else:
            self._cursor = 0
        self._restore_vanished(present, result)
        return result

    def _groups(self, mine: list[str]) -> Iterator[list[str]]:
        """``mine`` in order, as runs of up to :data:`BATCH_KEYS` keys whose last valid value was small, and each
        other key alone."""
        with self._lock:
            small = {key for key, (raw, _seq) in self._last.items() if len(raw) <= BATCH_VALUE_MAX}
        run: list[str] = []
        for key in mine:
            if key in small:
                run.append(key)
                if len(run) == BATCH_KEYS:
                    yield run
                    run = []
                continue
            if run:
                yield run
                run = []
            yield [key]
        if run:
            yield run

    def _read_group(self, group: list[str]) -> list[Optional[bytes]]:
        """The raw values of ``group`` (None: absent): one ``check`` and one ``multi_get`` when every key is there,
        else key by key. Only the job's own code deletes a key that was valid, and never between the two."""
        if len(group) > 1:
            try:
                if self.server.check(group):
                    return [bytes(value) for value in self.server.multi_get(group)]
            except Exception as error:  # noqa: BLE001 - read key by key instead
                log.debug("batched read of %d keys failed: %r", len(group), error)
        return [self._read(key) for key in group]

    def _check(self, key: str, raw: Optional[bytes], result: SweepResult) -> None:
        if raw is None:  # deleted between list and read: the next sweep sees it gone
            return
        result.read_bytes += len(raw)
        with self._lock:
            last = self._last.get(key)
            if last is not None and last[0] == raw:  # the very bytes found valid before: no MAC to compute again
                self._last.move_to_end(key)
                return
        sealed = storeauth.unseal(self.secret, self.job_uid, key, raw)
        if sealed is not None and (last is None or sealed.seq >= last[1]):
            self._remember(key, raw, sealed.seq)
            return
        reason = "unsigned" if sealed is None else "replayed"
        if last is None:
            self._delete(key, reason, result)
            return
        self._reject(key, reason)
        self._put_back(key, raw, last[0], result)

    def _is_torchs_own_leftover(self, key: str, result: SweepResult) -> bool:
        """``torch.rendezvous.<run id>`` (no ``/``) holding exactly :data:`NULL_SENTINEL`: read only under that
        name, and at most the sentinel's length is kept."""
        if not key.startswith(RENDEZVOUS_PREFIX) or "/" in key:
            return False
        raw = self._read(key)
        if raw is None:
            return False
        result.read_bytes += len(raw)
        return raw == NULL_SENTINEL

    def _drop(self, key: str, result: SweepResult) -> None:
        try:
            self.server.delete_key(key)
            result.deleted += 1
        except Exception as error:  # noqa: BLE001 - the next sweep tries again
            log.debug("could not delete %s: %r", self.shown(key), error)

    def _read(self, key: str) -> Optional[bytes]:
        """The raw value, None when the key is absent, without waiting: ``get`` blocks until the key exists (for
        the store timeout), so a key deleted between ``list_keys`` and the read would stall every sweep behind it.
        ``compare_set(key, probe, probe)`` answers at once: the current value, or the probe when there is none
        (the server sets nothing when the key is absent and the expected value is not empty)."""
        try:
            raw = bytes(self.server.compare_set(key, self._probe, self._probe))
        except Exception as error:  # noqa: BLE001 - the next sweep tries again
            log.debug("could not read %s: %r", self.shown(key), error)
            return None
        return None if raw == self._probe else raw

    def _restore_vanished(self, present: set[str], result: SweepResult) -> None:
        with self._lock:
            gone = [(k, v[0]) for k, v in self._last.items() if k not in present]
        for key, raw in gone:
            if key[len(self.namespace) :] in NOT_RESTORED:
                self._forget(key)
                continue
            self._reject(key, "deleted")
            self._put_back(key, b"", raw, result)

    def _put_back(self, key: str, expected: bytes, raw: bytes, result: SweepResult) -> None:
        """``compare_set(key, expected, raw)``: only over exactly what was seen (b"": only while still absent)."""
        try:
            now = bytes(self.server.compare_set(key, expected, raw))
        except Exception as error:  # noqa: BLE001 - the next sweep tries again
            log.warning("could not restore %s: %r", self.shown(key), error)
            return
        if now == raw:
            result.restored += 1
            log.warning("restored %s", self.shown(key))

    def _delete(self, key: str, reason: str, result: SweepResult) -> None:
        self._reject(key, reason)
        self._drop(key, result)

    def _reject(self, key: str, reason: str) -> None:
        key_class = self.key_class(key)
        shown = self.shown(key)
        with self._lock:
            self._counts[(key_class, reason)] += 1
            self._recent.pop(shown, None)
            self._recent[shown] = Rejection(shown, key_class, reason, self.clock())
            while len(self._recent) > MAX_RECENT:
                self._recent.popitem(last=False)

    def _remember(self, key: str, raw: bytes, seq: int) -> None:
        if len(raw) > MAX_REMEMBERED_VALUE or key[len(self.namespace) :] in NOT_RESTORED:
            return
        with self._lock:
            old = self._last.pop(key, None)
            if old is not None:
                self._last_bytes -= len(old[0])
            self._last[key] = (raw, seq)
            self._last_bytes += len(raw)
            while len(self._last) > self.max_remembered_keys or self._last_bytes > self.max_remembered_bytes:
                _, (dropped, _seq) = self._last.popitem(last=False)
                self._last_bytes -= len(dropped)

    def _forget(self, key: str) -> None:
        with self._lock:
            old = self._last.pop(key, None)
            if old is not None:
                self._last_bytes -= len(old[0])

    # ---- the thread -----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="store-guardian", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)

    def run(self) -> None:
        """Sweep until stopped: at once again after a sweep that changed something, else every ``interval_s``."""
        while not self.stop_event.is_set():
            began = time.monotonic()
            try:
                result = self.sweep()
            except Exception as error:  # noqa: BLE001 - a failed sweep is retried; the guardian must not die
                log.warning("store sweep failed: %r", error)
                self.stop_event.wait(self.interval_s)
                continue
            if not (result.deleted or result.truncated):
                self.stop_event.wait(sweep_pause(time.monotonic() - began, self.interval_s))


def sweep_pause(sweep_s: float, interval_s: float = SWEEP_INTERVAL_S, share: float = SWEEP_SHARE) -> float:
    """The pause after a quiet sweep that took ``sweep_s``: ``interval_s``, or longer so that sweeping takes at most
    ``share`` of the sweeper's time."""
    return max(interval_s, sweep_s * (1.0 - share) / share)


def pin_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Make glibc serve every allocation of ``threshold`` bytes or more with its own mapping, for good.

    glibc raises its mmap threshold to the size of each mmapped chunk freed (up to 32 MiB), after which 8 MiB
    values come from the heap and their memory is not given back when the key is deleted; setting
    ``M_MMAP_THRESHOLD`` explicitly turns that adjustment off. False where there is no glibc (nothing changes)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_mmap_threshold = -3
    return bool(mallopt(m_mmap_threshold, threshold))
