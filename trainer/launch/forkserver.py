"""Local mode's fork server: a node's programs (its launcher, the job agent) start as forks of one interpreter that
imported torch once.

Why: on one machine every local "pod" is a process tree of the same Python, and each one started cold imports torch
(about 3 CPU-s on a 2-core machine) on the cores the other nodes train on. ``disttrain local run`` starts this
server once per kind of program (:mod:`disttrain.operator.local.forkserver`, which starts it as
``python [-u] -m disttrain.trainer.launch.forkserver <the first pod's command>``) and asks it for each pod. The
child runs the pod's command as ``python [-u] -m module args`` (or a script) would run it: in a session of its own,
with the pod's environment, working directory and log file, stdin on ``/dev/null``.

A fork is made only where it is the same as a cold start; otherwise the server answers ``refused`` and the pod
starts cold:

- the command is this interpreter with the server's options (at most ``-u``), then ``-m module`` or a script;
- the environment torch was imported with is the one the program would import it with, but for ``DISTTRAIN_*``
  variables (per pod, read at run time, never at import), the pod's own ``per_pod`` variables (its name, uid:
  ``valueFrom.fieldRef``) and the request's ``run_time`` prefixes (a caller's own settings that it knows its
  programs read at run time). For the pod launcher that environment includes what it
  sets before its import (``OMP_NUM_THREADS`` for several workers, :func:`warmstart.worker_env_defaults`); a
  launcher in debug mode (whose torch variables name a folder it creates at start) starts cold;
- the CUDA driver is not loaded here (:func:`warmproc.fork_refusal`).

Requests and answers are :mod:`warmproc`'s (JSON lines on stdin, answers on the pipe named by
``DISTTRAIN_WARM_READY_FD``), with two more request fields: ``stdout``, the pod's log file (appended to), and the
pod's marker in ``env``. The local runtime finds a pod's processes by that marker in ``/proc/<pid>/environ``
(:mod:`disttrain.operator.local.proctree`), which shows the environment block a process started with, not later
changes, and a fork shares the server's. So the server starts with the marker set to a placeholder, and each
child writes its pod's marker over the placeholder's bytes in its own copy of that block: its
``/proc/<pid>/environ``, and that of every process it forks, then names its pod. A forked pod dies with the server
(``PR_SET_PDEATHSIG``, as warm workers die with their interpreter): the server's parent, the local runtime, ends
both together.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Optional

from disttrain.api import env as env_names
from disttrain.trainer.launch import debugenv, warmproc, warmstart

LAUNCHER = "disttrain.trainer.launch"
"""The pod launcher's module: it sets part of its environment before it imports torch."""
PRELOAD = (*warmproc.PRELOAD, "torch.distributed.run")
"""What the server imports before it forks: a worker's imports and torchrun's."""
PER_POD_PREFIX = "DISTTRAIN_"
"""Variables that may differ between the server and a pod it forks: disttrain's, read at run time only."""
MARKER_PLACEHOLDER_LENGTH = env_names.LOCAL_MARKER_ROOM
"""Bytes the server's marker placeholder holds: the longest marker a forked pod can carry (local mode's are 73)."""


