"""Background uploads of a rank's checkpoint files to the bucket, so that training never waits on the network.

Each rank submits the files it wrote for a save (:meth:`Uploader.submit` returns at once); one thread takes the
saves in order and has each uploaded (:meth:`ObjectStoreCommitter.upload_files`: every file in flight at once,
multipart, read back). A store that fails or cannot be reached is retried with exponential backoff (``initial_s``
doubling up to ``max_s``) until it answers or the uploader is closed: it delays the save's COMPLETE, never the
caller. Each upload records its attempts and last error, which is what status, metrics and events report.

With a :class:`~.uploadprocess.RemoteStore` (what :class:`~.tiered.BucketTier` passes for a bucket of the spec), the
transfers run in a process of their own at the lowest CPU priority (:mod:`.uploadprocess`): their threads never hold
the training process's GIL, and the thread here only waits on a pipe. Without one, or where no process can be
started, the transfers run in this process: the upload thread and the transfer threads it starts (Linux threads
inherit their creator's priority) run at a lower CPU priority (:data:`UPLOAD_NICENESS`), but share the GIL.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Optional, Protocol

from disttrain.api.manifest import FileDigest
from disttrain.trainer.checkpoint.uploadprocess import (
    Closed,
    RemoteStore,
    RemoteUploadError,
    UploadProcess,
    UploadProcessUnavailable,
)

log = logging.getLogger("disttrain.trainer")

UPLOAD_NICENESS = 10
"""Added to the upload thread's nice value (about a tenth of a core's share against a training thread at 0)."""


def lower_this_threads_priority(increment: int = UPLOAD_NICENESS) -> None:
    """Best effort: this thread alone (Linux: a thread id is a process id for ``setpriority``), never raising."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except (OSError, AttributeError) as exc:
        log.debug("upload thread keeps its priority: %s", exc)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How the background uploads and the publication wait out a bucket that fails: never the training steps."""

    initial_s: float = 1.0
    """First wait after a failed attempt, doubled after each failure..."""
    max_s: float = 30.0
    """...up to this."""
    connect_timeout_s: float = 60.0
    """One request's connect timeout: what an attempt waits for a bucket that drops packets (botocore's default)."""
    read_timeout_s: float = 60.0
    """One request's read timeout (botocore's default)."""


@dataclasses.dataclass
class Upload:
    """One save's files of this rank; ``done`` once uploaded and read back (``result``: digests with ETags)."""

    step: int
    round: int
    local_dir: Path
    files: dict[str, FileDigest]
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: Optional[dict[str, FileDigest]] = None
    attempts: int = 0
    last_error: str = ""
    dropped: bool = False
    """Its local copy was removed before it was uploaded (a newer save superseded it): never uploaded."""


class FileUploader(Protocol):
    """What an :class:`Uploader` uploads through: :class:`ObjectStoreCommitter` or :class:`~.tiered.RecordingStore`."""

    def upload_files(
        self, local_dir: Path, step: int, files: dict[str, FileDigest], round_: int
    ) -> dict[str, FileDigest]: ...


def describe(exc: BaseException) -> str:
    """``Type: message`` of a failed attempt (the child's own for an attempt that failed in the upload process)."""
    text = str(exc) if isinstance(exc, RemoteUploadError) else f"{type(exc).__name__}: {exc}"
    return text[:500]


