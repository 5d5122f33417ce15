"""The worker pod's launcher: torchrun, except that a failure of the user's code ends the pod with the user's code.

Worker pods run ``python -m disttrain.trainer.launch <torchrun args> <training command>``. Everything is torchrun
(:func:`torch.distributed.run.run`, the same arguments, the same elastic agent), with one difference in when the
agent restarts its workers by itself:

* **Exits of the elastic protocol restart in place**, as before: ``DRAINED`` (83) and ``REFORM`` (84) are how the
  operator re-forms a group (a drain, a lost peer, a failed collective); torchrun restarts the workers and they
  re-join the rendezvous. These are not failures, and the operator's directives count them.
* **Any other worker failure ends the agent at once** (an exception, ``sys.exit(3)``, an OOM kill): torchrun's own
  restart loop would retry it forever, invisibly (the operator passes a huge ``--max-restarts`` so that drains and
  reforms never run out). The pod then exits with the **user's real exit code** (not torchrun's 1; a signal ``-N``
  becomes ``128+N`` as a container reports it), so ``restartPolicy.exitCodes`` classes apply to it, and the
  operator counts the failure against ``restartPolicy.maxRestarts`` with backoff when it replaces the pod.

The real code and message come from torchrun's own failure report: the agent's ``RunResult.failures``, raised by
the launcher as :class:`ChildFailedError`. Each :class:`ProcessFailure` reads the worker's error file
(``TORCHELASTIC_ERROR_FILE``, written by ``@record`` or by :class:`~disttrain.trainer.loop.ElasticTrainer` when
user code raises), whose message is the last line of the traceback (``ValueError: ...``). That line, with the
exit code, is written to the container's termination message (``terminationMessagePath``; the local runtime
gives each node its own file through ``DISTTRAIN_TERMINATION_LOG``), where the operator reads it into the status.

On a node with CUDA devices, :func:`apply_nccl_env` first sets the NCCL environment of
:mod:`disttrain.trainer.launch.ncclenv` (async error handling, heartbeat, flight recorder) for the workers, keeping
what the pod's env already sets (docs/gpu.md). ``spec.debug`` (:mod:`disttrain.trainer.launch.debugenv`) is set in
``__main__``, before torch is imported; :func:`apply_per_rank_logs` adds its per-rank log files to torchrun's args.

The agent class cannot be chosen through a torchrun option, so :func:`run` makes
``torch.distributed.launcher.api`` build :class:`CountingAgent`, a :class:`LocalElasticAgent` whose only changes
are :meth:`CountingAgent._monitor_workers` and that a failed agent leaves the rendezvous open. This module imports
torch and never kopf or the operator.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any, NoReturn, Optional

import torch
from torch.distributed import run as torchrun
from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import (
    SubprocessHandler,
)
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
from torch.distributed.launcher import api as launcher_api

from disttrain.api import env
from disttrain.api.contract import WorkerContract
from disttrain.api.exitcodes import ExitCode
from disttrain.trainer.launch import (
    debugenv,
    exitbarrier,
    leaving,
    ncclenv,
    prestart,
)
from disttrain.trainer.launch.prestart import WARM_POOL
from disttrain.trainer.launch.readiness import Readiness
from disttrain.trainer.launch.rendezvous import DisttrainRendezvousHandler

log = logging.getLogger("disttrain.launch")

PROTOCOL_EXITS = frozenset({int(ExitCode.DRAINED), int(ExitCode.REFORM)})
"""Worker exits that are the elastic protocol, not failures: torchrun restarts the workers in place."""
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
"""Kubernetes' default ``terminationMessagePath`` (the pod builder sets it explicitly)."""
MAX_MESSAGE_CHARS = 1024
"""A termination message is capped at 4096 bytes by the kubelet; the status message needs one line."""


def raised(failure: ProcessFailure) -> bool:
    """The worker's code raised: it wrote torchrun's error file (``@record``, or ElasticTrainer on an exception)."""
    return os.path.isfile(failure.error_file)


def is_user_failure(failure: ProcessFailure) -> bool:
    """A failure of the user's code: it raised, or exited with a code that is no protocol exit. A SIGTERM without
    an error file is torchrun stopping the other workers of a group that already failed (collateral)."""
    if raised(failure):
        return True
    if failure.exitcode == 1 and leaving.marker(failure.pid).exists():
        return False  # its teardown hung and the hang guard ended it: a reform, not the user's failure
    return failure.exitcode not in PROTOCOL_EXITS and failure.exitcode != -signal.SIGTERM


