"""The trainer's options: one frozen record, built once from the user's keyword arguments and the worker contract.

:meth:`TrainerOptions.from_env` turns what a training script passes to
:meth:`~disttrain.trainer.loop.ElasticTrainer.from_env` (``parallelism="fsdp2"``, ``num_workers=2``, ...) and what
the contract decides (reforms in place) into nested sections, one per concern, in the way of torchtitan's
``JobConfig``. Every value is checked here, once: an invalid one raises :class:`OptionError` naming the option,
the value and what is allowed, and the trainer exits ``PERMANENT`` with that message. Nothing here starts anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional, TypedDict, TypeVar

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor.parallel import ParallelStyle
from torch.utils.data import default_collate

from disttrain.api.contract import WorkerContract
from disttrain.trainer import activation, inplace
from disttrain.trainer import effects as effects_mod
from disttrain.trainer import evaluation as evaluation_mod
from disttrain.trainer.checkpoint.manager import PhaseHook
from disttrain.trainer.checkpoint.uploads import RetryPolicy
from disttrain.trainer.parallel import Parallelism, Precision

if TYPE_CHECKING:
    from typing_extensions import Unpack

DEVICES = ("auto", "cuda", "cpu")
REFORM_GRACE_S = 5.0
"""After the operator's reform directive, how long an in-place worker may take to reach its reform (its next
collective fails, or its step ends) before it exits ``REFORM`` instead: a collective blocked on a peer that vanished
without closing its connections returns only after ``collectiveTimeoutSeconds``."""
ROUND_WAIT_S = 3600.0
"""Longest an in-place worker waits for the next round (the launcher answers or closes the socket long before)."""


class OptionError(ValueError):
    """An option the trainer cannot run with: a configuration error a restart cannot fix."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelOptions:
    """How the model is spread over the ranks."""

    parallelism: Parallelism = Parallelism.DDP
    """``ddp`` or ``fsdp2``."""
    shard_modules: Optional[Sequence[torch.nn.Module]] = None
    """FSDP2: the modules sharded before the root (None: :func:`~disttrain.trainer.parallel.default_shard_modules`)."""
    tp_plan: Optional[Mapping[str, ParallelStyle]] = None
    """FSDP x TP (``spec.training.mesh.tensorParallel``): the ``parallelize_module`` plan, module names (``*`` for
    any one name) to ``ColwiseParallel()``/``RowwiseParallel()``; required there, refused elsewhere."""
    device: str = "auto"
    """``auto`` (``cuda:LOCAL_RANK`` when CUDA is available, else the CPU; PERMANENT without CUDA when the trainer
    container requests GPUs, docs/gpu.md), ``cuda`` (PERMANENT without CUDA) or ``cpu``."""
    activation_checkpointing: Optional[activation.Target] = None
    """Modules whose activations are recomputed in the backward instead of kept (:mod:`~disttrain.trainer.activation`):
    a module class (the transformer block), several, or a predicate; None: none. Less memory, one more forward of
    each."""

    def __post_init__(self) -> None:
        problem = activation.check(self.activation_checkpointing)
        if problem is not None:
            raise OptionError(f"activation_checkpointing={self.activation_checkpointing!r}: {problem}")
        if self.device not in DEVICES:
            allowed = ", ".join(repr(d) for d in DEVICES)
            raise OptionError(f"device={self.device!r} is not supported; allowed: {allowed}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionOptions:
    """Numerics of the step."""

    precision: Precision = Precision.FP32
    """``fp32``, ``bf16`` or ``fp16`` (with a GradScaler in the checkpoint)."""
    grad_scaler: Optional[ShardedGradScaler] = None
    """fp16: the scaler to start from (its initial scale, growth interval); None: a default one."""
    clip_grad_norm: Optional[float] = None
    """Clip the global gradient norm to this value before each optimizer step (None: no clipping)."""

    def __post_init__(self) -> None:
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise OptionError(
                f"clip_grad_norm={self.clip_grad_norm!r} must be a positive number (or None: no clipping)"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataOptions:
    """How micro batches are read."""

    collate_fn: Callable[[list[Any]], Any] = default_collate
    """Turns the samples of a micro batch into one batch (not used for a ``TensorDataset``)."""
    num_workers: int = 0
    """DataLoader worker processes, driven by the global cursor (0: batches are read in the training process)."""
    prefetch_factor: Optional[int] = None
    """Batches each DataLoader worker keeps in flight (None: the DataLoader's default)."""

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise OptionError(f"num_workers={self.num_workers} must be >= 0 (0: batches are read in this process)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """What a checkpoint holds besides model, optimizer, scheduler and the trainer's own state."""

    user_state: Mapping[str, Stateful] = dataclasses.field(default_factory=dict)
    """More ``Stateful`` objects (an EMA, a curriculum counter), saved and restored under their names."""
    on_phase: Optional[PhaseHook] = None
    """Called inside a save at each :class:`~disttrain.trainer.checkpoint.manager.CheckpointPhase` (tests inject
    faults)."""
    upload_retry: Optional[RetryPolicy] = None
    """With ``spec.checkpoint.uri``: the backoff and request timeouts of the background uploads and publication
    (None: :class:`~disttrain.trainer.checkpoint.uploads.RetryPolicy`'s defaults)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EffectOptions:
    """Side effects carried out once per committed step (:mod:`disttrain.trainer.effects`) and evaluation in the
    loop (:mod:`disttrain.trainer.evaluation`)."""

    handlers: Mapping[str, effects_mod.Handler] = dataclasses.field(default_factory=dict)
    """``name -> handler(key, payload)``: what :meth:`~disttrain.trainer.loop.ElasticTrainer.declare_effect` may
    name; rank 0 calls it after the commit that records the declaration."""
    evaluation: Optional[evaluation_mod.EvalOptions] = None
    """Periodic evaluation on a held-out dataset (None: none)."""

    def __post_init__(self) -> None:
        for name, handler in self.handlers.items():
            try:
                effects_mod.check_name(name)
            except ValueError as exc:
                raise OptionError(f"effects: {exc}") from None
            if name == evaluation_mod.EVAL_EFFECT:
                raise OptionError(f"effects: {name!r} is the trainer's own (evaluation results); choose another name")
            if not callable(handler):
                raise OptionError(f"effects[{name!r}]={handler!r} is not callable: pass fn(key, payload)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LifecycleOptions:
    """How a group ends: in-place reforms (``spec.elastic.reformInPlace``) and their time limits."""

    reform_in_place: bool = False
    """The contract asks for in-place reforms and the parallelism allows them (DDP): the same on every rank."""
    reform_grace_s: float = REFORM_GRACE_S
    """See :data:`REFORM_GRACE_S`."""
    round_wait_s: float = ROUND_WAIT_S
    """See :data:`ROUND_WAIT_S`."""


class TrainerKwargs(TypedDict, total=False):
    """The keyword options of :meth:`~disttrain.trainer.loop.ElasticTrainer.from_env`, as a script passes them."""

    collate_fn: Callable[[list[Any]], Any]
    log_every: int
    on_checkpoint_phase: Optional[PhaseHook]
    checkpoint_upload_retry: Optional[RetryPolicy]
    parallelism: str | Parallelism
    precision: str | Precision
    shard_modules: Optional[Sequence[torch.nn.Module]]
    activation_checkpointing: Optional[activation.Target]
    tp_plan: Optional[Mapping[str, ParallelStyle]]
    clip_grad_norm: Optional[float]
    user_state: Optional[Mapping[str, Stateful]]
    grad_scaler: Optional[ShardedGradScaler]
    num_workers: int
    prefetch_factor: Optional[int]
    device: str
    effects: Optional[Mapping[str, effects_mod.Handler]]
    evaluation: Optional[evaluation_mod.EvalOptions]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerOptions:
    """Every option of one trainer, by section. Build it with :meth:`from_env`."""

    parallel: ParallelOptions = dataclasses.field(default_factory=ParallelOptions)
    precision: PrecisionOptions = dataclasses.field(default_factory=PrecisionOptions)
    data: DataOptions = dataclasses.field(default_factory=DataOptions)
    checkpoint: CheckpointOptions = dataclasses.field(default_factory=CheckpointOptions)
    lifecycle: LifecycleOptions = dataclasses.field(default_factory=LifecycleOptions)
    effects: EffectOptions = dataclasses.field(default_factory=EffectOptions)
    log_every: int = 10
    """Rank 0 logs the loss every this many steps (and at step 1)."""

    @classmethod
    def from_env(cls, contract: WorkerContract, **kwargs: Unpack[TrainerKwargs]) -> TrainerOptions:
        """The options of a script's keyword arguments under ``contract``. Raises :class:`OptionError` for an
        invalid value and ``TypeError`` for an unknown option (as a misspelt keyword argument does)."""
        unknown = sorted(set(kwargs) - set(TrainerKwargs.__annotations__))
        if unknown:
            raise TypeError(f"unexpected trainer options: {', '.join(unknown)}")
        parallelism = _choice("parallelism", kwargs.get("parallelism", Parallelism.DDP), Parallelism)
        precision = _choice("precision", kwargs.get("precision", Precision.FP32), Precision)
        return cls(
            parallel=ParallelOptions(
                parallelism=parallelism,
                shard_modules=kwargs.get("shard_modules"),
                tp_plan=kwargs.get("tp_plan"),
                device=kwargs.get("device", "auto"),
                activation_checkpointing=kwargs.get("activation_checkpointing"),
            ),
            precision=PrecisionOptions(
                precision=precision,
                grad_scaler=kwargs.get("grad_scaler"),
                clip_grad_norm=kwargs.get("clip_grad_norm"),
            ),
            data=DataOptions(
                collate_fn=kwargs.get("collate_fn", default_collate),
                num_workers=kwargs.get("num_workers", 0),
                prefetch_factor=kwargs.get("prefetch_factor"),
            ),
            checkpoint=CheckpointOptions(
                user_state=dict(kwargs.get("user_state") or {}),
                on_phase=kwargs.get("on_checkpoint_phase"),
                upload_retry=kwargs.get("checkpoint_upload_retry"),
            ),
            lifecycle=LifecycleOptions(reform_in_place=inplace.applies(contract.reform_in_place)),
            effects=EffectOptions(handlers=dict(kwargs.get("effects") or {}), evaluation=kwargs.get("evaluation")),
            log_every=kwargs.get("log_every", 10),
        )


_Choice = TypeVar("_Choice", Parallelism, Precision)


def _choice(name: str, value: str | _Choice, kind: type[_Choice]) -> _Choice:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(repr(k.value) for k in kind)
        raise OptionError(f"{name}={value!r} is not supported; allowed: {allowed}") from None
