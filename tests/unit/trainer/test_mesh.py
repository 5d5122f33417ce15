"""Where ranks sit on a 2-D mesh, and which samples they read."""

from __future__ import annotations

import pytest

from disttrain.api.spec import MeshSpec
from disttrain.trainer import mesh, sampler


def test_tp_groups_are_runs_of_consecutive_ranks_that_read_one_data_rank_s_samples():
    where = mesh.layout(MeshSpec(tensor_parallel=2), 8)
    assert (where.kind, where.shape, where.data_degree) == (mesh.MeshKind.TP, (4, 2), 4)
    assert [where.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [sampler.data_rank(r, 8, 4) for r in range(8)] == [where.data_rank(r) for r in range(8)]
    reads = [sampler.rank_positions(16, 8, where.data_degree, where.data_rank(r)) for r in range(8)]
    assert reads[0] == reads[1] == [16, 20] and reads[6] == reads[7] == [19, 23]


def test_under_hsdp_the_replicas_are_elastic_and_every_rank_is_a_data_rank():
    where = mesh.layout(MeshSpec(shard=4), 8)
    assert (where.kind, where.shape, where.data_degree, where.data_rank(5)) == (mesh.MeshKind.HSDP, (2, 4), 8, 5)


@pytest.mark.parametrize(
    ("spec", "world", "message"),
    [
        (MeshSpec(tensor_parallel=4), 6, "training.mesh.tensorParallel = 4 does not divide the world size 6"),
        (MeshSpec(shard=2, tensor_parallel=2), 4, "exactly one of shard and tensorParallel"),
    ],
    ids=["not-dividing", "both"],
)
def test_a_mesh_that_cannot_run_is_refused_naming_the_field(spec, world, message):
    with pytest.raises(mesh.MeshError, match=message):
        mesh.layout(spec, world)


def test_no_mesh_is_the_flat_one():
    assert mesh.layout(None, 3) == mesh.Layout(mesh.MeshKind.FLAT, 3, 1)
