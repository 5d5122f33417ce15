"""The start of a worker's trainer: everything :meth:`~disttrain.trainer.loop.ElasticTrainer.from_env` starts, in
order, handed to the trainer as :class:`Started`.

In this order: read the worker contract (or take ``context``) and the options, join the process group and a gloo
group for checkpoints, serve metrics on ``DISTTRAIN_METRICS_PORT + LOCAL_RANK``, move the model to its device, apply
activation checkpointing, then form the group's state (:func:`disttrain.trainer.groupstate.form`, as every in-place
reform does: plan batch and LR for the world size, wrap the model in DDP or FSDP2, on a 2-D mesh when
``spec.training.mesh`` says so, and start the checkpoint manager), install the SIGTERM handler, connect to the job
agent. Ends the process with
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

from disttrain.api import contract as contract_mod
from disttrain.api.spec import LRSchedule
from disttrain.trainer import activation, determinism, exits, groupstate, inplace
from disttrain.trainer import context as ctx_mod
from disttrain.trainer import data as data_mod
from disttrain.trainer import effects as effects_mod
from disttrain.trainer import evaluation as evaluation_mod
from disttrain.trainer import parallel as parallel_mod
from disttrain.trainer import precision as precision_mod
from disttrain.trainer import startup as startup_mod
from disttrain.trainer.control import Watchdog
from disttrain.trainer.groupstate import GroupState, Lasting
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

    group: GroupState
    """What belongs to the group this process joined (:func:`disttrain.trainer.groupstate.form`)."""
    lasting: Lasting
    """What the trainer keeps from group to group."""
    precision: precision_mod.PrecisionState
    link: Optional[WorkerLink]
    """This process's channel to its launcher (None: it cannot wait for the next round and restarts instead)."""
    in_place_fallback: Optional[str] = None
    """Why reforms restart this job's workers although in place was asked for (rank 0 reports it); None: they stay."""


def side_effects(
    options: TrainerOptions, started: Started
) -> tuple[effects_mod.EffectLedger, Optional[evaluation_mod.Evaluator]]:
    """The effect ledger (rank 0 carries out) and the evaluator, with their metrics on the worker's registry."""
    group, registry = started.group, started.lasting.metrics.registry
    handlers = dict(options.effects.handlers)
    evaluation = options.effects.evaluation
    evaluator = None
    if evaluation is not None:
        handlers[evaluation_mod.EVAL_EFFECT] = evaluation_mod.result_handler(evaluation)
        metrics = evaluation_mod.EvalMetrics(registry)
        evaluator = evaluation_mod.Evaluator(evaluation, group.device, metrics)
    ledger = effects_mod.EffectLedger(
        handlers,
        group.context.run_id or group.context.job_uid,
        group.context.checkpoint_dir,
        runner=group.rank == 0,
        metrics=effects_mod.EffectMetrics(registry),
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
    ctx = context or groupstate.context_or_exit()
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
    metrics = _serve_metrics(ctx)
    on_device = model.to(groups.device)  # in place: the optimizer keeps the same Parameter objects
    in_place = options.lifecycle.reform_in_place and not isinstance(model, torch.nn.parallel.DistributedDataParallel)
    try:
        activation.apply(on_device, par.activation_checkpointing)  # before wrapping: the model's own modules
        sharded_in_place = in_place and par.parallelism is parallel_mod.Parallelism.FSDP2
        template = parallel_mod.ModelTemplate(on_device, par.shard_modules) if sharded_in_place else None
        precision_state = precision_mod.PrecisionState(prec.precision, groups.device, prec.grad_scaler)
    except ValueError as exc:
        exits.exit_permanent(str(exc))
    watchdog = Watchdog(ctx.agent_endpoint, job_uid=ctx.job_uid)
    lasting = Lasting(
        options=options, optimizer=optimizer, watchdog=watchdog, metrics=metrics, in_place=in_place, template=template
    )
    group = groupstate.form(ctx, groups, clock, lasting, on_device)
    _open_control_channel(watchdog)
    if scheduler is not None and ctx.contract.training.lr.schedule is not LRSchedule.CONSTANT:
        log.warning(
            "a scheduler was passed: spec.training.lr.schedule=%s is ignored, the scheduler's factor "
            "applies on top of base LR x world-size factor",
            ctx.contract.training.lr.schedule.value,
        )
    if group.rank == 0:
        clock.stamps["old_exit_first"], clock.stamps["old_exit_last"] = startup_mod.take_exit_times(watchdog.store)
    clock.mark("group_ready")
    link = WorkerLink.connect() if in_place else None
    reason = None
    if group.rank == 0:
        prewrapped = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        reason = inplace.fallback_reason(
            ctx.contract.reform_in_place, par.parallelism.value, prewrapped, link is not None
        )
        inplace.log_fallback(reason)
    started = Started(group=group, lasting=lasting, precision=precision_state, link=link, in_place_fallback=reason)
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
