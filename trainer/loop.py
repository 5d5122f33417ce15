"""The training-loop API: the user's loop stays recognisable, the elastic machinery lives here.

    with ElasticTrainer.from_env(model, optimizer, dataset) as trainer:
        for step in trainer.steps():
            for batch in step:                       # this rank's micro batches of the step
                loss = loss_fn(trainer.model(batch.data[0]), batch.data[1], reduction="sum")
                step.backward(loss)                  # normalised by the global sample count
            # optimizer step, LR, checkpoint, drain/SIGTERM are handled when the loop comes back here

Lifecycle: :meth:`ElasticTrainer.from_env` starts everything with a side effect (process group, metrics server,
DDP or FSDP2, SIGTERM handler, control channel) and plans micro batch / accumulation / LR for the actual world size;
:meth:`~ElasticTrainer.steps` loads the newest valid checkpoint (resharding model and optimizer), refuses a
changed dataset, recomputes the LR from the declared rule and trains; :meth:`~ElasticTrainer.close` (the end of
the ``with``) stops it all. After each optimizer step the ranks agree (one tiny all-reduce,
:mod:`disttrain.trainer.boundary`) on drain requests and on the state of an async save, then checkpoint when due.
Exits: ``ExitCode.SUCCESS`` at the end, ``DRAINED`` after a drain/SIGTERM checkpoint, ``REFORM`` when a
collective fails or the agent says reform, ``PERMANENT`` for an invalid world size, contract or changed dataset.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Optional, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.utils.data import TensorDataset, default_collate

from disttrain.api import control as control_keys
from disttrain.api.contract import training_config_hash
from disttrain.api.exitcodes import ExitCode
from disttrain.api.manifest import CheckpointManifest
from disttrain.api.plan import InvalidWorldSizeError, Plan, plan
from disttrain.api.spec import LRSchedule, TrainingSpec
from disttrain.trainer import autointerval, exits, inplace, ordered_reduction
from disttrain.trainer import checkpoint as ckpt_mod
from disttrain.trainer import context as ctx_mod
from disttrain.trainer import data as data_mod
from disttrain.trainer import lr as lr_mod
from disttrain.trainer import parallel as parallel_mod
from disttrain.trainer import precision as precision_mod
from disttrain.trainer import sampler as sampler_mod
from disttrain.trainer import startup as startup_mod
from disttrain.trainer.boundary import NO_SAVE, BoundaryAgreement, BoundaryFlags
from disttrain.trainer.control import Watchdog
from disttrain.trainer.failures import is_collective_failure
from disttrain.trainer.handover import WorkerLink
from disttrain.trainer.metrics import TrainerMetrics
from disttrain.trainer.randomness import sample_seed

log = logging.getLogger("disttrain.trainer")
REFORM_GRACE_S = 5.0
"""After the operator's reform directive, how long an in-place worker may take to reach its reform (its next
collective fails, or its step ends) before it exits ``REFORM`` instead: a collective blocked on a peer that vanished
without closing its connections returns only after ``collectiveTimeoutSeconds``."""
ROUND_WAIT_S = 3600.0
"""Longest an in-place worker waits for the next round (the launcher answers or closes the socket long before)."""
_PROCESS_START = time.monotonic()
_IMPORTED_AT = time.time()  # the reform phase "imports" ends here (disttrain.trainer.startup)

try:
    from importlib.metadata import version as _pkg_version

    CODE_VERSION = _pkg_version("disttrain")
except Exception:  # noqa: BLE001 - running from a source tree without metadata
    CODE_VERSION = "0+unknown"


class MapDataset(Protocol):
    """A map-style dataset: a length and samples by index (``TensorDataset`` and friends)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


class MicroBatch:
    """One forward/backward worth of samples: the collated ``data``, their dataset ``indices`` and per-sample
    ``seeds`` for keyed randomness (see :mod:`disttrain.trainer.randomness`; computed on first use)."""

    __slots__ = ("data", "indices", "_seed", "_step", "_seeds")

    def __init__(self, data: Any, indices: list[int], seed: int, step: int) -> None:
        self.data, self.indices, self._seed, self._step = data, indices, seed, step
        self._seeds: Optional[list[int]] = None

    @property
    def seeds(self) -> list[int]:
        if self._seeds is None:
            self._seeds = [sample_seed(self._seed, self._step, j) for j in self.indices]
        return self._seeds


