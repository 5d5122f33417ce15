"""A rank's uploads in a process of their own, so that the training thread never waits for the uploads' GIL.

boto3's multipart transfers, the digests and the read-back are Python threads: in the training process they hold
its GIL and slow every step, whatever their nice value. Here one child process per :class:`~.uploads.Uploader`
does the uploads: a fresh interpreter running this module alone (never a fork of the threaded trainer, and never
an import of the training script, as a ``multiprocessing`` spawn child would do), started with the uploader and
reused, in a process group of its own (a SIGTERM to the trainer's process group, a drain, is the trainer's to act
on), at the lowest CPU priority (below), dying with its parent (``PR_SET_PDEATHSIG`` and the pipe's end). The parent
sends one attempt at a time and keeps the retry policy, so ``attempts`` and ``last_error`` are the parent's; a
child that dies fails the attempt in flight, which is retried in a new child.

Priority: the child starts at the trainer's priority (its imports), with the uploader rather than at the first save,
then runs its threads in Linux's ``SCHED_IDLE`` class at nice :data:`CHILD_NICENESS`: on a core that training keeps
busy, the upload takes only what training leaves, and the step time does not change; a spare core it uses freely.
No lock is shared with the trainer, so there is no inversion (in the trainer's own process, a low-priority thread
holding the GIL stalls training). Durability still goes before the last percent of step time: while a newer save
waits behind the upload in flight and the child's threads spend most of their time waiting for a core
(``/proc/<pid>/task/*/schedstat``: starved, not slow on the network), the parent replaces the child with one out of
the idle class, at nice :data:`CHILD_NICENESS` (an unprivileged process cannot leave ``SCHED_IDLE``, so the way back
is a new process), and retries the attempt there; once nothing waits behind, that child moves itself into the idle
class. Local retention never deletes the save in flight (:mod:`.tiered`), so a bucket behind catches up.

The child builds its store from a :class:`StoreRecipe`: the bucket and the client's settings, never a client or a
secret. It reads the credentials as :func:`~.objectstore.make_client` does, from the environment it inherits.

The pipe is a ``multiprocessing`` connection (a socket pair) whose end the child inherits as a file descriptor;
the recipe is its first message.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from disttrain.api.manifest import FileDigest
from disttrain.trainer.checkpoint.committer import CheckpointPhase, PhaseHook
from disttrain.trainer.checkpoint.objectstore import Location, ObjectStoreCommitter, TransferOptions, make_client

log = logging.getLogger("disttrain.trainer")

CHILD_NICENESS = 10
"""The upload process's nice value: in the idle class, and out of it while the uploads are behind and the idle class
starves them (about a tenth of a core against a training thread at 0)."""
STARVED_WINDOW_S = 2.0
"""How long the parent watches the child in the idle class, while a newer save waits, before judging it starved."""
STARVED_WAIT_SHARE = 0.5
"""Starved: the child's threads waited for a core at least this share of the window (summed over its threads)."""
READY_TIMEOUT_S = 300.0
"""How long a new upload process may take to start (at its priority, on busy cores) before it counts as not
startable."""
POLL_S = 0.5
"""How often the parent, waiting for its child, looks whether the uploader was closed."""
_PR_SET_PDEATHSIG = 1
OWN_GROUP: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {}
"""A process group of its own (a drain's SIGTERM to the trainer's group is the trainer's to act on), in the
trainer's session: a new session is a new scheduler autogroup where ``sched_autogroup_enabled`` is set, the idle
class then weighs only against the child's own threads, and the child takes half the training's core. (Before
Python 3.11, :func:`main` makes the group.)"""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreRecipe:
    """What a process needs to build a rank's upload store itself: picklable, without a client or a secret."""

    location: Location
    endpoint: Optional[str] = None
    region: Optional[str] = None
    addressing_style: str = "auto"
    timeouts: tuple[float, float] = (60.0, 60.0)
    """(connect, read) seconds of one request."""
    transfer: TransferOptions = dataclasses.field(default_factory=TransferOptions)
    job_uid: str = ""
    node: str = ""
    record_rank: Optional[int] = None
    """Record each upload for the publisher as this rank (:class:`~.tiered.RecordingStore`); None: upload only."""

    def committer(self) -> DescribedCommitter:
        return DescribedCommitter(self)


class DescribedCommitter(ObjectStoreCommitter):
    """A committer built from a :class:`StoreRecipe`, so that an upload process can build its twin."""

    def __init__(self, recipe: StoreRecipe) -> None:
        client = make_client(recipe.endpoint, recipe.region, recipe.addressing_style, recipe.timeouts)
        super().__init__(client, recipe.location, transfer=recipe.transfer, job_uid=recipe.job_uid, node=recipe.node)
        self.recipe = recipe


@dataclasses.dataclass(frozen=True)
class RemoteStore:
    """How an :class:`~.uploads.Uploader` uploads through a child process: the child's store, and the phase hook
    the parent runs when the child reaches a phase (the child waits for it, as the hook may kill this process)."""

    recipe: StoreRecipe
    on_phase: Optional[PhaseHook] = None


