"""When a step is done: its reductions and optimizer update completed on the device, not only queued.

On an accelerator the host queues the gradient all-reduce and the optimizer's kernels and returns at once; the
reduction may still be running on the device when the loop goes on. Everything that treats a step as done (the step
counter, the progress report, a checkpoint, the state a new group takes from memory in an in-place reform) must only
see weights that every rank reduced and updated in full. :meth:`StepCompletion.finish` is that rule, in one place: it
records an event on the current stream after the optimizer step, waits for it, and only then advances the counter;
an error the wait raises (a failed kernel) leaves the counter where it was, so the step is redone.

Callers: :meth:`~disttrain.trainer.loop.ElasticTrainer._optimizer_step`. The cost is one host-device sync per step;
on the CPU nothing is queued (every op has finished when it returns) and nothing is waited for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional, Protocol

import torch


class DeviceEvent(Protocol):
    """What the rule needs of a device event (``torch.Event``): mark the stream's position, wait for it."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...


class StepCompletion:
    """Advances a step only after the device finished it (see the module docstring).

    ``make_event`` builds one event per step (None: a device whose work is complete when the call returns, the CPU).
    A test passes a fake device's event factory to observe the order of record, wait and advance.
    """

    def __init__(self, make_event: Optional[Callable[[], DeviceEvent]]) -> None:
        self._make_event = make_event

    @property
    def waits(self) -> bool:
        """Whether :meth:`finish` waits for the device (False on the CPU)."""
        return self._make_event is not None

    def wait(self) -> None:
        """Wait until the work queued so far completed (nothing on the CPU)."""
        if self._make_event is not None:
            event = self._make_event()
            event.record()
            event.synchronize()

    def finish(self, advance: Callable[[], None]) -> None:
        """Wait until the work queued so far (the step's reductions and optimizer update) completed, then call
        ``advance`` (the counter moves). If the wait raises, ``advance`` is not called."""
        if self._make_event is not None:
            event = self._make_event()
            event.record()
            event.synchronize()
        advance()


def for_device(device: torch.device) -> StepCompletion:
    """The rule for the trainer's device: an event on the current stream of an accelerator, nothing on the CPU."""
    if device.type == "cpu":
        return StepCompletion(None)
    return StepCompletion(lambda: torch.Event(device=device))
