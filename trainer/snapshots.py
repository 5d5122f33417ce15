"""The trainer's state in and out of checkpoints: what a checkpoint holds, its manifest, and the resume.

Called by :class:`~disttrain.trainer.loop.ElasticTrainer` at every save and at every (re)start: a fresh process
resumes from the newest complete checkpoint (:func:`resume`); in place (:mod:`disttrain.trainer.inplace`) every new
group first agrees on the newest state any member holds, and takes it from that member's memory when it is newer
than the checkpoint (:func:`resume_from_memory`). Saving itself, and when, belongs to
:class:`~disttrain.trainer.checkpoint.manager.CheckpointManager`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Optional

from disttrain.api.contract import training_config_hash
from disttrain.api.manifest import CheckpointManifest
from disttrain.trainer import evaluation as evaluation_mod
from disttrain.trainer import inplace, recovery
from disttrain.trainer import lr as lr_mod
from disttrain.trainer import precision as precision_mod
from disttrain.trainer import sampler as sampler_mod
from disttrain.trainer.checkpoint import manager as ckpt_mod

if TYPE_CHECKING:
    from disttrain.trainer.loop import ElasticTrainer

log = logging.getLogger("disttrain.trainer")

try:
    from importlib.metadata import version as _pkg_version

    CODE_VERSION = _pkg_version("disttrain")
except Exception:  # noqa: BLE001 - running from a source tree without metadata
    CODE_VERSION = "0+unknown"


def contents(trainer: ElasticTrainer) -> dict[str, Any]:
    """What a checkpoint holds, as DCP Statefuls: model + optimizer, the trainer's state, the scheduler, the fp16
    scaler and the user's state."""
    held: dict[str, Any] = {
        "app": ckpt_mod.ModelOptimState(trainer.raw_model, trainer.optimizer),
        "trainer": trainer.state,
    }
    if trainer.scheduler is not None:
        held["scheduler"] = ckpt_mod.SchedulerState(trainer.scheduler)
    if trainer.precision.scaler is not None:
        held["grad_scaler"] = precision_mod.GradScalerState(trainer.precision.scaler)
    for name, stateful in trainer.options.checkpoint.user_state.items():
        held[f"user/{name}"] = stateful
    return held


def manifest(trainer: ElasticTrainer) -> CheckpointManifest:
    """The manifest of a save of the current step (digests and times are filled in by the commit)."""
    state, training = trainer.state, trainer.training
    return CheckpointManifest(
        step=state.step,
        samples_consumed=state.samples_consumed,
        data_cursor=state.data_cursor,
        world_size=trainer.world_size,
        plan=trainer.plan.to_status(),
        lr_scale=trainer.lr_state.scale_at(max(0, state.step - 1), training.lr.ramp_steps),
        dataset=trainer.sampler.fingerprint,
        metadata_sha256="pending",
        files={},
        created_at="pending",
        code_version=CODE_VERSION,
        config_hash=training_config_hash(training),
        job=trainer.ctx.job,
        job_uid=trainer.ctx.job_uid or None,
        effects=trainer.effects.record_for(state.step),
    )


def resume(trainer: ElasticTrainer) -> None:
    """Load the state this group continues from (the newest checkpoint, or in place a member's memory), recompute
    the LR ramp and start the watchdog."""
    found = trainer.checkpoints.find_latest()
    ramp = trainer.training.lr.ramp_steps
    trainer.recovery_note, trainer.resumed_from_memory = None, None
    if trainer.lifecycle.in_place and trainer.template is not None:
        # A sharded model: rebuilt from the members' memory, resharded onto this group's mesh.
        trainer.replica_group = recovery.new_replica_group(trainer)
        rebuilt = recovery.resume_from_memory(trainer, contents(trainer), found.step if found is not None else None)
        if rebuilt.step is not None:
            _resumed_in_place(trainer, rebuilt.step, found)
            trainer.resumed_from_memory = True
            log.info(
                "resumed in place from step %d held in memory (%.1f MB fetched from peers in %.2f s) at world size "
                "%d: plan %s, samples consumed %d; the newest checkpoint is step %s",
                rebuilt.step,
                rebuilt.fetched_bytes / 1e6,
                rebuilt.seconds,
                trainer.world_size,
                trainer.plan.to_status(),
                trainer.state.samples_consumed,
                found.step if found is not None else "none",
            )
            restore_effects(trainer, found)
            return
        if trainer.has_state or rebuilt.reason != "no member holds state in memory":
            trainer.recovery_note, trainer.resumed_from_memory = rebuilt.reason, False
            log.warning(
                "cannot resume in place from memory (%s): loading the newest complete checkpoint", rebuilt.reason
            )
    elif trainer.lifecycle.in_place:
        # Every new group agrees first: a member may hold a newer step in memory than any checkpoint.
        holdings = inplace.gather_holdings(
            trainer.state.step if trainer.has_state else inplace.NO_STATE,
            found.step if found is not None else inplace.NO_STATE,
            trainer.world_size,
        )
        source = inplace.choose_source(holdings)
        if source is not None:
            resume_from_memory(trainer, source, holdings)
            restore_effects(trainer, found)
            return
        if found is None:
            inplace.broadcast_module(trainer.raw_model)  # what DDP's construction did before init_sync=False
    if found is None:
        if trainer.rank == 0:
            log.info(
                "no complete checkpoint in %s: starting at step 0 (world size %d, plan %s)",
                trainer.ctx.checkpoint_dir,
                trainer.world_size,
                trainer.plan.to_status(),
            )
        trainer.lr_state = lr_mod.ramp_after_resume(None, None, 0, trainer.plan.lr_scale, 0, ramp)
        trainer.watchdog.start()
        restore_effects(trainer, None)
        return
    sampler_mod.check_fingerprint(found.dataset, trainer.sampler.fingerprint)
    if found.config_hash != training_config_hash(trainer.training):
        log.warning(
            "spec.training changed since checkpoint step-%d (config hash differs); continuing with the new contract",
            found.step,
        )
    trainer.checkpoints.load(found, contents(trainer))
    s = trainer.state
    if s.data_cursor != s.samples_consumed or s.data_cursor != found.data_cursor:
        # The cursor is the number of samples consumed by construction; anything else would replay or skip.
        gap = s.data_cursor - s.samples_consumed
        (trainer.metrics.samples_replayed if gap < 0 else trainer.metrics.samples_skipped).inc(abs(gap))
    _restore_lr(trainer)
    trainer.resumed_from = found.step
    trainer.resumed_from_job_uid = found.job_uid
    log.info(
        "resumed from checkpoint step-%d (saved at world size %d) at world size %d: plan %s, "
        "samples consumed %d, LR factor %.4g -> %.4g over %d steps",
        found.step,
        found.world_size,
        trainer.world_size,
        trainer.plan.to_status(),
        s.samples_consumed,
        trainer.lr_state.start_scale,
        trainer.lr_state.target_scale,
        ramp,
    )
    trainer.watchdog.start(recorded_generation=s.control_generation, recorded_uid=found.job_uid)
    restore_effects(trainer, found)


