"""A ``Popen`` for a process that was forked rather than spawned by ``subprocess``: the warm interpreter's workers
(:mod:`disttrain.trainer.launch.warmstart`) and local mode's forked pods (:mod:`disttrain.operator.local.forkserver`).
Both kinds are reaped by another process that reports their exit code; the subclass says where to read it."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from typing import Optional


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
