"""How a trainer's group ends: drain (SIGTERM, the agent, the script), a failed collective, the operator's reform
directive, and the handover to the next round in place (:mod:`disttrain.trainer.inplace`,
:mod:`disttrain.trainer.launch.handover`).

:class:`Lifecycle` belongs to one trainer (its :class:`Host`), whose loop asks it at every step boundary whether the
group has ended (a failure, the reform directive, a drain in place). It decides between exiting with the
:class:`~disttrain.api.exitcodes.ExitCode` the operator reads and staying for the next round; in place it leaves the
old group and replaces the host's :class:`~disttrain.trainer.groupstate.GroupState` with the next group's, built by
:func:`~disttrain.trainer.groupstate.form` as at the first start. It never trains.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Optional, Protocol

import torch

from disttrain.api import control as control_keys
from disttrain.api.exitcodes import ExitCode
from disttrain.api.plan import InvalidWorldSizeError
from disttrain.trainer import context as ctx_mod
from disttrain.trainer import exits, failures, groupstate, inplace, teardown
from disttrain.trainer import parallel as parallel_mod
from disttrain.trainer import sampler as sampler_mod
from disttrain.trainer import startup as startup_mod
from disttrain.trainer.failures import is_collective_failure
from disttrain.trainer.groupstate import GroupState, Lasting
from disttrain.trainer.launch.handover import WorkerLink
from disttrain.trainer.options import LifecycleOptions
from disttrain.trainer.recovery import Memory

log = logging.getLogger("disttrain.trainer")

SHARDED_GRACE_MARGIN_S = 5.0
"""What a worker holding a sharded state waits beyond the collective timeout before it gives up on staying."""

ABORT_AFTER_S = 1.0
"""How long the loop has after the reform directive to reach its reform by itself before the communicators are
aborted under it: a step that ends sooner is kept, one blocked on a dead peer is freed."""


class Host(Protocol):
    """What a :class:`Lifecycle` needs of the trainer it serves: the group's state, which it replaces at a reform, the
    step count, and the loop's own steps of ending and starting a group."""

    group: GroupState

    @property
    def step(self) -> int: ...

    def commit_current_step(self) -> None:
        """Make sure a committed checkpoint holds every step that ran."""

    def finish_uploads(self) -> None:
        """With a bucket: the last saves reach it."""

    def close_feed(self) -> None:
        """Stop the data loader's workers."""

    def resume(self) -> None:
        """Take the state the group continues from."""


