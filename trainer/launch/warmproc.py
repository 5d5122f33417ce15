"""A warm worker interpreter: the program :class:`disttrain.trainer.launch.warmstart.WarmPool` starts.

It imports :data:`PRELOAD` once, says it is ready, then serves the launcher's requests, JSON lines on its stdin:

- ``{"op": "fork", ...}``: fork a worker from this interpreter and answer ``{"spawned": pid}``. The worker starts
  with every import done, and this interpreter stays, ready for the next one: a node pays torch's import once,
  not once per local worker and again after every reform. Its exit is reported as ``{"exit": pid, "status": s}``
  (this interpreter is its parent and reaps it).
- ``{"op": "become", ...}``: become the worker itself (the interpreter is used up), for where forking is refused.

Answers go to the pipe named by ``DISTTRAIN_WARM_READY_FD``, as JSON lines. A fork is refused (``{"refused":
why}``, said in the ready line already) when the CUDA driver is loaded in this process: a CUDA context does not
survive ``fork``. Nothing here initialises CUDA: the imports run with torch's NVML-based availability check,
whose purpose is to stay fork-safe. A forked worker runs in a session of its own (as torchrun starts a worker),
dies with this interpreter (``PR_SET_PDEATHSIG``: an orphan could not be reaped nor reported), and gets the same
``sys.argv``, ``sys.path[0]``, working directory and environment a cold ``python script.py`` would. Forking a
process that imported torch is what torch's own ``DataLoader`` does for its workers on Linux.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, Optional

from disttrain.api import env

PRELOAD = ("torch", "torch._dynamo", "torch.distributed.checkpoint", "disttrain.trainer.loop")
"""What a warm interpreter imports while it waits: torch, what ``torch.optim`` imports lazily on the first
optimizer (``torch._dynamo``, about a second), and the trainer library."""
READY_FD_ENV = "DISTTRAIN_WARM_READY_FD"
"""The pipe a warm interpreter answers on: its ready line once its imports are done, then one line per request."""
HANDOVER_ENV = "DISTTRAIN_WARM_HANDOVER_TIME"
"""Set in a warm worker's environment: the Unix time it became the worker (its process started long before)."""
NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
"""torch's switch for a CUDA availability check that does not load the driver (documented as fork-safe)."""
PR_SET_PDEATHSIG = 1
REAP_POLL_S = 1.0
"""How often exits are looked for where ``pidfd_open`` is missing (a pidfd wakes the loop at once)."""


def fork_refusal() -> Optional[str]:
    """Why this process must not fork workers, or None. The CUDA driver mapped into it means a CUDA call happened
    (a forked child's CUDA calls would then fail with "initialization error")."""
    if not hasattr(os, "fork"):
        return "this platform has no fork"
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            if "libcuda.so" in maps.read():
                return "the CUDA driver is loaded in the warm interpreter"
    except OSError:
        return "/proc/self/maps is unreadable: cannot tell whether CUDA is loaded"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in the warm interpreter"
    return None


def import_modules(names: tuple[str, ...]) -> None:
    """Import ``names`` as a warm interpreter does: with torch's CUDA check that does not load the driver."""
    unset = NVML_CHECK_ENV not in os.environ
    if unset:
        os.environ[NVML_CHECK_ENV] = "1"
    try:
        for name in names:
            importlib.import_module(name)
    finally:
        if unset:
            os.environ.pop(NVML_CHECK_ENV, None)


def import_torch() -> None:
    """Import torch as a warm interpreter does, for a launcher that forks its warm interpreter from itself
    (:func:`disttrain.trainer.launch.prestart.become_warm_interpreter`)."""
    import_modules(("torch",))


def answer(fd: int, message: dict[str, Any]) -> None:
    """One JSON line (far below ``PIPE_BUF``: written at once); a launcher that went away reads none."""
    try:
        os.write(fd, json.dumps(message).encode() + b"\n")
    except (BrokenPipeError, OSError):
        pass