class RemoteUploadError(Exception):
    """An attempt that failed in the upload process; ``str()`` is the child's ``Type: message``."""


class UploadProcessDied(OSError):
    """The upload process ended during an attempt (killed, out of memory): the attempt is retried in a new one."""


class UploadProcessUnavailable(OSError):
    """No upload process could be started here: the uploader falls back to a thread of this process."""


class Starved(Exception):
    """The child in the idle class gets no core while a newer save waits: a child out of that class replaces it."""


class Closed(Exception):
    """The uploader was closed while it waited for its upload process."""


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL when the parent ends (Linux; ``prctl`` acts when the thread that started us ends), and end now if it
    already did."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            log.warning("upload process: prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
    if os.getppid() != parent_pid:
        os._exit(0)


def _run_low(idle_class: bool) -> None:
    """Every thread of this process (and those it starts later, which inherit their creator's) at nice
    :data:`CHILD_NICENESS`, with ``idle_class`` in ``SCHED_IDLE`` (Linux). Best effort."""
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, max(CHILD_NICENESS, os.getpriority(os.PRIO_PROCESS, tid)))
            if idle_class and hasattr(os, "SCHED_IDLE"):
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError as exc:  # a thread that ended meanwhile, or a platform without it
            log.debug("upload process thread %d keeps its priority: %s", tid, exc)


