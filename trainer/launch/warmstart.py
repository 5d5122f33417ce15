"""Warm worker interpreters: the imports of a worker are paid before the rendezvous completes, and once per node.

Why: a reform restarts the worker processes, and a new Python process spends seconds importing torch, torch's
compiler stack (which ``AdamW`` pulls in lazily) and disttrain before it can build the model (``imports`` and
``modelBuild`` in ``status.lastReform.phases``). Meanwhile the node's torchrun agent sits in the rendezvous,
waiting for the other nodes. So the launcher starts a warm interpreter *before* each rendezvous (:class:`WarmPool`,
from :meth:`disttrain.trainer.launch.launcher.CountingAgent._initialize_workers`): it runs
:mod:`disttrain.trainer.launch.warmproc`, imports torch and the trainer, and waits for requests. When torchrun then
starts a worker, the launcher asks the warm interpreter to fork it instead of starting a cold Python
(:meth:`WarmPool.take`): the child sets ``os.environ``, ``sys.argv`` and ``sys.path[0]`` as ``python script.py``
would, and runs the script as ``__main__``. torchrun gets a :class:`ForkedWorker`, a ``Popen`` whose exit code the
warm interpreter (its parent) reports: pid, new session, exit code and signals as for a cold start. The interpreter
stays for the next workers, so a node with N local workers imports torch once instead of N times, and a reform's
new workers start without any import. Where forking is refused (the CUDA driver got loaded into the interpreter),
the pool keeps one interpreter per local worker, each of which becomes a worker itself.

Nothing about training changes: the same script runs with the same imports and the same environment. The
hand-over only happens when that is certain (:func:`warm_command`, :func:`env_is_compatible`): the command is
this interpreter with at most ``-u`` and a script or ``-m module``, output is not redirected to files, and the
environment differs only in what torchrun sets per worker (ranks, sizes, master address, ``TORCHELASTIC_*``),
none of which is read at import time. Anything else starts cold. A pool costs one idle interpreter per node while
training runs (torch imported, no CUDA context). ``DISTTRAIN_WARM_WORKERS=0`` turns it off; ``=spawn`` keeps one
interpreter per local worker that becomes the worker, never forking (for a torch plug-in that starts threads at
import, which a fork would not carry over).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Optional

from disttrain.api import env as env_names
from disttrain.trainer.launch import ncclenv, warmproc
from disttrain.trainer.launch.warmproc import HANDOVER_ENV, PRELOAD, READY_FD_ENV

__all__ = ["HANDOVER_ENV", "PRELOAD", "ForkedWorker", "WarmPool", "env_is_compatible", "warm_command"]

log = logging.getLogger("disttrain.launch")

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
FORK_ANSWER_TIMEOUT_S = 300.0
"""Longest a worker start waits for the warm interpreter's fork (it may still be importing, on a loaded node);
past it the interpreter is ended and the worker starts cold."""


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(env_names.WARM_WORKERS, "1") != "0"


def forking(environ: Mapping[str, str] = os.environ) -> bool:
    """Workers are forked from one warm interpreter (``DISTTRAIN_WARM_WORKERS=spawn``: one per worker instead)."""
    return environ.get(env_names.WARM_WORKERS) != env_names.WARM_SPAWN


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


class ForkedWorker(subprocess.Popen):
    """torchrun's handle on a worker forked by a warm interpreter: the ``Popen`` calls torchrun and the launcher
    make (``pid``, ``poll``, ``wait``, signals; torchrun signals the worker's session with ``killpg``), with the exit
    code the interpreter, the worker's parent, reports. ``Popen.__init__`` is not called: nothing is spawned here."""

    def __init__(self, pid: int, args: Sequence[str], warm: _Warm) -> None:
        self.args = list(args)
        self.pid = pid
        self.returncode: Optional[int] = None
        self.stdin = self.stdout = self.stderr = None
        self._warm = warm

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._warm.exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self.returncode = self._warm.exit_code(self.pid, timeout)
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
        pass  # Popen's would look for a child of this process to reap: the warm interpreter reaps this one

    def __repr__(self) -> str:
        return f"<ForkedWorker: pid={self.pid} returncode={self.returncode}>"


class _Warm:
    """One warm interpreter: its flags, the environment it started with, its process, and what it answered
    (readiness, whether it forks, its forked workers' exits), read by a thread of its own."""

    def __init__(self, flags: tuple[str, ...], environ: dict[str, str], idle: bool) -> None:
        self.flags, self.environ, self.idle = flags, environ, idle
        self.ready = False
        self.refused: Optional[str] = None
        """Why it does not fork (known once ready); None: it does."""
        self._exits: dict[int, int] = {}
        self._forked: set[int] = set()
        self._answers: list[dict[str, object]] = []
        self._gone = False
        self._changed = threading.Condition()
        self._ask = threading.Lock()
        answers_r, answers_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, *flags, "-m", warmproc.__name__],
            stdin=subprocess.PIPE,
            env={**environ, READY_FD_ENV: str(answers_w)},
            pass_fds=(answers_w,),
            start_new_session=True,  # as torchrun starts its workers
        )
        os.close(answers_w)
        if idle:  # from its first instruction (its own module imports pydantic): later threads inherit it
            try:
                os.sched_setscheduler(self.proc.pid, os.SCHED_IDLE, os.sched_param(0))
            except OSError as exc:
                log.info("warm interpreter %d keeps normal priority: %s", self.proc.pid, exc)
        self._reader = threading.Thread(target=self._read, args=(answers_r,), name=f"warm-{self.proc.pid}", daemon=True)
        self._reader.start()

    def is_alive(self) -> bool:
        return not self._gone and self.proc.poll() is None

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as answers:
            for line in answers:
                try:
                    answer = json.loads(line)
                except ValueError:
                    continue
                with self._changed:
                    self._take_answer(answer)
                    self._changed.notify_all()
        with self._changed:  # the interpreter is gone: its forked workers died with it (PR_SET_PDEATHSIG; no kill
            self._gone = True  # here: their pids may already name other processes)
            for pid in self._forked - set(self._exits):
                self._exits[pid] = -signal.SIGKILL
            self._changed.notify_all()

    def _take_answer(self, answer: dict[str, object]) -> None:
        if "ready" in answer:
            self.ready = True
            self.refused = str(answer["refused"]) if answer.get("refused") else None
        elif "exit" in answer:
            status = answer.get("status")
            if isinstance(answer["exit"], int) and isinstance(status, int):
                self._exits[answer["exit"]] = os.waitstatus_to_exitcode(status)
        else:
            self._answers.append(answer)

    def is_ready(self) -> bool:
        """Its imports are done (checked without waiting)."""
        return self.ready

    def exit_code(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        """The exit code of forked worker ``pid`` (negative: the signal), waiting up to ``timeout`` (None: as long
        as it runs); None while it runs."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits, timeout)
            return self._exits.get(pid)

    def _request(self, request: dict[str, object]) -> bool:
        stdin = self.proc.stdin
        if stdin is None or not self.is_alive():
            return False
        try:
            stdin.write(json.dumps(request).encode() + b"\n")
            stdin.flush()
        except OSError:  # it died between the check and now
            return False
        return True

    def fork(self, argv: Sequence[str], request: dict[str, object]) -> Optional[ForkedWorker]:
        """A worker forked from this interpreter (waiting for its imports if they run); None: refused or gone."""
        with self._ask:
            with self._changed:
                self._answers.clear()
            if not self._request({"op": "fork", **request}):
                return None
            with self._changed:
                answered = self._changed.wait_for(lambda: bool(self._answers) or self._gone, FORK_ANSWER_TIMEOUT_S)
                answer = self._answers.pop(0) if self._answers else {}
                spawned = answer.get("spawned")
                if isinstance(spawned, int):
                    self._forked.add(spawned)
                    return ForkedWorker(spawned, argv, self)
            if not answered:
                waited = FORK_ANSWER_TIMEOUT_S
                log.warning("warm interpreter %d did not fork in %.0f s; ending it", self.proc.pid, waited)
                self.end()
            elif "refused" in answer:
                log.info("warm interpreter %d does not fork: %s", self.proc.pid, answer["refused"])
            return None

    def become(self, request: dict[str, object]) -> Optional[subprocess.Popen[bytes]]:
        """This interpreter's own process, now running the worker; None: it died meanwhile."""
        if not self._request({"op": "become", **request}):
            return None
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        return self.proc

    def end(self) -> None:
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
        self._forking = True
        """False once an interpreter refused to fork: from then on, one interpreter per local worker."""

    def __len__(self) -> int:
        """Interpreters waiting to start workers (warm or still importing)."""
        with self._lock:
            return len(self._ready)

    def is_warm(self) -> bool:
        """Every interpreter warming at normal priority has finished its imports: the workers this node starts
        next start without import delay (also true when the pool is empty: the workers took them, or none fit)."""
        with self._lock:
            return all(warm.is_ready() for warm in self._ready if not warm.idle and warm.is_alive())

    def prestart(self, launcher_argv: Sequence[str]) -> None:
        """Start the first workers' interpreter from the launcher's own command line, before the launcher imports
        torch itself: on a node's first start the two imports then overlap instead of following each other. Only
        the operator's form is read (``--nproc-per-node=N ... --no-python <command>``); anything else waits for
        :meth:`fill` from the agent."""
        argv = list(launcher_argv)
        counts = [a.split("=", 1)[1] for a in argv if a.startswith(("--nproc-per-node=", "--nproc_per_node="))]
        if "--no-python" not in argv or len(counts) != 1 or not counts[0].isdigit():
            return
        nproc = int(counts[0])
        self.fill(nproc, argv[argv.index("--no-python") + 1 :], environ=workers_environment(nproc))

    def fill(
        self, count: int, args: Sequence[str], *, idle: bool = False, environ: Optional[Mapping[str, str]] = None
    ) -> None:
        """Have interpreters warming for ``count`` workers started with ``args`` and ``environ`` (default: this
        process's; no-op when those cannot be warm): one that forks them all, or ``count`` where forking is
        refused; ``idle``: new ones import only on otherwise idle CPU."""
        with self._lock:
            self._fill(count, args, idle, dict(os.environ if environ is None else environ))

    def _fill(self, count: int, args: Sequence[str], idle: bool, environ: dict[str, str]) -> None:
        command = warm_command(args, environ)
        if command is None or not enabled(environ):
            return
        flags = tuple(command[0])
        for dead in [w for w in self._ready if not w.is_alive()]:
            dead.end()
            self._ready.remove(dead)
        for warm in self._ready:
            if warm.ready and warm.refused is not None:
                self._forking = False
        wanted = 1 if self._forking and forking(environ) else count
        while sum(1 for w in self._ready if w.flags == flags) < wanted:
            self._ready.append(_Warm(flags, dict(environ), idle))

    def take(self, args: Sequence[str], environ: Mapping[str, str]) -> Optional[subprocess.Popen[bytes]]:
        """A process now running the worker ``args`` with ``environ``, forked from a warm interpreter or a warm
        interpreter itself; None: start it cold. One still importing at normal priority is used too (it is ahead
        of a cold start), one importing on idle CPU not. The pool's lock is not held while a fork is awaited: the
        pod's readiness asks :meth:`is_warm` meanwhile."""
        command = warm_command(args, environ)
        if command is None:
            return None
        flags, argv = tuple(command[0]), command[1]
        request: dict[str, object] = {"argv": argv, "env": dict(environ), "cwd": os.getcwd()}
        while True:
            with self._lock:
                warm = self._choose(flags, environ)
                if warm is None:
                    return None
                if warm.refused is not None or not forking(warm.environ):  # it never forked: it may become one
                    self._ready.remove(warm)
                    proc = warm.become(request)
                    if proc is not None:
                        return proc
                    continue
            forked = warm.fork(argv, request)
            if forked is not None:
                return forked
            with self._lock:  # refused (it becomes this worker on the next pass) or gone (the next one is tried)
                if warm.is_alive() and warm.refused is not None:
                    self._forking = False
                elif warm in self._ready:
                    self._ready.remove(warm)
                    warm.end()

    def _choose(self, flags: tuple[str, ...], environ: Mapping[str, str]) -> Optional[_Warm]:
        for warm in self._ready:
            if warm.flags != flags or not warm.is_alive():
                continue
            if warm.idle and not warm.is_ready():  # still importing on idle CPU: a cold start is sooner
                continue
            return warm if env_is_compatible(warm.environ, environ) else None
        return None

    def close(self) -> None:
        """End the interpreters (closing stdin ends them, and the workers they forked; the kill is for one still
        importing)."""
        with self._lock:
            for warm in self._ready:
                warm.end()
            self._ready = []
