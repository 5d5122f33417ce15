"""The step-boundary agreement: every rank acts on a drain or a finished async save at the same step.

Each rank packs what it knows into :class:`BoundaryFlags`, seven int64s reduced with MAX in one tiny all-reduce.
:class:`BoundaryAgreement` starts that all-reduce at one boundary and reads it at the next, so it overlaps the
next step's compute instead of adding a synchronisation point; a decision lands one step after the earliest
rank saw its cause, or at once at the last step.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

NO_SAVE = -1
"""Pending-step value of a rank with no save in flight."""


@dataclasses.dataclass(frozen=True)
class BoundaryFlags:
    """What one rank reports at a step boundary, or (after the MAX all-reduce) what the group agrees on.

    MAX of a flag means "on any rank". The step of the save in flight travels as (step, -step), so MAX yields
    the newest and minus the oldest: the save flags speak of one save only when those two are equal.
    """

    drain: bool
    """A drain or SIGTERM was seen."""
    save_in_progress: bool
    """This rank has not finished its part of the async save in flight."""
    save_failed: bool
    """This rank's part of the async save in flight failed (informational: the commit gathers the errors)."""
    seconds_due: bool
    """The seconds interval of checkpoints has passed (only rank 0's clock counts)."""
    newest_pending_step: int
    """Step of the save in flight, :data:`NO_SAVE` if none."""
    oldest_pending_step: int
    """Equal to ``newest_pending_step`` on one rank; the lowest of them after the reduction."""
    interval_steps: int = 0
    """``intervalSteps: auto``: the checkpoint interval rank 0 proposes (0 on the other ranks and without auto),
    so every rank saves at the same steps with rank 0's estimate."""

    @classmethod
    def of_rank(
        cls,
        *,
        drain: bool,
        save_in_progress: bool,
        save_failed: bool,
        seconds_due: bool,
        pending_step: int,
        interval_steps: int = 0,
    ) -> BoundaryFlags:
        return cls(drain, save_in_progress, save_failed, seconds_due, pending_step, pending_step, interval_steps)

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor(
            [
                int(self.drain),
                int(self.save_in_progress),
                int(self.save_failed),
                int(self.seconds_due),
                self.newest_pending_step,
                -self.oldest_pending_step,
                self.interval_steps,
            ],
            dtype=torch.int64,
        )

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> BoundaryFlags:
        drain, in_progress, failed, seconds_due, newest, neg_oldest, interval = (int(x) for x in tensor.tolist())
        return cls(bool(drain), bool(in_progress), bool(failed), bool(seconds_due), newest, -neg_oldest, interval)

    def save_finished_everywhere(self, step: int) -> bool:
        """Every rank had finished its part of the save of ``step`` when the flags were taken."""
        return not self.save_in_progress and self.newest_pending_step == self.oldest_pending_step == step


class BoundaryAgreement:
    """The all-reduce of :class:`BoundaryFlags`, started at one boundary and read at the next."""

    def __init__(self) -> None:
        self._in_flight: Optional[tuple[torch.Tensor, dist.Work]] = None

    def exchange(self, flags: BoundaryFlags, read_now: bool = False) -> Optional[BoundaryFlags]:
        """Start reducing this boundary's ``flags``; return the group's flags of the previous boundary, or of
        this one when ``read_now`` (the last step: there is no next boundary). None at the first boundary.
        Collective: every rank calls it at every boundary."""
        tensor = flags.to_tensor()
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True)
        previous, self._in_flight = self._in_flight, (tensor, work)
        if read_now:
            previous, self._in_flight = self._in_flight, None
        if previous is None:
            return None
        previous[1].wait()
        return BoundaryFlags.from_tensor(previous[0])

    def settle(self) -> None:
        """Wait for the all-reduce still in flight, so an exit leaves no collective half-done behind it."""
        if self._in_flight is not None:
            self._in_flight[1].wait()
            self._in_flight = None