class Lifecycle:
    """Signals, drain and in-place reforms of one trainer (see the module docstring)."""

    def __init__(
        self, host: Host, options: LifecycleOptions, lasting: Lasting, link: Optional[WorkerLink], memory: Memory
    ) -> None:
        self.host = host
        self.options = options
        self.lasting = lasting
        self.in_place = lasting.in_place
        """The job's workers reform in place: the same on every rank, so every new group agrees on the state before
        it resumes."""
        self.memory = memory
        self.link = link
        """This process's channel to its launcher (None: it cannot wait for the next round and restarts instead)."""
        self.group_failure: Optional[BaseException] = None
        """A collective failure kept from the user's code; the step is redone in the next group."""
        self.reform_signal: Optional[control_keys.ControlSignal] = None
        self.drained_in_place = False
        self._reforming = threading.Event()

    @property
    def can_stay(self) -> bool:
        """This process can outlive its group: it reforms in place and has a launcher to ask for the next round."""
        return self.in_place and self.link is not None

    def start(self) -> None:
        """Guard the wrapper and listen for the reform directive (once the trainer's parts are in place)."""
        self.guard_wrapper()
        if self.link is not None:
            self.lasting.watchdog.on_reform = self.on_reform_directive

    def close(self) -> None:
        if self.link is not None:
            self.link.close()

    # ---- failures ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def keeping_group_failures(self) -> Iterator[None]:
        """In place, a collective failure inside the block is noted (:attr:`group_failure`) instead of raised: the
        step is redone in the next group. Otherwise, and for any other error, the exception goes on."""
        try:
            yield
        except BaseException as exc:
            if not (self.can_stay and inplace.is_group_failure(exc)):
                raise
            self.note_group_failure(exc)

    def note_group_failure(self, exc: BaseException) -> None:
        if self.group_failure is None:
            self.group_failure = exc
            log.warning(
                "a collective failed (%s: %s); re-forming in place",
                type(exc).__name__,
                str(exc).splitlines()[0][:200] if str(exc) else "",
            )

    def guard_wrapper(self) -> None:
        """Keep a failed buffer broadcast in DDP's forward (called from the user's code) from the user."""
        model = self.host.group.model
        if self.can_stay and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            inplace.guard_buffer_sync(model, self.note_group_failure)

    def exit_on_error(self, exc: BaseException) -> None:
        """A user error or a collective desync exits PERMANENT and a failed collective REFORM, without Python's
        shutdown (it can block on a dead peer); anything else is written to torchrun's error file (the launcher puts
        its last line in the pod's termination message) and propagates (exit 1, retryable)."""
        if isinstance(exc, (sampler_mod.DatasetChangedError, InvalidWorldSizeError, ctx_mod.ContractError)):
            exits.exit_permanent(str(exc))
        desync = failures.find_desync(exc)
        if desync is not None:  # a program bug: every new group would repeat it
            log.error("torch: %s", " ".join(str(exc).split()))
            exits.record_error(failures.CollectiveDesyncError(desync.message()))
            exits.exit_permanent(desync.message())
        if is_collective_failure(exc):
            log.error(
                "a collective failed (%s: %s); exiting %d so the group re-forms from the last checkpoint",
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
                int(ExitCode.REFORM),
            )
            startup_mod.note_exit(self.lasting.watchdog.store)
            exits.hard_exit(ExitCode.REFORM)
        exits.record_error(exc)

    # ---- drain -------------------------------------------------------------------------------------------
    def drain(self) -> None:
        """Commit the current step, then exit ``ExitCode.DRAINED``: no step that ran is lost. In place, a worker
        that is neither stopped (SIGTERM) nor a victim of the directive stays for the next round instead."""
        host = self.host
        host.commit_current_step()
        watchdog, step = self.lasting.watchdog, host.step
        reason = watchdog.drain_reason or "drain on another rank"
        if self.can_stay and not watchdog.exit_requested and not self.is_excluded():
            log.info("drained at step %d (%s): checkpoint step-%d committed; re-forming in place", step, reason, step)
            watchdog.clear_drain()
            self.drained_in_place = True
            return
        log.info(
            "drained at step %d (%s): checkpoint step-%d committed; exiting %d",
            step,
            reason,
            step,
            int(ExitCode.DRAINED),
        )
        host.finish_uploads()  # with checkpoint.uri: the drain's save reaches the bucket before the pod goes
        watchdog.stop()
        host.group.checkpoints.join_retention()
        startup_mod.note_exit(watchdog.store)
        exits.hard_exit(ExitCode.DRAINED)

    def is_excluded(self) -> bool:
        """This node is a victim of the directive in flight (the agent's target plan excludes it)."""
        store = self.lasting.watchdog.store
        if store is None:
            return False
        target = control_keys.read_model(store, control_keys.TARGET_KEY, control_keys.TargetPlan)
        return target is not None and self.host.group.context.node_name in target.exclude

    # ---- in-place reforms --------------------------------------------------------------------------------
    def on_reform_directive(self, signal: control_keys.ControlSignal) -> bool:
        """The watchdog's ``reform`` directive (its thread): the loop re-forms in place at its next chance (the
        next collective fails at once when a peer died; else at the end of the step). A loop that does not get there
        within :data:`ABORT_AFTER_S` is blocked in a device wait or a collective: this thread, which is not, aborts the
        communicators and shuts down the gloo groups' connections
        (:func:`~disttrain.trainer.teardown.abort_communicators`), which frees it, and the step is not counted. One
        still blocked after ``reform_grace_s`` exits ``REFORM`` and restarts; a worker that holds a sharded state in
        memory waits the collective timeout (and a margin) first, since its memory is the group's state and a gloo
        receive whose connections could not be shut down (no ``/proc``) fails only then."""
        self.reform_signal = signal
        grace_s = self.options.reform_grace_s
        if self.lasting.template is not None:
            timeout_s = self.host.group.context.contract.collective_timeout_seconds
            grace_s = max(grace_s, timeout_s + SHARDED_GRACE_MARGIN_S)

        def exit_if_blocked() -> None:
            if not self._reforming.wait(min(ABORT_AFTER_S, grace_s)):
                aborted = teardown.abort_communicators()
                log.warning(
                    "reform signal (generation %d, %s): the loop is blocked; aborted %d communicators",
                    signal.generation,
                    signal.reason,
                    aborted,
                )
            if not self._reforming.wait(max(0.0, grace_s - ABORT_AFTER_S)):
                log.warning(
                    "reform signal (generation %d, %s): no in-place reform within %.0f s (a collective blocks); "
                    "exiting %d",
                    signal.generation,
                    signal.reason,
                    grace_s,
                    int(ExitCode.REFORM),
                )
                startup_mod.note_exit(self.lasting.watchdog.store)
                exits.hard_exit(ExitCode.REFORM)

        threading.Thread(target=exit_if_blocked, name="disttrain-reform-grace", daemon=True).start()
        return True

    def reform_in_place(self) -> None:
        """Leave the group, take the next round from the launcher, rebuild what belongs to a group and resume from
        the state the new group agrees on. Exits ``REFORM`` when no round comes (the launcher then restarts it)."""
        self._reforming.set()
        cause = (
            f"collective failed: {type(self.group_failure).__name__}"
            if self.group_failure is not None
            else f"reform directive generation {self.reform_signal.generation}"
            if self.reform_signal is not None
            else "drained"
        )
        host = self.host
        step = host.step
        self.group_failure = None  # its traceback holds the old group's objects: they must go now (_leave_group)
        # Every wait in leaving has a deadline (the save in flight, the teardown); this bounds the rest.
        bound = host.group.context.contract.collective_timeout_seconds + 5.0 + teardown.LEAVE_DEADLINE_S
        with teardown.hang_guard(bound + teardown.HANG_MARGIN_S, "leaving the group"):
            startup_mod.note_exit(self.lasting.watchdog.store)
            self._leave_group()
        env = self.link.request_round(step, self.options.round_wait_s) if self.link is not None else None
        if env is None:
            log.warning("no next round for this worker (%s); exiting %d", cause, int(ExitCode.REFORM))
            exits.hard_exit(ExitCode.REFORM)
        log.info("re-forming in place after step %d (%s)", step, cause)
        self._join_round(env)
        host.resume()
        self.group_failure, self.reform_signal, self.drained_in_place = None, None, False
        self._reforming.clear()

    def _leave_group(self) -> None:
        """Drop everything bound to the group that ended: a save in flight, the loader, the wrapper, the groups."""
        host, group = self.host, self.host.group
        try:
            group.checkpoints.abandon(timeout_s=group.context.contract.collective_timeout_seconds + 5.0)
        except RuntimeError as exc:
            log.warning("cannot re-form in place (%s); exiting %d", exc, int(ExitCode.REFORM))
            exits.hard_exit(ExitCode.REFORM)
        host.close_feed()
        self.lasting.optimizer.zero_grad(set_to_none=True)
        try:
            group.agreement.settle()  # fails at once on a broken group; a left group must hold no work in flight
        except Exception as exc:  # noqa: BLE001 - the failure that ends this group, seen once more
            log.debug("the boundary agreement in flight ended with: %s", exc)
        self.memory.leave()
        inplace.retire(group.model)
        sharded = self.lasting.template is not None
        if sharded:  # the old model and its mesh go now; the memory holds the state
            parallel_mod.release(self.lasting.optimizer)
        host.group = group.left(drop_model=sharded)
        del group
        inplace.leave_groups()

    def _join_round(self, environ: Mapping[str, str]) -> None:
        """Become the worker of the next round ``environ`` describes (what torchrun would have started a process
        with), and form the next group's state the way the first start formed it."""
        host, lasting = self.host, self.lasting
        handed_over = time.time()
        os.environ.clear()
        os.environ.update(environ)
        os.environ[startup_mod.HANDOVER_ENV] = repr(handed_over)
        clock = startup_mod.StartupClock(handed_over)
        clock.mark("setup_begin", handed_over)
        ctx = groupstate.context_or_exit()
        groups = ctx_mod.init_process_group(ctx, use_cuda=host.group.device.type == "cuda")
        host.group = group = groupstate.form(ctx, groups, clock, lasting, host.group)
        lasting.metrics.restart_count.set(ctx.restart_count)
        lasting.watchdog.mark_history()  # the directive that ended the old group is done with this round
        teardown.joined_new_group()
        self.guard_wrapper()
        if group.rank == 0:
            first, last = startup_mod.take_exit_times(lasting.watchdog.store)
            clock.stamps["old_exit_first"], clock.stamps["old_exit_last"] = first, last
        clock.mark("group_ready")
