"""Warm worker interpreters: the imports of a worker are paid before the rendezvous completes, and once per node.

Why: a reform restarts the worker processes, and a new Python process spends seconds importing torch, torch's
compiler stack (which ``AdamW`` pulls in lazily) and disttrain before it can build the model (``imports`` and
``modelBuild`` in ``status.lastReform.phases``). Meanwhile the node's torchrun agent sits in the rendezvous,
waiting for the other nodes. So the launcher has a warm interpreter *before* each rendezvous (:class:`WarmPool`,
from :meth:`disttrain.trainer.launch.launcher.CountingAgent._initialize_workers`): it runs
:mod:`disttrain.trainer.launch.warmproc`, imports torch and the trainer, and waits for requests. The first one is a
fork of the launcher made once the launcher imported torch (:meth:`WarmPool.prestart_here`), so the node does not
import torch twice; later ones are fresh interpreters. When torchrun then
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

import contextlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Optional

from disttrain.api import env as env_names
from disttrain.common.forkedpopen import Fork, ForkAnswers, ForkedChild, ForkedPopen
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
PER_ROUND_ENV = frozenset({env_names.RENDEZVOUS_ROUND})
"""Variables the rendezvous handler sets in the launcher's environment once a round completes, after the warm
interpreters started; the trainer reads them when it joins the group, never at import time."""
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
            and key not in PER_WORKER_ENV | PER_ROUND_ENV | ncclenv.NAMES
            and not key.startswith("TORCHELASTIC_")
        ):
            log.info("worker starts cold: %s differs from the warm interpreter's environment", key)
            return False
    return True


def operator_form(launcher_argv: Sequence[str]) -> Optional[tuple[int, list[str]]]:
    """``(nproc per node, worker command)`` from a launcher command line of the operator's form
    (``--nproc-per-node=N ... --no-python <command>``); None for any other form (torchrun parses those later)."""
    argv = list(launcher_argv)
    counts = [a.split("=", 1)[1] for a in argv if a.startswith(("--nproc-per-node=", "--nproc_per_node="))]
    if "--no-python" not in argv or len(counts) != 1 or not counts[0].isdigit():
        return None
    return int(counts[0]), argv[argv.index("--no-python") + 1 :]


def launch_form(launcher_argv: Sequence[str]) -> Optional[tuple[int, list[str]]]:
    """:func:`operator_form`, or else torchrun's own reading of the command line (once torch is imported): the
    worker command torchrun will build (``python -u [-m] script args`` unless ``--no-python``); None where the
    local world size is not a number or the arguments are wrong (the launcher reports those)."""
    form = operator_form(launcher_argv)
    if form is not None or "torch" not in sys.modules:
        return form
    from torch.distributed import run as torchrun

    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            args = torchrun.parse_args(list(launcher_argv))  # type: ignore[no-untyped-call]
    except SystemExit:
        return None
    if not str(args.nproc_per_node).isdigit() or args.run_path:
        return None
    script = [args.training_script, *args.training_script_args]
    if args.no_python:
        return int(args.nproc_per_node), script
    python = [os.environ.get("PYTHON_EXEC", sys.executable), "-u", *(["-m"] if args.module else [])]
    return int(args.nproc_per_node), [*python, *script]


def worker_env_defaults(launcher_argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What torchrun will add to the launcher's environment ``environ`` for its workers (:func:`workers_environment`),
    known from the launcher's command line before torch is imported (``--nproc-per-node``); empty when it is not a
    number."""
    argv = list(launcher_argv)
    counts = [a.split("=", 1)[1] for a in argv if a.startswith(("--nproc-per-node=", "--nproc_per_node="))]
    counts += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--nproc-per-node", "--nproc_per_node")]
    if len(counts) != 1 or not counts[0].isdigit():
        return {}
    return {k: v for k, v in workers_environment(int(counts[0]), environ).items() if environ.get(k) != v}


def interpreter_options(orig_argv: Sequence[str]) -> list[str]:
    """The options ``orig_argv`` (``sys.orig_argv``) gave the interpreter itself, before ``-m``, ``-c`` or a script."""
    options: list[str] = []
    for arg in orig_argv[1:]:
        if arg in ("-m", "-c") or not arg.startswith("-"):
            break
        options.append(arg)
    return options


