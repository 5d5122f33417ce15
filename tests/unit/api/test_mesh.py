"""``spec.training.mesh``: the admission rule on nprocPerNode and the batch plan on the data degree."""

from __future__ import annotations

import celpy
import pytest
from tests.conftest import JobBuilder

from disttrain.api import rules, validation
from disttrain.api.plan import InvalidWorldSizeError, plan, valid_world_sizes
from disttrain.api.spec import DistTrainJob, TrainingSpec

[MESH_RULE] = [r for r in rules.RULES if "training.mesh.%s" in r.message]


def _spec(nproc: int, mesh: dict) -> dict:
    job = JobBuilder().set("spec.nprocPerNode", nproc).set("spec.training.mesh", mesh).build()
    return DistTrainJob.model_validate(job).model_dump(mode="json", by_alias=True, exclude_none=True)["spec"]


def _cel(expression: str, node: dict) -> object:
    env = celpy.Environment()

    def fmt(template: object, args: object) -> celpy.celtypes.StringType:
        values = tuple(int(a) if isinstance(a, int) else str(a) for a in args)  # type: ignore[attr-defined]
        return celpy.celtypes.StringType(str(template) % values)

    return env.program(env.compile(expression), functions={"format": fmt}).evaluate({"self": celpy.json_to_cel(node)})


@pytest.mark.parametrize(
    ("nproc", "mesh", "allowed"),
    [
        (4, {"tensorParallel": 2}, True),
        (8, {"shard": 8}, True),
        (4, {"tensorParallel": 3}, False),
        (2, {"shard": 4}, False),
        (6, {"tensorParallel": 4}, False),
    ],
    ids=["tp2-of-4", "shard8-of-8", "tp3-of-4", "shard4-of-2", "tp4-of-6"],
)
def test_the_crd_refuses_a_proc_count_the_inner_degree_does_not_divide(nproc, mesh, allowed):
    spec = _spec(nproc, mesh)
    assert bool(_cel(MESH_RULE.cel, spec)) is allowed is MESH_RULE.holds(spec)
    if not allowed:
        [(name, degree)] = mesh.items()
        message = str(_cel(MESH_RULE.to_cel()["messageExpression"], spec))
        assert message.startswith(f"training.mesh.{name} = {degree} must divide nprocPerNode = {nproc}")


def test_disttrain_validate_names_the_mesh_field_and_nproc_per_node():
    obj = JobBuilder().set("spec.nprocPerNode", 4).set("spec.training.globalBatchSize", 32).build()
    obj["spec"]["training"]["mesh"] = {"tensorParallel": 3}
    [problem] = [p for p in validation.validate_object(obj) if p.severity is validation.Severity.ERROR]
    assert problem.path == "spec.training.mesh" and "nprocPerNode = 4" in problem.message


def _training(mesh: dict, policy: str = "fixed") -> TrainingSpec:
    return TrainingSpec.model_validate(
        {
            "globalBatchSize": 16,
            "microBatchSize": 2,
            "batchPolicy": policy,
            "lr": {"base": 0.1},
            "maxSteps": 10,
            "accumulationSteps": 2,
            "mesh": mesh,
        }
    )


def test_the_plan_of_an_fsdp_x_tp_mesh_sees_the_data_degree():
    p = plan(_training({"tensorParallel": 4}), 16)  # 4 TP groups read different samples
    assert (p.world_size, p.data_degree, p.accum_steps, p.global_batch) == (16, 4, 2, 16)
    scaled = plan(_training({"tensorParallel": 4}, "scaled"), 16)
    assert (scaled.global_batch, scaled.lr_scale) == (2 * 2 * 4, 1.0)


def test_under_hsdp_every_rank_reads_its_own_samples():
    p = plan(_training({"shard": 2}), 8)
    assert (p.data_degree, p.accum_steps) == (8, 1)


def test_a_world_size_the_inner_degree_does_not_divide_is_invalid_and_the_valid_ones_are_named():
    with pytest.raises(InvalidWorldSizeError, match=r"not a multiple of training.mesh.tensorParallel = 4") as e:
        plan(_training({"tensorParallel": 4}), 6)
    assert e.value.valid == [4, 8, 16, 32]  # data degrees 1, 2, 4, 8 split 16 samples by 2
    assert valid_world_sizes(_training({"shard": 2}, "scaled"), [1, 2, 3, 4]) == [2, 4]
