"""The boundary flags: their tensor form round-trips, and a MAX reduction over ranks means what the loop reads."""

import pytest
import torch

from disttrain.trainer.boundary import NO_SAVE, BoundaryFlags


def flags(
    drain: bool = False,
    in_progress: bool = False,
    failed: bool = False,
    seconds: bool = False,
    pending: int = NO_SAVE,
    interval: int = 0,
) -> BoundaryFlags:
    return BoundaryFlags.of_rank(
        drain=drain,
        save_in_progress=in_progress,
        save_failed=failed,
        seconds_due=seconds,
        pending_step=pending,
        interval_steps=interval,
    )


def reduced(*ranks: BoundaryFlags) -> BoundaryFlags:
    """What ``all_reduce(op=MAX)`` leaves on every rank."""
    return BoundaryFlags.from_tensor(torch.stack([r.to_tensor() for r in ranks]).max(dim=0).values)


def test_the_tensor_is_seven_int64s_and_round_trips():
    f = flags(drain=True, failed=True, pending=8)
    t = f.to_tensor()
    assert t.dtype == torch.int64 and t.tolist() == [1, 0, 1, 0, 8, -8, 0]
    assert BoundaryFlags.from_tensor(t) == f
    g = flags(interval=17)
    assert BoundaryFlags.from_tensor(g.to_tensor()) == g


def test_rank_zeros_interval_proposal_reaches_every_rank():
    """Only rank 0 proposes (the others send 0), so MAX hands its interval to all."""
    proposal = flags(interval=23)
    assert reduced(proposal, flags(), flags()).interval_steps == 23


@pytest.mark.parametrize(
    ("ranks", "finished"),
    [
        ([flags(pending=8), flags(pending=8)], True),
        ([flags(pending=8), flags(pending=8, in_progress=True)], False),
        ([flags(pending=8), flags(pending=4)], False),  # the ranks speak of different saves
        ([flags(pending=8), flags()], False),  # one rank has no save in flight
        ([flags(), flags()], False),
    ],
    ids=["all-done", "one-still-writing", "different-saves", "one-without-a-save", "no-save"],
)
def test_a_save_is_finished_everywhere_only_when_every_rank_finished_that_very_save(ranks, finished):
    assert reduced(*ranks).save_finished_everywhere(8) is finished


def test_a_flag_raised_on_any_rank_is_raised_for_all():
    agreed = reduced(flags(), flags(drain=True), flags(seconds=True))
    assert agreed.drain and agreed.seconds_due and not agreed.save_in_progress