def fork_here_refusal(flags: tuple[str, ...], environ: Mapping[str, str]) -> Optional[str]:
    """Why a fork of this process would not be the interpreter ``python [flags] -m warmproc`` with ``environ``
    would be, or None. Threads would not survive the fork; the environment counts at torch's import; the
    interpreter's options are this process's (only ``-u`` can be added, by the child)."""
    if not hasattr(os, "fork"):
        return "this platform has no fork"
    torch = sys.modules.get("torch")
    if torch is None:
        return "this process has not imported torch"
    if threading.active_count() > 1:
        return "this process runs threads"
    if torch.cuda.is_initialized():
        return "CUDA is initialised in this process"
    if dict(os.environ) != dict(environ):
        return "the workers' environment is not this process's"
    options = interpreter_options(sys.orig_argv)
    if not set(options) <= ALLOWED_FLAGS:
        return f"this process runs with interpreter options {options}"
    if "-u" in options and "-u" not in flags:
        return "this process's output is unbuffered (-u), the workers' is not"
    return None


def _unbuffer_stdio() -> None:
    """``sys.stdout`` and ``sys.stderr`` as ``python -u`` makes them: unbuffered binary layer, write-through text."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(getattr(stream, "buffer", None), io.FileIO):
            continue
        stream.flush()
        raw = io.FileIO(stream.fileno(), "w", closefd=False)
        unbuffered = io.TextIOWrapper(raw, encoding=stream.encoding, errors=stream.errors, write_through=True)
        _REPLACED_STREAMS.append(stream)
        setattr(sys, name, unbuffered)
        setattr(sys, f"__{name}__", unbuffered)


_REPLACED_STREAMS: list[object] = []
"""The standard streams :func:`_unbuffer_stdio` replaced, kept: nothing is closed or collected mid-run."""


def _enter_forked_interpreter(requests: int, answer_fd: int, unbuffered: bool) -> None:
    """Make this fork child what :meth:`_Warm.spawn` starts: own session, requests on stdin, the answer pipe named
    in the environment, ``-u``'s streams if asked."""
    os.setsid()
    os.dup2(requests, 0)
    os.close(requests)
    os.environ[READY_FD_ENV] = str(answer_fd)
    if unbuffered:
        _unbuffer_stdio()