def waited_for_a_core_ns(pid: int) -> Optional[int]:
    """Nanoseconds the threads of ``pid`` have spent runnable but waiting for a core (None where Linux's
    ``schedstat`` cannot be read)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for tid in tids:
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total


def _build_store(recipe: StoreRecipe, conn: multiprocessing.connection.Connection, phases: bool) -> Any:
    committer = recipe.committer()
    if recipe.record_rank is None:
        return committer
    from disttrain.trainer.checkpoint.tiered import RecordingStore

    def ask_parent(phase: CheckpointPhase, step: int) -> None:
        conn.send(("phase", phase.value, step))
        if conn.recv() != ("go",):
            raise OSError("the trainer did not let the upload go on")

    return RecordingStore(committer, recipe.record_rank, ask_parent if phases else None)


def serve(conn: multiprocessing.connection.Connection, parent_pid: int) -> None:
    """The upload process: the recipe first, then one attempt per message, until the pipe closes or says ``None``."""
    _die_with_parent(parent_pid)
    try:
        recipe, phases, idle_class = conn.recv()
    except (EOFError, OSError):
        return
    store = _build_store(recipe, conn, phases)
    # Started at the trainer's priority: its imports take a third of a CPU-second, which in the idle class on cores
    # that training keeps busy would never end.
    _run_low(idle_class)
    try:
        conn.send(("ready", os.getpid()))
    except OSError:  # the uploader closed while this process started
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        if message == ("idle",):
            _run_low(idle_class=True)
            continue
        _, local_dir, step, files, round_ = message
        try:
            result = store.upload_files(Path(local_dir), step, files, round_)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which retries
            conn.send(("failed", f"{type(exc).__name__}: {exc}"[:500]))
        else:
            conn.send(("done", result))


class UploadProcess:
    """The parent's side of one upload process: started with the uploader, started again after it died or starved."""

    def __init__(
        self, remote: RemoteStore, closed: threading.Event, behind: Callable[[], bool] = lambda: False
    ) -> None:
        self.remote = remote
        self.closed = closed
        self.behind = behind
        """Whether a newer save waits behind the upload in flight."""
        self._process: Optional[subprocess.Popen[bytes]] = None
        self._conn: Optional[multiprocessing.connection.Connection] = None
        self.pid: Optional[int] = None
        """The running upload process's pid (None before it started and after one died)."""
        self.idle_class = True
        """Whether the running child is in the idle class."""
        self.starts = 0
        self.replaced_starved = 0
        """Children replaced because the idle class starved them while the uploads were behind."""
        self._busy = False

    def ensure_started(self) -> None:
        """Start the child unless it runs, so that a save does not wait for an interpreter's start (which on busy
        cores takes seconds); raises :class:`UploadProcessUnavailable`, :class:`UploadProcessDied` or
        :class:`Closed`."""
        if self._process is None:
            self._start(idle_class=not self.behind())

    def attempt(self, local_dir: Path, step: int, files: dict[str, FileDigest], round_: int) -> dict[str, FileDigest]:
        """One upload in the child (in a new one out of the idle class where the idle class starves it while the
        uploads are behind); raises :class:`RemoteUploadError`, :class:`UploadProcessDied`,
        :class:`UploadProcessUnavailable` or :class:`Closed`."""
        while True:
            self.ensure_started()
            if not self.idle_class and not self.behind():
                self._send(("idle",))  # caught up: the training's share again
                self.idle_class = True
            self._busy = True
            try:
                return self._upload(("upload", str(local_dir), step, files, round_))
            except Starved:
                log.warning(
                    "checkpoint uploads behind, and process %s in the idle class gets no core: a new upload "
                    "process at nice %d takes step-%d until they keep up",
                    self.pid,
                    CHILD_NICENESS,
                    step,
                )
                self.stop()  # killed: it is in the middle of the upload
                self.replaced_starved += 1
            finally:
                self._busy = False

    def _send(self, message: Any) -> None:
        assert self._conn is not None
        try:
            self._conn.send(message)
        except OSError as exc:
            raise self._died() from exc

    def _upload(self, request: tuple[Any, ...]) -> dict[str, FileDigest]:
        self._send(request)
        while True:
            kind, *rest = self._receive(watch_starvation=True)
            if kind == "phase":
                assert self.remote.on_phase is not None
                try:
                    self.remote.on_phase(CheckpointPhase(rest[0]), rest[1])
                except BaseException:
                    self.stop()  # the child waits for a "go" that never comes: a new one takes the next attempt
                    raise
                self._send(("go",))
            elif kind == "failed":
                raise RemoteUploadError(rest[0])
            else:
                result: dict[str, FileDigest] = rest[0]
                return result

    def _start(self, idle_class: bool) -> None:
        parent, child = multiprocessing.Pipe()
        command = [sys.executable, "-m", __name__, str(child.fileno()), str(os.getpid())]
        try:
            process = subprocess.Popen(command, pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, **OWN_GROUP)
        except Exception as exc:  # whatever the platform refuses, the thread takes over
            parent.close()
            raise UploadProcessUnavailable(f"{type(exc).__name__}: {exc}") from exc
        finally:
            child.close()
        self._process, self._conn, self.starts = process, parent, self.starts + 1
        try:
            parent.send((self.remote.recipe, self.remote.on_phase is not None, idle_class))
        except Exception as exc:  # a recipe that cannot be sent, or a child already gone
            self.stop()
            raise UploadProcessUnavailable(f"{type(exc).__name__}: {exc}") from exc
        try:
            _, pid = self._receive(timeout_s=READY_TIMEOUT_S)
        except UploadProcessDied as exc:
            if self.starts == 1:
                raise UploadProcessUnavailable(str(exc)) from exc
            raise
        self.pid, self.idle_class = pid, idle_class
        log.info("checkpoint uploads run in process %d (nice %d%s)", pid, CHILD_NICENESS, ", SCHED_IDLE" * idle_class)

    def _receive(self, timeout_s: Optional[float] = None, watch_starvation: bool = False) -> Any:
        """The child's next message; waits while the child lives and the uploader is open. With
        ``watch_starvation``, raises :class:`Starved` once the child in the idle class spent most of
        :data:`STARVED_WINDOW_S` waiting for a core while a newer save waited (slow on the network is not starved)."""
        assert self._process is not None and self._conn is not None
        waited = 0.0
        watch: Optional[tuple[float, int]] = None  # (since, the child's wait for a core then)
        while True:
            if self.closed.is_set():
                raise Closed()
            if self._conn.poll(POLL_S):  # a dead child's end of the pipe closes: EOF here
                try:
                    return self._conn.recv()
                except (EOFError, OSError) as exc:
                    raise self._died() from exc
            if self._process.poll() is not None:
                raise self._died()
            waited += POLL_S
            if timeout_s is not None and waited >= timeout_s:
                self.stop()
                raise UploadProcessUnavailable(f"the upload process did not start within {timeout_s:.0f} s")
            if watch_starvation:
                watch = self._watch_starvation(watch)

    def _watch_starvation(self, watch: Optional[tuple[float, int]]) -> Optional[tuple[float, int]]:
        """The next watch (None while there is nothing to watch); raises :class:`Starved`."""
        if not self.idle_class or self._process is None or not self.behind():
            return None
        waited_ns = waited_for_a_core_ns(self._process.pid)
        if waited_ns is None:
            return None
        now = time.monotonic()
        if watch is None:
            return now, waited_ns
        since, then = watch
        if now - since < STARVED_WINDOW_S:
            return watch
        if (waited_ns - then) / 1e9 >= STARVED_WAIT_SHARE * (now - since):
            raise Starved()
        return now, waited_ns

    def _died(self) -> UploadProcessDied:
        pid = self._process.pid if self._process is not None else None
        return UploadProcessDied(f"the upload process {pid} ended (exit code {self.stop()})")

    def stop(self, timeout_s: float = 5.0) -> Optional[int]:
        """End the child (asked first when idle, killed in the middle of an upload or when it does not end) and
        reap it; returns its exit code."""
        process, conn = self._process, self._conn
        self._process = self._conn = None
        self.pid = None
        if conn is not None:
            try:
                conn.send(None)
            except OSError:
                pass
            conn.close()
        if process is None:
            return None
        if process.poll() is None and not self._busy:
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        if process.poll() is None:
            process.kill()
        return process.wait()


def main(argv: list[str]) -> None:
    """``python -m disttrain.trainer.checkpoint.uploadprocess <pipe fd> <parent pid>``: the upload process."""
    if os.getpgid(0) != os.getpid():
        os.setpgid(0, 0)
    serve(multiprocessing.connection.Connection(int(argv[0])), int(argv[1]))


if __name__ == "__main__":
    main(sys.argv[1:])
