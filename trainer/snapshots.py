"""The trainer's state in and out of checkpoints: what a checkpoint holds, its manifest, and the resume.

Called by the training loop at every save and at every start of a group: a fresh process resumes from the newest
complete checkpoint (:func:`resume`); in place (:mod:`disttrain.trainer.inplace`) every new group first agrees on the
newest state any member holds, and takes it from that member's memory when it is newer than the checkpoint
(:func:`resume_from_memory`). It reads the group's state (:class:`~disttrain.trainer.groupstate.GroupState`) and the
trainer's lasting parts it restores (:class:`Resuming`). Saving itself, and when, belongs to
:class:`~disttrain.trainer.checkpoint.manager.CheckpointManager`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.stateful import Stateful

from disttrain.api.contract import training_config_hash
from disttrain.api.manifest import CheckpointManifest, DatasetFingerprint
from disttrain.api.spec import TrainingSpec
from disttrain.trainer import effects as effects_mod
from disttrain.trainer import evaluation as evaluation_mod
from disttrain.trainer import inplace, recovery
from disttrain.trainer import lr as lr_mod
from disttrain.trainer import parallel as parallel_mod
from disttrain.trainer import precision as precision_mod
from disttrain.trainer import sampler as sampler_mod
from disttrain.trainer.checkpoint import manager as ckpt_mod
from disttrain.trainer.control import Watchdog
from disttrain.trainer.groupstate import GroupState
from disttrain.trainer.metrics import TrainerMetrics

log = logging.getLogger("disttrain.trainer")

try:
    from importlib.metadata import version as _pkg_version

    CODE_VERSION = _pkg_version("disttrain")
except Exception:  # noqa: BLE001 - running from a source tree without metadata
    CODE_VERSION = "0+unknown"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Saved:
    """The trainer's objects a checkpoint holds besides the model (which belongs to the group)."""

    optimizer: torch.optim.Optimizer
    state: ckpt_mod.TrainerState
    scheduler: Any = None
    precision: precision_mod.PrecisionState
    user_state: Mapping[str, Stateful] = dataclasses.field(default_factory=dict)

    def contents(self, raw_model: torch.nn.Module) -> dict[str, Any]:
        """What a checkpoint holds, as DCP Statefuls: model + optimizer, the trainer's state, the scheduler, the fp16
        scaler and the user's state."""
        held: dict[str, Any] = {"app": ckpt_mod.ModelOptimState(raw_model, self.optimizer), "trainer": self.state}
        if self.scheduler is not None:
            held["scheduler"] = ckpt_mod.SchedulerState(self.scheduler)
        if self.precision.scaler is not None:
            held["grad_scaler"] = precision_mod.GradScalerState(self.precision.scaler)
        for name, stateful in self.user_state.items():
            held[f"user/{name}"] = stateful
        return held


@dataclasses.dataclass
class Resumption:
    """Where the current group's state came from, as rank 0's progress reports it."""

    step: Optional[int] = None
    """The step resumed from (a checkpoint's or memory's); None: a fresh start."""
    job_uid: Optional[str] = None
    """The job uid of the checkpoint resumed from."""
    from_memory: Optional[bool] = None
    """This group took its state from memory (True) or its checkpoint (False) in an in-place reform."""
    note: Optional[str] = None
    """Why this group resumed from its checkpoint though it reforms in place (None: from memory, a first start)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Resuming:
    """What a resume restores besides the group's state: the trainer's parts that outlive its groups."""

    saved: Saved
    training: TrainingSpec
    dataset: DatasetFingerprint
    """The sampler's fingerprint of the dataset, which a checkpoint must match."""
    in_place: bool
    """The job's workers reform in place: every new group agrees on the state before it resumes."""
    template: Optional[parallel_mod.ModelTemplate]
    """A sharded model's structure (in place): its state is rebuilt from the members' memory."""
    memory: recovery.Memory
    watchdog: Watchdog
    metrics: TrainerMetrics
    effects: effects_mod.EffectLedger
    evaluator: Optional[evaluation_mod.Evaluator]