def workers_environment(nproc_per_node: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment torchrun will give its workers, known before torchrun has parsed its arguments: the
    launcher's, plus ``OMP_NUM_THREADS=1`` when more than one worker runs per node and it is unset (torchrun's own
    default, ``torch/distributed/run.py``). torch reads it at import, so an interpreter prestarted without it could
    never be taken (:func:`env_is_compatible`): every worker of a multi-GPU node would start cold."""
    workers = dict(environ)
    if nproc_per_node > 1 and "OMP_NUM_THREADS" not in workers:
        workers["OMP_NUM_THREADS"] = "1"
    return workers


class ForkedWorker(ForkedChild):
    """torchrun's handle on a worker forked by a warm interpreter, which is its parent, reaps it and reports its
    exit code (torchrun signals a worker's session with ``killpg``, which needs only its ``pid``)."""


class _ForkedInterpreter(ForkedPopen):
    """A warm interpreter this process forked from itself (:meth:`WarmPool.prestart_here`): its child, reaped here,
    by polling (another thread may wait for it too: a blocking ``waitpid`` of one would leave the other none)."""

    POLL_S = 0.05

    def __init__(self, pid: int, args: Sequence[str], requests: int) -> None:
        super().__init__(pid, args)
        self.stdin = os.fdopen(requests, "wb")
        self._reaping = threading.Lock()

    def _exit_code(self, timeout: Optional[float]) -> Optional[int]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._reaping:
                if self.returncode is not None:
                    return self.returncode
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped by someone else: its status is lost
                    return -signal.SIGKILL
                if pid:
                    return os.waitstatus_to_exitcode(status)
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(self.POLL_S if deadline is None else max(0.0, min(self.POLL_S, deadline - time.monotonic())))


class InWarmInterpreter(BaseException):
    """Raised in the child of :meth:`WarmPool.prestart_here`, which is now the warm interpreter: the launcher's
    ``__main__`` runs :func:`disttrain.trainer.launch.warmproc.main` at its top level, so the process ends as an
    interpreter ends (threads joined, atexit, finalisation), not inside the launcher's frames."""


class _Warm:
    """One warm interpreter: its flags, the environment it started with, its process, and what it answered
    (readiness, whether it forks, its forked workers' exits), read by a thread of its own."""

    def __init__(
        self,
        flags: tuple[str, ...],
        environ: dict[str, str],
        idle: bool,
        start: Callable[[int, int], subprocess.Popen[bytes]],
    ) -> None:
        """``start(answer_fd, read_end)`` starts the interpreter, which answers on ``answer_fd`` (closed here
        afterwards; ``read_end`` is this process's, for a fork to close)."""
        self.flags, self.environ, self.idle = flags, environ, idle
        self._ask = threading.Lock()
        answers_r, answers_w = os.pipe()
        try:
            self.proc = start(answers_w, answers_r)
        except InWarmInterpreter:
            raise  # in the fork: the write end is its answer pipe
        except BaseException:
            os.close(answers_r)
            os.close(answers_w)
            raise
        os.close(answers_w)
        if idle:  # from its first instruction (its own module imports pydantic): later threads inherit it
            try:
                os.sched_setscheduler(self.proc.pid, os.SCHED_IDLE, os.sched_param(0))
            except OSError as exc:
                log.info("warm interpreter %d keeps normal priority: %s", self.proc.pid, exc)
        self.answers = ForkAnswers(answers_r, f"warm-{self.proc.pid}")

    @classmethod
    def spawn(cls, flags: tuple[str, ...], environ: dict[str, str], idle: bool) -> _Warm:
        """A fresh ``python [flags] -m warmproc`` (it imports everything itself)."""

        def start(answer_fd: int, _: int) -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                [sys.executable, *flags, "-m", warmproc.__name__],
                stdin=subprocess.PIPE,
                env={**environ, READY_FD_ENV: str(answer_fd)},
                pass_fds=(answer_fd,),
                start_new_session=True,  # as torchrun starts its workers
            )

        return cls(flags, environ, idle, start)

    @classmethod
    def fork_here(cls, flags: tuple[str, ...], environ: dict[str, str]) -> _Warm:
        """A fork of this process (see :meth:`WarmPool.prestart_here`); in the child, raises
        :class:`InWarmInterpreter` with the child set up as :meth:`spawn`'s would be."""

        def start(answer_fd: int, answers_read_end: int) -> subprocess.Popen[bytes]:
            requests_r, requests_w = os.pipe()
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.close(requests_w)
                os.close(answers_read_end)
                _enter_forked_interpreter(requests_r, answer_fd, "-u" in flags)
                raise InWarmInterpreter()
            os.close(requests_r)
            return _ForkedInterpreter(pid, [*sys.orig_argv[:1], *flags, "-m", warmproc.__name__], requests_w)

        return cls(flags, environ, False, start)

    @property
    def ready(self) -> bool:
        return self.answers.ready

    @property
    def refused(self) -> Optional[str]:
        """Why it does not fork (known once ready); None: it does."""
        return self.answers.refused

    def is_alive(self) -> bool:
        return not self.answers.gone and self.proc.poll() is None

    def is_ready(self) -> bool:
        """Its imports are done (checked without waiting)."""
        return self.answers.ready

    def exit_code(self, fork: Fork, timeout: Optional[float]) -> Optional[int]:
        """The exit code of forked worker ``fork`` (negative: the signal), waiting up to ``timeout`` (None: as long
        as it runs); None while it runs."""
        return self.answers.exit_code(fork, timeout)

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
            fork, answer = self.answers.request_fork(
                lambda: self._request({"op": "fork", **request}), FORK_ANSWER_TIMEOUT_S
            )
        if fork is not None:
            return ForkedWorker(fork, argv, self)
        if answer is None:
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
        form = operator_form(launcher_argv)
        if form is not None:
            self.fill(form[0], form[1], environ=workers_environment(form[0]))

    def prestart_here(self, launcher_argv: Sequence[str]) -> None:
        """:meth:`prestart`, forking the interpreter from this process where that gives the same interpreter
        (:func:`fork_here_refusal`): the launcher has imported torch, and the fork inherits it instead of
        importing it again (2-3 CPU-seconds of each node's start). Raises :class:`InWarmInterpreter` in the child.
        ``DISTTRAIN_WARM_WORKERS=spawn`` (several interpreters) and any refusal start a fresh one instead."""
        form = launch_form(launcher_argv)
        if form is None:
            return
        environ = workers_environment(form[0])
        command = warm_command(form[1], environ)
        if command is None or not enabled(environ):
            return
        flags = tuple(command[0])
        refusal = "several interpreters are wanted" if not forking(environ) else fork_here_refusal(flags, environ)
        if refusal is not None:
            log.info("the warm interpreter starts afresh, not forked from the launcher: %s", refusal)
            self.prestart(launcher_argv)
            return
        with self._lock:
            if not any(warm.flags == flags for warm in self._ready):
                self._ready.append(_Warm.fork_here(flags, environ))

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
            self._ready.append(_Warm.spawn(flags, dict(environ), idle))

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
