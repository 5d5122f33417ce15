"""In-place reforms: the launcher hands the next rendezvous round to the worker processes it already runs.

Why: a reform used to end every worker process and start new ones, so each survivor paid for its model build,
its checkpoint load and the steps since the last checkpoint again (``modelBuild``, ``checkpointLoad`` and the
redone steps of ``status.lastReform``), although it still held the whole state in memory. With this channel a
survivor asks its launcher for the next round instead of exiting (:meth:`WorkerLink.request_round`), the
launcher's torchrun agent runs the rendezvous as for any restart, and where torchrun would start the worker it hands
the new round's environment (ranks, world size, master address) to the waiting process instead
(:meth:`Broker.take`). torchrun keeps the same ``Popen`` handle it would have had, so monitoring, exit codes and
signals stay torchrun's. What the worker does with the round is in :mod:`disttrain.trainer.inplace`.

The channel is a Unix socket in Linux's abstract namespace (no file, so a read-only root filesystem does not
matter), named in ``$DISTTRAIN_LAUNCHER_SOCKET``, open to processes of the launcher's own user only. One JSON
object per line:

* worker to launcher: ``{"hello": {"pid", "local_rank"}}`` when it connects; ``{"reform": {"step", "time"}}`` when
  it waits for the next round;
* launcher to worker: ``{"round": {"env": {...}}}``, the environment torchrun built for the worker of that local
  rank; ``{"restart": "why"}``, or the socket closing: exit, and torchrun starts a new process as before.

Nothing here imports torch: the launcher creates the socket before it imports torch itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from types import FrameType
from typing import Any, Optional

from disttrain.api import env as env_names

log = logging.getLogger("disttrain.launch")

ABSTRACT_PREFIX = "@"
"""How an abstract socket name is written in the environment (the NUL byte it stands for cannot be)."""
MAX_LINE = 1 << 20
"""Longest message accepted (a worker environment is a few kilobytes)."""
RELEASE_GRACE_S = 5.0
"""How long a worker told to restart may take to exit before the launcher kills it."""


def _socket_address(name: str) -> str:
    return "\0" + name[len(ABSTRACT_PREFIX) :] if name.startswith(ABSTRACT_PREFIX) else name


def _send(sock: socket.socket, message: Mapping[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


class _Lines:
    """Newline-delimited JSON read from a socket (blocking, with the socket's own timeout)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def read(self) -> Optional[dict[str, Any]]:
        """The next message; None when the peer closed the socket (or sent something unreadable)."""
        while b"\n" not in self.buffer:
            chunk = self.sock.recv(65536)
            if not chunk or len(self.buffer) > MAX_LINE:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except ValueError:
            return None
        return message if isinstance(message, dict) else None


class WorkerLink:
    """A worker's end of the channel (see the module docstring)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lines = _Lines(sock)

    @classmethod
    def connect(cls, environ: Mapping[str, str] = os.environ) -> Optional[WorkerLink]:
        """Connect to this worker's launcher and introduce the process; None without a launcher socket (not started
        by the disttrain launcher) or when it cannot be reached."""
        name = environ.get(env_names.LAUNCHER_SOCKET)
        if not name:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(5.0)
            sock.connect(_socket_address(name))
            _send(sock, {"hello": {"pid": os.getpid(), "local_rank": int(environ.get("LOCAL_RANK", "0"))}})
        except (OSError, ValueError) as exc:
            sock.close()
            log.info("no in-place reforms: the launcher's socket %s cannot be reached (%s)", name, exc)
            return None
        return cls(sock)

    def request_round(self, step: int, timeout_s: float) -> Optional[dict[str, str]]:
        """Wait for the next round's environment; None: exit, the launcher restarts this worker (it said so, it is
        gone, or no round came within ``timeout_s``)."""
        try:
            self.sock.settimeout(timeout_s)
            _send(self.sock, {"reform": {"step": step, "time": time.time()}})
            with _sigterm_ends_wait():
                message = self._lines.read()
        except OSError as exc:
            log.warning("no next round from the launcher (%s)", exc)
            return None
        round_ = (message or {}).get("round")
        if not isinstance(round_, dict) or not isinstance(round_.get("env"), dict):
            log.warning("the launcher restarts this worker: %s", (message or {}).get("restart", "its socket closed"))
            return None
        return {str(k): str(v) for k, v in round_["env"].items()}

    def close(self) -> None:
        self.sock.close()


class _StopRequested(OSError):
    """SIGTERM came while the worker waited for a round."""


@contextlib.contextmanager
def _sigterm_ends_wait() -> Iterator[None]:
    """While a worker waits for the next round, SIGTERM ends the wait (and so the process) at once.

    Why: the trainer's SIGTERM handler asks for a drain at the next step boundary, and a waiting worker has no step:
    torchrun, stopping the node's workers after a sibling's reform exit, would wait 30 s and then SIGKILL it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Optional[FrameType]) -> None:
        raise _StopRequested("SIGTERM while waiting for the next round")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Worker:
    """What the broker knows of one connected worker process."""

    def __init__(self, sock: socket.socket, pid: int, local_rank: int) -> None:
        self.sock, self.pid, self.local_rank = sock, pid, local_rank
        self.waiting_since: Optional[float] = None
        self.step: Optional[int] = None


