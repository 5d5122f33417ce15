"""A step counts only after the device finished it: its reductions and optimizer update, not only their launch.

A fake device stands in for the accelerator: its event records the order of calls, so the tests see whether the step
counter moved before the wait (on a real GPU that would let a snapshot copy half-reduced weights).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Optional

import pytest
import torch

from disttrain.api.plan import Plan
from disttrain.trainer import completion, recovery
from disttrain.trainer.checkpoint.manager import TrainerState
from disttrain.trainer.loop import ElasticTrainer
from disttrain.trainer.lr import LRState
from disttrain.trainer.options import TrainerOptions
from disttrain.trainer.parallel import Precision
from disttrain.trainer.precision import PrecisionState


class FakeDeviceEvent:
    """An event of a fake device: ``record`` and ``synchronize`` append to a shared log, ``on_sync`` runs at the wait
    (where a real device would still be running the step's kernels)."""

    def __init__(self, calls: list[str], on_sync: Optional[Callable[[], None]] = None) -> None:
        self.calls, self.on_sync = calls, on_sync

    def record(self) -> None:
        self.calls.append("record")

    def synchronize(self) -> None:
        self.calls.append("synchronize")
        if self.on_sync is not None:
            self.on_sync()


def test_the_counter_advances_only_after_the_wait():
    calls: list[str] = []
    rule = completion.StepCompletion(lambda: FakeDeviceEvent(calls))

    rule.finish(lambda: calls.append("advance"))

    assert calls == ["record", "synchronize", "advance"]


def test_a_failed_wait_leaves_the_counter_where_it_was():
    def failing_wait() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    steps = [0]
    rule = completion.StepCompletion(lambda: FakeDeviceEvent([], on_sync=failing_wait))

    with pytest.raises(RuntimeError, match="illegal memory access"):
        rule.finish(lambda: steps.__setitem__(0, steps[0] + 1))
    assert steps == [0]


def test_each_step_waits_once():
    calls: list[str] = []
    rule = completion.StepCompletion(lambda: FakeDeviceEvent(calls))

    for _ in range(3):
        rule.finish(lambda: calls.append("advance"))

    assert calls == ["record", "synchronize", "advance"] * 3


@pytest.mark.parametrize(
    ("device", "waits"),
    [(torch.device("cpu"), False), (torch.device("cuda", 0), True), (torch.device("xpu", 0), True)],
    ids=["cpu-has-nothing-queued", "cuda-waits", "other-accelerators-wait"],
)
def test_the_rule_is_chosen_by_device_type(device: torch.device, waits: bool):
    assert completion.for_device(device).waits is waits


def test_the_cpu_rule_advances_at_once():
    steps: list[int] = []
    completion.for_device(torch.device("cpu")).finish(lambda: steps.append(1))
    assert steps == [1]


def _trainer_on_fake_device(calls: list[str], on_sync: Callable[[], None]) -> Any:
    """The trainer's parts that one optimizer step touches, on a fake device (no process group, no DDP)."""
    model = torch.nn.Linear(2, 1)
    trainer: Any = ElasticTrainer.__new__(ElasticTrainer)
    trainer.options = TrainerOptions()
    trainer.group = types.SimpleNamespace(
        ordered=None,
        rank=0,
        raw_model=model,
        replica_group=None,
        checkpoints=types.SimpleNamespace(before_optimizer_step=lambda: None),
        plan=Plan(world_size=1, micro_batch=4, accum_steps=1, global_batch=4, lr_scale=1.0),
    )
    trainer.memory = recovery.Memory()
    trainer.optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    trainer.scheduler = None
    trainer.precision = PrecisionState(Precision.FP32, torch.device("cpu"))
    trainer.watchdog = types.SimpleNamespace(seen_generation=-1)
    trainer.lr_state = LRState(1.0, 1.0, 0)
    trainer.state = TrainerState()
    trainer.completion = completion.StepCompletion(lambda: FakeDeviceEvent(calls, on_sync))
    return trainer


def test_the_trainer_steps_after_its_reductions_and_counts_after_its_update_completed():
    calls: list[str] = []
    seen_at_waits: list[dict[str, Any]] = []

    def at_wait() -> None:  # the device is still working: nothing that marks the step done may have moved yet
        seen = {"step": trainer.state.step, "cursor": trainer.state.data_cursor}
        seen["weight"] = trainer.group.raw_model.weight.detach().clone()
        seen_at_waits.append(seen)

    trainer = _trainer_on_fake_device(calls, at_wait)
    before = trainer.group.raw_model.weight.detach().clone()
    trainer.group.raw_model(torch.ones(4, 2)).sum().backward()

    trainer._optimizer_step()

    assert calls == ["record", "synchronize"] * 2
    reductions, update = seen_at_waits
    assert torch.equal(reductions["weight"], before), "nothing is stepped before the reductions are known good"
    assert update["step"] == 0 and update["cursor"] == 0
    assert not torch.equal(update["weight"], before), "the update is queued before the second wait"
    assert (trainer.state.step, trainer.state.samples_consumed, trainer.state.data_cursor) == (1, 4, 4)
