"""The training-loop API: the user's loop stays recognisable, the elastic machinery lives here.

    with ElasticTrainer(model, optimizer, dataset) as trainer:
        for step in trainer.steps():
            for batch in step:                       # this rank's micro batches of the step
                loss = loss_fn(trainer.model(batch.data[0]), batch.data[1], reduction="sum")
                step.backward(loss)                  # normalised by the global sample count
            # optimizer step, LR, checkpoint, drain/SIGTERM are handled when the loop comes back here

At start the trainer joins the group, plans micro batch / accumulation / LR for the actual world size, loads the
newest valid checkpoint (resharding model and optimizer), refuses a changed dataset, and recomputes the LR from
the declared rule. After each optimizer step it agrees with all ranks (one tiny all-reduce) on drain requests and
on the state of an async save, then checkpoints when due. Exits: ``ExitCode.SUCCESS`` at the end,
``DRAINED`` after a drain/SIGTERM checkpoint, ``REFORM`` when a collective fails or the agent says reform,
``PERMANENT`` for an invalid world size, contract or changed dataset.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, Optional, cast

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset, default_collate

from disttrain.api import control as control_keys
from disttrain.api.contract import training_config_hash
from disttrain.api.exitcodes import ExitCode
from disttrain.api.manifest import CheckpointManifest
from disttrain.api.plan import InvalidWorldSizeError, Plan, plan
from disttrain.api.spec import LRSchedule
from disttrain.trainer import checkpoint as ckpt_mod
from disttrain.trainer import context as ctx_mod
from disttrain.trainer import lr as lr_mod
from disttrain.trainer import sampler as sampler_mod
from disttrain.trainer.control import Watchdog, report_failure
from disttrain.trainer.metrics import TrainerMetrics
from disttrain.trainer.randomness import sample_seed

log = logging.getLogger("disttrain.trainer")
_PROCESS_START = time.monotonic()

try:
    from importlib.metadata import version as _pkg_version

    CODE_VERSION = _pkg_version("disttrain")
except Exception:  # noqa: BLE001 - running from a source tree without metadata
    CODE_VERSION = "0+unknown"


class MicroBatch:
    """One forward/backward worth of samples: the collated ``data``, their dataset ``indices`` and per-sample
    ``seeds`` for keyed randomness (see :mod:`disttrain.trainer.randomness`; computed on first use)."""

    __slots__ = ("data", "indices", "_seed", "_step", "_seeds")
    _seeds: Optional[list[int]]

    def __init__(self, data: Any, indices: list[int], seed: int, step: int) -> None:
        self.data, self.indices, self._seed, self._step, self._seeds = data, indices, seed, step, None

    @property
    def seeds(self) -> list[int]:
        if self._seeds is None:
            self._seeds = [sample_seed(self._seed, self._step, j) for j in self.indices]
        return self._seeds


class Step:
    """One optimizer step on this rank: iterate it for micro batches, call :meth:`backward` once per micro batch.

    Iteration turns DDP's gradient sync off for all but the last micro batch (forward included, as DDP needs).
    """

    def __init__(self, trainer: ElasticTrainer, index: int, indices: list[int]) -> None:
        self.trainer = trainer
        self.index = index
        self.indices = indices
        p = trainer.plan
        self.micro_indices = [indices[i * p.micro_batch:(i + 1) * p.micro_batch] for i in range(p.accum_steps)]
        self.loss_sum = 0.0
        self.loss_count = 0

    @property
    def global_batch(self) -> int:
        return self.trainer.plan.global_batch

    def __iter__(self) -> Iterator[MicroBatch]:
        model = self.trainer.model
        last = len(self.micro_indices) - 1
        seed = self.trainer.training.seed
        try:
            for i, idx in enumerate(self.micro_indices):
                if isinstance(model, DistributedDataParallel):
                    model.require_backward_grad_sync = i == last
                yield MicroBatch(self.trainer.fetch(idx), idx, seed, self.index)
        finally:
            if isinstance(model, DistributedDataParallel):
                model.require_backward_grad_sync = True

    def global_count(self, local_count: float | int | torch.Tensor) -> float:
        """Sum of a count over all ranks (e.g. non-padding tokens in this step): the denominator of a
        token-weighted loss. Collective: every rank calls it once per step, before its backward passes."""
        t = torch.as_tensor(local_count, dtype=torch.float64).reshape(1).clone()
        dist.all_reduce(t)
        return float(t.item())

    def backward(self, loss_sum: torch.Tensor, denominator: Optional[float] = None,
                 count: Optional[int] = None) -> None:
        """Backward of a loss *summed* over this micro batch, normalised by the global count of the step.

        ``denominator`` defaults to the global batch (sample-weighted); pass :meth:`global_count` of your token
        counts for a token-weighted loss. DDP averages gradients over W ranks, hence the factor W: the result is
        exactly sum(all samples' losses) / global count, whatever the split into ranks and micro batches.
        """
        denom = float(denominator if denominator is not None else self.global_batch)
        (loss_sum * (self.trainer.world_size / denom)).backward()
        self.loss_sum += float(loss_sum.detach())
        self.loss_count += int(count if count is not None else
                               len(self.micro_indices[0]) if self.micro_indices else 0)


class ElasticTrainer:
    """Model, optimizer, (optional) scheduler and a map-style dataset in; :meth:`steps` out."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset: Sequence[Any],
                 scheduler: Any = None, collate_fn: Callable[[list[Any]], Any] = default_collate,
                 context: Optional[ctx_mod.ElasticContext] = None, log_every: int = 10) -> None:
        _configure_logging()
        try:
            self.ctx = context or ctx_mod.ElasticContext.from_env()
        except ctx_mod.ContractError as exc:
            _exit_permanent(str(exc))
        self.training = self.ctx.contract.training
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.log_every = log_every
        self.groups = ctx_mod.init_process_group(self.ctx)
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.metrics = TrainerMetrics()
        self.metrics.serve(self.ctx.metrics_port + self.ctx.local_rank if self.ctx.metrics_port else 0)
        self.metrics.restart_count.set(self.ctx.restart_count)
        try:
            self.plan: Plan = plan(self.training, self.world_size)
        except InvalidWorldSizeError as exc:
            _exit_permanent(f"spec.training: {exc}")
        self.sampler = sampler_mod.GlobalSampler(len(dataset), self.training.seed)
        self.state = ckpt_mod.TrainerState()
        self.device = self.groups.device
        self.raw_model = model.to(self.device)  # in place: the optimizer keeps the same Parameter objects
        if isinstance(model, DistributedDataParallel):
            self.model = model
        elif self.device.type == "cuda":
            self.model = DistributedDataParallel(model, device_ids=[self.device.index])
        else:
            self.model = DistributedDataParallel(model)
        self.checkpoints = ckpt_mod.CheckpointManager(self.ctx.checkpoint_dir, self.ctx.contract.checkpoint,
                                                      self.rank, self.world_size, self.groups.checkpoint,
                                                      metrics=self.metrics)
        self.watchdog = Watchdog(self.ctx.agent_endpoint)
        self.watchdog.install_sigterm()
        try:
            self.watchdog.connect()
        except Exception as exc:  # noqa: BLE001 - the channel is optional; SIGTERM still works
            log.warning("control channel %s unavailable (%s); only SIGTERM can drain", self.ctx.agent_endpoint, exc)
        self.checkpoints.on_commit = lambda m: self.watchdog.publish(control_keys.CHECKPOINT_KEY, m.model_dump_json())
        self.resumed_from: Optional[int] = None
        self.process_id = uuid.uuid4().hex  # tells the agent a new group from the old one (ProgressReport.process_id)
        self._agreement: Optional[tuple[torch.Tensor, Any]] = None
        self.lr_state = lr_mod.LRState(self.plan.lr_scale, self.plan.lr_scale, 0)
        self._fast_tensors = isinstance(dataset, TensorDataset)
        if scheduler is not None and self.training.lr.schedule is not LRSchedule.CONSTANT:
            log.warning("a scheduler was passed: spec.training.lr.schedule=%s is ignored, the scheduler's factor "
                        "applies on top of base LR x world-size factor", self.training.lr.schedule.value)

    # ---- user-facing -------------------------------------------------------------------------------------
    def __enter__(self) -> ElasticTrainer:
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> Literal[False]:
        if exc is None:
            self.close()
            return False
        if isinstance(exc, (sampler_mod.DatasetChangedError, InvalidWorldSizeError, ctx_mod.ContractError)):
            _exit_permanent(str(exc))
        if _is_collective_failure(exc):
            log.error("a collective failed (%s: %s); exiting %d so the group re-forms from the last checkpoint",
                      type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "", int(ExitCode.REFORM))
            _hard_exit(int(ExitCode.REFORM))
        return False

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
        self.watchdog.request_drain(reason)

    def fetch(self, indices: list[int]) -> Any:
        """The collated micro batch for dataset ``indices``, on the trainer's device."""
        if self._fast_tensors:
            idx = torch.as_tensor(indices, dtype=torch.long)
            return _to_device(tuple(t[idx] for t in cast(TensorDataset, self.dataset).tensors), self.device)
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(indices) if getitems is not None else [self.dataset[i] for i in indices]
        return _to_device(self.collate_fn(samples), self.device)

    def steps(self) -> Iterator[Step]:
        """Resume, then yield one :class:`Step` per optimizer step until maxSteps/maxSamples, a drain or a failure."""
        self._resume()
        first = True
        t_prev = time.monotonic()
        while not self.done:
            self._apply_lr()
            positions = sampler_mod.rank_positions(self.state.data_cursor, self.plan.global_batch,
                                                   self.world_size, self.rank)
            step = Step(self, self.state.step, self.sampler.indices(positions))
            yield step
            self._optimizer_step()
            now = time.monotonic()
            if first:
                self.metrics.resume_seconds.set(now - _PROCESS_START)
                first = False
            self._after_step(step, now - t_prev)
            t_prev = now
            self._boundary()
        self.checkpoints.wait_pending()
        if self.checkpoints.last_saved_step != self.state.step:
            self.checkpoints.save(self.state.step, self._state(), self._manifest(), force_sync=True)
        log.info("training finished at step %d (%d samples)", self.state.step, self.state.samples_consumed)

    def close(self) -> None:
        self.watchdog.stop()
        self.checkpoints.close()
        if dist.is_initialized():
            # Everyone leaves together: rank 0 hosts the group's store, and tearing it down under a peer
            # that is still finishing aborts that peer.
            dist.barrier()
            dist.destroy_process_group()

    # ---- internals ---------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"app": ckpt_mod.ModelOptimState(self.raw_model, self.optimizer), "trainer": self.state}
        if self.scheduler is not None:
            state["scheduler"] = _SchedulerState(self.scheduler)
        return state

    def _manifest(self) -> CheckpointManifest:
        return CheckpointManifest(
            step=self.state.step, samples_consumed=self.state.samples_consumed, data_cursor=self.state.data_cursor,
            world_size=self.world_size, plan=self.plan.to_status(),
            lr_scale=self.lr_state.scale_at(max(0, self.state.step - 1), self.training.lr.ramp_steps),
            dataset=self.sampler.fingerprint, metadata_sha256="pending", files={}, created_at="pending",
            code_version=CODE_VERSION, config_hash=training_config_hash(self.training), job=self.ctx.job)

    def _resume(self) -> None:
        manifest = self.checkpoints.find_latest()
        ramp = self.training.lr.ramp_steps
        if manifest is None:
            if self.rank == 0:
                log.info("no complete checkpoint in %s: starting at step 0 (world size %d, plan %s)",
                         self.ctx.checkpoint_dir, self.world_size, self.plan.to_status())
            self.lr_state = lr_mod.ramp_after_resume(None, None, 0, self.plan.lr_scale, 0, ramp)
            self.watchdog.start()
            return
        sampler_mod.check_fingerprint(manifest.dataset, self.sampler.fingerprint)
        if manifest.config_hash != training_config_hash(self.training):
            log.warning("spec.training changed since checkpoint step-%d (config hash differs); continuing with the "
                        "new contract", manifest.step)
        self.checkpoints.load(manifest, self._state())
        s = self.state
        if s.data_cursor != s.samples_consumed or s.data_cursor != manifest.data_cursor:
            # The cursor is the number of samples consumed by construction; anything else would replay or skip.
            gap = s.data_cursor - s.samples_consumed
            (self.metrics.samples_replayed if gap < 0 else self.metrics.samples_skipped).inc(abs(gap))
        saved_scale = s.lr_start_scale if s.lr_start_scale > 0 else None
        saved_target = s.lr_target_scale if s.lr_target_scale > 0 else None
        self.lr_state = lr_mod.ramp_after_resume(saved_scale, saved_target, s.lr_change_step, self.plan.lr_scale,
                                                 s.step, ramp)
        self.resumed_from = manifest.step
        log.info("resumed from checkpoint step-%d (saved at world size %d) at world size %d: plan %s, "
                 "samples consumed %d, LR factor %.4g -> %.4g over %d steps", manifest.step, manifest.world_size,
                 self.world_size, self.plan.to_status(), s.samples_consumed, self.lr_state.start_scale,
                 self.lr_state.target_scale, ramp)
        self.watchdog.start(recorded_generation=s.control_generation)

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
        self.current_scale = scale

    def _optimizer_step(self) -> None:
        self.checkpoints.before_optimizer_step()
        self.optimizer.step()
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
        m = self.metrics
        m.step.set(self.state.step)
        m.world_size.set(self.world_size)
        m.accum_steps.set(self.plan.accum_steps)
        rate = self.plan.global_batch / seconds if seconds > 0 else 0.0
        m.samples_per_second.set(rate)
        if self.rank != 0:
            return
        loss = step.loss_sum / step.loss_count if step.loss_count else None
        if self.state.step % self.log_every == 0 or self.state.step == 1:
            log.info("step %d loss %s lr %.4g world %d samples/s %.0f", self.state.step,
                     f"{loss:.4f}" if loss is not None else "-", self.optimizer.param_groups[0]["lr"],
                     self.world_size, rate)
        if self.watchdog.store is not None:
            report = control_keys.ProgressReport(
                step=self.state.step, samples_consumed=self.state.samples_consumed, world_size=self.world_size,
                plan=self.plan.to_status(), loss=loss, samples_per_second=rate,
                restart_count=self.ctx.restart_count, run_id=self.ctx.run_id, resumed_from_step=self.resumed_from,
                process_id=self.process_id, time=time.time())
            self.watchdog.publish(control_keys.PROGRESS_KEY, report.model_dump_json())

    def _boundary(self) -> None:
        """Agree on drain / save state with every rank, then checkpoint when due (and exit on drain).

        The agreement is an all-reduce started here and read at the next boundary, so it overlaps the next
        step's compute instead of adding a synchronisation point: a drain or an async save's outcome is acted
        on one step after the earliest rank saw it (every rank at the same step), or at once at the last step.
        """
        not_done, failed = self.checkpoints.local_pending_state()
        seconds_due = int(self.rank == 0 and self.checkpoints.seconds_due())
        pending = self.checkpoints.pending.step if self.checkpoints.pending is not None else -1
        # MAX of (pending, -pending) yields the max and -min: the flags speak of one save only if all ranks agree.
        flags = torch.tensor([int(self.watchdog.drain_requested), not_done, failed, seconds_due, pending, -pending],
                             dtype=torch.int64)
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)
        previous, self._agreement = self._agreement, (flags, work)
        last = self.done
        if last:
            previous = self._agreement
        if previous is None:
            return
        previous[1].wait()
        drain, any_not_done, _, seconds_due, max_pending, neg_min_pending = (int(x) for x in previous[0].tolist())
        p = self.checkpoints.pending
        if p is not None and not any_not_done and max_pending == -neg_min_pending == p.step:
            # Every rank had finished its part of this very save when the flags were taken.
            self.checkpoints.poll(all_done=True)
        if drain:
            if previous is not self._agreement:
                work.wait()  # leave no collective half-done behind the exit
            self.checkpoints.wait_pending()
            if self.checkpoints.last_saved_step != self.state.step:
                self.checkpoints.save(self.state.step, self._state(), self._manifest(), force_sync=True)
            reason = self.watchdog.drain_reason or "drain on another rank"
            log.info("drained at step %d (%s): checkpoint step-%d committed; exiting %d", self.state.step, reason,
                     self.state.step, int(ExitCode.DRAINED))
            self.watchdog.stop()
            self.checkpoints.join_retention()
            _hard_exit(int(ExitCode.DRAINED))
        if self.checkpoints.should_save(self.state.step, last=last) or seconds_due or self.checkpoints.retry_due:
            self.checkpoints.save(self.state.step, self._state(), self._manifest(), force_sync=last)