class Uploader:
    """This rank's upload thread and, with ``remote``, its upload process: both started by :meth:`start` (a bucket
    tier calls it when it is made) or else by the first submit."""

    def __init__(
        self,
        store: FileUploader,
        retry: Optional[RetryPolicy] = None,
        remote: Optional[RemoteStore] = None,
        in_flight_file: Optional[Path] = None,
    ) -> None:
        self.store = store
        self.retry = retry or RetryPolicy()
        self.in_flight_file = in_flight_file
        """Holds the step of the upload in flight while there is one, so that local retention keeps its files."""
        self._queue: queue.Queue[Optional[Upload]] = queue.Queue()
        self._stop = threading.Event()
        self.process: Optional[UploadProcess] = (
            UploadProcess(remote, self._stop, behind=lambda: len(self.pending()) > 1) if remote is not None else None
        )
        """The upload process (None: the uploads run in this process)."""
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._pending: list[Upload] = []
        self.last_seconds: Optional[float] = None
        """How long the newest upload that succeeded took, its failed attempts and their backoff excluded."""

    def start(self) -> None:
        """Start the upload thread, and in it the upload process, before the first save needs them."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="disttrain-upload", daemon=True)
                self._thread.start()

    def submit(self, step: int, local_dir: Path, files: dict[str, FileDigest], round_: int) -> Upload:
        upload = Upload(step=step, round=round_, local_dir=local_dir, files=dict(files))
        with self._lock:
            self._pending.append(upload)
        self.start()
        self._queue.put(upload)
        return upload

    def pending(self) -> list[Upload]:
        """Submitted and not uploaded yet, oldest first."""
        with self._lock:
            return [u for u in self._pending if not u.done.is_set()]

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop retrying and end the thread and the upload process; uploads not done stay not done (their local
        files are kept)."""
        self._stop.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)
        elif self.process is not None:
            self.process.stop()

    def _run(self) -> None:
        lower_this_threads_priority()
        try:
            if self.process is not None:
                try:
                    self.process.ensure_started()
                except UploadProcessUnavailable as exc:
                    log.warning("checkpoint uploads run in the training process: no upload process here (%s)", exc)
                    self.process = None
            self._upload_in_order()
        except Closed:
            pass
        finally:
            if self.process is not None:
                self.process.stop()  # from this thread: the child's PR_SET_PDEATHSIG follows the thread that started it

    def _attempt(self, upload: Upload) -> dict[str, FileDigest]:
        if self.process is not None:
            try:
                return self.process.attempt(upload.local_dir, upload.step, upload.files, upload.round)
            except UploadProcessUnavailable as exc:
                log.warning("checkpoint uploads run in the training process: no upload process here (%s)", exc)
                self.process = None
        return self.store.upload_files(upload.local_dir, upload.step, upload.files, upload.round)

    def _upload_in_order(self) -> None:
        while not self._stop.is_set():
            upload = self._queue.get()
            if upload is None:
                return
            delay = self.retry.initial_s
            self._mark_in_flight(upload.step)
            while not self._stop.is_set():
                if not upload.local_dir.is_dir():
                    log.warning("upload of checkpoint step-%d dropped: its local copy was removed", upload.step)
                    upload.dropped = True
                    self._finish(upload)
                    break
                upload.attempts += 1
                started = time.monotonic()
                try:
                    upload.result = self._attempt(upload)
                except Closed:
                    raise
                except Exception as exc:  # noqa: BLE001 - a store that fails is retried, never raised into training
                    upload.last_error = describe(exc)
                    log.warning(
                        "upload of checkpoint step-%d failed (attempt %d, retry in %.0f s): %s",
                        upload.step,
                        upload.attempts,
                        delay,
                        upload.last_error,
                    )
                    self._stop.wait(delay)
                    delay = min(delay * 2, self.retry.max_s)
                    continue
                upload.last_error = ""
                self.last_seconds = time.monotonic() - started
                self._finish(upload)
                break

    def _mark_in_flight(self, step: Optional[int]) -> None:
        """Written before the upload's files are looked at, so that retention, which reads it first, keeps them."""
        if self.in_flight_file is None:
            return
        try:
            if step is None:
                self.in_flight_file.unlink(missing_ok=True)
            else:
                self.in_flight_file.write_text(str(step))
        except OSError as exc:
            log.debug("cannot mark the upload in flight: %s", exc)

    def _finish(self, upload: Upload) -> None:
        self._mark_in_flight(None)
        upload.done.set()
        with self._lock:
            self._pending.remove(upload)
