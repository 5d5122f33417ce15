"""A ``Popen`` for a process that was forked rather than spawned by ``subprocess``: the warm interpreter's workers
(:mod:`disttrain.trainer.launch.warmstart`) and local mode's forked pods (:mod:`disttrain.operator.local.forkserver`).
Both kinds are reaped by another process that reports their exit code (:class:`ForkAnswers`); the subclass says
where to read it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional, Protocol


class ForkedPopen(subprocess.Popen):  # type: ignore[type-arg]
    """The calls torchrun and the local runtime make on a child (``pid``, ``poll``, ``wait``, signals), with the exit
    code from :meth:`_exit_code`. ``Popen.__init__`` is not called: nothing is spawned here."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.args = list(args)
        self.pid = pid
        self.returncode: Optional[int] = None
        self.stdin = self.stdout = self.stderr = None

    def _exit_code(self, timeout: Optional[float]) -> Optional[int]:
        """The exit code (negative: the signal), waiting up to ``timeout`` (None: as long as it runs); None while it
        runs. Each subclass reads it where its reaper reports it."""
        raise NotImplementedError

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._exit_code(0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self.returncode = self._exit_code(timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        pass  # Popen's would reap through state Popen.__init__ sets up

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: pid={self.pid} returncode={self.returncode}>"


class Fork(NamedTuple):
    """One process a :class:`ForkAnswers` process forked: its pid, and which of its forks it is. Once a fork was
    reaped its pid may name a later one, so exits are kept per fork, not per pid."""

    pid: int
    serial: int


class ExitReporter(Protocol):
    """The parent of forked processes, which reaps them: a fork server, a warm interpreter."""

    def exit_code(self, fork: Fork, timeout: Optional[float]) -> Optional[int]: ...


class ForkedChild(ForkedPopen):
    """A process forked on request by another, its parent, which reaps it and reports its exit code."""

    def __init__(self, fork: Fork, args: Sequence[str], parent: ExitReporter) -> None:
        super().__init__(fork.pid, args)
        self._fork = fork
        self._parent = parent

    def _exit_code(self, timeout: Optional[float]) -> Optional[int]:
        return self._parent.exit_code(self._fork, timeout)


class ForkAnswers:
    """What a process that forks on request answers, as JSON lines on a pipe, read by a thread of its own: its ready
    line (and why it refuses to fork, if it does), the pids it forked, their exits (it is their parent and reaps
    them). Local mode's fork server and the launcher's warm interpreters both speak this way.

    An exit belongs to the fork that holds its pid when the exit is read: the forking process answers a fork before
    it reaps it, and reaps it before the pid can name another process. An exit of a pid no fork holds (a child the
    process started for itself) is ignored."""

    def __init__(self, fd: int, thread_name: str) -> None:
        self.ready = False
        self.refused: Optional[str] = None
        """Why it does not fork (known once ready); None: it does."""
        self.gone = False
        """The pipe closed: the process is gone, and the ones it forked with it (``PR_SET_PDEATHSIG``)."""
        self._exits: dict[int, int] = {}
        """Exit codes by :attr:`Fork.serial`."""
        self._running: dict[int, int] = {}
        """The serial of the fork that holds each pid, from its answer until its exit."""
        self._serials = 0
        self._pending: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(fd,), name=thread_name, daemon=True)
        self._reader.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as answers:
            for line in answers:
                try:
                    answer = json.loads(line)
                except ValueError:
                    continue
                if isinstance(answer, dict):
                    with self._changed:
                        self._take(answer)
                        self._changed.notify_all()
        with self._changed:  # no kill here: the pids of its forks may already name other processes
            self.gone = True
            for serial in self._running.values():
                self._exits[serial] = -signal.SIGKILL
            self._running.clear()
            self._changed.notify_all()

    def _take(self, answer: dict[str, Any]) -> None:
        if "ready" in answer:
            self.ready = True
            self.refused = str(answer["refused"]) if answer.get("refused") else None
        elif "exit" in answer:
            pid, status = answer["exit"], answer.get("status")
            if isinstance(pid, int) and isinstance(status, int) and pid in self._running:
                self._exits[self._running.pop(pid)] = os.waitstatus_to_exitcode(status)
        else:
            if isinstance(answer.get("spawned"), int):
                self._serials += 1
                self._running[answer["spawned"]] = self._serials
                answer = {**answer, "serial": self._serials}
            self._pending.append(answer)

    def is_busy(self) -> bool:
        """A process it forked still runs (it would die with it)."""
        with self._changed:
            return not self.gone and bool(self._running)

    def exit_code(self, fork: Fork, timeout: Optional[float]) -> Optional[int]:
        """The exit code of ``fork`` (negative: the signal), waiting up to ``timeout`` (None: as long as it runs);
        None while it runs."""
        with self._changed:
            self._changed.wait_for(lambda: fork.serial in self._exits, timeout)
            return self._exits.get(fork.serial)

    def request_fork(self, send: Callable[[], bool], timeout: float) -> tuple[Optional[Fork], Optional[dict[str, Any]]]:
        """Ask for a fork (``send`` writes the request; False: it could not) and wait up to ``timeout`` for the
        answer. ``(fork, None)``: forked; ``(None, answer)``: refused (``answer["refused"]`` says why) or gone
        (``{}``); ``(None, None)``: no answer in time (the caller ends the process)."""
        with self._changed:
            self._pending.clear()
            if self.gone:
                return None, {}
        if not send():
            return None, {}
        with self._changed:
            answered = self._changed.wait_for(lambda: bool(self._pending) or self.gone, timeout)
            answer = self._pending.pop(0) if self._pending else {}
            if "serial" in answer:
                return Fork(answer["spawned"], answer["serial"]), None
        return None, answer if answered else None

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the reader to see the end of the pipe."""
        self._reader.join(timeout)