class _SchedulerState:
    """A user scheduler as a Stateful (its base LRs are recomputed from the rule after load anyway)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return {"json": json.dumps({k: v for k, v in self.scheduler.state_dict().items()
                                    if isinstance(v, (int, float, str, list, bool, type(None)))})}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = json.loads(state_dict["json"])
        saved.pop("base_lrs", None)
        self.scheduler.__dict__.update(saved)


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


def _is_collective_failure(exc: BaseException) -> bool:
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset", "Gloo", "gloo", "Timed out", "timed out",
                            "NCCL", "Socket", "socket"))


def _configure_logging() -> None:
    root = logging.getLogger()
    if not root.handlers:
        rank = os.environ.get("RANK", "0")
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format=f"%(asctime)s [disttrain rank {rank}] %(levelname)s %(message)s")
    logging.getLogger("disttrain").setLevel(logging.INFO)


def _exit_permanent(message: str) -> None:
    log.error("%s (exit %d: a restart cannot fix this)", message, int(ExitCode.PERMANENT))
    report_failure(int(ExitCode.PERMANENT), message)
    _hard_exit(int(ExitCode.PERMANENT))


def _hard_exit(code: int) -> None:
    """Exit without running torch's atexit/destructor paths, which can block on a peer that is gone."""
    for h in logging.getLogger().handlers:
        h.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