def user_failures(failures: Mapping[int, ProcessFailure]) -> dict[int, ProcessFailure]:
    """The failures that are the user's code failing (not the protocol exits, not torchrun's own SIGTERMs).

    When a worker leaves with a protocol exit, torchrun stops its siblings: SIGTERM, then SIGKILL for one that has not
    ended 30 s later (it was blocked, waiting for the next round, say). Such a SIGKILL, without an error file, next
    to a protocol exit is that escalation, not the user's failure."""
    stopped_for_protocol = any(not is_user_failure(f) and f.exitcode in PROTOCOL_EXITS | {1} for f in failures.values())
    return {
        rank: f
        for rank, f in failures.items()
        if is_user_failure(f) and not (stopped_for_protocol and f.exitcode == -signal.SIGKILL and not raised(f))
    }


def first_failure(failures: Mapping[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """The root cause: a user failure that raised, else one that exited by itself, earliest first (among all
    failures when none is the user's)."""
    pool = user_failures(failures) or dict(failures)
    rank = min(pool, key=lambda r: (not raised(pool[r]), pool[r].exitcode < 0, pool[r].timestamp, r))
    return rank, pool[rank]


def exit_code(failure: ProcessFailure) -> int:
    """The pod's exit code for a failure, as a container reports one: a worker that raised and was then stopped
    (it hung in shutdown after the exception) exits 1 like any uncaught Python exception; a signal -N is 128+N."""
    if failure.exitcode < 0 and raised(failure):
        return 1
    return container_exit_code(failure.exitcode)


def container_exit_code(exitcode: int) -> int:
    """A worker's exit status as a container would report it: a signal -N becomes 128+N; 0 never (it failed)."""
    if exitcode < 0:
        return 128 - exitcode
    return exitcode if 0 < exitcode < 256 else 1


def failure_line(failure: ProcessFailure) -> str:
    """The last line of the worker's traceback from its error file, or '' when it wrote none."""
    message: Any = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    if not os.path.isfile(failure.error_file) or not isinstance(message, str):
        return ""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def describe(rank: int, failure: ProcessFailure) -> str:
    """One line for the pod's termination message: exit code, rank and the traceback's last line."""
    code = exit_code(failure)
    if failure.exitcode >= 0 or raised(failure):
        what = f"exit code {code}"
    else:
        what = f"signal {failure.signal_name()} (exit code {code})"
    line = failure_line(failure)
    text = f"worker rank {rank} failed with {what}" + (f": {line}" if line else "")
    return text[:MAX_MESSAGE_CHARS]


def write_termination_message(text: str, path: Optional[str] = None) -> None:
    """Write the container's termination message (best effort: a read-only or absent path is only logged)."""
    path = path or os.environ.get(env.TERMINATION_LOG) or DEFAULT_TERMINATION_LOG
    try:
        with open(path, "w", encoding="utf-8") as out:
            out.write(text + "\n")
    except OSError as exc:
        log.warning("could not write the termination message to %s: %s", path, exc)


STOP_GRACE_MARGIN_S = 5.0
"""What a stop waits for a worker to reach the next round in place, beyond the job's collective timeout."""


def _stop_grace_s() -> float:
    """How long a stop waits for workers still in a failing collective to wait for the next round in place."""
    try:
        timeout = WorkerContract.from_env_value(os.environ.get(env.CONTRACT, "")).collective_timeout_seconds
    except ValueError:
        return STOP_GRACE_MARGIN_S
    return float(timeout) + STOP_GRACE_MARGIN_S


def _directed_anew(handler: Any) -> Callable[[], bool]:
    """Whether the operator has issued a directive (the target's generation moved) since now, read through the
    rendezvous handler's ``target()``. In the exit barrier this node's workers finished every step; a directive
    then means a node of the group was lost (or is being drained) and the node the barrier waits for may never come,
    so the barrier is left at once instead of after its timeout."""
    target = getattr(handler, "target", None)
    if not callable(target):
        return lambda: False

    def generation() -> Optional[int]:
        try:
            plan = target()
        except Exception:  # noqa: BLE001 - an unreachable store says nothing; the barrier's timeout still holds
            return None
        return None if plan is None else int(plan.generation)

    entered = generation()
    if entered is None:  # no target to compare with (no operator, or its store away): the timeout alone
        return lambda: False
    return lambda: (now := generation()) is not None and now > entered  # a lower one is a replay, not a directive


class CountingAgent(LocalElasticAgent):
    """torchrun's agent, giving up at the first failure of user code so that the operator counts it.

    Whenever it ends without success (a failure of user code, a rendezvous error), the rendezvous stays open:
    torchrun would close it on its way out, and the replacement node the operator starts could never join.
    """

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        try:
            result: RunResult = super().run(role)
        except BaseException:
            self._leave_rendezvous_open()
            raise
        if result is None:
            # torch's agent returns nothing when a node beyond nnodes' maximum (its redundancy list: a hot spare of a
            # job at nodes.max) finds the rendezvous closed by the finished group; the launcher API would then fail
            # on the missing result. Said the way every other waiting node hears it: see run().
            raise RendezvousClosedError("the rendezvous closed while this node waited in torch's redundancy list")
        if result.is_failed():
            self._leave_rendezvous_open()
        return result

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        """Warm the next workers' interpreters while the rendezvous runs
        (:mod:`disttrain.trainer.launch.warmstart`); after
        it, end the workers that waited in place and were not handed a round (none should be left)."""
        spec = worker_group.spec
        if isinstance(spec.entrypoint, str):
            WARM_POOL.fill(spec.local_world_size, [spec.entrypoint, *map(str, spec.args)])
        READINESS.arm(WARM_POOL.is_warm)  # the pod reads Ready once they are (disttrain.trainer.launch.readiness)
        try:
            super()._initialize_workers(worker_group)
        finally:
            if prestart.HANDOVER is not None:
                prestart.HANDOVER.release("no round of this node took it")

    def _stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        """torchrun's stop, except for workers that wait for the next round in place: they are kept for it
        (:meth:`disttrain.trainer.launch.handover.Broker.detach`) instead of being signalled.

        A worker that does not wait yet gets the collective timeout (and a margin) to get there first: one whose
        collective is still failing (on gloo a receive from a peer that left only fails at the timeout) then waits
        for the next round and is kept, its state in memory with it. Whatever neither exits nor waits by then is
        stopped as torchrun stops it (SIGTERM: a healthy worker drains)."""
        pcontext = getattr(self, "_pcontext", None)
        if prestart.HANDOVER is not None and isinstance(pcontext, SubprocessContext):
            handlers = pcontext.subprocess_handlers
            deadline = time.monotonic() + _stop_grace_s()
            while time.monotonic() < deadline and any(
                h.proc.poll() is None and not prestart.HANDOVER.is_waiting(h.proc.pid) for h in handlers.values()
            ):
                time.sleep(0.05)
            for local_rank, handler in list(handlers.items()):
                if handler.proc.poll() is None and prestart.HANDOVER.is_waiting(handler.proc.pid):
                    del handlers[local_rank]
                    prestart.HANDOVER.detach(local_rank, handler.proc)
        super()._stop_workers(worker_group, *args, **kwargs)

    def _waiting_in_place(self) -> bool:
        pcontext = getattr(self, "_pcontext", None)
        if prestart.HANDOVER is None or not isinstance(pcontext, SubprocessContext):
            return False
        return prestart.HANDOVER.all_waiting(pcontext.pids())

    def _exit_barrier(self) -> None:
        """torchrun's exit barrier on our own keys (:mod:`disttrain.trainer.launch.exitbarrier`): a stranger who deletes
        them only delays it. As torch's, an agent that cannot reach the store or waited the timeout leaves."""
        spec = self._worker_group.spec
        store: Any = self._store  # set by the rendezvous before any worker ran
        world, me = self._worker_group.group_world_size, self._worker_group.group_rank
        if world is None or me is None:  # no rendezvous happened: nothing to wait for
            return
        log.info(
            "[%s] local worker group finished (%s); waiting up to %s s for the other %d nodes",
            spec.role,
            self._worker_group.state,
            self._exit_barrier_timeout,
            world - 1,
        )
        start = time.monotonic()
        redirected = _directed_anew(getattr(spec, "rdzv_handler", None))
        self._in_exit_barrier = True
        try:
            if exitbarrier.wait_for_all(store, world, me, self._exit_barrier_timeout, abandon=redirected):
                log.info("[%s] every node finished; waited %.1f s", spec.role, time.monotonic() - start)
            elif redirected():
                log.info(
                    "[%s] the operator re-directed the group (a node was lost); leaving the exit barrier", spec.role
                )
            else:
                waited = time.monotonic() - start
                log.warning("[%s] the exit barrier timed out after %.0f s; leaving", spec.role, waited)
        except SignalException:
            raise
        except Exception:  # as torch's: an agent that cannot reach the store leaves anyway
            log.exception("[%s] error in the exit barrier after %.1f s", spec.role, time.monotonic() - start)
        finally:
            self._in_exit_barrier = False

    def _leave_rendezvous_open(self) -> None:
        handler = self._worker_group.spec.rdzv_handler
        if isinstance(handler, DisttrainRendezvousHandler):
            handler.leave_open()

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result: RunResult = super()._monitor_workers(worker_group)
        spec = worker_group.spec
        if result.state is WorkerState.HEALTHY and self._waiting_in_place():
            # Every worker of this node waits for the next round in place: torchrun restarts the group as after a
            # protocol exit, and :meth:`_stop_workers` keeps these processes for it.
            return RunResult(state=WorkerState.UNHEALTHY)
        if result.state is WorkerState.HEALTHY and isinstance(spec.entrypoint, str):
            # The workers run: warm the next ones now, on idle CPU, so a reform finds them ready.
            WARM_POOL.fill(spec.local_world_size, [spec.entrypoint, *map(str, spec.args)], idle=True)
        if result.is_failed():
            failed = user_failures(result.failures)
            if failed:
                rank, failure = first_failure(failed)
                log.error(
                    "%s; not restarting in place: the pod exits with this code and the operator counts the "
                    "restart against spec.restartPolicy.maxRestarts",
                    describe(rank, failure),
                )
                self._remaining_restarts = 0  # torchrun stops the workers and returns this result
                self._announce_leaving()
        return result

    def _announce_leaving(self) -> None:
        """This node's last beat, now: its workers failed and the pod exits once torchrun stopped them, which takes
        seconds on a loaded machine; meanwhile the agent leaves the verdict to the pod's exit (``PodFailed`` with the
        user's code), never to the beat's silence (``HeartbeatLost``)."""
        handler = self._worker_group.spec.rdzv_handler
        if isinstance(handler, DisttrainRendezvousHandler) and handler.beat is not None:
            handler.beat.leave()


READINESS = Readiness()
"""The pod's readiness port (``DISTTRAIN_READY_PORT``)."""
_cold_popen = SubprocessHandler._popen
_stock_close = SubprocessHandler.close


def close_worker(self: SubprocessHandler, death_sig: Optional[signal.Signals] = None) -> None:
    """torchrun's stop of one worker (``killpg`` of its session), for a worker whose session is already gone.

    A warm worker is its warm interpreter's child, reaped there the moment it exits, so ``killpg`` can find no
    process left (``ProcessLookupError``) where a cold worker would still be the launcher's zombie. torchrun's
    close then raised out of its monitor loop, and the launcher ended with exit 1 instead of the workers' code
    (seen in CI: a drained worker's exit 83)."""
    try:
        _stock_close(self, death_sig)
    except ProcessLookupError:
        for stream in (self._stdout, self._stderr):
            if stream:
                stream.close()


def _warm_popen(self: SubprocessHandler, args: tuple[str, ...], env: dict[str, str]) -> Any:
    """torchrun's worker start: the process of this local rank that waits in place when there is one, else a warm
    interpreter when one fits (output not redirected to files), else a cold start."""
    if prestart.HANDOVER is not None:
        waiting = prestart.HANDOVER.take(env)
        if waiting is not None:
            return waiting
    if getattr(self, "_stdout", None) is None and getattr(self, "_stderr", None) is None:
        proc = WARM_POOL.take(args, env)
        if proc is not None:
            return proc
    return _cold_popen(self, args, env)


def apply_nccl_env(environ: MutableMapping[str, str], has_cuda: bool) -> None:
    """Set the workers' NCCL variables (:func:`ncclenv.plan`) in ``environ`` and create the node's dump folder
    (``<checkpoint dir>/flight-recorder/<node name>``, else under the temp dir). Nothing on a node without CUDA:
    its group is gloo, which reads none of them."""
    if not has_cuda:
        return
    folder = _dump_folder(environ)
    nccl = ncclenv.plan(_collective_timeout_s(environ), folder, environ)
    environ.update(nccl.to_set)
    if nccl.kept:
        log.info(
            "NCCL settings kept from the pod's env: %s", " ".join(f"{k}={v}" for k, v in sorted(nccl.kept.items()))
        )
    log.info("NCCL settings for the workers: %s", " ".join(f"{k}={v}" for k, v in nccl.to_set.items()))


def apply_per_rank_logs(args: Any, environ: Mapping[str, str]) -> None:
    """``spec.debug.perRankLogs``: torchrun's ``--log-dir`` in the launcher's debug folder and ``--tee 3`` (files,
    and the pod's log as before), unless the command line sets its own. torchrun makes a fresh folder per launcher
    and per restart (``<run id>_<unique>/attempt_<n>/<local rank>/``): no file is ever overwritten."""
    debug = debugenv.contract_debug(environ)
    if debug is not None and debug.is_on:
        log.info("debug mode for the workers: %s", debugenv.describe(environ))
    folder = debugenv.log_dir(environ)
    if debug is None or not debug.per_rank_logs or folder is None:
        return
    if args.log_dir is None:
        args.log_dir = folder
    if args.redirects == "0" and args.tee == "0":
        args.tee = debugenv.TEE_ALL
    log.info("per-rank logs of the workers under %s", args.log_dir)


def _collective_timeout_s(environ: Mapping[str, str]) -> int:
    """``spec.elastic.collectiveTimeoutSeconds`` from the worker contract (its default without a readable one: the
    trainer reports a bad contract itself)."""
    try:
        return WorkerContract.from_env_value(environ.get(env.CONTRACT, "")).collective_timeout_seconds
    except ValueError:
        default: int = WorkerContract.model_fields["collective_timeout_seconds"].default
        return default


def _dump_folder(environ: Mapping[str, str]) -> str:
    """The node's flight recorder folder, created: on the checkpoint volume (shared, outlives the pod) when it can
    be, else in the temp dir."""
    node = environ.get(env.NODE_NAME, "")
    roots = [environ.get(env.CHECKPOINT_DIR, ""), os.path.join(tempfile.gettempdir(), "disttrain")]
    for root in filter(None, roots):
        folder = ncclenv.dump_folder(root, node)
        try:
            os.makedirs(folder, exist_ok=True)
            return folder
        except OSError as exc:
            log.warning("cannot create the flight recorder folder %s (%s)", folder, exc)
    return tempfile.gettempdir()


def run(argv: Sequence[str]) -> int:
    """Run torchrun with ``argv``; the exit code the pod should end with."""
    args = torchrun.parse_args(list(argv))  # type: ignore[no-untyped-call]
    apply_per_rank_logs(args, os.environ)
    apply_nccl_env(os.environ, torch.cuda.device_count() > 0)
    prestart.open_handover()
    launcher_api.LocalElasticAgent = CountingAgent  # type: ignore[misc]  # what launch_agent builds
    SubprocessHandler._popen = _warm_popen  # type: ignore[method-assign]  # where torchrun starts a worker
    SubprocessHandler.close = close_worker  # type: ignore[method-assign]  # where torchrun stops one
    try:
        torchrun.run(args)  # type: ignore[no-untyped-call]
    except ChildFailedError as error:
        rank, failure = first_failure(error.failures)
        text = describe(rank, failure)
        write_termination_message(text)
        return exit_code(failure)
    except RendezvousClosedError:
        # Only a node that finished the training closes the rendezvous (a failing agent leaves it open, above):
        # this node waited outside the group (a hot spare, a late newcomer) and the job is done without it.
        log.info("the rendezvous is closed: the job finished while this node waited outside the group")
        write_termination_message("rendezvous closed: the job finished while this node waited outside the group")
        return 0
    finally:
        READINESS.close()
        if prestart.HANDOVER is not None:  # first: workers waiting in place end gracefully, before the warm
            prestart.HANDOVER.close()  # interpreter that forked them ends (and takes its workers with it)
        WARM_POOL.close()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    exit_now(run(sys.argv[1:] if argv is None else argv))


def exit_now(code: int) -> NoReturn:
    """End the pod's process with ``code``: what Python's exit does up to its atexit hooks (non-daemon threads
    joined, the hooks run, the streams flushed), without the interpreter's finalisation after them.

    Why: with torch loaded that teardown took 0.6 s here, 1.2 s in a local pod forked from a fork server (it writes to
    every page the pod shares with the server), several seconds under CI's load; the pod's exit, which names what
    happened (a crash is ``PodFailed`` with the user's code), came after the agent's silence rule had named it
    ``HeartbeatLost``. The launcher's work is done by then: its workers are gone and its store calls drained."""
    main_thread = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main_thread and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to write
            pass
    os._exit(code)