def import_environment(command: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """The environment ``command`` (``-m module args`` or ``script args``) has when it imports torch: ``environ``,
    plus what the pod launcher sets for its workers before its import."""
    imported = dict(environ)
    if list(command[:2]) == ["-m", LAUNCHER]:
        imported.update(warmstart.worker_env_defaults(command[2:], imported))
    return imported


def _comparable(environ: Mapping[str, str], run_time: Sequence[str], per_pod: Collection[str]) -> dict[str, str]:
    prefixes = (PER_POD_PREFIX, *run_time)
    return {k: v for k, v in environ.items() if not k.startswith(prefixes) and k not in per_pod}


def pod_refusal(request: Mapping[str, Any], flags: Sequence[str], imported: Mapping[str, str]) -> Optional[str]:
    """Why the pod ``request`` describes (``argv``, ``env``) must start cold rather than as a fork of a server that
    runs with ``flags`` and imported torch with ``imported``; None: a fork is the same as a cold start."""
    argv, environ = list(request.get("argv") or []), dict(request.get("env") or {})
    command = warmstart.warm_command(argv, environ)
    if command is None:
        return "the command is not this interpreter running -m module or a script"
    own_flags, rest = command
    if list(own_flags) != list(flags):
        return f"interpreter options {own_flags} are not the server's {list(flags)}"
    if rest[:2] == ["-m", LAUNCHER]:
        debug = debugenv.contract_debug(environ)
        if debug is not None and debug.is_on:
            return "debug mode sets torch's variables at the launcher's start"
    marker = environ.get(env_names.LOCAL_MARKER, "")
    if len(marker.encode()) > MARKER_PLACEHOLDER_LENGTH:
        return f"the marker is longer than {MARKER_PLACEHOLDER_LENGTH} bytes"
    run_time = [str(prefix) for prefix in request.get("run_time") or () if prefix]
    per_pod = {str(name) for name in request.get("per_pod") or ()}
    wanted = _comparable(import_environment(rest, environ), run_time, per_pod)
    have = _comparable(imported, run_time, per_pod)
    differing = sorted(k for k in set(wanted) | set(have) if wanted.get(k) != have.get(k))
    if differing:
        return f"{differing[0]} is not what torch was imported with here"
    return None


def _environment_block() -> tuple[int, int]:
    """Address and size of this process's initial environment block (``env_start``, ``env_end``: fields 50 and 51 of
    ``/proc/self/stat``, counted from 1; field 3 follows the command name's closing parenthesis)."""
    with open("/proc/self/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    start, end = int(fields[50 - 3]), int(fields[51 - 3])
    return start, end - start


def write_marker(marker: str) -> bool:
    """Write ``marker`` over the placeholder value of the marker variable in this process's environment block (NUL
    padded): ``/proc/self/environ`` then shows it, and so does every process forked from here. False: no room."""
    start, size = _environment_block()
    block = ctypes.string_at(start, size)
    name = f"{env_names.LOCAL_MARKER}=".encode()
    at = 0 if block.startswith(name) else block.find(b"\0" + name) + 1
    if at == 0 and not block.startswith(name):
        return False
    value_at = at + len(name)
    end = block.find(b"\0", value_at)
    room = (end if end >= 0 else size) - value_at
    new = marker.encode()
    if len(new) > room:
        return False
    ctypes.memmove(start + value_at, new + b"\0" * (room - len(new)), room)
    return True


def enter_pod(request: Mapping[str, Any]) -> None:
    """Turn this fork child into the pod's program, as a cold ``python [flags] command`` in the pod would start."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    stdout = request.get("stdout")
    if stdout:
        log = os.open(stdout, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
    environ = dict(request["env"])
    marker = environ.get(env_names.LOCAL_MARKER)
    if marker is not None and not write_marker(marker):
        print("disttrain fork server: the pod's marker does not fit its placeholder", file=sys.stderr)
        os._exit(1)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(environ)
    command = warmstart.warm_command(request["argv"], environ)
    assert command is not None  # pod_refusal checked it before the fork
    warmproc.run_as_main(command[1])


def main(program: Sequence[str]) -> None:
    """Import torch with ``program``'s import environment, say ready, fork pods on request, run one in a child."""
    answer_fd = int(os.environ.pop(warmproc.READY_FD_ENV, "-1"))
    command = warmstart.warm_command(program)
    flags = tuple(warmstart.interpreter_options(sys.orig_argv))
    if command is not None:
        os.environ.update(import_environment(command[1], os.environ))
    imported = dict(os.environ)  # what torch is imported with (its import adds variables of its own)
    warmproc.import_modules(PRELOAD)
    refusal = warmproc.fork_refusal()
    warmproc.answer(answer_fd, {"ready": True, "refused": refusal})
    request = warmproc.serve(answer_fd, refusal, lambda r: pod_refusal(r, flags, imported))
    if request is None:
        os._exit(0)  # the runtime closed the server: its pods were ended first, or die with it
    os.close(answer_fd)
    enter_pod(request)


if __name__ == "__main__":
    main(sys.argv[1:])
