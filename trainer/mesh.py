"""The device mesh of a job: 1-D, or 2-D with the node count as its elastic outer dimension.

``spec.training.mesh`` declares the fixed inner degree (:class:`~disttrain.api.spec.MeshSpec`); the outer degree is
world size / inner and changes with every reform. Ranks are laid out row-major, so the inner groups are runs of
consecutive ranks, which stay inside a node because the inner degree divides ``nprocPerNode`` (the CRD refuses the
rest). Called by :mod:`disttrain.trainer.parallel` to wrap the model, and by the loop to know which samples a rank
reads: on an FSDP x TP mesh the ranks of one TP group read the same samples, so the data rank decides them.

Pure apart from :func:`build`, which creates the mesh's process groups (a collective).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from disttrain.api.spec import MeshSpec
from disttrain.api.spec import data_degree as spec_data_degree
from disttrain.trainer import groupsockets


class MeshKind(str, enum.Enum):
    """``flat``: one dimension. ``hsdp``: replicate (elastic) x shard. ``tp``: data (elastic, FSDP) x tensor."""

    FLAT = "flat"
    HSDP = "hsdp"
    TP = "tp"


DIM_NAMES = {MeshKind.HSDP: ("replicate", "shard"), MeshKind.TP: ("data", "tensor")}
"""The dimension names of each 2-D mesh, outer (elastic) first, as TorchTitan names them."""


class MeshError(ValueError):
    """The declared mesh cannot run at this world size or with these options: a configuration error."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each rank sits on the mesh of one group."""

    kind: MeshKind
    world_size: int
    inner: int
    """Ranks in the fixed inner dimension (1 for a flat mesh)."""

    @property
    def outer(self) -> int:
        """Groups along the elastic dimension: world size / inner degree."""
        return self.world_size // self.inner

    @property
    def data_degree(self) -> int:
        """Ranks that read different samples: the TP groups under FSDP x TP, every rank otherwise."""
        return spec_data_degree(self.world_size, self.inner if self.kind is MeshKind.TP else None)

    def data_rank(self, rank: int) -> int:
        """The sampler's rank of global ``rank``: its TP group's index under FSDP x TP, ``rank`` otherwise."""
        return rank // self.inner if self.kind is MeshKind.TP else rank

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.world_size,) if self.kind is MeshKind.FLAT else (self.outer, self.inner)


def layout(spec: Optional[MeshSpec], world_size: int) -> Layout:
    """The layout of ``spec`` at ``world_size``; raises :class:`MeshError` naming the field when it does not fit."""
    if spec is None:
        return Layout(MeshKind.FLAT, world_size, 1)
    if spec.shard is not None and spec.tensor_parallel is not None:
        raise MeshError("training.mesh: exactly one of shard and tensorParallel must be set, got both")
    if spec.shard is None and spec.tensor_parallel is None:
        return Layout(MeshKind.FLAT, world_size, 1)
    kind = MeshKind.TP if spec.tensor_parallel is not None else MeshKind.HSDP
    name = "tensorParallel" if kind is MeshKind.TP else "shard"
    inner = spec.inner_degree
    if world_size % inner:
        raise MeshError(f"training.mesh.{name} = {inner} does not divide the world size {world_size}")
    return Layout(kind, world_size, inner)


def build(device_type: str, where: Layout) -> DeviceMesh:
    """The mesh of ``where`` over the default group: 1-D, or 2-D named by :data:`DIM_NAMES` (outer first). The
    connections of the groups it creates are the process's to shut down when it leaves them
    (:mod:`disttrain.trainer.groupsockets`)."""
    with groupsockets.capture():
        if where.kind is MeshKind.FLAT:
            return init_device_mesh(device_type, where.shape)
        return init_device_mesh(device_type, where.shape, mesh_dim_names=DIM_NAMES[where.kind])