def resume_from_memory(trainer: ElasticTrainer, source: int, holdings: list[inplace.Holding]) -> None:
    """Take the state of rank ``source``'s memory (every rank that holds another step loads it): nothing that ran
    since the last checkpoint is redone."""
    newest = holdings[source].memory_step
    receivers = [r for r, h in enumerate(holdings) if h.memory_step != newest]
    t0 = time.monotonic()
    sent = 0
    if receivers:
        sent = inplace.broadcast_state(contents(trainer), source, trainer.rank in receivers)
    s = trainer.state
    _restore_lr(trainer)
    trainer.resumed_from, trainer.resumed_from_memory = s.step, True
    disk = holdings[0].disk_step
    # The same history on every rank (when a save is due follows from it): the newest complete checkpoint.
    newest_checkpoint = disk if disk != inplace.NO_STATE else None
    ckpts = trainer.checkpoints
    ckpts.loaded_step = ckpts.last_saved_step = ckpts.commits.last_committed_step = newest_checkpoint
    log.info(
        "resumed in place from step %d held in memory by rank %d (%d of %d ranks received %.1f MB in %.2f s) at "
        "world size %d: plan %s, samples consumed %d; the newest checkpoint is step %s",
        newest,
        source,
        len(receivers),
        trainer.world_size,
        sent / 1e6,
        time.monotonic() - t0,
        trainer.world_size,
        trainer.plan.to_status(),
        s.samples_consumed,
        disk if disk != inplace.NO_STATE else "none",
    )
    if not trainer.watchdog.started:
        trainer.watchdog.start(recorded_generation=s.control_generation, recorded_uid=trainer.ctx.job_uid or None)


def _resumed_in_place(trainer: ElasticTrainer, step: int, found: Optional[CheckpointManifest]) -> None:
    """After a sharded state was rebuilt from memory at ``step``: the LR ramp, the checkpoint history (the newest
    complete checkpoint, the same on every rank) and the watchdog."""
    s = trainer.state
    _restore_lr(trainer)
    trainer.resumed_from = step
    newest_checkpoint = found.step if found is not None else None
    ckpts = trainer.checkpoints
    ckpts.loaded_step = ckpts.last_saved_step = ckpts.commits.last_committed_step = newest_checkpoint
    if not trainer.watchdog.started:
        trainer.watchdog.start(recorded_generation=s.control_generation, recorded_uid=trainer.ctx.job_uid or None)


def restore_effects(trainer: ElasticTrainer, found: Optional[CheckpointManifest]) -> None:
    """After a resume: the effects the newest commit holds and no confirmation covers are owed (rank 0 carries them
    out now), declarations of steps that will be redone go, and an evaluation the commit records is not run
    again."""
    ledger = trainer.effects
    ledger.runner = trainer.rank == 0
    if not ledger.runner:
        ledger.due = []
    durable = trainer.checkpoints.commits.durable_step
    ledger.restore(found, trainer.state.step, durable=found is None or (durable is not None and found.step <= durable))
    if trainer.evaluator is not None:
        trainer.evaluator.reset()
        recorded = [r.step for r in (found.effects if found else []) if r.name == evaluation_mod.EVAL_EFFECT]
        trainer.evaluator.last_step = max([trainer.evaluator.last_step, *recorded])
    ledger.carry_out()


def _restore_lr(trainer: ElasticTrainer) -> None:
    """The LR ramp from the restored state to this world size's factor."""
    s = trainer.state
    saved_scale = s.lr_start_scale if s.lr_start_scale > 0 else None
    saved_target = s.lr_target_scale if s.lr_target_scale > 0 else None
    trainer.lr_state = lr_mod.ramp_after_resume(
        saved_scale, saved_target, s.lr_change_step, trainer.plan.lr_scale, s.step, trainer.training.lr.ramp_steps
    )