def _set_pdeathsig(sig: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def _reap(answer_fd: int, pidfds: dict[int, int]) -> None:
    """Report every child that exited (raw wait status) and forget it."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        for fd, child in list(pidfds.items()):
            if child == pid:
                os.close(fd)
                del pidfds[fd]
        answer(answer_fd, {"exit": pid, "status": status})


def _fork_worker(pidfds: dict[int, int]) -> int:
    """Fork; in the child (0 returned) drop the exit watches and take a session of its own (the answer pipe is
    closed by :func:`main`, in both kinds of worker)."""
    parent = os.getpid()
    with warnings.catch_warnings():  # Python 3.12 warns of torch's native thread; see the module docstring
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        for fd in pidfds:
            os.close(fd)
        os.setsid()
        _set_pdeathsig(signal.SIGKILL)
        if os.getppid() != parent:  # the interpreter died before the line above: nobody would report this worker
            os._exit(1)
        return 0
    try:
        pidfds[os.pidfd_open(pid)] = pid
    except (AttributeError, OSError):
        pass  # no pidfd (Linux < 5.3): the loop looks for exits every REAP_POLL_S
    return pid


def serve(
    answer_fd: int, refusal: Optional[str], refuse: Callable[[dict[str, Any]], Optional[str]] = lambda _: None
) -> Optional[dict[str, Any]]:
    """Serve requests until this process is to run a worker: returns that request (in a forked child, or on
    ``become``), or None when the launcher closed stdin (this interpreter then ends, and its forked workers with
    it: they are the launcher's, which is gone). ``refuse(request)``: why this one request is not forked, or
    None."""
    pidfds: dict[int, int] = {}
    pending = b""
    while True:
        readable, _, _ = select.select([0, *pidfds], [], [], REAP_POLL_S)
        _reap(answer_fd, pidfds)
        if 0 not in readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return None
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request: dict[str, Any] = json.loads(line)
            if request.get("op") != "fork":
                return request
            why = refusal if refusal is not None else refuse(request)
            if why is not None:
                answer(answer_fd, {"refused": why})
                continue
            pid = _fork_worker(pidfds)
            if pid == 0:
                return request
            answer(answer_fd, {"spawned": pid})


def run_as_main(argv: list[str]) -> None:
    """Run ``argv`` (``script args`` or ``-m module args``) as ``python`` would run it as ``__main__``."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")


def _leave_idle() -> None:
    """Every thread of this process back to ``SCHED_OTHER`` if the pool started it at ``SCHED_IDLE`` (a refill);
    allowed unprivileged since Linux 2.6.39; best effort."""
    if os.sched_getscheduler(0) != os.SCHED_IDLE:
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
        except OSError as exc:
            print(f"disttrain warm interpreter: cannot leave SCHED_IDLE: {exc}", file=sys.stderr)


def become(request: dict[str, Any]) -> None:
    """Turn this process into the worker ``request`` describes, as ``python [flags] argv`` would have started."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[HANDOVER_ENV] = repr(time.time())
    _leave_idle()
    run_as_main(request["argv"])


def main() -> None:
    """Import, say ready (and whether workers can be forked), serve, and run a worker where asked to."""
    import_modules(PRELOAD)
    answer_fd = int(os.environ.pop(READY_FD_ENV, "-1"))
    spawn = os.environ.get(env.WARM_WORKERS) == env.WARM_SPAWN
    refusal = f"{env.WARM_WORKERS}={env.WARM_SPAWN}" if spawn else fork_refusal()
    answer(answer_fd, {"ready": True, "refused": refusal})
    request = serve(answer_fd, refusal)
    if request is None:
        os._exit(0)  # the agent went away or closed the pool
    if answer_fd >= 0:
        os.close(answer_fd)  # the launcher reads the end of the answers once this interpreter alone is gone
    become(request)


if __name__ == "__main__":
    main()
