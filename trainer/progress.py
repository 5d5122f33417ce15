"""What a finished step tells the world: metrics, rank 0's log line and progress record, and this rank's side of the
boundary agreement (with rank 0's automatic checkpoint interval).

Called by the training loop after each optimizer step, with the current group's state
(:class:`~disttrain.trainer.groupstate.GroupState`); it never changes the training state. The loss it reports is the
step's global loss (docs/trainer.md, "The loss contract"), reduced over the ranks only at the steps
:meth:`Reporter.is_loss_read` names and read from the device only then.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Optional

from disttrain.api import control as control_keys
from disttrain.api import env
from disttrain.trainer import beacons
from disttrain.trainer.boundary import NO_SAVE, BoundaryFlags
from disttrain.trainer.control import Watchdog

if TYPE_CHECKING:
    from disttrain.trainer.checkpoint.manager import TrainerState
    from disttrain.trainer.groupstate import GroupState
    from disttrain.trainer.metrics import TrainerMetrics
    from disttrain.trainer.snapshots import Resumption
    from disttrain.trainer.step import Step

log = logging.getLogger("disttrain.trainer")


class Reporter:
    """What a trainer tells the world after each step; it keeps what outlives the groups (the watchdog, the metrics,
    the log cadence) and is handed the current group's state at each call."""

    def __init__(
        self, log_every: int, watchdog: Watchdog, metrics: TrainerMetrics, in_place_fallback: Optional[str]
    ) -> None:
        self.log_every = log_every
        self.watchdog = watchdog
        self.metrics = metrics
        self.in_place_fallback = in_place_fallback
        """Why reforms restart this job's workers although in place was asked for (rank 0 reports it)."""
        self.blocked_seen = 0.0
        """The seconds saves had blocked training at the last step (the planner gets the step time without them)."""

    def is_loss_read(self, step_number: int) -> bool:
        """Whether step ``step_number``'s global loss is reduced and reported: at rank 0's log lines (every
        ``log_every`` steps and step 1) and, with a control channel, at every step (the progress record carries it).
        Decided from the step number and the job's configuration alone, so every rank agrees (the reduction is a
        collective); at other steps nothing reads the loss, so no rank waits for the device to produce it."""
        logging_due = step_number % self.log_every == 0 or step_number == 1
        return logging_due or bool(self.watchdog.endpoint)

    def report_step(
        self, group: GroupState, state: TrainerState, resumption: Resumption, step: Step, seconds: float, lr: float
    ) -> None:
        """Feed the interval planner, set the step metrics and, on rank 0, log and publish the progress record
        (``lr``: the first param group's)."""
        ckpts = group.checkpoints
        if group.planner is not None:  # the step time without what saves blocked it
            blocked, self.blocked_seen = ckpts.blocked_s - self.blocked_seen, ckpts.blocked_s
            group.planner.observe_step(seconds - blocked)
        m = self.metrics
        m.step.set(state.step)
        m.world_size.set(group.world_size)
        m.accum_steps.set(group.plan.accum_steps)
        rate = group.plan.global_batch / seconds if seconds > 0 else 0.0
        m.samples_per_second.set(rate)
        loss = step.global_loss  # None where the step did not reduce it (is_loss_read)
        if loss is not None:
            m.loss.set(loss)
        if group.rank != 0:
            return
        logging_due = state.step % self.log_every == 0 or state.step == 1
        if logging_due:
            log.info(
                "step %d loss %s lr %.4g world %d samples/s %.0f",
                state.step,
                f"{loss:.4f}" if loss is not None else "-",
                lr,
                group.world_size,
                rate,
            )
        if self.watchdog.store is not None:
            report = control_keys.ProgressReport(
                step=state.step,
                samples_consumed=state.samples_consumed,
                world_size=group.world_size,
                plan=group.plan.to_status(),
                loss=loss,
                samples_per_second=rate,
                restart_count=group.context.restart_count,
                run_id=group.context.run_id,
                resumed_from_step=resumption.step,
                resumed_from_job_uid=resumption.job_uid,
                resumed_from_memory=resumption.from_memory,
                recovery_note=resumption.note,
                process_id=group.process_id,
                time=time.time(),
                startup=group.startup.report(),
                in_place_fallback=self.in_place_fallback,
                checkpoint_upload=ckpts.commits.upload_backlog(),
                checkpoint_blocked_seconds=round(ckpts.blocked_s, 3),
            )
            self.watchdog.publish(control_keys.PROGRESS_KEY, report.model_dump_json())

    def send_beacon(self, group: GroupState, step: int) -> None:
        """Tell the job agent this rank reached ``step``'s gradient reduction (its stall rule names the ranks that
        did not). On an accelerator the beacon goes out when the device gets there, not when the host queued the
        work (:mod:`disttrain.trainer.beacons`). One signed ``set`` per rank and step, about a TCP round trip to the
        agent (well under a millisecond on a cluster network), and none without a control channel."""
        watchdog = self.watchdog
        if watchdog.store is None:
            return
        sender = watchdog.beacons
        if sender is None:
            sender = watchdog.beacons = beacons.for_device(group.device, watchdog.publish)
        rank, world_size = group.rank, group.world_size
        saving = bool(group.checkpoints.local_pending_state()[0])
        where = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"

        def render(reached_at: float) -> str:
            return control_keys.StepBeacon(
                step=step,
                rank=rank,
                world_size=world_size,
                group=where,
                node=os.environ.get(env.NODE_NAME, ""),
                pod_uid=os.environ.get(env.POD_UID, ""),
                saving=saving,
                time=reached_at,
            ).model_dump_json()

        sender.send(control_keys.beacon_key(rank), render)

    def boundary_flags(self, group: GroupState) -> BoundaryFlags:
        """This rank's side of the boundary agreement."""
        ckpts = group.checkpoints
        save_in_progress, save_failed = ckpts.local_pending_state()
        pending = ckpts.pending
        return BoundaryFlags.of_rank(
            drain=self.watchdog.drain_requested,
            save_in_progress=bool(save_in_progress),
            save_failed=bool(save_failed),
            seconds_due=group.rank == 0 and ckpts.seconds_due(),
            pending_step=pending.step if pending is not None else NO_SAVE,
            interval_steps=self._propose_interval(group),
        )

    def _propose_interval(self, group: GroupState) -> int:
        """Rank 0's automatic checkpoint interval for the boundary agreement (0: none), published when it changes."""
        if group.planner is None:
            return 0
        checkpoints = group.checkpoints
        steps = group.planner.propose(checkpoints.last_save_blocking_s, checkpoints.commits.last_upload_seconds())
        report = group.planner.report()
        if report is not None:
            self.watchdog.publish(control_keys.INTERVAL_KEY, report.model_dump_json())
        return steps
