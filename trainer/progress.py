"""What a finished step tells the world: metrics, rank 0's log line and progress record, and this rank's side of the
boundary agreement (with rank 0's automatic checkpoint interval).

Called by :class:`~disttrain.trainer.loop.ElasticTrainer` after each optimizer step. It reads the trainer and never
changes its training state. The loss it reports is the step's global loss (docs/trainer.md, "The loss contract"),
reduced over the ranks only at the steps :func:`is_loss_read` names and read from the device only then.
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
from disttrain.trainer.checkpoint import autointerval
from disttrain.trainer.control import Watchdog

if TYPE_CHECKING:
    from disttrain.trainer.loop import ElasticTrainer
    from disttrain.trainer.step import Step

log = logging.getLogger("disttrain.trainer")


def is_loss_read(trainer: ElasticTrainer, step_number: int) -> bool:
    """Whether step ``step_number``'s global loss is reduced and reported: at rank 0's log lines (every
    ``log_every`` steps and step 1) and, with a control channel, at every step (the progress record carries it).
    Decided from the step number and the job's configuration alone, so every rank agrees (the reduction is a
    collective); at other steps nothing reads the loss, so no rank waits for the device to produce it."""
    logging_due = step_number % trainer.options.log_every == 0 or step_number == 1
    return logging_due or bool(trainer.watchdog.endpoint)


def report_step(trainer: ElasticTrainer, step: Step, seconds: float) -> None:
    """Feed the interval planner, set the step metrics and, on rank 0, log and publish the progress record."""
    ckpts = trainer.checkpoints
    if trainer.planner is not None:  # the step time without what saves blocked it
        blocked, trainer.blocked_seen = ckpts.blocked_s - trainer.blocked_seen, ckpts.blocked_s
        trainer.planner.observe_step(seconds - blocked)
    m, state = trainer.metrics, trainer.state
    m.step.set(state.step)
    m.world_size.set(trainer.world_size)
    m.accum_steps.set(trainer.plan.accum_steps)
    rate = trainer.plan.global_batch / seconds if seconds > 0 else 0.0
    m.samples_per_second.set(rate)
    loss = step.global_loss  # None where the step did not reduce it (is_loss_read)
    if loss is not None:
        m.loss.set(loss)
    if trainer.rank != 0:
        return
    logging_due = state.step % trainer.options.log_every == 0 or state.step == 1
    if logging_due:
        log.info(
            "step %d loss %s lr %.4g world %d samples/s %.0f",
            state.step,
            f"{loss:.4f}" if loss is not None else "-",
            trainer.optimizer.param_groups[0]["lr"],
            trainer.world_size,
            rate,
        )
    if trainer.watchdog.store is not None:
        report = control_keys.ProgressReport(
            step=state.step,
            samples_consumed=state.samples_consumed,
            world_size=trainer.world_size,
            plan=trainer.plan.to_status(),
            loss=loss,
            samples_per_second=rate,
            restart_count=trainer.ctx.restart_count,
            run_id=trainer.ctx.run_id,
            resumed_from_step=trainer.resumed_from,
            resumed_from_job_uid=trainer.resumed_from_job_uid,
            resumed_from_memory=trainer.resumed_from_memory,
            recovery_note=trainer.recovery_note,
            process_id=trainer.process_id,
            time=time.time(),
            startup=trainer.startup.report(),
            in_place_fallback=trainer.in_place_fallback,
            checkpoint_upload=trainer.checkpoints.commits.upload_backlog(),
            checkpoint_blocked_seconds=round(ckpts.blocked_s, 3),
        )
        trainer.watchdog.publish(control_keys.PROGRESS_KEY, report.model_dump_json())


def send_beacon(trainer: ElasticTrainer, step: int) -> None:
    """Tell the job agent this rank reached ``step``'s gradient reduction (its stall rule names the ranks that did
    not). On an accelerator the beacon goes out when the device gets there, not when the host queued the work
    (:mod:`disttrain.trainer.beacons`). One signed ``set`` per rank and step, about a TCP round trip to the agent
    (well under a millisecond on a cluster network), and none without a control channel."""
    watchdog = trainer.watchdog
    if watchdog.store is None:
        return
    sender = watchdog.beacons
    if sender is None:
        sender = watchdog.beacons = beacons.for_device(trainer.device, watchdog.publish)
    rank, world_size = trainer.rank, trainer.world_size
    saving = bool(trainer.checkpoints.local_pending_state()[0])
    group = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"

    def render(reached_at: float) -> str:
        return control_keys.StepBeacon(
            step=step,
            rank=rank,
            world_size=world_size,
            group=group,
            node=os.environ.get(env.NODE_NAME, ""),
            pod_uid=os.environ.get(env.POD_UID, ""),
            saving=saving,
            time=reached_at,
        ).model_dump_json()

    sender.send(control_keys.beacon_key(rank), render)


def boundary_flags(trainer: ElasticTrainer) -> BoundaryFlags:
    """This rank's side of the boundary agreement."""
    ckpts = trainer.checkpoints
    save_in_progress, save_failed = ckpts.local_pending_state()
    pending = ckpts.pending
    return BoundaryFlags.of_rank(
        drain=trainer.watchdog.drain_requested,
        save_in_progress=bool(save_in_progress),
        save_failed=bool(save_failed),
        seconds_due=trainer.rank == 0 and ckpts.seconds_due(),
        pending_step=pending.step if pending is not None else NO_SAVE,
        interval_steps=_propose_interval(trainer),
    )


def _propose_interval(trainer: ElasticTrainer) -> int:
    """Rank 0's automatic checkpoint interval for the boundary agreement (0: none), published when it changes."""
    if trainer.planner is None:
        return 0
    checkpoints = trainer.checkpoints
    steps = trainer.planner.propose(checkpoints.last_save_blocking_s, checkpoints.commits.last_upload_seconds())
    report = trainer.planner.report()
    if report is not None:
        trainer.watchdog.publish(control_keys.INTERVAL_KEY, report.model_dump_json())
    return steps


def interval_planner(
    rank: int, auto_interval: bool, watchdog: Watchdog, kept: Optional[autointerval.IntervalPlanner] = None
) -> Optional[autointerval.IntervalPlanner]:
    """The automatic checkpoint interval's planner of a group (``intervalSteps: auto``): rank 0 estimates and the
    boundary agreement carries its interval to every rank; ``kept``, the planner of this process's previous group,
    goes on with its estimates."""
    if rank != 0 or not auto_interval:
        return None
    return kept if kept is not None else autointerval.IntervalPlanner(lambda: read_reliability(watchdog))


def read_reliability(watchdog: Watchdog) -> Optional[control_keys.ReliabilityReport]:
    """The agent's failure-rate estimate for the interval planner (None without a control channel or before the
    watchdog's thread first read it)."""
    return watchdog.reliability()