def manifest(
    group: GroupState,
    training: TrainingSpec,
    state: ckpt_mod.TrainerState,
    lr_scale: float,
    dataset: DatasetFingerprint,
    effects: effects_mod.EffectLedger,
) -> CheckpointManifest:
    """The manifest of a save of the current step (digests and times are filled in by the commit); ``lr_scale``: the
    LR factor the step ran with."""
    return CheckpointManifest(
        step=state.step,
        samples_consumed=state.samples_consumed,
        data_cursor=state.data_cursor,
        world_size=group.world_size,
        plan=group.plan.to_status(),
        lr_scale=lr_scale,
        dataset=dataset,
        metadata_sha256="pending",
        files={},
        created_at="pending",
        code_version=CODE_VERSION,
        config_hash=training_config_hash(training),
        job=group.context.job,
        job_uid=group.context.job_uid or None,
        effects=effects.record_for(state.step),
    )


def resume(group: GroupState, parts: Resuming, resumption: Resumption, has_state: bool) -> lr_mod.LRState:
    """Load the state this group continues from (the newest checkpoint, or in place a member's memory), start the
    watchdog, and return the LR ramp from it. ``has_state``: this process already trained (an in-place reform)."""
    found = group.checkpoints.find_latest()
    state, ramp = parts.saved.state, parts.training.lr.ramp_steps
    resumption.note, resumption.from_memory = None, None
    if parts.in_place and parts.template is not None:
        # A sharded model: rebuilt from the members' memory, resharded onto this group's mesh.
        group.replica_group = recovery.new_replica_group(group.context.contract.collective_timeout_seconds)
        rebuilt = recovery.resume_from_memory(
            group, parts.memory.held, parts.saved.contents(group.raw_model), found.step if found is not None else None
        )
        if rebuilt.step is not None:
            lr_state = _resumed_in_place(group, parts, rebuilt.step, found)
            resumption.step, resumption.from_memory = rebuilt.step, True
            log.info(
                "resumed in place from step %d held in memory (%.1f MB fetched from peers in %.2f s) at world size "
                "%d: plan %s, samples consumed %d; the newest checkpoint is step %s",
                rebuilt.step,
                rebuilt.fetched_bytes / 1e6,
                rebuilt.seconds,
                group.world_size,
                group.plan.to_status(),
                state.samples_consumed,
                found.step if found is not None else "none",
            )
            restore_effects(group, parts, found)
            return lr_state
        if has_state or rebuilt.reason != "no member holds state in memory":
            resumption.note, resumption.from_memory = rebuilt.reason, False
            log.warning(
                "cannot resume in place from memory (%s): loading the newest complete checkpoint", rebuilt.reason
            )
    elif parts.in_place:
        # Every new group agrees first: a member may hold a newer step in memory than any checkpoint.
        holdings = inplace.gather_holdings(
            state.step if has_state else inplace.NO_STATE,
            found.step if found is not None else inplace.NO_STATE,
            group.world_size,
        )
        source = inplace.choose_source(holdings)
        if source is not None:
            lr_state = resume_from_memory(group, parts, source, holdings)
            resumption.step, resumption.from_memory = state.step, True
            restore_effects(group, parts, found)
            return lr_state
        if found is None:
            inplace.broadcast_module(group.raw_model)  # what DDP's construction did before init_sync=False
    if found is None:
        if group.rank == 0:
            log.info(
                "no complete checkpoint in %s: starting at step 0 (world size %d, plan %s)",
                group.context.checkpoint_dir,
                group.world_size,
                group.plan.to_status(),
            )
        lr_state = lr_mod.ramp_after_resume(None, None, 0, group.plan.lr_scale, 0, ramp)
        parts.watchdog.start()
        restore_effects(group, parts, None)
        return lr_state
    sampler_mod.check_fingerprint(found.dataset, parts.dataset)
    if found.config_hash != training_config_hash(parts.training):
        log.warning(
            "spec.training changed since checkpoint step-%d (config hash differs); continuing with the new contract",
            found.step,
        )
    group.checkpoints.load(found, parts.saved.contents(group.raw_model))
    s = state
    if s.data_cursor != s.samples_consumed or s.data_cursor != found.data_cursor:
        # The cursor is the number of samples consumed by construction; anything else would replay or skip.
        gap = s.data_cursor - s.samples_consumed
        (parts.metrics.samples_replayed if gap < 0 else parts.metrics.samples_skipped).inc(abs(gap))
    lr_state = restored_lr(s, group.plan.lr_scale, ramp)
    resumption.step, resumption.job_uid = found.step, found.job_uid
    log.info(
        "resumed from checkpoint step-%d (saved at world size %d) at world size %d: plan %s, "
        "samples consumed %d, LR factor %.4g -> %.4g over %d steps",
        found.step,
        found.world_size,
        group.world_size,
        group.plan.to_status(),
        s.samples_consumed,
        lr_state.start_scale,
        lr_state.target_scale,
        ramp,
    )
    parts.watchdog.start(recorded_generation=s.control_generation, recorded_uid=found.job_uid)
    restore_effects(group, parts, found)
    return lr_state


