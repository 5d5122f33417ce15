"""The batch/LR plan for a world size: the one rule both the operator (to choose sizes) and the trainer (to apply).

fixed mode keeps the global batch and lets gradient accumulation absorb the world size, so the optimizer sees
the same batch at every size; a size that cannot divide it is invalid. scaled mode keeps the per-process batch
and grows the global batch with the world, scaling the LR by linear / sqrt / none relative to the reference
batch, reached over a ramp. The LR schedule is a function of samples consumed, so its length never depends on
the world size. On a 2-D mesh (``training.mesh``) these rules see the data degree, the ranks that read different
samples (world size / tensorParallel; the world size under HSDP), and a world size the inner degree does not divide
is invalid.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from disttrain.api.spec import BatchPolicy, LRScaling, LRSchedule, LRSpec, TrainingSpec, data_degree

if TYPE_CHECKING:
    from disttrain.api.spec import DistTrainJobSpec


class InvalidWorldSizeError(ValueError):
    """The world size cannot run this training contract; ``valid`` lists the sizes that can (up to a bound)."""

    def __init__(self, world_size: int, reason: str, valid: list[int]) -> None:
        self.world_size = world_size
        self.valid = valid
        shown = ", ".join(map(str, valid)) if valid else "none"
        super().__init__(f"world size {world_size} is invalid: {reason}; valid world sizes: {shown}")


class Plan(BaseModel):
    """How one optimizer step is made at a given world size."""

    model_config = ConfigDict(frozen=True)
    world_size: int
    micro_batch: int
    accum_steps: int
    global_batch: int
    lr_scale: float
    data_parallel: int = 0
    """Ranks that read different samples (the sampler's world); 0 stands for ``world_size`` (a 1-D mesh)."""

    @property
    def data_degree(self) -> int:
        """Ranks that read different samples: the world size, or world / tensorParallel on an FSDP x TP mesh."""
        return self.data_parallel or self.world_size

    def to_status(self) -> dict[str, float | int]:
        """The camelCase form used in ``status.plan`` and the checkpoint manifest."""
        return {
            "worldSize": self.world_size,
            "globalBatch": self.global_batch,
            "microBatch": self.micro_batch,
            "accumSteps": self.accum_steps,
            "lrScale": self.lr_scale,
        }


def lr_factor(scaling: LRScaling, batch: int, reference: int) -> float:
    """LR multiplier for a global batch relative to the reference batch."""
    ratio = batch / reference
    if scaling is LRScaling.LINEAR:
        return ratio
    if scaling is LRScaling.SQRT:
        return math.sqrt(ratio)
    return 1.0


def _data_degree(training: TrainingSpec, world_size: int) -> int:
    """:func:`~disttrain.api.spec.data_degree` of ``world_size`` ranks under ``training.mesh``."""
    return data_degree(world_size, training.mesh.tensor_parallel if training.mesh is not None else None)


def _mesh_fits(training: TrainingSpec, world_size: int) -> bool:
    return training.mesh is None or world_size % training.mesh.inner_degree == 0


def _fixed_mode_divisor_ok(training: TrainingSpec, world_size: int) -> bool:
    if not _mesh_fits(training, world_size):
        return False
    return training.global_batch_size % (training.micro_batch_size * _data_degree(training, world_size)) == 0


def valid_world_sizes(training: TrainingSpec, sizes: Iterable[int] | None = None) -> list[int]:
    """World sizes (from ``sizes``, default every size up to the global batch) that can run this contract."""
    readers = (training.mesh.tensor_parallel or 1) if training.mesh is not None else 1  # TP ranks share samples
    limit = max(1, training.global_batch_size // training.micro_batch_size) * readers
    candidates = list(sizes) if sizes is not None else range(1, limit + 1)
    if training.batch_policy is BatchPolicy.SCALED:
        return sorted(w for w in candidates if w >= 1 and _mesh_fits(training, w))
    return sorted(w for w in candidates if w >= 1 and _fixed_mode_divisor_ok(training, w))


def valid_node_counts(spec: DistTrainJobSpec) -> list[int]:
    """Node counts in [nodes.min, nodes.max] whose world size (nodes x nprocPerNode) is valid."""
    nproc = spec.nproc_per_node
    counts = range(spec.nodes.min, spec.nodes.max + 1)
    valid = set(valid_world_sizes(spec.training, [n * nproc for n in counts]))
    return [n for n in counts if n * nproc in valid]


def plan(training: TrainingSpec, world_size: int) -> Plan:
    """The plan for ``world_size``; raises :class:`InvalidWorldSizeError` naming the valid sizes."""
    if world_size < 1:
        raise InvalidWorldSizeError(world_size, "it must be at least 1", [])
    micro = training.micro_batch_size
    if not _mesh_fits(training, world_size):
        assert training.mesh is not None
        name = "tensorParallel" if training.mesh.tensor_parallel else "shard"
        reason = f"it is not a multiple of training.mesh.{name} = {training.mesh.inner_degree}"
        raise InvalidWorldSizeError(world_size, reason, valid_world_sizes(training))
    data = _data_degree(training, world_size)
    if training.batch_policy is BatchPolicy.FIXED:
        if not _fixed_mode_divisor_ok(training, world_size):
            size = "worldSize" if data == world_size else "dataDegree"
            reason = (
                f"globalBatchSize {training.global_batch_size} is not a multiple of "
                f"microBatchSize x {size} = {micro} x {data} = {micro * data}"
            )
            raise InvalidWorldSizeError(world_size, reason, valid_world_sizes(training))
        accum = training.global_batch_size // (micro * data)
        global_batch = training.global_batch_size
    else:
        accum = training.accumulation_steps
        global_batch = micro * accum * data
    scale = lr_factor(training.lr.scaling, global_batch, training.reference_batch)
    return Plan(
        world_size=world_size,
        micro_batch=micro,
        accum_steps=accum,
        global_batch=global_batch,
        lr_scale=scale,
        data_parallel=data if data != world_size else 0,
    )


def ramped_lr_scale(start: float, target: float, steps_since_change: int, ramp_steps: int) -> float:
    """LR factor ``steps_since_change`` optimizer steps (0-based) after the factor changed from start to target.

    The factor moves linearly and reaches ``target`` on the ``ramp_steps``-th step after the change.
    """
    if ramp_steps <= 0 or steps_since_change + 1 >= ramp_steps:
        return target
    fraction = (steps_since_change + 1) / ramp_steps
    return start + (target - start) * fraction


def schedule_factor(lr: LRSpec, samples_consumed: int, total_samples: int) -> float:
    """Warmup/decay multiplier at ``samples_consumed`` of ``total_samples`` (world-size independent)."""
    if lr.warmup_samples > 0 and samples_consumed < lr.warmup_samples:
        return samples_consumed / lr.warmup_samples
    if lr.schedule is LRSchedule.CONSTANT:
        return 1.0
    span = max(1, total_samples - lr.warmup_samples)
    progress = min(1.0, max(0.0, (samples_consumed - lr.warmup_samples) / span))
    if lr.schedule is LRSchedule.COSINE:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        decay = 1.0 - progress
    return lr.min_factor + (1.0 - lr.min_factor) * decay


def learning_rate(training: TrainingSpec, samples_consumed: int, scale: float) -> float:
    """The LR to put in every param group: base x world-size factor x schedule."""
    return training.lr.base * scale * schedule_factor(training.lr, samples_consumed, training.total_samples)
