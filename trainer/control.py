"""The watchdog: SIGTERM and the job agent's control keys turned into step-boundary decisions.

``drain`` (and SIGTERM) only set a flag: the loop checkpoints at the next step boundary and exits with
``ExitCode.DRAINED`` (or, reforming in place, stays for the next round). ``reform`` cannot wait for a boundary (a
collective may be stuck on a dead peer), so the watchdog thread calls ``os._exit(ExitCode.REFORM)`` itself, unless
the trainer takes it (``on_reform``: an in-place worker re-forms at its next failed collective or step end, and
exits itself when that does not come soon, :mod:`disttrain.trainer.inplace`). Each signal generation is acted on
once: the generation present when this process started, or the one recorded in the checkpoint, is history and ignored,
so a worker restarted after a reform does not reform again. Generations count within one job (its
``metadata.uid``): a signal of another job is ignored, and a checkpoint written by another job (one deleted and
recreated under the same name) records nothing this job's directives are compared with. A directive is also bound
to the rendezvous round it was issued for (:func:`disttrain.api.control.judge_directive`): a worker of a later round
never acts on it, so an old directive replayed while a reform is in flight cannot send the new round's workers away
again. The history only ever rises; a replay is logged and counted (:attr:`Watchdog.refused`), never acted on.

The store is reached through :mod:`disttrain.trainer.store.channel`: every value read is verified against the job's
secret
(a forged signal or failure record is absent), every value written is sealed.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Optional

from disttrain.api import control as keys
from disttrain.api import env
from disttrain.api.exitcodes import ExitCode
from disttrain.trainer import diagnostics, startup
from disttrain.trainer.beacons import BeaconSender
from disttrain.trainer.store import channel, resilient

if TYPE_CHECKING:
    from torch.distributed import Store

log = logging.getLogger("disttrain.trainer")

STOP_JOIN_S = 2.0
"""How long :meth:`Watchdog.stop` waits for the polling thread to finish its current store call."""
RELIABILITY_READ_SECONDS = 2.0
"""How often the watchdog's thread reads the agent's failure history once someone asked for it."""


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"agent endpoint {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


def read_signal(store: keys.StoreReader) -> Optional[keys.ControlSignal]:
    """The current signal in the store, or None when there is none (or it cannot be parsed)."""
    return keys.read_model(store, keys.SIGNAL_KEY, keys.ControlSignal)


class Watchdog:
    """Follows SIGTERM and the control channel. ``drain_requested`` is read by the loop at step boundaries."""

    def __init__(
        self,
        endpoint: Optional[str],
        poll_seconds: float = 0.2,
        exit_fn: Callable[[int], None] = os._exit,
        job_uid: Optional[str] = None,
    ) -> None:
        self.endpoint = endpoint
        self.job_uid = os.environ.get(env.JOB_UID, "") if job_uid is None else job_uid
        self.poll_seconds = poll_seconds
        self._exit = exit_fn
        self._drain = threading.Event()
        self._stop = threading.Event()
        self.drain_reason = ""
        self.exit_requested = False
        """The drain must end the process (SIGTERM: the pod is going away; or the training script asked), even
        where the trainer re-forms in place after a directive's drain."""
        self.store: Optional[Store] = None
        self.seen_generation = -1
        """The newest directive generation acted on or taken as history; it only ever rises."""
        self.round = keys.NO_ROUND
        """The rendezvous round this process belongs to (``$DISTTRAIN_RENDEZVOUS_ROUND``, read again whenever it
        joins a round): directives issued for an earlier round are not acted on."""
        self.refused: collections.Counter[str] = collections.Counter()
        """Directives read and not acted on, by :class:`~disttrain.api.control.DirectiveVerdict` (``older``,
        ``earlier-round``): replays, or the directive that formed this round."""
        self._refusals_logged: set[tuple[int, int, str]] = set()
        self._thread: Optional[threading.Thread] = None
        self._history = threading.Lock()
        self.on_reform: Optional[Callable[[keys.ControlSignal], bool]] = None
        """Takes a ``reform`` directive instead of the exit (returns whether it did)."""
        self.seen_diagnostics: Optional[str] = None
        """The id of the newest diagnostics request acted on (or present at connect: history)."""
        self._reliability: Optional[keys.ReliabilityReport] = None
        self._reliability_wanted = False
        self._reliability_read_at: Optional[float] = None
        self.beacons: Optional[BeaconSender] = None
        """Publishes the step beacons (:meth:`disttrain.trainer.progress.Reporter.send_beacon` makes it); stopped with
        this."""

    @property
    def drain_requested(self) -> bool:
        return self._drain.is_set()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def clear_drain(self) -> None:
        """A directive's drain was acted on without an exit (an in-place reform): the next one is a new request. A
        drain that must end the process stays."""
        if not self.exit_requested:
            self._drain.clear()
            self.drain_reason = ""

    def request_drain(self, reason: str, *, then_exit: bool = False) -> None:
        if not self._drain.is_set():
            self.drain_reason = reason
            log.info(
                "drain requested (%s): checkpoint at the next step boundary, then exit %d",
                reason,
                int(ExitCode.DRAINED),
            )
        self.exit_requested = self.exit_requested or then_exit
        self._drain.set()

    def install_sigterm(self) -> None:
        """SIGTERM means drain. Only the main thread may install handlers; elsewhere this is a no-op."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda signum, frame: self._on_sigterm())

    def _on_sigterm(self) -> None:
        self.request_drain("SIGTERM", then_exit=True)

    def connect(self, timeout_s: float = 30.0) -> None:
        if not self.endpoint:
            return
        host, port = parse_endpoint(self.endpoint)
        self.store = channel.connect(host, port, timeout_s)
        self.round = keys.parse_round(os.environ.get(env.RENDEZVOUS_ROUND))
        self.seen_generation = max(self.seen_generation, self._history_at_connect())
        request = keys.read_model(self.store, keys.DIAGNOSTICS_KEY, keys.DiagnosticsRequest)
        self.seen_diagnostics = request.id if request is not None else None
        self._reliability = keys.read_model(self.store, keys.RELIABILITY_KEY, keys.ReliabilityReport)
        self._reliability_read_at = time.monotonic()

    def _history_at_connect(self) -> int:
        """The newest generation present when this process connects: the directive's, and no lower than the target
        plan's, which the agent writes with the directive's generation just after it. A replayed older directive
        (or one garbled to absent) under the signal key cannot lower a fresh worker's history below it, so the
        directive that formed this worker's round is never taken for a new one. The plan is read first: a directive
        published between the two reads is then seen in the signal (written before the plan), never skipped."""
        assert self.store is not None
        plan = keys.read_model(self.store, keys.TARGET_KEY, keys.TargetPlan)
        current = read_signal(self.store)
        found = [
            item.generation
            for item in (plan, current)
            if item is not None and (not item.job_uid or not self.job_uid or item.job_uid == self.job_uid)
        ]
        return max(found, default=-1)

    def mark_history(self) -> None:
        """The directive in the store now is history (a worker that joins a new round in place, as one that
        starts): only a later generation is acted on."""
        self.round = keys.parse_round(os.environ.get(env.RENDEZVOUS_ROUND))
        if self.store is None:
            return
        try:
            current = read_signal(self.store)
        except Exception as exc:  # noqa: BLE001 - a flaky agent must not stop the reform
            log.debug("control channel read failed: %s", exc)
            return
        with self._history:
            if current is not None and self._is_ours(current):
                self.seen_generation = max(self.seen_generation, current.generation)
            self.clear_drain()  # a directive's drain seen only after the group drained on another rank's word

    def start(self, recorded_generation: int = -1, recorded_uid: Optional[str] = None) -> None:
        """Start polling; generations up to max(seen at connect, recorded in the checkpoint) are history.

        ``recorded_uid`` is the job that wrote the checkpoint: another job's generation means nothing here."""
        if recorded_uid is None or recorded_uid == self.job_uid:
            self.seen_generation = max(self.seen_generation, recorded_generation)
        elif recorded_generation >= 0:
            log.info(
                "checkpoint written by job uid %s, not this one (%s): its directive generation %d is not ours",
                recorded_uid,
                self.job_uid,
                recorded_generation,
            )
        if self.store is None:
            return
        self._thread = threading.Thread(target=self._run, name="disttrain-watchdog", daemon=True)
        self._thread.start()

    def stop(self, join_s: float = STOP_JOIN_S) -> None:
        """Stop polling and wait (up to ``join_s``) for the thread to leave its store call: a thread inside one
        when the interpreter finalises aborts the process (:func:`disttrain.trainer.store.signedstore._drain_at_exit`
        ends a call that outlasts the wait)."""
        self._stop.set()
        beacon_sender, self.beacons = self.beacons, None
        if beacon_sender is not None:
            beacon_sender.stop(join_s)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_s)

    def reliability(self) -> Optional[keys.ReliabilityReport]:
        """The agent's failure history as this watchdog's thread last read it (None before the first read or
        without a control channel). The training thread asks here rather than reading the store: a read from a
        store on a powered-off node waits out the operation's timeout, and the whole group's step with it."""
        self._reliability_wanted = True
        return self._reliability

    def follow_reliability(self) -> None:
        """Read the failure history again when it is due (once :meth:`reliability` has been asked for)."""
        now = time.monotonic()
        if self.store is None or not self._reliability_wanted:
            return
        if self._reliability_read_at is not None and now - self._reliability_read_at < RELIABILITY_READ_SECONDS:
            return
        self._reliability_read_at = now
        self._reliability = keys.read_model(self.store, keys.RELIABILITY_KEY, keys.ReliabilityReport) or (
            self._reliability
        )

    def poll_once(self) -> None:
        if self.store is None:
            return  # no control channel: only SIGTERM
        self.follow_diagnostics()
        self.follow_reliability()
        current = read_signal(self.store)
        if current is None:
            return
        with self._history:  # not interleaved with mark_history: a generation is acted on once
            verdict = keys.judge_directive(
                current, job_uid=self.job_uid, history=self.seen_generation, worker_round=self.round
            )
            if verdict in (keys.DirectiveVerdict.OLDER, keys.DirectiveVerdict.EARLIER_ROUND):
                self._refuse(current, verdict)
            if verdict is not keys.DirectiveVerdict.ACT:
                return
            self.seen_generation = current.generation
        if current.action == "reform" and self.on_reform is not None and self.on_reform(current):
            log.warning("reform signal (generation %d, %s): re-forming in place", current.generation, current.reason)
        elif current.action == "reform":
            log.warning(
                "reform signal (generation %d, %s): exiting %d now",
                current.generation,
                current.reason,
                int(ExitCode.REFORM),
            )
            sys.stderr.flush()
            startup.note_exit(self.store)
            self._exit(int(ExitCode.REFORM))
        elif current.action == "drain":
            self.request_drain(f"drain signal generation {current.generation}: {current.reason}")

    def _refuse(self, current: keys.ControlSignal, verdict: keys.DirectiveVerdict) -> None:
        """Count a directive not acted on (a replay, or the one that formed this round) and log it once. A directive
        of an earlier round becomes history: the history only ever rises."""
        self.refused[verdict.value] += 1
        if verdict is keys.DirectiveVerdict.EARLIER_ROUND:
            self.seen_generation = max(self.seen_generation, current.generation)
        seen = (current.generation, current.round, verdict.value)
        if seen in self._refusals_logged:
            return
        self._refusals_logged.add(seen)
        log.warning(
            "directive generation %d (%s) not acted on: %s (this worker: round %d, history generation %d)",
            current.generation,
            current.action.value,
            f"issued for round {current.round}"
            if verdict is keys.DirectiveVerdict.EARLIER_ROUND
            else "older than this worker's history",
            self.round,
            self.seen_generation,
        )

    def follow_diagnostics(self) -> None:
        """Dump this rank's stacks (:mod:`disttrain.trainer.diagnostics`) once per new request of the job agent: it
        asks when it finds a stalled step, and this thread answers while the main thread is stuck."""
        if self.store is None:
            return
        request = keys.read_model(self.store, keys.DIAGNOSTICS_KEY, keys.DiagnosticsRequest)
        if request is None or request.id == self.seen_diagnostics:
            return
        if request.job_uid and self.job_uid and request.job_uid != self.job_uid:
            return  # another job's (one recreated under this name): not ours to answer
        self.seen_diagnostics = request.id
        checkpoint_dir = os.environ.get(env.CHECKPOINT_DIR)
        if not checkpoint_dir:
            log.warning("diagnostics %s asked for, but no $%s to write to", request.id, env.CHECKPOINT_DIR)
            return
        rank = int(os.environ.get("RANK", "0") or 0)
        directory = os.path.join(checkpoint_dir, keys.DIAGNOSTICS_FOLDER)
        diagnostics.dump(directory, request.id, os.environ.get(env.NODE_NAME, "node"), rank)

    def _is_ours(self, current: keys.ControlSignal) -> bool:
        """Whether ``current`` was issued for this job (a signal or worker without a uid predates uids)."""
        return not current.job_uid or not self.job_uid or current.job_uid == self.job_uid

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.poll_once()
            except Exception as exc:  # noqa: BLE001 - a flaky agent must not kill training
                log.debug("control channel poll failed: %s", exc)

    def publish(self, key: str, value: str) -> None:
        """Write a progress/checkpoint record for the agent (best effort: the agent may be restarting)."""
        if self.store is None:
            return
        link = resilient.resilient_of(self.store)
        try:
            with link.quick() if link is not None else contextlib.nullcontext():
                self.store.set(key, value)
        except Exception as exc:  # noqa: BLE001
            log.debug("could not publish %s: %s", key, exc)


def report_failure(exit_code: int, message: str, endpoint: Optional[str] = None, timeout_s: float = 5.0) -> bool:
    """Tell the job agent why this worker is about to exit (best effort; returns whether it was written).

    torchrun turns a worker's exit code into its own (1) or restarts the worker, so a pod's exit code cannot
    carry ``ExitCode.PERMANENT``; the ``FAILURE_KEY`` record can, and the operator fails the job on it instead
    of crash-looping. Works before the contract or the process group exists: it only needs the endpoint.
    """
    endpoint = endpoint if endpoint is not None else os.environ.get(env.AGENT_ENDPOINT)
    if not endpoint:
        return False
    try:
        host, port = parse_endpoint(endpoint)
        store = channel.connect(host, port, timeout_s)
        record = keys.WorkerFailure(
            exit_code=exit_code, node=os.environ.get(env.NODE_NAME, ""), message=message[:2000], time=time.time()
        )
        store.set(keys.FAILURE_KEY, record.model_dump_json())
        return True
    except Exception as exc:  # noqa: BLE001 - the exit code and the log still say it
        log.warning("could not report the failure to the job agent at %s: %s", endpoint, exc)
        return False