def resume_from_memory(
    group: GroupState, parts: Resuming, source: int, holdings: list[inplace.Holding]
) -> lr_mod.LRState:
    """Take the state of rank ``source``'s memory (every rank that holds another step loads it): nothing that ran
    since the last checkpoint is redone. Returns the LR ramp from it."""
    newest = holdings[source].memory_step
    receivers = [r for r, h in enumerate(holdings) if h.memory_step != newest]
    t0 = time.monotonic()
    sent = 0
    if receivers:
        sent = inplace.broadcast_state(parts.saved.contents(group.raw_model), source, group.rank in receivers)
    s = parts.saved.state
    lr_state = restored_lr(s, group.plan.lr_scale, parts.training.lr.ramp_steps)
    disk = holdings[0].disk_step
    # The same history on every rank (when a save is due follows from it): the newest complete checkpoint.
    newest_checkpoint = disk if disk != inplace.NO_STATE else None
    ckpts = group.checkpoints
    ckpts.loaded_step = ckpts.last_saved_step = ckpts.commits.last_committed_step = newest_checkpoint
    log.info(
        "resumed in place from step %d held in memory by rank %d (%d of %d ranks received %.1f MB in %.2f s) at "
        "world size %d: plan %s, samples consumed %d; the newest checkpoint is step %s",
        newest,
        source,
        len(receivers),
        group.world_size,
        sent / 1e6,
        time.monotonic() - t0,
        group.world_size,
        group.plan.to_status(),
        s.samples_consumed,
        disk if disk != inplace.NO_STATE else "none",
    )
    if not parts.watchdog.started:
        parts.watchdog.start(recorded_generation=s.control_generation, recorded_uid=group.context.job_uid or None)
    return lr_state


def _resumed_in_place(
    group: GroupState, parts: Resuming, step: int, found: Optional[CheckpointManifest]
) -> lr_mod.LRState:
    """After a sharded state was rebuilt from memory at ``step``: the LR ramp, the checkpoint history (the newest
    complete checkpoint, the same on every rank) and the watchdog."""
    s = parts.saved.state
    lr_state = restored_lr(s, group.plan.lr_scale, parts.training.lr.ramp_steps)
    newest_checkpoint = found.step if found is not None else None
    ckpts = group.checkpoints
    ckpts.loaded_step = ckpts.last_saved_step = ckpts.commits.last_committed_step = newest_checkpoint
    if not parts.watchdog.started:
        parts.watchdog.start(recorded_generation=s.control_generation, recorded_uid=group.context.job_uid or None)
    return lr_state


def restore_effects(group: GroupState, parts: Resuming, found: Optional[CheckpointManifest]) -> None:
    """After a resume: the effects the newest commit holds and no confirmation covers are owed (rank 0 carries them
    out now), declarations of steps that will be redone go, and an evaluation the commit records is not run
    again."""
    ledger, evaluator = parts.effects, parts.evaluator
    ledger.runner = group.rank == 0
    if not ledger.runner:
        ledger.due = []
    durable = group.checkpoints.commits.durable_step
    ledger.restore(
        found, parts.saved.state.step, durable=found is None or (durable is not None and found.step <= durable)
    )
    if evaluator is not None:
        evaluator.reset()
        recorded = [r.step for r in (found.effects if found else []) if r.name == evaluation_mod.EVAL_EFFECT]
        evaluator.last_step = max([evaluator.last_step, *recorded])
    ledger.carry_out()


def restored_lr(state: ckpt_mod.TrainerState, lr_scale: float, ramp_steps: int) -> lr_mod.LRState:
    """The LR ramp from the restored ``state`` to this world size's factor ``lr_scale``."""
    saved_scale = state.lr_start_scale if state.lr_start_scale > 0 else None
    saved_target = state.lr_target_scale if state.lr_target_scale > 0 else None
    return lr_mod.ramp_after_resume(saved_scale, saved_target, state.lr_change_step, lr_scale, state.step, ramp_steps)
