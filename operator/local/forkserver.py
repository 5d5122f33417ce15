"""Local pods started as forks of a fork server that imported torch once, instead of cold interpreters.

Why: every local pod runs the same Python, and a cold start imports torch again (about 3 CPU-s on 2 cores) on the
cores the other nodes train on: a replacement's start slows the survivors, and a test of a few nodes spends most
of its CPU importing. :class:`ForkServers` keeps one server per kind of pod command (``python -m
disttrain.trainer.launch.forkserver``, :mod:`disttrain.trainer.launch.forkserver`, started lazily with the first
such pod's command and environment) and asks it to fork each pod; :class:`ForkedPod` is the ``Popen`` the
runtime keeps, whose exit code the server (the pod's parent) reports.

Anything the server refuses (another interpreter, an environment that differs where torch reads it at import,
debug mode, the CUDA driver loaded) starts cold with :func:`proctree.spawn`; so does every pod with
``DISTTRAIN_LOCAL_FORK=0`` (:func:`enabled`). A pod forked from a server dies with it: :meth:`ForkServers.close`
ends the servers after the runtime ended their pods.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Optional

from disttrain.api import env as env_names
from disttrain.common.forkedpopen import Fork, ForkAnswers, ForkedChild
from disttrain.operator.local import proctree

log = logging.getLogger("disttrain.local")

SERVER_MODULE = "disttrain.trainer.launch.forkserver"
READY_FD_ENV = "DISTTRAIN_WARM_READY_FD"
"""The pipe the server answers on (the warm interpreter's protocol, :mod:`disttrain.trainer.launch.warmproc`)."""
ANSWER_TIMEOUT_S = 120.0
"""Longest a pod's start waits for its fork (the server may still be importing on a loaded machine); past it the
server is ended and the pod starts cold."""
MAX_SERVERS = 3
"""Servers kept at once (each holds torch imported, about 300 MB): a local job needs two (its agent, its nodes)."""
PER_POD_PREFIX = "DISTTRAIN_"
"""Variables that differ from pod to pod without needing another server (read at run time, never at import)."""


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """On unless ``DISTTRAIN_LOCAL_FORK=0`` (every pod cold, as before the fork server: to compare, or to rule it
    out)."""
    return environ.get(env_names.LOCAL_FORK, "1") != "0"


def server_key(
    argv: Sequence[str], environ: Mapping[str, str], run_time: Sequence[str] = (), per_pod: Collection[str] = ()
) -> Optional[tuple[Any, ...]]:
    """Which server can fork ``argv``: one per interpreter, its options, module or script, and environment but
    for ``DISTTRAIN_*``, the ``run_time`` prefixes and the ``per_pod`` names; None for a command no server runs
    (not this Python)."""
    if not argv or not _is_this_python(argv[0]):
        return None
    options = tuple(_leading_options(argv[1:]))
    rest = list(argv[1 + len(options) :])
    if not rest or rest[0] == "-c" or (rest[0] == "-m" and len(rest) < 2):
        return None
    program = tuple(rest[:2]) if rest[0] == "-m" else tuple(rest[:1])
    prefixes = (PER_POD_PREFIX, *run_time)
    comparable = frozenset((k, v) for k, v in environ.items() if not k.startswith(prefixes) and k not in per_pod)
    return argv[0], options, program, comparable


def _is_this_python(program: str) -> bool:
    try:
        return os.path.samefile(program, sys.executable)
    except OSError:
        return False


def _leading_options(args: Sequence[str]) -> list[str]:
    options = []
    for arg in args:
        if arg in ("-m", "-c") or not arg.startswith("-"):
            break
        options.append(arg)
    return options


class ForkedPod(ForkedChild):
    """The runtime's handle on a pod its fork server forked, with the exit code the server (its parent) reports."""


class _Server:
    """One fork server: its process and what it answered (:class:`ForkAnswers`: its forks, their exits)."""

    def __init__(self, argv: Sequence[str], environ: Mapping[str, str], log_path: Path) -> None:
        options = _leading_options(argv[1:])
        answers_r, answers_w = os.pipe()
        placeholder = "." * env_names.LOCAL_MARKER_ROOM
        try:
            with open(log_path, "ab") as server_log:
                self.proc = subprocess.Popen(
                    [argv[0], *options, "-m", SERVER_MODULE, *argv],
                    stdin=subprocess.PIPE,
                    stdout=server_log,
                    stderr=subprocess.STDOUT,
                    env={**environ, env_names.LOCAL_MARKER: placeholder, READY_FD_ENV: str(answers_w)},
                    pass_fds=(answers_w,),
                    start_new_session=True,
                )
        finally:
            os.close(answers_w)
        self.answers = ForkAnswers(answers_r, "fork-server")
        self._ask = threading.Lock()

    def is_busy(self) -> bool:
        """A pod it forked still runs (it would die with the server)."""
        return self.answers.is_busy()

    def exit_code(self, fork: Fork, timeout: Optional[float]) -> Optional[int]:
        return self.answers.exit_code(fork, timeout)

    def _send(self, request: dict[str, Any]) -> bool:
        if self.proc.stdin is None:
            return False
        try:
            self.proc.stdin.write(json.dumps({"op": "fork", **request}).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            return False
        return True

    def fork(self, request: dict[str, Any]) -> Optional[ForkedPod]:
        """The pod, forked; None: refused (the reason is logged) or the server is gone."""
        with self._ask:
            fork, answer = self.answers.request_fork(lambda: self._send(request), ANSWER_TIMEOUT_S)
        if fork is not None:
            return ForkedPod(fork, request["argv"], self)
        if answer is None:
            log.warning("fork server %d did not answer in %.0f s; ending it", self.proc.pid, ANSWER_TIMEOUT_S)
            self.close()
        elif "refused" in answer:
            log.info("fork server %d: a pod starts cold: %s", self.proc.pid, answer["refused"])
        return None

    def close(self) -> None:
        """End the server (and any pod it forked that still runs: they die with it)."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.answers.join(5)


class ForkServers:
    """The runtime's fork servers, one per :func:`server_key`, started on first use; logs go to ``logs_dir``.
    ``run_time``: prefixes of more variables that may differ between pods of one server, for a caller that knows
    its programs read them at run time only (a test's own settings)."""

    def __init__(self, logs_dir: Path, environ: Mapping[str, str] = os.environ, run_time: Sequence[str] = ()) -> None:
        self.logs_dir = logs_dir
        self.enabled = enabled(environ)
        self.run_time = tuple(run_time)
        self._started = 0
        self._servers: dict[tuple[Any, ...], _Server] = {}
        self._refused: set[tuple[Any, ...]] = set()

    def _server(
        self, argv: Sequence[str], environ: Mapping[str, str], per_pod: Collection[str]
    ) -> Optional[tuple[tuple[Any, ...], _Server]]:
        key = server_key(argv, environ, self.run_time, per_pod) if self.enabled else None
        if key is None or key in self._refused:
            return None
        server = self._servers.pop(key, None)
        if server is None:
            if not self._make_room():
                return None
            self._started += 1
            server = _Server(argv, environ, self.logs_dir / f"fork-server-{self._started}.log")
        self._servers[key] = server  # the most recently used last
        return key, server

    def _make_room(self) -> bool:
        """Below :data:`MAX_SERVERS` servers, ending the least recently used idle one if needed; False: every one
        has pods running (this pod then starts cold)."""
        for key, server in list(self._servers.items()):
            if len(self._servers) < MAX_SERVERS:
                break
            if not server.is_busy():
                self._servers.pop(key).close()
        return len(self._servers) < MAX_SERVERS

    def prepare(self, argv: Sequence[str], environ: Mapping[str, str], per_pod: Collection[str] = ()) -> None:
        """Start the server for pods like ``argv`` now, without waiting: several import torch side by side."""
        self._server(argv, environ, per_pod)

    def start(
        self,
        argv: Sequence[str],
        environ: Mapping[str, str],
        cwd: str,
        output: IO[bytes],
        per_pod: Collection[str] = (),
    ) -> Optional[ForkedPod]:
        """The pod ``argv`` with ``environ`` (its marker included) in ``cwd``, output appended to ``output``'s file,
        as a fork (waiting for its server's imports); None where it must start cold. ``per_pod``: variables that are
        the pod's own (its name, uid), read at run time."""
        found = self._server(argv, environ, per_pod)
        if found is None:
            return None
        key, server = found
        output.flush()
        request = {"argv": list(argv), "env": dict(environ), "cwd": cwd, "stdout": output.name}
        pod = server.fork({**request, "run_time": list(self.run_time), "per_pod": sorted(per_pod)})
        if pod is None:  # one refusal holds for every pod of this key: the same command and environment
            self._refused.add(key)
            self._servers.pop(key).close()
        return pod

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
        self._servers.clear()


def start_pod(
    forks: Optional[ForkServers],
    argv: Sequence[str],
    environ: Mapping[str, str],
    cwd: str,
    output: IO[bytes],
    marker: str,
    per_pod: Collection[str] = (),
) -> Any:
    """The pod ``argv``, marked with ``marker`` (:func:`proctree.marked`) for its process tree: a fork of ``forks``
    where one can run it, else cold (:func:`proctree.spawn`; always when ``forks`` is None). Either answers
    ``poll``, ``wait`` and ``pid`` as a ``subprocess.Popen`` does."""
    forked = forks.start(argv, proctree.marked(environ, marker), cwd, output, per_pod) if forks is not None else None
    return forked or proctree.spawn(argv, environ, cwd, output, marker)
