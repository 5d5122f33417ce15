"""The start of a worker's trainer: everything :meth:`~disttrain.trainer.loop.ElasticTrainer.from_env` starts, in
order, handed to the trainer as :class:`Started`.

In this order: read the worker contract (or take ``context``) and the options, join the process group and a gloo
group for checkpoints, serve metrics on ``DISTTRAIN_METRICS_PORT + LOCAL_RANK``, plan batch and LR for the world
size, move the model to its device, apply activation checkpointing and wrap it in DDP or FSDP2 (on a 2-D mesh when
``spec.training.mesh`` says so), install the SIGTERM handler, connect to the job agent. Ends the process with
``ExitCode.PERMANENT`` (after telling the agent) when the contract, an option or the dataset is invalid or the world
size does not fit the contract.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
import torch.distributed as dist

from disttrain.api import contract as contract_mod
from disttrain.api import control as control_keys
from disttrain.api.plan import Plan
from disttrain.api.spec import LRSchedule
from disttrain.trainer import activation, determinism, exits, inplace, ordered_reduction
from disttrain.trainer import context as ctx_mod
from disttrain.trainer import data as data_mod
from disttrain.trainer import effects as effects_mod
from disttrain.trainer import evaluation as evaluation_mod
from disttrain.trainer import lifecycle as lifecycle_mod
from disttrain.trainer import mesh as mesh_mod
from disttrain.trainer import parallel as parallel_mod
from disttrain.trainer import precision as precision_mod
from disttrain.trainer import startup as startup_mod
from disttrain.trainer.checkpoint import manager as ckpt_mod
from disttrain.trainer.control import Watchdog
from disttrain.trainer.launch.handover import WorkerLink
from disttrain.trainer.metrics import TrainerMetrics
from disttrain.trainer.options import OptionError, TrainerKwargs, TrainerOptions

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger("disttrain.trainer")
_IMPORTED_AT = time.time()  # the reform phase "imports" ends here (disttrain.trainer.startup)


class MapDataset(Protocol):
    """A map-style dataset: a length and samples by index (``TensorDataset`` and friends)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class Components:
    """The user's training objects, as the trainer keeps them."""

    model: torch.nn.Module
    """The model on its device, unwrapped (the trainer wraps it in DDP or FSDP2)."""
    optimizer: torch.optim.Optimizer
    dataset: MapDataset
    """Map-style (a seekable stream is read through :class:`~disttrain.trainer.data.SeekingDataset`)."""
    scheduler: Any = None
    """An LR scheduler whose factor applies on top of the declared LR rule (None: the rule alone)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Started:
    """What :meth:`ElasticTrainer.from_env` started for this process, handed to the constructor."""

    context: ctx_mod.ElasticContext
    groups: ctx_mod.Groups
    rank: int
    plan: Plan
    parallel: parallel_mod.ParallelModel
    ordered: Optional[ordered_reduction.OrderedReducer]
    """The gradient reducer of ``spec.training.gradientReduction: ordered`` (None: DDP's all-reduce)."""
    precision: precision_mod.PrecisionState
    checkpoints: ckpt_mod.CheckpointManager
    watchdog: Watchdog
    metrics: TrainerMetrics
    in_place: bool
    """The job's workers reform in place (:mod:`disttrain.trainer.inplace`)."""
    link: Optional[WorkerLink]
    """This process's channel to its launcher (None: it cannot wait for the next round and restarts instead)."""
    startup: startup_mod.StartupClock
    in_place_fallback: Optional[str] = None
    """Why reforms restart this job's workers although in place was asked for (rank 0 reports it); None: they stay."""
    template: Optional[parallel_mod.ModelTemplate] = None
    """The sharded model's structure before wrapping, which a group re-formed in place shards again (None: DDP, or
    no in-place reforms)."""


def side_effects(
    options: TrainerOptions, started: Started
) -> tuple[effects_mod.EffectLedger, Optional[evaluation_mod.Evaluator]]:
    """The effect ledger (rank 0 carries out) and the evaluator, with their metrics on the worker's registry."""
    handlers = dict(options.effects.handlers)
    evaluation = options.effects.evaluation
    evaluator = None
    if evaluation is not None:
        handlers[evaluation_mod.EVAL_EFFECT] = evaluation_mod.result_handler(evaluation)
        metrics = evaluation_mod.EvalMetrics(started.metrics.registry)
        evaluator = evaluation_mod.Evaluator(evaluation, started.groups.device, metrics)
    ledger = effects_mod.EffectLedger(
        handlers,
        started.context.run_id or started.context.job_uid,
        started.context.checkpoint_dir,
        runner=started.rank == 0,
        metrics=effects_mod.EffectMetrics(started.metrics.registry),
    )
    return ledger, evaluator


def start(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset: MapDataset | data_mod.SeekableStream,
    *,
    scheduler: Any = None,
    context: Optional[ctx_mod.ElasticContext] = None,
    **kwargs: Unpack[TrainerKwargs],
) -> tuple[TrainerOptions, Components, Started]:
    """Start everything this worker's trainer needs, in the order of the module docstring; the trainer's constructor
    only stores what this returns."""
    clock = startup_mod.StartupClock(_IMPORTED_AT)
    clock.mark("setup_begin")
    _configure_logging()
    ctx = context or lifecycle_mod.context_or_exit()
    try:
        options = TrainerOptions.from_env(ctx.contract, **kwargs)
    except OptionError as exc:
        exits.exit_permanent(str(exc))
    try:
        readable: MapDataset = data_mod.random_access(dataset)
    except TypeError as exc:
        exits.exit_permanent(str(exc))
    par, prec = options.parallel, options.precision
    determinism.apply(ctx.contract.training)
    groups = ctx_mod.init_process_group(ctx, use_cuda=_use_cuda_or_exit(par.device, ctx.contract.gpus_per_node))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    metrics = _serve_metrics(ctx)
    training_plan = lifecycle_mod.plan_or_exit(ctx.contract.training, world_size)
    on_device = model.to(groups.device)  # in place: the optimizer keeps the same Parameter objects
    in_place = options.lifecycle.reform_in_place and not isinstance(model, torch.nn.parallel.DistributedDataParallel)
    try:
        activation.apply(on_device, par.activation_checkpointing)  # before wrapping: the model's own modules
        sharded_in_place = in_place and par.parallelism is parallel_mod.Parallelism.FSDP2
        template = parallel_mod.ModelTemplate(on_device, par.shard_modules) if sharded_in_place else None
        wrapped = parallel_mod.wrap(
            on_device,
            optimizer,
            groups.device,
            par,
            prec.precision,
            init_sync=not in_place,
            layout=mesh_mod.layout(ctx.contract.training.mesh, world_size),
        )
        precision_state = precision_mod.PrecisionState(prec.precision, groups.device, prec.grad_scaler)
        ordered = ordered_reduction.for_training(
            ctx.contract.training, on_device, par.parallelism, prec.precision, training_plan
        )
    except ValueError as exc:
        exits.exit_permanent(str(exc))
    watchdog = Watchdog(ctx.agent_endpoint, job_uid=ctx.job_uid)
    try:
        checkpoints = ckpt_mod.CheckpointManager(
            ctx.checkpoint_dir,
            ctx.contract.checkpoint,
            rank,
            world_size,
            groups.checkpoint,
            ckpt_mod.ManagerOptions(
                metrics=metrics,
                on_commit=lambda m: watchdog.publish(control_keys.CHECKPOINT_KEY, m.model_dump_json()),
                on_phase=options.checkpoint.on_phase,
                upload_retry=options.checkpoint.upload_retry,
                job_uid=ctx.job_uid,
                node=ctx.node_name,
            ),
        )
    except ImportError as exc:  # checkpoint.uri without the S3 client: no restart installs it
        exits.exit_permanent(
            f"spec.checkpoint.uri needs boto3 in the trainer's image: pip install 'disttrain[trainer,s3]' ({exc})"
        )
    _open_control_channel(watchdog)
    if scheduler is not None and ctx.contract.training.lr.schedule is not LRSchedule.CONSTANT:
        log.warning(
            "a scheduler was passed: spec.training.lr.schedule=%s is ignored, the scheduler's factor "
            "applies on top of base LR x world-size factor",
            ctx.contract.training.lr.schedule.value,
        )
    if rank == 0:
        clock.stamps["old_exit_first"], clock.stamps["old_exit_last"] = startup_mod.take_exit_times(watchdog.store)
    clock.mark("group_ready")
    started = Started(
        context=ctx,
        groups=groups,
        rank=rank,
        plan=training_plan,
        parallel=wrapped,
        ordered=ordered,
        precision=precision_state,
        checkpoints=checkpoints,
        watchdog=watchdog,
        metrics=metrics,
        in_place=in_place,
        link=WorkerLink.connect() if in_place else None,
        startup=clock,
        template=template,
    )
    if rank == 0:
        prewrapped = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        reason = inplace.fallback_reason(
            ctx.contract.reform_in_place, par.parallelism.value, prewrapped, started.link is not None
        )
        inplace.log_fallback(reason)
        started = dataclasses.replace(started, in_place_fallback=reason)
    components = Components(model=on_device, optimizer=optimizer, dataset=readable, scheduler=scheduler)
    return options, components, started


def _serve_metrics(ctx: ctx_mod.ElasticContext) -> TrainerMetrics:
    metrics = TrainerMetrics()
    metrics.serve(ctx.metrics_port + ctx.local_rank if ctx.metrics_port else 0)
    metrics.restart_count.set(ctx.restart_count)
    return metrics


def _use_cuda_or_exit(device: str, gpus_per_node: int = 0) -> Optional[bool]:
    """``device`` as the process group's choice; CUDA asked for and absent is a permanent error, not a CPU run.

    Asked for means ``device='cuda'``, or ``device='auto'`` in a job whose trainer container requests GPUs
    (``gpus_per_node`` of the contract). Checked before the group is joined, so the failure comes at once."""
    if device == "cpu":
        return False
    if torch.cuda.is_available():
        return None if device == "auto" else True
    if device == "auto" and gpus_per_node == 0:
        return None
    if device == "auto":
        message = contract_mod.missing_gpu_message(
            gpus_per_node, torch.__version__, _torch_build(), torch.cuda.device_count()
        )
    else:
        message = (
            f"device='cuda' was asked for but CUDA is not available in this container (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda or 'none'}, {torch.cuda.device_count()} devices visible): "
            "use a CUDA build of torch and request GPUs (resources.limits['nvidia.com/gpu']), or pass device='cpu'"
        )
    exits.exit_permanent(message)


def _torch_build() -> str:
    """What this torch build can drive: ``CUDA <version>``, ``ROCm <version>`` or ``CPU only``."""
    hip = getattr(torch.version, "hip", None)
    if torch.version.cuda:
        return f"CUDA {torch.version.cuda}"
    return f"ROCm {hip}" if hip else "CPU only"


def _open_control_channel(watchdog: Watchdog) -> None:
    """SIGTERM means drain; the agent's store is optional (without it only SIGTERM can drain)."""
    watchdog.install_sigterm()
    try:
        watchdog.connect()
    except Exception as exc:  # noqa: BLE001 - the channel is optional; SIGTERM still works
        log.warning("control channel %s unavailable (%s); only SIGTERM can drain", watchdog.endpoint, exc)


def _configure_logging() -> None:
    root = logging.getLogger()
    if not root.handlers:
        rank = os.environ.get("RANK", "0")
        logging.basicConfig(
            level=logging.INFO,
            stream=sys.stderr,
            format=f"%(asctime)s [disttrain rank {rank}] %(levelname)s %(message)s",
        )
    logging.getLogger("disttrain").setLevel(logging.INFO)
