"""Background uploads of a rank's checkpoint files to the bucket, so that training never waits on the network.

Each rank submits the files it wrote for a save (:meth:`Uploader.submit` returns at once); one thread uploads
the saves in order (:meth:`ObjectStoreCommitter.upload_files`: every file in flight at once, multipart, read back).
A store that fails or cannot be reached is retried with exponential backoff (``initial_s`` doubling up to
``max_s``) until it answers or the uploader is closed: it delays the save's COMPLETE, never the caller. Each
upload records its attempts and last error, which is what status, metrics and events report.

The upload thread runs at a lower CPU priority (:data:`UPLOAD_NICENESS`), and so do the transfer threads it starts
(Linux threads inherit their creator's): where cores are short, the training loop and its data loader go first and
the upload takes what is left.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Optional

from disttrain.api.manifest import FileDigest
from disttrain.trainer.checkpoint.objectstore import ObjectStoreCommitter

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


class Uploader:
    """This rank's upload thread (started on the first submit)."""

    def __init__(self, store: ObjectStoreCommitter, retry: Optional[RetryPolicy] = None) -> None:
        self.store = store
        self.retry = retry or RetryPolicy()
        self._queue: queue.Queue[Optional[Upload]] = queue.Queue()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._pending: list[Upload] = []
        self.last_seconds: Optional[float] = None
        """How long the newest upload that succeeded took, its failed attempts and their backoff excluded."""

    def submit(self, step: int, local_dir: Path, files: dict[str, FileDigest], round_: int) -> Upload:
        upload = Upload(step=step, round=round_, local_dir=local_dir, files=dict(files))
        with self._lock:
            self._pending.append(upload)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="disttrain-upload", daemon=True)
                self._thread.start()
        self._queue.put(upload)
        return upload

    def pending(self) -> list[Upload]:
        """Submitted and not uploaded yet, oldest first."""
        with self._lock:
            return [u for u in self._pending if not u.done.is_set()]

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop retrying and end the thread; uploads not done stay not done (their local files are kept)."""
        self._stop.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        lower_this_threads_priority()
        while not self._stop.is_set():
            upload = self._queue.get()
            if upload is None:
                return
            delay = self.retry.initial_s
            while not self._stop.is_set():
                if not upload.local_dir.is_dir():
                    log.warning("upload of checkpoint step-%d dropped: its local copy was removed", upload.step)
                    upload.dropped = True
                    self._finish(upload)
                    break
                upload.attempts += 1
                started = time.monotonic()
                try:
                    upload.result = self.store.upload_files(upload.local_dir, upload.step, upload.files, upload.round)
                except Exception as exc:  # noqa: BLE001 - a store that fails is retried, never raised into training
                    upload.last_error = f"{type(exc).__name__}: {exc}"[:500]
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

    def _finish(self, upload: Upload) -> None:
        upload.done.set()
        with self._lock:
            self._pending.remove(upload)