class Broker:
    """The launcher's end: accepts its workers, knows which wait for a round, hands rounds to them."""

    def __init__(self, name: str, server: socket.socket) -> None:
        self.name = name
        self._server = server
        self._lock = threading.Lock()
        self._workers: dict[int, _Worker] = {}  # by pid
        self._detached: dict[int, tuple[_Worker, subprocess.Popen[bytes]]] = {}  # by local rank
        self._accepting: Optional[threading.Thread] = None

    @classmethod
    def listen(cls) -> Optional[Broker]:
        """A broker on a fresh abstract socket, accepting workers; None where Unix sockets are unavailable (then no
        in-place reforms)."""
        broker = cls.bind()
        return broker.start() if broker is not None else None

    def start(self) -> Broker:
        """Accept workers (once; connections made before wait in the socket's backlog). Apart from :meth:`bind` so
        that the launcher can fork its warm interpreter in between, while it runs no thread."""
        if self._accepting is None:
            self._accepting = threading.Thread(target=self._accept, name="disttrain-handover", daemon=True)
            self._accepting.start()
        return self

    def forget_in_fork(self) -> None:
        """In a forked child: close this process's copy of the listening socket (the parent goes on serving it)."""
        self._server.close()

    @classmethod
    def bind(cls) -> Optional[Broker]:
        """A broker on a fresh abstract socket, not accepting yet (:meth:`start`); None where Unix sockets are
        unavailable."""
        name = f"{ABSTRACT_PREFIX}disttrain-handover-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(_socket_address(name))
            server.listen(64)
        except OSError as exc:
            server.close()
            log.info("no in-place reforms: cannot listen on a Unix socket (%s)", exc)
            return None
        return cls(name, server)

    # ---- the workers' side ----------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return  # closed
            if not _same_user(sock):
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock,), name="disttrain-handover-worker", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        lines = _Lines(sock)
        worker: Optional[_Worker] = None
        try:
            while True:
                message = lines.read()
                if message is None:
                    break
                if "hello" in message and worker is None:
                    hello = message["hello"]
                    worker = _Worker(sock, int(hello["pid"]), int(hello["local_rank"]))
                    with self._lock:
                        self._workers[worker.pid] = worker
                elif "reform" in message and worker is not None:
                    with self._lock:
                        worker.step = int(message["reform"].get("step", -1))
                        worker.waiting_since = time.time()
                    log.info("worker %d (local rank %d) waits for the next round", worker.pid, worker.local_rank)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.debug("handover connection ended: %s", exc)
        finally:
            with self._lock:
                if worker is not None and self._workers.get(worker.pid) is worker:
                    del self._workers[worker.pid]
            sock.close()

    # ---- the agent's side -----------------------------------------------------------------------------
    def is_waiting(self, pid: int) -> bool:
        """The worker process ``pid`` waits for the next round."""
        with self._lock:
            worker = self._workers.get(pid)
            return worker is not None and worker.waiting_since is not None

    def all_waiting(self, pids: Mapping[int, int]) -> bool:
        """Every worker of ``pids`` (local rank -> pid) waits for the next round."""
        return bool(pids) and all(self.is_waiting(pid) for pid in pids.values())

    def detach(self, local_rank: int, proc: subprocess.Popen[bytes]) -> None:
        """Keep the waiting worker ``proc`` for the round torchrun starts next (instead of stopping it)."""
        with self._lock:
            worker = self._workers.get(proc.pid)
            if worker is not None:
                self._detached[local_rank] = (worker, proc)

    def take(self, environ: Mapping[str, str]) -> Optional[subprocess.Popen[bytes]]:
        """The detached worker of ``environ``'s LOCAL_RANK, now given ``environ`` as its next round; None: start one."""
        try:
            local_rank = int(environ.get("LOCAL_RANK", "-1"))
        except ValueError:
            return None
        with self._lock:
            found = self._detached.pop(local_rank, None)
        if found is None:
            return None
        worker, proc = found
        if proc.poll() is not None:
            return None
        try:
            _send(worker.sock, {"round": {"env": dict(environ)}})
        except OSError as exc:
            log.info("worker %d cannot take the next round (%s); starting a new one", proc.pid, exc)
            _end(proc)
            return None
        with self._lock:
            worker.waiting_since = None
        log.info("worker %d (local rank %d) takes the next round in place", proc.pid, local_rank)
        return proc

    def release(self, reason: str) -> None:
        """Tell every detached worker that no round came for it (it exits), and make sure it is gone."""
        with self._lock:
            detached, self._detached = list(self._detached.values()), {}
        for worker, proc in detached:
            try:
                _send(worker.sock, {"restart": reason})
            except OSError:
                pass
            _end(proc)

    def close(self) -> None:
        self.release("the launcher ends")
        with self._lock:
            workers, self._workers = list(self._workers.values()), {}
        _shut(self._server)
        for worker in workers:
            _shut(worker.sock)


def _shut(sock: socket.socket) -> None:
    """Close ``sock`` so that the peer, and a thread of ours blocked reading it, see the end at once (a bare close
    from another thread leaves a blocked ``recv`` waiting and sends no FIN)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _end(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.wait(RELEASE_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(RELEASE_GRACE_S)


def _same_user(sock: socket.socket) -> bool:
    """The connecting process runs as this process's user (``SO_PEERCRED``)."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return False
    _pid, uid, _gid = struct.unpack("3i", creds)
    return bool(uid == os.getuid())