class Step:
    """One optimizer step on this rank: iterate it for micro batches, call :meth:`backward` once per micro batch.

    Iteration turns gradient sync (DDP, FSDP2) off for all but the last micro batch (forward included, as DDP
    needs).
    """

    def __init__(self, trainer: ElasticTrainer, index: int, indices: list[int]) -> None:
        self.trainer = trainer
        self.index = index
        self.indices = indices
        p = trainer.plan
        if trainer.ordered is not None:
            self.micro_indices = ordered_reduction.micro_indices(indices, p.accum_steps)
        else:
            self.micro_indices = [indices[i * p.micro_batch : (i + 1) * p.micro_batch] for i in range(p.accum_steps)]
        self._losses: list[torch.Tensor] = []  # detached, read once when reported (no device sync per backward)
        self.loss_count = 0

    @property
    def global_batch(self) -> int:
        return self.trainer.plan.global_batch

    @property
    def loss_sum(self) -> float:
        """This rank's summed loss of the step so far. Read lazily: on an accelerator ``float()`` waits for the
        device, so the loop only reads it when a value is reported (rank 0's log and progress record)."""
        return sum(float(t) for t in self._losses)

    def __iter__(self) -> Iterator[MicroBatch]:
        parallel = self.trainer.parallel
        ordered = self.trainer.ordered
        last = len(self.micro_indices) - 1
        seed = self.trainer.training.seed
        try:
            for i, idx in enumerate(self.micro_indices):
                if self.trainer.group_failure is not None:
                    return  # the group broke (kept from the user's code): the step is redone in the next group
                parallel.set_gradient_sync(i == last and ordered is None)  # ordered: reduced before the step
                if ordered is not None:
                    ordered.before_backward(i)
                yield MicroBatch(self.trainer.fetch(idx), idx, seed, self.index)
        finally:
            parallel.set_gradient_sync(True)

    def global_count(self, local_count: float | int | torch.Tensor) -> float:
        """Sum of a count over all ranks (e.g. non-padding tokens in this step): the denominator of a
        token-weighted loss. Collective: every rank calls it once per step, before its backward passes."""
        t = torch.as_tensor(local_count, dtype=torch.float64).reshape(1).clone()
        with self.trainer.keeping_group_failures():
            dist.all_reduce(t)
            return float(t.item())
        return float(t.item()) * self.trainer.world_size  # the group broke: any value (this step is redone)

    def backward(
        self, loss_sum: torch.Tensor, denominator: Optional[float] = None, count: Optional[int] = None
    ) -> None:
        """Backward of a loss *summed* over this micro batch, normalised by the global count of the step.

        ``denominator`` defaults to the global batch (sample-weighted); pass :meth:`global_count` of your token
        counts for a token-weighted loss. Where the reduction averages over the W ranks (fp32 DDP) the loss is
        multiplied by W first; FSDP2 and mixed-precision DDP sum (:class:`~disttrain.trainer.parallel.ParallelModel`).
        Either way the result is exactly sum(all samples' losses) / global count, whatever the split into ranks
        and micro batches. Under fp16 the loss is scaled by the GradScaler first.
        """
        denom = float(denominator if denominator is not None else self.global_batch)
        factor = 1.0 if self.trainer.ordered is not None else self.trainer.parallel.loss_factor(self.trainer.world_size)
        with self.trainer.keeping_group_failures():
            self.trainer.precision.scale(loss_sum * (factor / denom)).backward()
        self._losses.append(loss_sum.detach())
        self.loss_count += int(count if count is not None else len(self.micro_indices[0]) if self.micro_indices else 0)


