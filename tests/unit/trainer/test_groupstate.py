"""What a group's state keeps when its group is left, and the interval planner's life across groups.

Leaving a group must drop every object bound to it (a gloo group closes its connections only when freed, and an old
DDP wrapper or mesh kept alive keeps its groups alive), while the checkpoint history, the planner's estimates and a
sharded model's optimizer layout go on to the next group's :func:`~disttrain.trainer.groupstate.form`.
"""

from __future__ import annotations

import time
import types
from typing import Any

import torch

from disttrain.api.plan import Plan
from disttrain.trainer import groupstate
from disttrain.trainer.boundary import BoundaryAgreement
from disttrain.trainer.checkpoint.autointerval import IntervalPlanner
from disttrain.trainer.control import Watchdog
from disttrain.trainer.parallel import Parallelism, ParallelModel
from disttrain.trainer.startup import StartupClock


def _joined(model: torch.nn.Module, parallelism: Parallelism) -> groupstate.GroupState:
    """A group's state as :func:`groupstate.form` leaves it, with stand-ins for what needs a live process group."""
    any_: Any = types.SimpleNamespace
    return groupstate.GroupState(
        context=any_(node_name="n0", group_rank=0),
        groups=any_(default=object(), checkpoint=object(), device=torch.device("cpu")),
        rank=0,
        world_size=2,
        plan=Plan(world_size=2, micro_batch=2, accum_steps=1, global_batch=4, lr_scale=1.0),
        parallel=ParallelModel(model, parallelism, sums_gradients=True, optimizer_layout=[["weight", "bias"]]),
        raw_model=model,
        ordered=any_(),
        checkpoints=any_(group=object(), last_saved_step=40),
        agreement=BoundaryAgreement(),
        planner=IntervalPlanner(lambda: None),
        process_id="p1",
        startup=StartupClock(time.time()),
        replica_group=any_(),
    )


def test_leaving_drops_everything_bound_to_the_group_and_keeps_what_the_next_one_continues():
    model = torch.nn.Linear(2, 1)
    joined = _joined(model, Parallelism.DDP)
    checkpoints, planner = joined.checkpoints, joined.planner

    left = joined.left(drop_model=False)

    assert left.groups.default is None and left.groups.checkpoint is None
    assert left.groups.device == torch.device("cpu")
    assert left.ordered is None and left.replica_group is None
    assert left.agreement is not joined.agreement, "a new agreement: none in flight on the old group"
    assert checkpoints.group is None, "the manager holds no old group"
    assert left.checkpoints is checkpoints and checkpoints.last_saved_step == 40, "its history goes on"
    assert left.planner is planner, "rank 0's estimates go on"
    assert left.model is model and left.raw_model is model, "DDP's model is wrapped again in the next group"
    assert joined.parallel.module is model, "the state it was made from is left alone (it is dropped whole)"


def test_a_sharded_model_is_dropped_with_its_mesh_but_its_optimizer_layout_goes_on():
    model = torch.nn.Linear(2, 1)
    joined = _joined(model, Parallelism.FSDP2)

    left = joined.left(drop_model=True)

    assert left.raw_model is not model and left.model is not model
    assert list(left.raw_model.parameters()) == []
    assert left.parallel.optimizer_layout == [["weight", "bias"]], "the next rewrap's names"
    assert left.parallel.parallelism is Parallelism.FSDP2


def test_the_interval_planner_is_rank_0s_and_goes_on_while_the_process_stays_rank_0():
    watchdog = Watchdog(None)
    first = groupstate.interval_planner(0, True, watchdog)
    assert isinstance(first, IntervalPlanner)
    assert groupstate.interval_planner(0, True, watchdog, kept=first) is first
    assert groupstate.interval_planner(1, True, watchdog, kept=first) is None
    assert groupstate.interval_planner(0, False, watchdog) is None
