"""The training-loop API: the user's loop stays recognisable, the elastic machinery lives here.

    with ElasticTrainer.from_env(model, optimizer, dataset) as trainer:
        for step in trainer.steps():
            for batch in step:                       # this rank's micro batches of the step
                loss = loss_fn(trainer.model(batch.data[0]), batch.data[1], reduction="sum")
                step.backward(loss)                  # normalised by the global sample count
            # optimizer step, LR, checkpoint, drain/SIGTERM are handled when the loop comes back here

Lifecycle: :meth:`ElasticTrainer.from_env` reads the options (:mod:`disttrain.trainer.options`) and starts everything
with a side effect (process group, metrics server, DDP or FSDP2, SIGTERM handler, control channel:
:mod:`disttrain.trainer.bootstrap`) and plans micro batch / accumulation / LR for the actual world size;
:meth:`~ElasticTrainer.steps` loads the newest valid checkpoint (resharding model and optimizer,
:mod:`disttrain.trainer.snapshots`), refuses a changed dataset, recomputes the LR from the declared rule and trains;
:meth:`~ElasticTrainer.close` (the end of the ``with``) stops it all. After each optimizer step the ranks agree (one
tiny all-reduce, :mod:`disttrain.trainer.boundary`) on drain requests and on the state of an async save, then checkpoint
when due. How a group ends (drain, failure, reform in place) is :mod:`disttrain.trainer.lifecycle`'s.
Exits: ``ExitCode.SUCCESS`` at the end, ``DRAINED`` after a drain/SIGTERM checkpoint, ``REFORM`` when a
collective fails or the agent says reform, ``PERMANENT`` for an invalid world size, contract, option or changed
dataset.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import TensorDataset

from disttrain.api.plan import Plan
from disttrain.api.spec import TrainingSpec
from disttrain.trainer import bootstrap, exits, gate, progress, recovery, snapshots, startfailures
from disttrain.trainer import completion as completion_mod
from disttrain.trainer import context as ctx_mod
from disttrain.trainer import data as data_mod
from disttrain.trainer import evaluation as evaluation_mod
from disttrain.trainer import lifecycle as lifecycle_mod
from disttrain.trainer import lr as lr_mod
from disttrain.trainer import precision as precision_mod
from disttrain.trainer import sampler as sampler_mod
from disttrain.trainer.bootstrap import Components, MapDataset, Started
from disttrain.trainer.checkpoint import manager as ckpt_mod
from disttrain.trainer.groupstate import GroupState
from disttrain.trainer.options import TrainerKwargs, TrainerOptions
from disttrain.trainer.ordered_reduction import OrderedReducer
from disttrain.trainer.parallel import ParallelModel
from disttrain.trainer.step import MicroBatch, Step, to_device

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Components", "ElasticTrainer", "MapDataset", "MicroBatch", "Started", "Step"]

log = logging.getLogger("disttrain.trainer")
_PROCESS_START = time.monotonic()


class ElasticTrainer:
    """Model, optimizer, (optional) scheduler and a map-style dataset in; :meth:`steps` out.

    Start one with :meth:`from_env`. The constructor only stores parts that are already started, so
    :func:`disttrain.trainer.bootstrap.start` is the one place that shows what starts, in which order, and
    :meth:`close` what stops.
    """

    def __init__(self, options: TrainerOptions, components: Components, started: Started) -> None:
        self.options = options
        self.group: GroupState = started.group
        """Everything bound to the current process group (:mod:`disttrain.trainer.groupstate`): replaced whole when
        the lifecycle re-forms the group in place."""
        self.training: TrainingSpec = started.group.context.contract.training
        self.device = started.group.device
        self.precision = started.precision
        self.optimizer = components.optimizer
        self.scheduler = components.scheduler
        self.dataset = components.dataset
        self.watchdog = started.lasting.watchdog
        self.metrics = started.lasting.metrics
        self.template = started.lasting.template
        """A sharded model's structure, sharded again on each new mesh in place (None: DDP or no in-place reforms)."""
        self.memory = recovery.Memory()
        """This group's state in memory and the partner's copy, and the previous group's (a sharded model reforming
        in place)."""
        self.resumption = snapshots.Resumption()
        """Where the current group's state came from (a checkpoint, memory), as rank 0's progress reports it."""
        self.sampler = sampler_mod.GlobalSampler(len(components.dataset), self.training.seed)
        self.state = ckpt_mod.TrainerState()
        self.saved = snapshots.Saved(
            optimizer=self.optimizer,
            state=self.state,
            scheduler=self.scheduler,
            precision=self.precision,
            user_state=options.checkpoint.user_state,
        )
        """What a checkpoint holds besides the model (:mod:`disttrain.trainer.snapshots`)."""
        self.lr_state = lr_mod.LRState(started.group.plan.lr_scale, started.group.plan.lr_scale, 0)
        self.has_state = False
        self.completion = completion_mod.for_device(started.group.device)
        """The step counter moves only once the device finished the step (:mod:`disttrain.trainer.completion`)."""
        self.lifecycle = lifecycle_mod.Lifecycle(self, options.lifecycle, started.lasting, started.link, self.memory)
        self.effects, self.evaluator = bootstrap.side_effects(options, started)
        """Side effects once per committed step (:mod:`disttrain.trainer.effects`); evaluation in the loop."""
        self.reporter = progress.Reporter(options.log_every, self.watchdog, self.metrics, started.in_place_fallback)
        self._feed: Optional[data_mod.LoaderFeed] = None
        self._grad_norm: Optional[torch.Tensor] = None  # the last step's, read only when asked (a device sync)
        if options.precision.clip_grad_norm is not None:
            self.metrics.grad_norm.set_function(lambda: self.last_grad_norm or 0.0)  # read when scraped

    @classmethod
    def from_env(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: MapDataset | data_mod.SeekableStream,
        *,
        scheduler: Any = None,
        context: Optional[ctx_mod.ElasticContext] = None,
        **kwargs: Unpack[TrainerKwargs],
    ) -> ElasticTrainer:
        """Start the trainer of this worker, configured by the torchrun and ``DISTTRAIN_*`` environment: what starts,
        in which order, is :func:`disttrain.trainer.bootstrap.start`'s. Ends the process with ``ExitCode.PERMANENT``
        (after telling the agent) when the contract, an option or the dataset is invalid or the world size does not
        fit the contract, and with ``ExitCode.REFORM`` when the group fails to start because its peers left
        (:mod:`disttrain.trainer.startfailures`).

        ``kwargs`` are the options of :class:`~disttrain.trainer.options.TrainerKwargs` (``parallelism``,
        ``precision``, ``shard_modules``, ``grad_scaler``, ``clip_grad_norm``, ``user_state``, ``collate_fn``,
        ``num_workers``, ``prefetch_factor``, ``device``, ``log_every``, ``on_checkpoint_phase``); each is
        documented on its field of :class:`~disttrain.trainer.options.TrainerOptions`. ``dataset``: map-style, or
        an ``IterableDataset`` that can seek (:class:`~disttrain.trainer.data.SeekableStream`).
        """
        try:
            options, components, started = bootstrap.start(
                model, optimizer, dataset, scheduler=scheduler, context=context, **kwargs
            )
        except Exception as exc:
            startfailures.exit_if_peers_failed(exc)  # a start its peers failed re-joins, a bounded number of times
            exits.record_error(exc)
            raise
        startfailures.clear()
        trainer = cls(options, components, started)
        trainer.lifecycle.start()
        return trainer

    # ---- user-facing -------------------------------------------------------------------------------------
    def __enter__(self) -> ElasticTrainer:
        return self

    def __exit__(
        self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        """Success closes; an error ends the process as :meth:`~disttrain.trainer.lifecycle.Lifecycle.exit_on_error`
        says (PERMANENT, REFORM, or the error file and exit 1)."""
        if exc is None:
            self.close()
            return
        self.lifecycle.exit_on_error(exc)

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def data_rank(self) -> int:
        """Which samples this rank reads: the rank, or its TP group's index on an FSDP x TP mesh (whose ranks read
        the same samples)."""
        return self.group.data_rank

    # The current group's parts (:class:`~disttrain.trainer.groupstate.GroupState`), as the training script reads them.
    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def plan(self) -> Plan:
        return self.group.plan

    @property
    def model(self) -> torch.nn.Module:
        """The wrapped model of the current group: call it at each step (a reform in place wraps it again)."""
        return self.group.model

    @property
    def parallel(self) -> ParallelModel:
        return self.group.parallel

    @property
    def ordered(self) -> Optional[OrderedReducer]:
        return self.group.ordered

    @property
    def checkpoints(self) -> ckpt_mod.CheckpointManager:
        return self.group.checkpoints

    @property
    def resumed_from(self) -> Optional[int]:
        """The step this process's state was last resumed from (a checkpoint's or memory's; None: a fresh start)."""
        return self.resumption.step

    @property
    def samples_consumed(self) -> int:
        return self.state.samples_consumed

    @property
    def done(self) -> bool:
        t = self.training
        if t.max_steps is not None:
            return self.state.step >= t.max_steps
        return self.state.samples_consumed >= t.total_samples

    @property
    def seed(self) -> int:
        """``spec.training.seed``: the key of the sampler's permutation and of per-sample randomness."""
        return self.training.seed

    @property
    def group_failure(self) -> Optional[BaseException]:
        """A collective failure kept from the user's code; the step is redone in the next group."""
        return self.lifecycle.group_failure

    @property
    def last_grad_norm(self) -> Optional[float]:
        """Global gradient norm before clipping at the last step (None before the first step or without
        clipping). Kept as a tensor and read here, so clipping adds no device sync to the step."""
        return float(self._grad_norm) if self._grad_norm is not None else None

    def keeping_group_failures(self) -> AbstractContextManager[None]:
        """See :meth:`~disttrain.trainer.lifecycle.Lifecycle.keeping_group_failures`."""
        return self.lifecycle.keeping_group_failures()

    def request_drain(self, reason: str = "requested by the training script") -> None:
        """Checkpoint at the next step boundary, then exit ``ExitCode.DRAINED`` (as SIGTERM does)."""
        self.watchdog.request_drain(reason, then_exit=True)

    def declare_effect(self, name: str, payload: Optional[dict[str, Any]] = None) -> str:
        """Declare the side effect ``name`` (a handler of the ``effects`` option) of the step being run, with a
        small JSON ``payload``: rank 0 calls ``handler(key, payload)`` after the checkpoint covering this step
        commits, once per committed step (the contract: :mod:`disttrain.trainer.effects`). Returns the key
        ``<run id>/<step>/<name>``. Declare it on every rank (rank 0's declarations are the ones recorded)."""
        return self.effects.declare(name, payload or {}, self.state.step + 1)

    def full_model_state_dict(self) -> dict[str, Any]:
        """The whole model's weights as plain CPU tensors on global rank 0 (empty elsewhere), under DDP or FSDP2
        alike: the way to export the trained model. Collective: every rank calls it."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.group.raw_model, options=options)

    def fetch(self, indices: list[int]) -> Any:
        """The collated micro batch for dataset ``indices``, on the trainer's device."""
        if self._feed is not None:
            return to_device(self._feed.next_batch(indices), self.device)
        if isinstance(self.dataset, TensorDataset):
            idx = torch.as_tensor(indices, dtype=torch.long)
            return to_device(tuple(t[idx] for t in self.dataset.tensors), self.device)
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(indices) if getitems is not None else [self.dataset[i] for i in indices]
        return to_device(self.options.data.collate_fn(samples), self.device)

    def steps(self) -> Iterator[Step]:
        """Resume, then yield one :class:`Step` per optimizer step until maxSteps/maxSamples, a drain or a failure.

        In place (:mod:`disttrain.trainer.inplace`), a group that breaks during a step, or a drain, does not end
        the process: the lifecycle joins the next group and the loop goes on from the agreed state (a step the
        broken group did not finish is redone there)."""
        life = self.lifecycle
        self.resume()
        first = True
        t_prev = time.monotonic()
        while not self.done:
            self._apply_lr()
            positions = sampler_mod.rank_positions(
                self.state.data_cursor, self.plan.global_batch, self.plan.data_degree, self.data_rank
            )
            step = Step(
                self,
                self.state.step,
                self.sampler.indices(positions),
                lambda n: self.reporter.send_beacon(self.group, n),
                reduce_loss=self.reporter.is_loss_read(self.state.step + 1),
            )
            yield step
            if life.group_failure is None:  # a directive still lets the step finish: the gate decides it on every rank
                with self.keeping_group_failures():
                    self._optimizer_step()
            if life.group_failure is not None or life.reform_signal is not None:
                life.reform_in_place()
                first, t_prev = True, time.monotonic()
                continue
            now = time.monotonic()
            if first:
                self.group.startup.mark("first_step")
                self.metrics.resume_seconds.set(now - _PROCESS_START)
                first = False
            lr = self.optimizer.param_groups[0]["lr"]
            self.reporter.report_step(self.group, self.state, self.resumption, step, now - t_prev, lr)
            t_prev = now
            with self.keeping_group_failures():
                self._boundary()
                self._settle_effects()
            if life.group_failure is not None or life.drained_in_place:
                life.reform_in_place()
                first, t_prev = True, time.monotonic()
        self.commit_current_step()
        self.finish_uploads()
        log.info("training finished at step %d (%d samples)", self.state.step, self.state.samples_consumed)

    def close(self) -> None:
        """Stop what :meth:`from_env` started: the watchdog, pending saves, the data loader's workers, the
        process group."""
        self.watchdog.stop()
        self.lifecycle.close()
        self.close_feed()
        self.checkpoints.close()
        if dist.is_initialized():
            # Everyone leaves together: rank 0 hosts the group's store, and tearing it down under a peer
            # that is still finishing aborts that peer.
            dist.barrier()
            dist.destroy_process_group()

    # ---- internals (also called by the lifecycle) ----------------------------------------------------------
    def resume(self) -> None:
        """Take the state this group continues from, then start reading batches from its cursor."""
        parts = snapshots.Resuming(
            saved=self.saved,
            training=self.training,
            dataset=self.sampler.fingerprint,
            in_place=self.lifecycle.in_place,
            template=self.template,
            memory=self.memory,
            watchdog=self.watchdog,
            metrics=self.metrics,
            effects=self.effects,
            evaluator=self.evaluator,
        )
        self.lr_state = snapshots.resume(self.group, parts, self.resumption, self.has_state)
        self.has_state = True
        self.group.startup.mark("resumed")
        if self.options.data.num_workers > 0:
            self._feed = self._start_feed()

    def close_feed(self) -> None:
        """Stop the DataLoader's workers (a new group starts its own from the agreed cursor)."""
        if self._feed is not None:
            self._feed.close()
            self._feed = None

    def commit_current_step(self) -> None:
        """Make sure a committed checkpoint holds every step that ran (the end of training, a drain)."""
        self.checkpoints.wait_pending()
        if self.checkpoints.last_saved_step != self.state.step:
            self._save(force_sync=True)
        self._settle_effects()

    def finish_uploads(self) -> None:
        """With a bucket, before the process leaves: the last saves reach it, then their effects run."""
        if self.checkpoints.tier is not None:
            self.checkpoints.commits.close_tier()
            self._settle_effects()

    def _settle_effects(self) -> None:
        """Effects of a save that is durable (committed; with a bucket, COMPLETE there) become due; rank 0 carries
        out what is due."""
        self.effects.note_committed(self.checkpoints.commits.durable_step)
        self.effects.carry_out()

    def _evaluate_if_due(self, last: bool) -> None:
        """Evaluate at this boundary when due (every rank alike), before a save here records the result."""
        ev, step = self.evaluator, self.state.step
        if ev is None or not ev.is_due(step, self.rank, last=last):
            return
        result = ev.evaluate(self.model, step, self.world_size, self.rank, self.plan.data_degree, self.data_rank)
        payload = {"step": step, "metrics": evaluation_mod.jsonable(result)}
        self.effects.declare(evaluation_mod.EVAL_EFFECT, payload, step)

    def _start_feed(self) -> data_mod.LoaderFeed:
        """A DataLoader that reads ahead exactly the micro batches the steps from the restored cursor will ask for."""
        p, data = self.plan, self.options.data
        shape = (p.global_batch, p.data_degree, self.data_rank, p.micro_batch, p.accum_steps)
        batches = data_mod.CursorBatchSampler(self.sampler, self.state.data_cursor, *shape)
        pin = self.device.type == "cuda"
        return data_mod.LoaderFeed(self.dataset, data.collate_fn, batches, data.num_workers, data.prefetch_factor, pin)

    def _save(self, force_sync: bool) -> None:
        state = self.state
        lr_scale = self.lr_state.scale_at(max(0, state.step - 1), self.training.lr.ramp_steps)
        fingerprint = self.sampler.fingerprint
        manifest = snapshots.manifest(self.group, self.training, state, lr_scale, fingerprint, self.effects)
        self.checkpoints.save(state.step, self.saved.contents(self.group.raw_model), manifest, force_sync=force_sync)

    def _apply_lr(self) -> None:
        scale = self.lr_state.scale_at(self.state.step, self.training.lr.ramp_steps)
        lr_mod.apply_lr(self.optimizer, self.scheduler, self.training, self.state.samples_consumed, scale)
        lr_mod.apply_scheduler_factor(self.optimizer, self.scheduler)
        self.metrics.lr_scale.set(scale)

    def _optimizer_step(self) -> None:
        """Reduce, then step only once every rank's reductions succeeded (:mod:`disttrain.trainer.gate`), then count
        the step and keep it in memory (a sharded model reforming in place)."""
        if self.ordered is not None:
            self.ordered.reduce()
        self.precision.unscale(self.optimizer)
        clip = self.options.precision.clip_grad_norm
        if clip is not None:
            self._grad_norm = precision_mod.clip_global_grad_norm(self.group.raw_model, clip)
        gate.device_wait(self.completion.wait, self.state.step + 1, self.rank)  # the reductions done on the device
        try:
            gate.agree(True, self.state.step + 1, self.rank)
        except gate.StepAbortedError:
            self.optimizer.zero_grad(set_to_none=True)  # nothing of this step's gradient is ever applied
            raise
        self.checkpoints.before_optimizer_step()
        self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        self.completion.finish(self._count_step)
        recovery.keep_step(self.memory, self.group, self.state.step, lambda: self.saved.contents(self.group.raw_model))

    def _count_step(self) -> None:
        """The step is done: advance the counter, the data cursor and what a checkpoint records with them."""
        s = self.state
        s.step += 1
        s.samples_consumed += self.plan.global_batch
        s.data_cursor += self.plan.global_batch
        s.lr_start_scale, s.lr_target_scale = self.lr_state.start_scale, self.lr_state.target_scale
        s.lr_change_step = self.lr_state.change_step
        s.control_generation = self.watchdog.seen_generation

    def _boundary(self) -> None:
        """Agree on drain / save state with every rank (:mod:`disttrain.trainer.boundary`), then complete a save
        every rank finished, drain, or checkpoint when due."""
        last = self.done
        self._evaluate_if_due(last)
        agreed = self.group.agreement.exchange(self.reporter.boundary_flags(self.group), read_now=last)
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
        self.checkpoints.commits.report_published()
        if agreed.drain:
            self.group.agreement.settle()
            self.lifecycle.drain()
            return  # drained in place (otherwise the process has exited)
        if self.checkpoints.should_save(self.state.step, last=last) or agreed.seconds_due or self.checkpoints.retry_due:
            self._save(force_sync=last)
