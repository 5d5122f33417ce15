"""How the model is spread over the ranks: DDP (every rank holds everything) or FSDP2 (``fully_shard``).

Called once by :meth:`disttrain.trainer.loop.ElasticTrainer.from_env`. Whatever the parallelism, the state-dict
keys stay the model's own FQNs (DCP's ``get_state_dict`` strips DDP's ``module.``; ``fully_shard`` keeps names),
so a checkpoint written under one parallelism loads under the other, at any world size.

Mixed precision is decided here too, because each parallelism does it differently: FSDP2 casts at module
boundaries through its ``MixedPrecisionPolicy``; DDP runs the forward under ``torch.autocast``. Either way the
floating-point outputs come back in fp32, so the user's loss is computed in full precision, and gradients are
reduced in fp32.

On a 2-D mesh (:mod:`disttrain.trainer.mesh`) FSDP2 does both dimensions: HSDP is ``fully_shard`` on the whole
(replicate, shard) mesh; FSDP x TP first splits the layers of the script's TP plan over the ``tensor`` dimension
(``parallelize_module``), then ``fully_shard`` shards over the elastic ``data`` dimension, as TorchTitan does.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from disttrain.trainer import debugmode
from disttrain.trainer import mesh as mesh_mod

if TYPE_CHECKING:
    from disttrain.trainer.options import ParallelOptions


class Parallelism(str, enum.Enum):
    """``ddp``: replicate the model, all-reduce gradients. ``fsdp2``: shard parameters, gradients and optimizer
    state with ``fully_shard`` (for models that do not fit one device)."""

    DDP = "ddp"
    FSDP2 = "fsdp2"


class Precision(str, enum.Enum):
    """Compute precision. ``bf16`` needs no loss scaling; ``fp16`` gets a GradScaler (see :mod:`.precision`)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        return {Precision.FP32: None, Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}[self]


class ParallelModel:
    """The wrapped model (``module``, what ``trainer.model`` is) and what the loop needs from it: gradient sync
    on or off (accumulation communicates only on the last micro batch), and whether the gradient reduction sums
    or averages over the ranks.

    Why sums: a loss multiplied by W before a low-precision backward is rounded differently at each world size
    (a factor 4/12 is not 3/12 times a power of two), so bf16 gradients would differ between W=4 and W=3. With
    a summing reduction the backward runs on ``loss_sum / global count`` alone, the same at every world size.
    FSDP2 and mixed-precision DDP sum; fp32 DDP keeps its stock averaging (exact in fp32 anyway).
    """

    def __init__(
        self,
        module: nn.Module,
        parallelism: Parallelism,
        sums_gradients: bool,
        optimizer_layout: Sequence[Sequence[str]] = (),
    ) -> None:
        self.module = module
        self.parallelism = parallelism
        self.sums_gradients = sums_gradients
        self.optimizer_layout = [list(names) for names in optimizer_layout]
        """FSDP2: the names of each optimizer param group's parameters, read when the model was sharded (what
        :func:`rewrap` points the optimizer at again). Read then because a step that fails mid-forward or
        mid-backward leaves unsharded parameters registered on the modules, which the optimizer does not hold."""

    def loss_factor(self, world_size: int) -> float:
        """What a loss normalised by the global count is multiplied by before backward: W under an averaging
        reduction (which divides by W again), 1 under a summing one."""
        return 1.0 if self.sums_gradients else float(world_size)

    def set_gradient_sync(self, enabled: bool) -> None:
        if isinstance(self.module, DistributedDataParallel):
            self.module.require_backward_grad_sync = enabled
        elif isinstance(self.module, FSDPModule):
            self.module.set_requires_gradient_sync(enabled)


