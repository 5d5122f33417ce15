"""Flight-recorder dumps for NCCL groups that torch itself never dumps: the groups a process re-forms in place.

torch 2.13's ``ProcessGroupNCCL`` numbers its instances with a process-wide counter (``getUid()``), and only the
heartbeat monitor of the group with uid 0 acts on the dump signal (``checkDumpSignal = dumpOnTimeoutOrEx_ &&
getUid() == 0``): the flag a timed-out watchdog raises in this process, or the ``exception_dump`` key any rank's
watchdog sets in the group's store. That is the first NCCL group the process created. A survivor that re-forms in
place aborts it and creates new ones (uid 1, 2, ...), whose monitors never dump, whatever the environment says, and
no variable changes that. The ring buffer itself is one per process and keeps recording every group's collectives,
so the dump is only a matter of writing it.

:class:`DumpWatch` does what the uid-0 monitor would have done, for a group whose uid is not 0: it polls the group's
store for torch's dump signal (every second, as ``TORCH_NCCL_COORD_CHECK_MILSEC``'s default) and writes the trace
(``_dump_nccl_trace``) once, to the file torch's writer uses (``$TORCH_FR_DUMP_TEMP_FILE<global rank>``), so the
dumps of every rank read together with ``torchfrtrace``. docs/gpu.md has the details.
"""

from __future__ import annotations

import atexit
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Optional, Protocol

log = logging.getLogger("disttrain.trainer")

DUMP_SIGNAL_KEY = "exception_dump"
"""torch's ``kStoreDumpKey`` (``ProcessGroupNCCL.hpp``): set, with the signalling rank as a 4-byte int, in the
group's underlying store by the watchdog of any rank that finds a collective timed out or failed."""
POLL_S = 1.0
"""How often the store is asked: the default of torch's own ``TORCH_NCCL_COORD_CHECK_MILSEC``."""
DUMP_FILE_ENV = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
"""Where torch writes its dump (the first name set wins, as torch reads them); the launcher sets the first."""
DUMP_ON_TIMEOUT_ENV = "TORCH_NCCL_DUMP_ON_TIMEOUT"
STORE_FAILURES_TO_STOP = 3
"""Failed store reads in a row that end a watch: the group's store is gone, and with it the group."""
TRUE_VALUES = frozenset({"1", "true", "yes", "y", "on"})


class SignalStore(Protocol):
    """What a watch needs of a c10d store."""

    def check(self, keys: list[str]) -> bool: ...

    def get(self, key: str) -> bytes: ...


def torch_dumps(uid: int) -> bool:
    """Whether torch's own heartbeat monitor dumps for the NCCL group with this uid (only uid 0's does)."""
    return uid == 0


def dump_on_timeout(environ: Mapping[str, str]) -> bool:
    """``TORCH_NCCL_DUMP_ON_TIMEOUT`` is on (the launcher turns it on; a user may turn it off)."""
    return environ.get(DUMP_ON_TIMEOUT_ENV, "").strip().lower() in TRUE_VALUES


def dump_file(environ: Mapping[str, str], rank: int) -> str:
    """The file a dump of global rank ``rank`` goes to: torch's prefix plus the rank, as its writer names it."""
    prefix = next((environ[name] for name in DUMP_FILE_ENV if environ.get(name)), "")
    return f"{prefix or os.path.join(tempfile.gettempdir(), 'nccl_trace_rank_')}{rank}"


def underlying_store(store: Any) -> Any:
    """The store under every ``PrefixStore`` layer: where torch's watchdogs set the dump signal."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


class DumpWatch:
    """Writes this process's flight-recorder trace to ``path`` once ``store`` carries torch's dump signal.

    One watch runs at a time: starting one stops the one before (the group it watched is gone). It also ends after
    its dump, on :meth:`stop`, and when the store cannot be read any more."""

    _current: ClassVar[Optional[DumpWatch]] = None
    _current_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self,
        store: SignalStore,
        path: str,
        trace: Optional[Callable[[], Optional[bytes]]] = None,
        poll_s: float = POLL_S,
    ) -> None:
        """``trace``: the dump's bytes (default: torch's flight recorder, :func:`diagnostics.flight_recorder_trace`)."""
        self.store, self.path, self.poll_s = store, path, poll_s
        self._trace = trace
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.dumped_to: Optional[str] = None
        """The file written, once it was."""

    def start(self) -> DumpWatch:
        with DumpWatch._current_lock:
            previous, DumpWatch._current = DumpWatch._current, self
        if previous is not None:
            previous.stop(join_s=0)  # its group is gone; a read of a dead store must not hold up the new group
        self._thread = threading.Thread(target=self._run, name="disttrain-fr-dump", daemon=True)
        self._thread.start()
        return self

    def stop(self, join_s: float = 2.0) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_s)

    @classmethod
    def stop_current(cls, join_s: float = 2.0) -> None:
        """Stop the running watch, if any (at exit: a thread inside a store call when the interpreter finalises
        would abort the process)."""
        with cls._current_lock:
            current, cls._current = cls._current, None
        if current is not None:
            current.stop(join_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.poll_s):
            try:
                signalled = self.store.check([DUMP_SIGNAL_KEY])
            except Exception as exc:  # noqa: BLE001 - the group's store went with the group
                failures += 1
                if failures >= STORE_FAILURES_TO_STOP:
                    log.debug("flight-recorder watch ends: its store cannot be read (%s)", exc)
                    return
                continue
            failures = 0
            if signalled:
                self._dump(self._signalling_rank())
                return

    def _signalling_rank(self) -> int:
        try:
            return int.from_bytes(self.store.get(DUMP_SIGNAL_KEY)[:4], "little", signed=True)
        except Exception:  # noqa: BLE001 - the rank is only for the log line
            return -1

    def _dump(self, source_rank: int) -> None:
        trace = self._trace() if self._trace is not None else _torch_trace()
        if trace is None:
            log.warning("flight-recorder dump signalled by rank %d, but torch keeps no trace here", source_rank)
            return
        temporary = f"{self.path}.tmp{os.getpid()}"
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(temporary, "wb") as handle:
                handle.write(trace)
            os.replace(temporary, self.path)
        except OSError as exc:
            log.warning("could not write the flight-recorder dump %s: %s", self.path, exc)
            return
        self.dumped_to = self.path
        log.warning(
            "a collective timed out or failed (dump signalled by rank %d): flight-recorder trace of this re-formed "
            "group written to %s",
            source_rank,
            self.path,
        )


def _torch_trace() -> Optional[bytes]:
    from disttrain.trainer import diagnostics

    return diagnostics.flight_recorder_trace()


def watch_reformed_group(environ: Mapping[str, str], rank: int, uid: Optional[int], store: Any) -> Optional[DumpWatch]:
    """Start a watch for the NCCL group just created (``store``: its store, any ``PrefixStore`` of it), unless torch
    dumps for it itself (uid 0), it is not NCCL (no uid) or dumps on timeout are off."""
    if uid is None or torch_dumps(uid) or not dump_on_timeout(environ):
        return None
    return DumpWatch(underlying_store(store), dump_file(environ, rank)).start()


atexit.register(DumpWatch.stop_current)
