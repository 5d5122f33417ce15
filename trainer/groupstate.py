"""What belongs to one process group of a trainer: :class:`GroupState`, built by :func:`form` at the first start
(:mod:`disttrain.trainer.bootstrap`) and again at every in-place reform (:mod:`disttrain.trainer.lifecycle`).

A trainer keeps what outlives its groups (the options, the optimizer, the watchdog, the metrics, the training state)
apart from what a group owns: its process groups, rank and world size, the batch plan, the wrapped model, the
checkpoint manager bound to the group, the boundary agreement and rank 0's automatic-interval planner. The trainer
holds one :class:`GroupState` and replaces it whole when its group ends, so nothing of an old group outlives it by
accident, and a new group is built the same way whether it is the process's first or not.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Optional

import torch
import torch.distributed as dist

from disttrain.api import control as control_keys
from disttrain.api.plan import InvalidWorldSizeError, Plan, plan
from disttrain.api.spec import TrainingSpec
from disttrain.trainer import context as ctx_mod
from disttrain.trainer import exits, ordered_reduction
from disttrain.trainer import mesh as mesh_mod
from disttrain.trainer import parallel as parallel_mod
from disttrain.trainer import sampler as sampler_mod
from disttrain.trainer import startup as startup_mod
from disttrain.trainer.boundary import BoundaryAgreement
from disttrain.trainer.checkpoint import autointerval
from disttrain.trainer.checkpoint import manager as ckpt_mod
from disttrain.trainer.control import Watchdog
from disttrain.trainer.metrics import TrainerMetrics
from disttrain.trainer.options import TrainerOptions


@dataclasses.dataclass(kw_only=True)
class GroupState:
    """Everything bound to the process group this trainer is a member of; replaced whole at every reform."""

    context: ctx_mod.ElasticContext
    """This round's context (rank, restart count, contract) as the launcher started the group."""
    groups: ctx_mod.Groups
    rank: int
    world_size: int
    plan: Plan
    """Batch, accumulation and LR factor for this world size."""
    parallel: parallel_mod.ParallelModel
    """The wrapper (DDP or FSDP2) over the group's mesh; ``parallel.module`` is what the user's loop calls."""
    raw_model: torch.nn.Module
    """The model under the wrapper: what checkpoints and gradient clipping read (the user's, or the sharded one)."""
    ordered: Optional[ordered_reduction.OrderedReducer]
    """The gradient reducer of ``spec.training.gradientReduction: ordered`` (None: the wrapper's all-reduce)."""
    checkpoints: ckpt_mod.CheckpointManager
    """Saves and loads over this group's checkpoint group (its history goes on from the previous group's)."""
    agreement: BoundaryAgreement
    """The step-boundary agreement on drain and save state, on this group."""
    planner: Optional[autointerval.IntervalPlanner]
    """Rank 0's automatic checkpoint interval planner (``intervalSteps: auto``; its estimates go on across groups)."""
    process_id: str
    """Tells the agent this group's progress from the previous group's (``ProgressReport.process_id``)."""
    startup: startup_mod.StartupClock
    """This group's startup stamps, sent with rank 0's progress."""
    replica_group: Optional[dist.ProcessGroup] = None
    """The gloo group of the in-memory copies and of recoveries from memory (a sharded model reforming in place);
    set when the group resumes."""

    @property
    def model(self) -> torch.nn.Module:
        """The wrapped model, what the user's loop calls."""
        return self.parallel.module

    @property
    def device(self) -> torch.device:
        return self.groups.device

    @property
    def data_rank(self) -> int:
        """Which samples this rank reads: the rank, or its TP group's index on an FSDP x TP mesh."""
        return sampler_mod.data_rank(self.rank, self.world_size, self.plan.data_degree)

    def left(self, drop_model: bool) -> GroupState:
        """This state once its group is left: no process group, no wrapper over it, no reducer, no agreement in
        flight; the checkpoint manager (its history), the planner and the wrapper's optimizer layout stay for the
        next :func:`form`. ``drop_model``: a sharded model goes too (its mesh with it); DDP's model stays."""
        old = self.parallel
        raw = torch.nn.Module() if drop_model else self.raw_model
        self.checkpoints.group = None
        return dataclasses.replace(
            self,
            groups=ctx_mod.Groups(default=None, checkpoint=None, device=self.device),
            parallel=parallel_mod.ParallelModel(raw, old.parallelism, old.sums_gradients, old.optimizer_layout),
            raw_model=raw,
            ordered=None,
            agreement=BoundaryAgreement(),
            replica_group=None,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Lasting:
    """What a trainer keeps from group to group and :func:`form` builds each group's state from."""

    options: TrainerOptions
    optimizer: torch.optim.Optimizer
    watchdog: Watchdog
    metrics: TrainerMetrics
    in_place: bool
    """The job's workers reform in place (:mod:`disttrain.trainer.inplace`): no weight broadcast at wrapping."""
    template: Optional[parallel_mod.ModelTemplate] = None
    """A sharded model's structure, sharded again on each new mesh (None: DDP, or no in-place reforms)."""


def form(
    ctx: ctx_mod.ElasticContext,
    groups: ctx_mod.Groups,
    startup: startup_mod.StartupClock,
    lasting: Lasting,
    before: GroupState | torch.nn.Module,
) -> GroupState:
    """The state of the group just joined (``groups``): the plan for its world size, the model wrapped on its mesh,
    the ordered reducer, the checkpoint manager, a fresh boundary agreement and rank 0's interval planner.

    ``before``: the state of the group this process left (an in-place reform: its model, or a sharded model's
    structure, is wrapped again, its checkpoint history and planner go on), or the user's model on its device (the
    first start). Ends the process ``PERMANENT`` when the world size, the mesh or an option does not fit."""
    training = ctx.contract.training
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group_plan = plan_or_exit(training, world_size)
    previous = before if isinstance(before, GroupState) else None
    options, optimizer = lasting.options, lasting.optimizer
    precision = options.precision.precision
    try:
        layout = mesh_mod.layout(training.mesh, world_size)
        if previous is not None and lasting.template is not None:  # a new model on the new mesh (state: the resume)
            how = parallel_mod.Sharding(precision, layout, options.parallel.tp_plan)
            names = previous.parallel.optimizer_layout
            wrapped = parallel_mod.rewrap(lasting.template, names, optimizer, groups.device, how)
            raw_model = wrapped.module
        else:
            model = previous.raw_model if previous is not None else before
            assert isinstance(model, torch.nn.Module)
            wrapped = parallel_mod.wrap(
                model,
                optimizer,
                groups.device,
                options.parallel,
                precision,
                init_sync=not lasting.in_place,
                layout=layout,
            )
            raw_model = model  # FSDP2 shards it in place: the wrapper's module is the model itself
        ordered = ordered_reduction.for_training(
            training, raw_model, options.parallel.parallelism, precision, group_plan
        )
    except ValueError as exc:
        exits.exit_permanent(str(exc))
    if previous is not None:
        checkpoints = previous.checkpoints.successor(rank, world_size, groups.checkpoint)
    else:
        checkpoints = _first_checkpoints(ctx, rank, world_size, groups, lasting)
    kept = previous.planner if previous is not None else None
    return GroupState(
        context=ctx,
        groups=groups,
        rank=rank,
        world_size=world_size,
        plan=group_plan,
        parallel=wrapped,
        raw_model=raw_model,
        ordered=ordered,
        checkpoints=checkpoints,
        agreement=BoundaryAgreement(),
        planner=interval_planner(rank, checkpoints.spec.auto_interval, lasting.watchdog, kept),
        process_id=uuid.uuid4().hex,
        startup=startup,
    )


def _first_checkpoints(
    ctx: ctx_mod.ElasticContext, rank: int, world_size: int, groups: ctx_mod.Groups, lasting: Lasting
) -> ckpt_mod.CheckpointManager:
    """The process's first checkpoint manager; a ``checkpoint.uri`` without the S3 client exits ``PERMANENT``."""
    watchdog, options = lasting.watchdog, lasting.options.checkpoint
    try:
        return ckpt_mod.CheckpointManager(
            ctx.checkpoint_dir,
            ctx.contract.checkpoint,
            rank,
            world_size,
            groups.checkpoint,
            ckpt_mod.ManagerOptions(
                metrics=lasting.metrics,
                on_commit=lambda m: watchdog.publish(control_keys.CHECKPOINT_KEY, m.model_dump_json()),
                on_phase=options.on_phase,
                upload_retry=options.upload_retry,
                job_uid=ctx.job_uid,
                node=ctx.node_name,
            ),
        )
    except ImportError as exc:  # checkpoint.uri without the S3 client: no restart installs it
        exits.exit_permanent(
            f"spec.checkpoint.uri needs boto3 in the trainer's image: pip install 'disttrain[trainer,s3]' ({exc})"
        )


def interval_planner(
    rank: int, auto_interval: bool, watchdog: Watchdog, kept: Optional[autointerval.IntervalPlanner] = None
) -> Optional[autointerval.IntervalPlanner]:
    """The automatic checkpoint interval's planner of a group (``intervalSteps: auto``): rank 0 estimates and the
    boundary agreement carries its interval to every rank; ``kept``, the planner of this process's previous group,
    goes on with its estimates."""
    if rank != 0 or not auto_interval:
        return None
    return kept if kept is not None else autointerval.IntervalPlanner(watchdog.reliability)


def context_or_exit() -> ctx_mod.ElasticContext:
    """This round's context from the environment; a missing or invalid contract exits ``PERMANENT``."""
    try:
        return ctx_mod.ElasticContext.from_env()
    except ctx_mod.ContractError as exc:
        exits.exit_permanent(str(exc))


def plan_or_exit(training: TrainingSpec, world_size: int) -> Plan:
    """The batch and LR plan for ``world_size``; a world size the contract does not allow exits ``PERMANENT``."""
    try:
        return plan(training, world_size)
    except InvalidWorldSizeError as exc:
        exits.exit_permanent(f"spec.training: {exc}")