class _AutocastDDP(DistributedDataParallel):
    """DDP whose forward runs under ``torch.autocast`` and returns floating-point outputs in fp32."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, **kwargs: Any) -> None:
        super().__init__(module, **kwargs)
        self._autocast_dtype = dtype

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        device_type = "cuda" if self.device_ids else "cpu"
        with torch.autocast(device_type=device_type, dtype=self._autocast_dtype):
            out = super().forward(*inputs, **kwargs)  # type: ignore[no-untyped-call]
        return _to_fp32(out)


def wrap(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    options: ParallelOptions,
    precision: Precision,
    *,
    init_sync: bool = True,
    layout: Optional[mesh_mod.Layout] = None,
) -> ParallelModel:
    """``model`` (already on ``device``) wrapped for ``options.parallelism``; under FSDP2 the optimizer's param groups
    are pointed at the sharded parameters, because ``fully_shard`` replaces every parameter object, and
    ``options.shard_modules`` and ``options.tp_plan`` (the ``parallelize_module`` plan of an FSDP x TP mesh: module
    names, ``*`` for any one name, to ParallelStyles) apply. ``init_sync=False``: DDP does not broadcast rank 0's
    weights at construction (in-place reforms agree on the state themselves, :mod:`disttrain.trainer.inplace`).
    ``layout``: the mesh (None: 1-D over the world)."""
    parallelism, shard_modules, tp_plan = options.parallelism, options.shard_modules, options.tp_plan
    where = layout or mesh_mod.Layout(mesh_mod.MeshKind.FLAT, dist.get_world_size(), 1)
    _check_mesh(where, parallelism, tp_plan)
    if parallelism is Parallelism.DDP:
        if shard_modules is not None:
            raise ValueError("shard_modules is an FSDP2 option; it is not allowed with parallelism='ddp'")
        ddp = _data_parallel(model, device, precision, init_sync)
        sums = precision.compute_dtype is not None
        if sums:
            ddp.register_comm_hook(None, _sum_allreduce_hook)
        return ParallelModel(ddp, parallelism, sums_gradients=sums)
    if isinstance(model, DistributedDataParallel):
        raise ValueError("parallelism='fsdp2' needs the plain model, not one already wrapped in DDP")
    names = _shard(model, optimizer, device, precision, shard_modules, where, tp_plan)
    return ParallelModel(model, parallelism, sums_gradients=True, optimizer_layout=names)


def default_shard_modules(model: nn.Module) -> list[nn.Module]:
    """The blocks TorchTitan shards: every element of the model's ``ModuleList``/``Sequential`` children (the
    transformer blocks); without such a container, every direct child that holds parameters. The root is
    sharded after them in any case, so embeddings and heads left over are sharded with the root."""
    blocks: list[nn.Module] = []
    for child in model.children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            blocks.extend(m for m in child if any(True for _ in m.parameters()))
    if blocks:
        return blocks
    return [c for c in model.children() if any(True for _ in c.parameters())]


def _check_mesh(
    where: mesh_mod.Layout, parallelism: Parallelism, tp_plan: Optional[Mapping[str, ParallelStyle]]
) -> None:
    """Refuse the option combinations a mesh cannot run, naming the option and the field."""
    if where.kind is not mesh_mod.MeshKind.FLAT and parallelism is not Parallelism.FSDP2:
        raise ValueError(
            f"spec.training.mesh ({where.kind.value}) needs parallelism='fsdp2', got {parallelism.value!r}: "
            "both mesh dimensions are FSDP2's (HSDP) or FSDP2's and tensor parallelism's"
        )
    if where.kind is mesh_mod.MeshKind.TP and not tp_plan:
        raise ValueError(
            "spec.training.mesh.tensorParallel needs a tp_plan: pass tp_plan={module name: ColwiseParallel() | "
            "RowwiseParallel() ...} to ElasticTrainer.from_env"
        )
    if tp_plan and where.kind is not mesh_mod.MeshKind.TP:
        raise ValueError("tp_plan was passed but spec.training.mesh.tensorParallel is not set: declare the degree")


def _data_parallel(
    model: nn.Module, device: torch.device, precision: Precision, init_sync: bool = True
) -> DistributedDataParallel:
    """``model`` wrapped in DDP (as given when it already is and runs fp32); one device per process on GPUs.

    ``find_unused_parameters=True`` is there for exact resumes, not for unused parameters. Plain DDP reduces its
    first iteration with one bucket in reverse parameter order, then rebuilds its buckets in the order gradients
    became ready. An all-reduce sums each element in an order set by its offset in the bucket (gloo's ring starts
    each chunk's sum at another rank), so the first step of a run resumed from step k's checkpoint was summed in
    another order than step k+1 of the uninterrupted run: 1.5e-8 apart after that one step on the toy model at
    W=3, drifting from there. With this switch torch lays the buckets out once, at construction (reverse parameter
    order, the usual 1 MiB / 25 MiB caps), and never rebuilds them; communication still overlaps the backward.
    Cost: one autograd-graph traversal per synchronised backward (docs/trainer.md, "Same world size, same bits").
    """
    kwargs: dict[str, Any] = {"device_ids": [device.index]} if device.type == "cuda" else {}
    kwargs["find_unused_parameters"] = True
    if not init_sync:
        kwargs["init_sync"] = False
    dtype = precision.compute_dtype
    if isinstance(model, DistributedDataParallel):
        if dtype is not None:
            raise ValueError(f"precision={precision.value!r} needs the plain model, not one already wrapped in DDP")
        return model
    debug_group = debugmode.ddp_process_group()  # spec.debug DETAIL on gloo: see disttrain.trainer.debugmode
    if debug_group is not None:
        kwargs["process_group"] = debug_group
    if dtype is None:
        return DistributedDataParallel(model, **kwargs)
    return _AutocastDDP(model, dtype, **kwargs)


def _shard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    precision: Precision,
    shard_modules: Optional[Sequence[nn.Module]],
    where: mesh_mod.Layout,
    tp_plan: Optional[Mapping[str, ParallelStyle]],
) -> list[list[str]]:
    if optimizer.state:
        raise ValueError(
            "parallelism='fsdp2' needs a fresh optimizer (no state yet): fully_shard replaces the parameters, "
            "and the trainer moves the optimizer onto the sharded ones"
        )
    names = {id(p): name for name, p in model.named_parameters()}
    _shard_model(model, device, precision, shard_modules, where, tp_plan)
    _point_optimizer(optimizer, model, names)
    return optimizer_layout(model, optimizer)


def optimizer_layout(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The names in ``model`` of each of ``optimizer``'s param groups' parameters (while the model's registered
    parameters are the ones the optimizer holds: sharded, between steps)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def _shard_model(
    model: nn.Module,
    device: torch.device,
    precision: Precision,
    shard_modules: Optional[Sequence[nn.Module]],
    where: mesh_mod.Layout,
    tp_plan: Optional[Mapping[str, ParallelStyle]],
) -> None:
    """``fully_shard`` (after ``parallelize_module`` on an FSDP x TP mesh) over the mesh of ``where``, summing."""
    mesh = mesh_mod.build(device.type, where)
    if where.kind is mesh_mod.MeshKind.TP:
        assert tp_plan is not None
        data_dim, tensor_dim = mesh_mod.DIM_NAMES[mesh_mod.MeshKind.TP]
        parallelize_module(model, mesh[tensor_dim], dict(tp_plan))
        mesh = mesh[data_dim]  # FSDP2 shards over the elastic dimension; TP's layers stay split over the inner one
    dtype = precision.compute_dtype
    inner = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    root = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, output_dtype=torch.float32)
    blocks = list(shard_modules) if shard_modules is not None else default_shard_modules(model)
    for block in blocks:
        if block is model:
            continue
        fully_shard(block, mesh=mesh, mp_policy=inner)
    fully_shard(model, mesh=mesh, mp_policy=root)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def _point_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, names: Mapping[int, str]) -> None:
    """Point the optimizer's param groups at ``model``'s parameters of the same names (``names``: id of each
    parameter the optimizer holds now -> its name)."""
    sharded = dict(model.named_parameters())
    for group in optimizer.param_groups:
        try:
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        except KeyError as exc:
            raise ValueError(
                "parallelism='fsdp2': the optimizer holds a parameter that is not one of the model's"
            ) from exc


@dataclasses.dataclass(frozen=True)
class Sharding:
    """How a sharded model is spread: what :func:`rewrap` needs besides the model, at a new world size."""

    precision: Precision
    layout: mesh_mod.Layout
    tp_plan: Optional[Mapping[str, ParallelStyle]] = None


class ModelTemplate:
    """The user's model before it was sharded, its parameters on the meta device (no memory), its buffers kept: what
    a group re-formed in place shards again on its new mesh (:func:`rewrap`). ``fully_shard`` changes a module in
    place and binds its mesh into it, so the structure is copied once, before the first wrap."""

    def __init__(self, model: nn.Module, shard_modules: Optional[Sequence[nn.Module]] = None) -> None:
        memo: dict[int, object] = {
            id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()
        }
        self.module = copy.deepcopy(model, memo)
        names = {id(m): name for name, m in model.named_modules()}
        self.shard_names = [names[id(m)] for m in shard_modules] if shard_modules is not None else None

    def build(self) -> nn.Module:
        """A fresh copy of the structure (meta parameters, real buffers)."""
        return copy.deepcopy(self.module)


def release(optimizer: torch.optim.Optimizer) -> None:
    """Let go of a sharded model whose group ended: the optimizer emptied of the old parameters and their state.
    Nothing then holds the old mesh but the model, which the caller drops, so the old process groups are freed at
    once (the names :func:`rewrap` points the optimizer at again are the wrapper's ``optimizer_layout``)."""
    for group in optimizer.param_groups:
        group["params"] = []
    optimizer.state.clear()


def rewrap(
    template: ModelTemplate,
    param_names: Sequence[Sequence[str]],
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    how: Sharding,
) -> ParallelModel:
    """A new model from ``template``, sharded over the current group's mesh, its weights uninitialised (the caller
    loads the state), and ``optimizer``'s param groups pointed at its parameters of ``param_names`` (what
    :func:`release` returned; loading initialises the optimizer's state again)."""
    _check_mesh(how.layout, Parallelism.FSDP2, how.tp_plan)
    model = template.build()
    blocks = [model.get_submodule(n) for n in template.shard_names] if template.shard_names is not None else None
    _shard_model(model, device, how.precision, blocks, how.layout, how.tp_plan)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in template.module.named_buffers():
            model.get_buffer(name).copy_(buffer)
    params = dict(model.named_parameters())
    for group, names in zip(optimizer.param_groups, param_names, strict=True):
        group["params"] = [params[name] for name in names]
    return ParallelModel(model, Parallelism.FSDP2, sums_gradients=True, optimizer_layout=param_names)


def _sum_allreduce_hook(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's all-reduce without the division by W (see :class:`ParallelModel`)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    assert work is not None
    reduced: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda fut: fut.value()[0])
    return reduced


def _to_fp32(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() else out
    if isinstance(out, (list, tuple)):
        return type(out)(_to_fp32(o) for o in out)
    if isinstance(out, dict):
        return {k: _to_fp32(v) for k, v in out.items()}
    return out
