"""Warm worker interpreters: the imports of a worker are paid before the rendezvous completes, not after.

Why: a reform restarts the worker processes, and a new Python process spends seconds importing torch, torch's
compiler stack (which ``AdamW`` pulls in lazily) and disttrain before it can build the model (``imports`` and
``modelBuild`` in ``status.lastReform.phases``). Meanwhile the node's torchrun agent sits in the rendezvous,
waiting for the other nodes. So the launcher starts the next workers' interpreters *before* each rendezvous
(:class:`WarmPool`, from :meth:`disttrain.trainer.launch.launcher.CountingAgent._initialize_workers`): each runs this
module, imports :data:`PRELOAD`, and waits on its stdin. When torchrun then starts a worker, the launcher hands
the worker's command line and environment to a warm interpreter instead of starting a cold one (:meth:`take`):
it sets ``os.environ``, ``sys.argv`` and ``sys.path[0]`` as ``python script.py`` would, and runs the script as
``__main__``. torchrun keeps the same ``Popen`` handle it would have had (pid, new session, exit code, signals).

Nothing about training changes: the same script runs in the same interpreter with the same environment. The
hand-over only happens when that is certain (:func:`warm_command`, :func:`env_is_compatible`): the command is
this interpreter with at most ``-u`` and a script or ``-m module``, output is not redirected to files, and the
environment differs only in what torchrun sets per worker (ranks, sizes, master address, ``TORCHELASTIC_*``),
none of which is read at import time. Anything else starts cold, as before. A pool costs one idle interpreter per
local worker while training runs (torch imported, no CUDA context). ``DISTTRAIN_WARM_WORKERS=0`` turns it off.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import runpy
import select
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Optional

from disttrain.api import env as env_names
from disttrain.trainer.launch import ncclenv

log = logging.getLogger("disttrain.launch")

PRELOAD = ("torch", "torch._dynamo", "torch.distributed.checkpoint", "disttrain.trainer.loop")
"""What a warm interpreter imports while it waits: torch, what ``torch.optim`` imports lazily on the first
optimizer (``torch._dynamo``, about a second), and the trainer library."""
HANDOVER_ENV = "DISTTRAIN_WARM_HANDOVER_TIME"
"""Set in a warm worker's environment: the Unix time it became the worker (its process started long before)."""
PER_WORKER_ENV = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    }
)
"""Variables torchrun sets per worker and that nothing reads at import time; ``TORCHELASTIC_*`` too."""
ALLOWED_FLAGS = frozenset({"-u"})
READY_FD_ENV = "DISTTRAIN_WARM_READY_FD"
"""The pipe a warm interpreter writes one byte to once its imports are done (an unready one is never taken)."""
IDLE_ARG = "--idle"
"""Import at ``SCHED_IDLE`` (a refill while training runs must not slow the training down)."""


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(env_names.WARM_WORKERS, "1") != "0"


def is_this_python(program: str, environ: Mapping[str, str] = os.environ) -> bool:
    """``program`` starts this interpreter with this environment's packages: this file, or the same binary reached
    from the same directory (``python`` / ``python3`` of one venv; a base interpreter reached through another
    directory has other packages). A bare name is looked up on ``environ``'s PATH, as starting the worker would
    (``subprocess`` searches the child's PATH): on Kubernetes the container's command is plain ``python``."""
    if os.path.isabs(program):
        path: Optional[str] = program
    elif os.sep in program:
        return False  # relative to a working directory that may differ
    else:
        path = shutil.which(program, path=os.pathsep.join(os.get_exec_path(dict(environ))))
    if path is None:
        return False
    if path == sys.executable:
        return True
    same_binary = os.path.realpath(path) == os.path.realpath(sys.executable)
    return same_binary and os.path.dirname(os.path.abspath(path)) == os.path.dirname(os.path.abspath(sys.executable))


def warm_command(args: Sequence[str], environ: Mapping[str, str] = os.environ) -> Optional[tuple[list[str], list[str]]]:
    """``(interpreter flags, script argv)`` when ``args`` (torchrun's worker command, started with ``environ``) can
    run in a warm interpreter: this Python, at most ``-u``, then a script or ``-m module``; None otherwise."""
    if not args or not is_this_python(args[0], environ):
        return None
    rest = list(args[1:])
    flags: list[str] = []
    while rest and rest[0] in ALLOWED_FLAGS:
        flags.append(rest.pop(0))
    if not rest:
        return None
    if rest[0] == "-m":
        return (flags, rest) if len(rest) >= 2 else None
    if rest[0].startswith("-"):
        return None
    return flags, rest