class ElasticTrainer:
    """Model, optimizer, (optional) scheduler and a map-style dataset in; :meth:`steps` out.

    Start one with :meth:`from_env`. The constructor only stores parts that are already started, so
    :meth:`from_env` is the one place that shows what starts, in which order, and :meth:`close` what stops.
    """

    def __init__(
        self,
        *,
        context: ctx_mod.ElasticContext,
        groups: ctx_mod.Groups,
        rank: int,
        plan: Plan,
        model: torch.nn.Module,
        parallel: parallel_mod.ParallelModel,
        optimizer: torch.optim.Optimizer,
        dataset: MapDataset,
        checkpoints: ckpt_mod.CheckpointManager,
        watchdog: Watchdog,
        metrics: TrainerMetrics,
        scheduler: Any = None,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        log_every: int = 10,
        precision: Optional[precision_mod.PrecisionState] = None,
        clip_grad_norm: Optional[float] = None,
        user_state: Optional[Mapping[str, Stateful]] = None,
        num_workers: int = 0,
        prefetch_factor: Optional[int] = None,
        ordered: Optional[ordered_reduction.OrderedReducer] = None,
        in_place: bool = False,
        link: Optional[WorkerLink] = None,
        wrap_options: tuple[parallel_mod.Parallelism, parallel_mod.Precision] = (
            parallel_mod.Parallelism.DDP,
            parallel_mod.Precision.FP32,
        ),
    ) -> None:
        self.ctx = context
        self.training: TrainingSpec = context.contract.training
        self.groups = groups
        self.device = groups.device
        self.rank = rank
        self.world_size = plan.world_size
        self.plan = plan
        self.raw_model = model
        self.parallel = parallel
        self.model = parallel.module
        self.ordered = ordered
        """The gradient reducer of ``spec.training.gradientReduction: ordered`` (None: DDP's all-reduce)."""
        self.precision = precision or precision_mod.PrecisionState(parallel_mod.Precision.FP32, groups.device)
        self.clip_grad_norm = clip_grad_norm
        self._grad_norm: Optional[torch.Tensor] = None  # the last step's, read only when asked (a device sync)
        self.user_state: dict[str, Stateful] = dict(user_state or {})
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self._feed: Optional[data_mod.LoaderFeed] = None
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.log_every = log_every
        self.checkpoints = checkpoints
        self.watchdog = watchdog
        self.metrics = metrics
        self.sampler = sampler_mod.GlobalSampler(len(dataset), self.training.seed)
        self.state = ckpt_mod.TrainerState()
        self.lr_state = lr_mod.LRState(plan.lr_scale, plan.lr_scale, 0)
        self.resumed_from: Optional[int] = None
        self.process_id = uuid.uuid4().hex  # tells the agent a new group from the old one (ProgressReport.process_id)
        self._agreement = BoundaryAgreement()
        self._planner = (  # intervalSteps: auto: rank 0 estimates, the boundary agreement carries it to all ranks
            autointerval.IntervalPlanner(self._read_reliability)
            if rank == 0 and checkpoints.spec.auto_interval
            else None
        )
        self._blocked_seen = 0.0
        self.in_place = in_place
        """The job's workers reform in place (:mod:`disttrain.trainer.inplace`): the same on every rank, so every new
        group agrees on the state before it resumes."""
        self._link = link
        """This process's channel to its launcher (None: it cannot wait for the next round and restarts instead)."""
        self._wrap_options = wrap_options
        self.group_failure: Optional[BaseException] = None
        """A collective failure kept from the user's code; the step is redone in the next group."""
        self._reform_signal: Optional[control_keys.ControlSignal] = None
        self._reforming = threading.Event()
        self._drained_in_place = False
        self._has_state = False
        self.startup = startup_mod.StartupClock(_IMPORTED_AT)
        """This process's startup stamps, sent with rank 0's progress (``from_env`` starts them earlier)."""
        if clip_grad_norm is not None:
            metrics.grad_norm.set_function(lambda: self.last_grad_norm or 0.0)  # read when scraped

    @property
    def last_grad_norm(self) -> Optional[float]:
        """Global gradient norm before clipping at the last step (None before the first step or without
        clipping). Kept as a tensor and read here, so clipping adds no device sync to the step."""
        return float(self._grad_norm) if self._grad_norm is not None else None

    @classmethod
    def from_env(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: MapDataset | data_mod.SeekableStream,
        *,
        scheduler: Any = None,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        log_every: int = 10,
        context: Optional[ctx_mod.ElasticContext] = None,
        on_checkpoint_phase: Optional[ckpt_mod.PhaseHook] = None,
        parallelism: str | parallel_mod.Parallelism = parallel_mod.Parallelism.DDP,
        precision: str | parallel_mod.Precision = parallel_mod.Precision.FP32,
        shard_modules: Optional[Sequence[torch.nn.Module]] = None,
        clip_grad_norm: Optional[float] = None,
        user_state: Optional[Mapping[str, Stateful]] = None,
        grad_scaler: Optional[ShardedGradScaler] = None,
        num_workers: int = 0,
        prefetch_factor: Optional[int] = None,
        device: str = "auto",
    ) -> ElasticTrainer:
        """Start the trainer of this worker, configured by the torchrun and ``DISTTRAIN_*`` environment.

        In this order: read the worker contract (or take ``context``), join the process group and a gloo group
        for checkpoints, serve metrics on ``DISTTRAIN_METRICS_PORT + LOCAL_RANK``, plan batch and LR for the
        world size, move the model to its device and wrap it in DDP or FSDP2, install the SIGTERM handler, connect
        to the job agent. Ends the process with ``ExitCode.PERMANENT`` (after telling the agent) when the contract is
        missing or invalid or the world size does not fit it. ``on_checkpoint_phase`` lets tests act inside a
        save (:class:`~disttrain.trainer.checkpoint.CheckpointPhase`).

        ``parallelism``: ``"ddp"`` (default) or ``"fsdp2"`` (``fully_shard`` on each of ``shard_modules``, by
        default :func:`~disttrain.trainer.parallel.default_shard_modules`, then the root). ``precision``:
        ``"fp32"``, ``"bf16"`` or ``"fp16"`` (with a GradScaler in the checkpoint; pass ``grad_scaler`` to set its
        initial scale or growth interval). ``clip_grad_norm``: clip the
        global gradient norm to this value before each optimizer step. ``user_state``: more ``Stateful`` objects
        (an EMA, a curriculum counter) saved and restored with every checkpoint under their names.
        ``dataset``: map-style, or an ``IterableDataset`` that can seek
        (:class:`~disttrain.trainer.data.SeekableStream`).
        ``num_workers`` > 0: batches come from a ``DataLoader`` with that many worker processes (and
        ``prefetch_factor`` batches each in flight, pinned memory on GPU), driven by the global cursor.
        ``device``: ``"auto"`` (``cuda:LOCAL_RANK`` when CUDA is available, else the CPU), ``"cuda"`` (refuse to
        start, ``PERMANENT``, when CUDA is absent) or ``"cpu"``.
        """
        clock = startup_mod.StartupClock(_IMPORTED_AT)
        clock.mark("setup_begin")
        _configure_logging()
        parallelism = _option_or_exit("parallelism", parallelism, parallel_mod.Parallelism)
        precision = _option_or_exit("precision", precision, parallel_mod.Precision)
        try:
            readable: MapDataset = data_mod.random_access(dataset)
        except TypeError as exc:
            exits.exit_permanent(str(exc))
        if num_workers < 0:
            exits.exit_permanent(f"num_workers={num_workers} must be >= 0 (0: batches are read in this process)")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            exits.exit_permanent(f"clip_grad_norm={clip_grad_norm!r} must be a positive number (or None: no clipping)")
        ctx = context or _context_or_exit()
        groups = ctx_mod.init_process_group(ctx, use_cuda=_use_cuda_or_exit(device))
        rank, world_size = dist.get_rank(), dist.get_world_size()
        metrics = _serve_metrics(ctx)
        training_plan = _plan_or_exit(ctx.contract.training, world_size)
        on_device = model.to(groups.device)  # in place: the optimizer keeps the same Parameter objects
        in_place = inplace.applies(
            ctx.contract.reform_in_place,
            parallelism is parallel_mod.Parallelism.DDP
            and not isinstance(model, torch.nn.parallel.DistributedDataParallel),
        )
        try:
            wrapped = parallel_mod.wrap(
                on_device, optimizer, groups.device, parallelism, precision, shard_modules, init_sync=not in_place
            )
            precision_state = precision_mod.PrecisionState(precision, groups.device, grad_scaler)
            ordered = ordered_reduction.for_training(
                ctx.contract.training, on_device, parallelism, precision, training_plan
            )
        except ValueError as exc:
            exits.exit_permanent(str(exc))
        watchdog = Watchdog(ctx.agent_endpoint, job_uid=ctx.job_uid)
        checkpoints = ckpt_mod.CheckpointManager(
            ctx.checkpoint_dir,
            ctx.contract.checkpoint,
            rank,
            world_size,
            groups.checkpoint,
            metrics=metrics,
            on_commit=lambda m: watchdog.publish(control_keys.CHECKPOINT_KEY, m.model_dump_json()),
            on_phase=on_checkpoint_phase,
            job_uid=ctx.job_uid,
            node=ctx.node_name,
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
        trainer = cls(
            context=ctx,
            groups=groups,
            rank=rank,
            plan=training_plan,
            model=on_device,
            parallel=wrapped,
            optimizer=optimizer,
            dataset=readable,
            checkpoints=checkpoints,
            watchdog=watchdog,
            metrics=metrics,
            scheduler=scheduler,
            collate_fn=collate_fn,
            log_every=log_every,
            precision=precision_state,
            clip_grad_norm=clip_grad_norm,
            user_state=user_state,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
            ordered=ordered,
            in_place=in_place,
            link=WorkerLink.connect() if in_place else None,
            wrap_options=(parallelism, precision),
        )
        trainer.startup = clock
        trainer._guard_wrapper()
        if trainer._link is not None:
            watchdog.on_reform = trainer._reform_directive
        return trainer

    # ---- user-facing -------------------------------------------------------------------------------------
    def __enter__(self) -> ElasticTrainer:
        return self

    def __exit__(
        self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        """Success closes; a user error exits PERMANENT and a failed collective REFORM, without Python's
        shutdown (it can block on a dead peer); anything else is written to torchrun's error file (the launcher
        puts its last line in the pod's termination message) and propagates (exit 1, retryable)."""
        if exc is None:
            self.close()
            return
        if isinstance(exc, (sampler_mod.DatasetChangedError, InvalidWorldSizeError, ctx_mod.ContractError)):
            exits.exit_permanent(str(exc))
        if is_collective_failure(exc):
            log.error(
                "a collective failed (%s: %s); exiting %d so the group re-forms from the last checkpoint",
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
                int(ExitCode.REFORM),
            )
            startup_mod.note_exit(self.watchdog.store)
            exits.hard_exit(ExitCode.REFORM)
        exits.record_error(exc)

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def samples_consumed(self) -> int:
        return self.state.samples_consumed

    @property
    def done(self) -> bool:
        t = self.training
        if t.max_steps is not None:
            return self.state.step >= t.max_steps
        return self.state.samples_consumed >= t.total_samples

    def request_drain(self, reason: str = "requested by the training script") -> None:
        """Checkpoint at the next step boundary, then exit ``ExitCode.DRAINED`` (as SIGTERM does)."""
        self.watchdog.request_drain(reason, then_exit=True)

    def full_model_state_dict(self) -> dict[str, Any]:
        """The whole model's weights as plain CPU tensors on global rank 0 (empty elsewhere), under DDP or FSDP2
        alike: the way to export the trained model. Collective: every rank calls it."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.raw_model, options=options)

    def fetch(self, indices: list[int]) -> Any:
        """The collated micro batch for dataset ``indices``, on the trainer's device."""
        if self._feed is not None:
            return _to_device(self._feed.next_batch(indices), self.device)
        if isinstance(self.dataset, TensorDataset):
            idx = torch.as_tensor(indices, dtype=torch.long)
            return _to_device(tuple(t[idx] for t in self.dataset.tensors), self.device)
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(indices) if getitems is not None else [self.dataset[i] for i in indices]
        return _to_device(self.collate_fn(samples), self.device)

    def steps(self) -> Iterator[Step]:
        """Resume, then yield one :class:`Step` per optimizer step until maxSteps/maxSamples, a drain or a failure.

        In place (:mod:`disttrain.trainer.inplace`), a group that breaks during a step, or a drain, does not end
        the process: :meth:`_reform_in_place` joins the next group and the loop goes on from the agreed state (a
        step the broken group did not finish is redone there)."""
        self._resume()
        self._resumed()
        first = True
        t_prev = time.monotonic()
        while not self.done:
            self._apply_lr()
            positions = sampler_mod.rank_positions(
                self.state.data_cursor, self.plan.global_batch, self.world_size, self.rank
            )
            step = Step(self, self.state.step, self.sampler.indices(positions))
            yield step
            if self.group_failure is None and self._reform_signal is None:
                with self.keeping_group_failures():
                    self._optimizer_step()
            if self.group_failure is not None or self._reform_signal is not None:
                self._reform_in_place()
                first, t_prev = True, time.monotonic()
                continue
            now = time.monotonic()
            if first:
                self.startup.mark("first_step")
                self.metrics.resume_seconds.set(now - _PROCESS_START)
                first = False
            self._after_step(step, now - t_prev)
            t_prev = now
            with self.keeping_group_failures():
                self._boundary()
            if self.group_failure is not None or self._drained_in_place:
                self._reform_in_place()
                first, t_prev = True, time.monotonic()
        self._commit_current_step()
        log.info("training finished at step %d (%d samples)", self.state.step, self.state.samples_consumed)

    def close(self) -> None:
        """Stop what :meth:`from_env` started: the watchdog, pending saves, the data loader's workers, the
        process group."""
        self.watchdog.stop()
        if self._link is not None:
            self._link.close()
        if self._feed is not None:
            self._feed.close()
        self.checkpoints.close()
        if dist.is_initialized():
            # Everyone leaves together: rank 0 hosts the group's store, and tearing it down under a peer
            # that is still finishing aborts that peer.
            dist.barrier()
            dist.destroy_process_group()

    # ---- internals ---------------------------------------------------------------------------------------
    def _start_feed(self) -> data_mod.LoaderFeed:
        """A DataLoader that reads ahead exactly the micro batches the steps from the restored cursor will ask for."""
        batches = data_mod.CursorBatchSampler(
            self.sampler,
            self.state.data_cursor,
            self.plan.global_batch,
            self.world_size,
            self.rank,
            self.plan.micro_batch,
            self.plan.accum_steps,
        )
        return data_mod.LoaderFeed(
            self.dataset,
            self.collate_fn,
            batches,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,
            pin_memory=self.device.type == "cuda",
        )

    def _checkpoint_contents(self) -> dict[str, Any]:
        """What a checkpoint holds, as DCP Statefuls: model + optimizer, :attr:`state`, the scheduler."""
        contents: dict[str, Any] = {
            "app": ckpt_mod.ModelOptimState(self.raw_model, self.optimizer),
            "trainer": self.state,
        }
        if self.scheduler is not None:
            contents["scheduler"] = ckpt_mod.SchedulerState(self.scheduler)
        if self.precision.scaler is not None:
            contents["grad_scaler"] = precision_mod.GradScalerState(self.precision.scaler)
        for name, stateful in self.user_state.items():
            contents[f"user/{name}"] = stateful
        return contents

    def _manifest(self) -> CheckpointManifest:
        return CheckpointManifest(
            step=self.state.step,
            samples_consumed=self.state.samples_consumed,
            data_cursor=self.state.data_cursor,
            world_size=self.world_size,
            plan=self.plan.to_status(),
            lr_scale=self.lr_state.scale_at(max(0, self.state.step - 1), self.training.lr.ramp_steps),
            dataset=self.sampler.fingerprint,
            metadata_sha256="pending",
            files={},
            created_at="pending",
            code_version=CODE_VERSION,
            config_hash=training_config_hash(self.training),
            job=self.ctx.job,
            job_uid=self.ctx.job_uid or None,
        )

    def _save(self, force_sync: bool) -> None:
        self.checkpoints.save(self.state.step, self._checkpoint_contents(), self._manifest(), force_sync=force_sync)

    def _commit_current_step(self) -> None:
        """Make sure a committed checkpoint holds every step that ran (the end of training, a drain)."""
        self.checkpoints.wait_pending()
        if self.checkpoints.last_saved_step != self.state.step:
            self._save(force_sync=True)

    def _resumed(self) -> None:
        """What follows a resume: the startup stamp, the data loader from the restored cursor."""
        self._has_state = True
        self.startup.mark("resumed")
        if self.num_workers > 0:
            self._feed = self._start_feed()

    def _resume(self) -> None:
        manifest = self.checkpoints.find_latest()
        ramp = self.training.lr.ramp_steps
        if self.in_place:
            # Every new group agrees first: a member may hold a newer step in memory than any checkpoint.
            holdings = inplace.gather_holdings(
                self.state.step if self._has_state else inplace.NO_STATE,
                manifest.step if manifest is not None else inplace.NO_STATE,
                self.world_size,
            )
            source = inplace.choose_source(holdings)
            if source is not None:
                self._resume_from_memory(source, holdings)
                return
            if manifest is None:
                inplace.broadcast_module(self.raw_model)  # what DDP's construction did before init_sync=False
        if manifest is None:
            if self.rank == 0:
                log.info(
                    "no complete checkpoint in %s: starting at step 0 (world size %d, plan %s)",
                    self.ctx.checkpoint_dir,
                    self.world_size,
                    self.plan.to_status(),
                )
            self.lr_state = lr_mod.ramp_after_resume(None, None, 0, self.plan.lr_scale, 0, ramp)
            self.watchdog.start()
            return
        sampler_mod.check_fingerprint(manifest.dataset, self.sampler.fingerprint)
        if manifest.config_hash != training_config_hash(self.training):
            log.warning(
                "spec.training changed since checkpoint step-%d (config hash differs); continuing with the "
                "new contract",
                manifest.step,
            )
        self.checkpoints.load(manifest, self._checkpoint_contents())
        s = self.state
        if s.data_cursor != s.samples_consumed or s.data_cursor != manifest.data_cursor:
            # The cursor is the number of samples consumed by construction; anything else would replay or skip.
            gap = s.data_cursor - s.samples_consumed
            (self.metrics.samples_replayed if gap < 0 else self.metrics.samples_skipped).inc(abs(gap))
        saved_scale = s.lr_start_scale if s.lr_start_scale > 0 else None
        saved_target = s.lr_target_scale if s.lr_target_scale > 0 else None
        self.lr_state = lr_mod.ramp_after_resume(
            saved_scale, saved_target, s.lr_change_step, self.plan.lr_scale, s.step, ramp
        )
        self.resumed_from = manifest.step
        log.info(
            "resumed from checkpoint step-%d (saved at world size %d) at world size %d: plan %s, "
            "samples consumed %d, LR factor %.4g -> %.4g over %d steps",
            manifest.step,
            manifest.world_size,
            self.world_size,
            self.plan.to_status(),
            s.samples_consumed,
            self.lr_state.start_scale,
            self.lr_state.target_scale,
            ramp,
        )
        self.watchdog.start(recorded_generation=s.control_generation, recorded_uid=manifest.job_uid)

    def _resume_from_memory(self, source: int, holdings: list[inplace.Holding]) -> None:
        """Take the state of rank ``source``'s memory (every rank that holds another step loads it): nothing that
        ran since the last checkpoint is redone."""
        newest = holdings[source].memory_step
        receivers = [r for r, h in enumerate(holdings) if h.memory_step != newest]
        t0 = time.monotonic()
        sent = 0
        if receivers:
            sent = inplace.broadcast_state(self._checkpoint_contents(), source, self.rank in receivers)
        s = self.state
        saved_scale = s.lr_start_scale if s.lr_start_scale > 0 else None
        saved_target = s.lr_target_scale if s.lr_target_scale > 0 else None
        self.lr_state = lr_mod.ramp_after_resume(
            saved_scale, saved_target, s.lr_change_step, self.plan.lr_scale, s.step, self.training.lr.ramp_steps
        )
        self.resumed_from = s.step
        disk = holdings[0].disk_step
        # The same history on every rank (when a save is due follows from it): the newest complete checkpoint.
        newest_checkpoint = disk if disk != inplace.NO_STATE else None
        ckpts = self.checkpoints
        ckpts.loaded_step = ckpts.last_saved_step = ckpts.last_committed_step = newest_checkpoint
        log.info(
            "resumed in place from step %d held in memory by rank %d (%d of %d ranks received %.1f MB in %.2f s) at "
            "world size %d: plan %s, samples consumed %d; the newest checkpoint is step %s",
            newest,
            source,
            len(receivers),
            self.world_size,
            sent / 1e6,
            time.monotonic() - t0,
            self.world_size,
            self.plan.to_status(),
            s.samples_consumed,
            disk if disk != inplace.NO_STATE else "none",
        )
        if not self.watchdog.started:
            self.watchdog.start(recorded_generation=s.control_generation, recorded_uid=self.ctx.job_uid or None)

    # ---- in-place reforms -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def keeping_group_failures(self) -> Iterator[None]:
        """In place, a collective failure inside the block is noted (:attr:`group_failure`) instead of raised: the
        step is redone in the next group. Otherwise, and for any other error, the exception goes on."""
        try:
            yield
        except BaseException as exc:
            if not (self.in_place and self._link is not None and inplace.is_group_failure(exc)):
                raise
            self._note_group_failure(exc)

    def _note_group_failure(self, exc: BaseException) -> None:
        if self.group_failure is None:
            self.group_failure = exc
            log.warning(
                "a collective failed (%s: %s); re-forming in place",
                type(exc).__name__,
                str(exc).splitlines()[0][:200] if str(exc) else "",
            )

    def _guard_wrapper(self) -> None:
        """Keep a failed buffer broadcast in DDP's forward (called from the user's code) from the user."""
        if (
            self.in_place
            and self._link is not None
            and isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        ):
            inplace.guard_buffer_sync(self.model, self._note_group_failure)

    def _reform_directive(self, signal: control_keys.ControlSignal) -> bool:
        """The watchdog's ``reform`` directive (its thread): the loop re-forms in place at its next chance (the
        next collective fails at once when a peer died; else at the end of the step). A loop that does not get
        there within :data:`REFORM_GRACE_S` is blocked in a collective: the process exits ``REFORM`` as before."""
        self._reform_signal = signal

        def exit_if_blocked() -> None:
            if not self._reforming.wait(REFORM_GRACE_S):
                log.warning(
                    "reform signal (generation %d, %s): no in-place reform within %.0f s (a collective blocks); "
                    "exiting %d",
                    signal.generation,
                    signal.reason,
                    REFORM_GRACE_S,
                    int(ExitCode.REFORM),
                )
                startup_mod.note_exit(self.watchdog.store)
                exits.hard_exit(ExitCode.REFORM)

        threading.Thread(target=exit_if_blocked, name="disttrain-reform-grace", daemon=True).start()
        return True

    def _excluded(self) -> bool:
        """This node is a victim of the directive in flight (the agent's target plan excludes it)."""
        store = self.watchdog.store
        if store is None:
            return False
        target = control_keys.read_model(store, control_keys.TARGET_KEY, control_keys.TargetPlan)
        return target is not None and self.ctx.node_name in target.exclude

    def _reform_in_place(self) -> None:
        """Leave the group, take the next round from the launcher, rebuild what belongs to a group and resume from
        the state the new group agrees on. Exits ``REFORM`` when no round comes (the launcher then restarts it)."""
        self._reforming.set()
        cause = (
            f"collective failed: {type(self.group_failure).__name__}"
            if self.group_failure is not None
            else f"reform directive generation {self._reform_signal.generation}"
            if self._reform_signal is not None
            else "drained"
        )
        step = self.state.step
        self.group_failure = None  # its traceback holds the old group's objects: they must go now (_leave_group)
        startup_mod.note_exit(self.watchdog.store)
        self._leave_group()
        env = self._link.request_round(step, ROUND_WAIT_S) if self._link is not None else None
        if env is None:
            log.warning("no next round for this worker (%s); exiting %d", cause, int(ExitCode.REFORM))
            exits.hard_exit(ExitCode.REFORM)
        log.info("re-forming in place after step %d (%s)", step, cause)
        self._join_round(env)
        self._resume()
        self._resumed()
        self.group_failure, self._reform_signal, self._drained_in_place = None, None, False
        self._reforming.clear()

    def _leave_group(self) -> None:
        """Drop everything bound to the group that ended: a save in flight, the loader, the wrapper, the groups."""
        try:
            self.checkpoints.abandon(timeout_s=self.ctx.contract.collective_timeout_seconds + 5.0)
        except RuntimeError as exc:
            log.warning("cannot re-form in place (%s); exiting %d", exc, int(ExitCode.REFORM))
            exits.hard_exit(ExitCode.REFORM)
        if self._feed is not None:
            self._feed.close()
            self._feed = None
        self.optimizer.zero_grad(set_to_none=True)
        try:
            self._agreement.settle()  # fails at once on a broken group; a left group must hold no work in flight
        except Exception as exc:  # noqa: BLE001 - the failure that ends this group, seen once more
            log.debug("the boundary agreement in flight ended with: %s", exc)
        self._agreement = BoundaryAgreement()
        inplace.retire(self.model)
        parallelism, sums = self.parallel.parallelism, self.parallel.sums_gradients
        self.model, self.parallel = self.raw_model, parallel_mod.ParallelModel(self.raw_model, parallelism, sums)
        self.ordered = None
        self.checkpoints.group = None
        self.groups = ctx_mod.Groups(default=None, checkpoint=None, device=self.device)
        inplace.leave_groups()

    def _join_round(self, environ: Mapping[str, str]) -> None:
        """Become the worker of the next round ``environ`` describes (what torchrun would have started a process
        with), and rebuild the group-bound parts the way :meth:`from_env` builds them."""
        handed_over = time.time()
        os.environ.clear()
        os.environ.update(environ)
        os.environ[startup_mod.HANDOVER_ENV] = repr(handed_over)
        self.startup = startup_mod.StartupClock(handed_over)
        self.startup.mark("setup_begin", handed_over)
        ctx = _context_or_exit()
        groups = ctx_mod.init_process_group(ctx, use_cuda=self.device.type == "cuda")
        rank, world_size = dist.get_rank(), dist.get_world_size()
        training_plan = _plan_or_exit(ctx.contract.training, world_size)
        parallelism, precision = self._wrap_options
        try:
            wrapped = parallel_mod.wrap(
                self.raw_model, self.optimizer, groups.device, parallelism, precision, init_sync=False
            )
            ordered = ordered_reduction.for_training(
                ctx.contract.training, self.raw_model, parallelism, precision, training_plan
            )
        except ValueError as exc:
            exits.exit_permanent(str(exc))
        self.ctx, self.groups, self.rank, self.world_size, self.plan = ctx, groups, rank, world_size, training_plan
        self.parallel, self.model, self.ordered = wrapped, wrapped.module, ordered
        self.checkpoints = self.checkpoints.successor(rank, world_size, groups.checkpoint)
        self._agreement = BoundaryAgreement()
        if rank != 0:
            self._planner = None
        elif self._planner is None and self.checkpoints.spec.auto_interval:
            self._planner = autointerval.IntervalPlanner(self._read_reliability)
        self.process_id = uuid.uuid4().hex
        self.metrics.restart_count.set(ctx.restart_count)
        self.watchdog.mark_history()  # the directive that ended the old group is done with this round
        self._guard_wrapper()
        if rank == 0:
            first, last = startup_mod.take_exit_times(self.watchdog.store)
            self.startup.stamps["old_exit_first"], self.startup.stamps["old_exit_last"] = first, last
        self.startup.mark("group_ready")

    def _apply_lr(self) -> None:
        scale = self.lr_state.scale_at(self.state.step, self.training.lr.ramp_steps)
        lr_mod.apply_lr(self.optimizer, self.scheduler, self.training, self.state.samples_consumed, scale)
        if self.scheduler is not None:
            # The scheduler's own factor applies on top of the base LRs just recomputed from the rule.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # get_lr() outside step() warns; we call it deliberately
                closed = getattr(self.scheduler, "_get_closed_form_lr", None)
                lrs = closed() if closed is not None else self.scheduler.get_lr()
            for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr
        self.metrics.lr_scale.set(scale)

    def _optimizer_step(self) -> None:
        if self.ordered is not None:
            self.ordered.reduce()
        self.checkpoints.before_optimizer_step()
        self.precision.unscale(self.optimizer)
        if self.clip_grad_norm is not None:
            self._grad_norm = precision_mod.clip_global_grad_norm(self.raw_model, self.clip_grad_norm)
        self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        s = self.state
        s.step += 1
        s.samples_consumed += self.plan.global_batch
        s.data_cursor += self.plan.global_batch
        s.lr_start_scale, s.lr_target_scale = self.lr_state.start_scale, self.lr_state.target_scale
        s.lr_change_step = self.lr_state.change_step
        s.control_generation = self.watchdog.seen_generation

    def _after_step(self, step: Step, seconds: float) -> None:
        if self._planner is not None:  # the step time without what saves blocked it
            blocked, self._blocked_seen = self.checkpoints.blocked_s - self._blocked_seen, self.checkpoints.blocked_s
            self._planner.observe_step(seconds - blocked)
        m = self.metrics
        m.step.set(self.state.step)
        m.world_size.set(self.world_size)
        m.accum_steps.set(self.plan.accum_steps)
        rate = self.plan.global_batch / seconds if seconds > 0 else 0.0
        m.samples_per_second.set(rate)
        if self.rank != 0:
            return
        logging_due = self.state.step % self.log_every == 0 or self.state.step == 1
        if not logging_due and self.watchdog.store is None:
            return  # nothing reads the loss this step: do not wait for the device to produce it
        loss = step.loss_sum / step.loss_count if step.loss_count else None
        if logging_due:
            log.info(
                "step %d loss %s lr %.4g world %d samples/s %.0f",
                self.state.step,
                f"{loss:.4f}" if loss is not None else "-",
                self.optimizer.param_groups[0]["lr"],
                self.world_size,
                rate,
            )
        if self.watchdog.store is not None:
            report = control_keys.ProgressReport(
                step=self.state.step,
                samples_consumed=self.state.samples_consumed,
                world_size=self.world_size,
                plan=self.plan.to_status(),
                loss=loss,
                samples_per_second=rate,
                restart_count=self.ctx.restart_count,
                run_id=self.ctx.run_id,
                resumed_from_step=self.resumed_from,
                process_id=self.process_id,
                time=time.time(),
                startup=self.startup.report(),
            )
            self.watchdog.publish(control_keys.PROGRESS_KEY, report.model_dump_json())

    def _boundary_flags(self) -> BoundaryFlags:
        """This rank's side of the boundary agreement."""
        save_in_progress, save_failed = self.checkpoints.local_pending_state()
        pending = self.checkpoints.pending
        return BoundaryFlags.of_rank(
            drain=self.watchdog.drain_requested,
            save_in_progress=bool(save_in_progress),
            save_failed=bool(save_failed),
            seconds_due=self.rank == 0 and self.checkpoints.seconds_due(),
            pending_step=pending.step if pending is not None else NO_SAVE,
            interval_steps=self._propose_interval(),
        )

    def _propose_interval(self) -> int:
        """Rank 0's automatic checkpoint interval for the boundary agreement (0: none), published when it changes."""
        if self._planner is None:
            return 0
        steps = self._planner.propose(self.checkpoints.last_save_blocking_s)
        report = self._planner.report()
        if report is not None:
            self.watchdog.publish(control_keys.INTERVAL_KEY, report.model_dump_json())
        return steps

    def _read_reliability(self) -> Optional[control_keys.ReliabilityReport]:
        store = self.watchdog.store
        if store is None:
            return None
        return control_keys.read_model(store, control_keys.RELIABILITY_KEY, control_keys.ReliabilityReport)

    def _boundary(self) -> None:
        """Agree on drain / save state with every rank (:mod:`disttrain.trainer.boundary`), then complete a save
        every rank finished, drain, or checkpoint when due."""
        last = self.done
        agreed = self._agreement.exchange(self._boundary_flags(), read_now=last)
        if agreed is None:
            # The first boundary of a run has no agreement yet; a save due by step count needs none (every rank
            # decides alike from the step), so the first interval after a resume is not skipped.
            if self.checkpoints.should_save(self.state.step, last=last):
                self._save(force_sync=last)
            return
        if agreed.interval_steps > 0:
            self.checkpoints.agreed_interval = agreed.interval_steps
            self.metrics.checkpoint_interval_steps.set(agreed.interval_steps)
        pending = self.checkpoints.pending
        if pending is not None and agreed.save_finished_everywhere(pending.step):
            self.checkpoints.poll(all_done=True)
        if agreed.drain:
            self._agreement.settle()
            self._drain()
            return  # drained in place (otherwise the process has exited)
        if self.checkpoints.should_save(self.state.step, last=last) or agreed.seconds_due or self.checkpoints.retry_due:
            self._save(force_sync=last)

    def _drain(self) -> None:
        """Commit the current step, then exit ``ExitCode.DRAINED``: no step that ran is lost. In place, a worker
        that is neither stopped (SIGTERM) nor a victim of the directive stays for the next round instead."""
        self._commit_current_step()
        reason = self.watchdog.drain_reason or "drain on another rank"
        if self.in_place and self._link is not None and not self.watchdog.exit_requested and not self._excluded():
            log.info(
                "drained at step %d (%s): checkpoint step-%d committed; re-forming in place",
                self.state.step,
                reason,
                self.state.step,
            )
            self.watchdog.clear_drain()
            self._drained_in_place = True
            return
        log.info(
            "drained at step %d (%s): checkpoint step-%d committed; exiting %d",
            self.state.step,
            reason,
            self.state.step,
            int(ExitCode.DRAINED),
        )
        self.watchdog.stop()
        self.checkpoints.join_retention()
        startup_mod.note_exit(self.watchdog.store)
        exits.hard_exit(ExitCode.DRAINED)


def _context_or_exit() -> ctx_mod.ElasticContext:
    try:
        return ctx_mod.ElasticContext.from_env()
    except ctx_mod.ContractError as exc:
        exits.exit_permanent(str(exc))


def _serve_metrics(ctx: ctx_mod.ElasticContext) -> TrainerMetrics:
    metrics = TrainerMetrics()
    metrics.serve(ctx.metrics_port + ctx.local_rank if ctx.metrics_port else 0)
    metrics.restart_count.set(ctx.restart_count)
    return metrics


def _plan_or_exit(training: TrainingSpec, world_size: int) -> Plan:
    try:
        return plan(training, world_size)
    except InvalidWorldSizeError as exc:
        exits.exit_permanent(f"spec.training: {exc}")


_Option = TypeVar("_Option", parallel_mod.Parallelism, parallel_mod.Precision)


def _use_cuda_or_exit(device: str) -> Optional[bool]:
    """``device`` as the process group's choice; CUDA asked for and absent is a permanent error, not a CPU run."""
    if device == "auto":
        return None
    if device == "cpu":
        return False
    if device != "cuda":
        exits.exit_permanent(f"device={device!r} is not supported; allowed: 'auto', 'cuda', 'cpu'")
    if not torch.cuda.is_available():
        exits.exit_permanent(
            f"device='cuda' was asked for but CUDA is not available in this container (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda or 'none'}, {torch.cuda.device_count()} devices visible): "
            "use a CUDA build of torch and request GPUs (resources.limits['nvidia.com/gpu']), or pass device='cpu'"
        )
    return True


def _option_or_exit(name: str, value: str | _Option, kind: type[_Option]) -> _Option:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(repr(k.value) for k in kind)
        exits.exit_permanent(f"{name}={value!r} is not supported; allowed: {allowed}")


def _open_control_channel(watchdog: Watchdog) -> None:
    """SIGTERM means drain; the agent's store is optional (without it only SIGTERM can drain)."""
    watchdog.install_sigterm()
    try:
        watchdog.connect()
    except Exception as exc:  # noqa: BLE001 - the channel is optional; SIGTERM still works
        log.warning("control channel %s unavailable (%s); only SIGTERM can drain", watchdog.endpoint, exc)


def _to_device(data: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return data
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=True)
    if isinstance(data, (list, tuple)):
        return type(data)(_to_device(d, device) for d in data)
    if isinstance(data, dict):
        return {k: _to_device(v, device) for k, v in data.items()}
    return data


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