def env_is_compatible(warm: Mapping[str, str], worker: Mapping[str, str]) -> bool:
    """Whether a worker environment differs from the one the warm interpreter started with only per worker."""
    for key in set(warm) | set(worker):
        if (
            warm.get(key) != worker.get(key)
            and key not in PER_WORKER_ENV | ncclenv.NAMES
            and not key.startswith("TORCHELASTIC_")
        ):
            log.info("worker starts cold: %s differs from the warm interpreter's environment", key)
            return False
    return True


def workers_environment(nproc_per_node: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment torchrun will give its workers, known before torchrun has parsed its arguments: the
    launcher's, plus ``OMP_NUM_THREADS=1`` when more than one worker runs per node and it is unset (torchrun's own
    default, ``torch/distributed/run.py``). torch reads it at import, so an interpreter prestarted without it could
    never be taken (:func:`env_is_compatible`): every worker of a multi-GPU node would start cold."""
    workers = dict(environ)
    if nproc_per_node > 1 and "OMP_NUM_THREADS" not in workers:
        workers["OMP_NUM_THREADS"] = "1"
    return workers


class _Warm:
    """One warm interpreter: its flags, the environment it started with, its process and readiness pipe."""

    def __init__(self, flags: tuple[str, ...], environ: dict[str, str], idle: bool) -> None:
        self.flags, self.environ, self.idle = flags, environ, idle
        self.ready = False
        self._ready_r, ready_w = os.pipe()
        command = [sys.executable, *flags, "-m", __name__, *([IDLE_ARG] if idle else [])]
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            env={**environ, READY_FD_ENV: str(ready_w)},
            pass_fds=(ready_w,),
            start_new_session=True,  # as torchrun starts its workers
        )
        os.close(ready_w)
        if idle:  # from its first instruction (its own module imports pydantic): later threads inherit it
            try:
                os.sched_setscheduler(self.proc.pid, os.SCHED_IDLE, os.sched_param(0))
            except OSError as exc:
                log.info("warm interpreter %d keeps normal priority: %s", self.proc.pid, exc)

    def is_ready(self) -> bool:
        """Its imports are done (checked without waiting)."""
        if not self.ready and self._ready_r >= 0 and select.select([self._ready_r], [], [], 0)[0]:
            self.ready = os.read(self._ready_r, 1) == b"1"
            os.close(self._ready_r)
            self._ready_r = -1
        return self.ready

    def release(self) -> None:
        """Close this side of the readiness pipe (taken, or ending)."""
        if self._ready_r >= 0:
            os.close(self._ready_r)
            self._ready_r = -1

    def end(self) -> None:
        self.release()
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.kill()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass


class WarmPool:
    """Warm interpreters of one agent, by interpreter flags. Thread-safe: the pod's readiness
    (:mod:`disttrain.trainer.launch.readiness`) asks :meth:`is_warm` from a thread of its own."""

    def __init__(self) -> None:
        self._ready: list[_Warm] = []
        self._lock = threading.RLock()

    def __len__(self) -> int:
        """Interpreters waiting to become workers (warm or still importing)."""
        with self._lock:
            return len(self._ready)

    def is_warm(self) -> bool:
        """Every interpreter warming at normal priority has finished its imports: the workers this node starts
        next start without import delay (also true when the pool is empty: the workers took them, or none fit)."""
        with self._lock:
            return all(warm.is_ready() for warm in self._ready if not warm.idle and warm.proc.poll() is None)

    def prestart(self, launcher_argv: Sequence[str]) -> None:
        """Start the first workers' interpreters from the launcher's own command line, before the launcher imports
        torch itself: on a node's first start the two imports then overlap instead of following each other. Only
        the operator's form is read (``--nproc-per-node=N ... --no-python <command>``); anything else waits for
        :meth:`fill` from the agent, as before."""
        argv = list(launcher_argv)
        counts = [a.split("=", 1)[1] for a in argv if a.startswith(("--nproc-per-node=", "--nproc_per_node="))]
        if "--no-python" not in argv or len(counts) != 1 or not counts[0].isdigit():
            return
        nproc = int(counts[0])
        self.fill(nproc, argv[argv.index("--no-python") + 1 :], environ=workers_environment(nproc))

    def fill(
        self, count: int, args: Sequence[str], *, idle: bool = False, environ: Optional[Mapping[str, str]] = None
    ) -> None:
        """Have ``count`` interpreters warming for workers started with ``args`` and ``environ`` (default: this
        process's; no-op when those cannot be warm); ``idle``: they import only on otherwise idle CPU."""
        with self._lock:
            self._fill(count, args, idle, dict(os.environ if environ is None else environ))

    def _fill(self, count: int, args: Sequence[str], idle: bool, environ: dict[str, str]) -> None:
        command = warm_command(args, environ)
        if command is None or not enabled(environ):
            return
        flags = tuple(command[0])
        for dead in [w for w in self._ready if w.proc.poll() is not None]:
            dead.end()
            self._ready.remove(dead)
        while sum(1 for w in self._ready if w.flags == flags) < count:
            self._ready.append(_Warm(flags, dict(environ), idle))

    def take(self, args: Sequence[str], environ: Mapping[str, str]) -> Optional[subprocess.Popen[bytes]]:
        """A warm interpreter now running the worker ``args`` with ``environ``; None: start it cold. One still
        importing at normal priority is taken too (it is ahead of a cold start), one importing on idle CPU not."""
        with self._lock:
            return self._take(args, environ)

    def _take(self, args: Sequence[str], environ: Mapping[str, str]) -> Optional[subprocess.Popen[bytes]]:
        command = warm_command(args, environ)
        if command is None:
            return None
        flags, argv = tuple(command[0]), command[1]
        for warm in list(self._ready):
            proc = warm.proc
            if warm.flags != flags or proc.poll() is not None or proc.stdin is None:
                continue
            if warm.idle and not warm.is_ready():  # still importing on idle CPU: a cold start is sooner
                continue
            if not env_is_compatible(warm.environ, environ):
                return None
            self._ready.remove(warm)
            warm.release()
            message = {"argv": argv, "env": dict(environ), "cwd": os.getcwd()}
            try:
                proc.stdin.write(json.dumps(message).encode() + b"\n")
                proc.stdin.close()
            except OSError as exc:  # it died between poll() and now
                log.info("warm interpreter %d unusable (%s); starting the worker cold", proc.pid, exc)
                continue
            return proc
        return None

    def close(self) -> None:
        """End the interpreters nobody took (closing stdin ends them; the kill is for one still importing)."""
        with self._lock:
            for warm in self._ready:
                warm.end()
            self._ready = []


def _run(argv: list[str]) -> None:
    """Run ``argv`` (``script args`` or ``-m module args``) as ``python`` would run it as ``__main__``."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")


def _set_idle(idle: bool) -> None:
    """Every thread of this process to ``SCHED_IDLE`` or back to ``SCHED_OTHER`` (allowed unprivileged since
    Linux 2.6.39); best effort."""
    policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    if not idle and os.sched_getscheduler(0) != os.SCHED_IDLE:
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))
        except OSError as exc:
            print(f"disttrain warm interpreter: cannot set scheduling policy {policy}: {exc}", file=sys.stderr)


def main() -> None:
    """A warm interpreter: import, say it is ready, wait for the worker's command, become the worker."""
    idle = IDLE_ARG in sys.argv[1:]  # the pool set SCHED_IDLE as it started this process
    for name in PRELOAD:
        importlib.import_module(name)
    ready_fd = int(os.environ.pop(READY_FD_ENV, "-1"))
    if ready_fd >= 0:
        try:
            os.write(ready_fd, b"1")
        except BrokenPipeError:
            pass  # already taken: nobody asks any more
        os.close(ready_fd)
    line = sys.stdin.buffer.readline()
    if not line:
        os._exit(0)  # the agent went away or closed the pool
    message = json.loads(line)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.chdir(message["cwd"])
    os.environ.clear()
    os.environ.update(message["env"])
    os.environ[HANDOVER_ENV] = repr(time.time())
    if idle:
        _set_idle(False)
    _run(message["argv"])


if __name__ == "__main__":
    main()
