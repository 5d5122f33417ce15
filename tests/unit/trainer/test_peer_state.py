"""What a peer sends in an in-place reform is loaded as plain data, never unpickled freely."""

from __future__ import annotations

import io
import os

import pytest
import torch

from disttrain.trainer import gate
from disttrain.trainer.checkpoint.manager import TrainerState
from disttrain.trainer.replicas.wire import safe_load

pytestmark = pytest.mark.unit


class _RunsCode:
    def __reduce__(self):  # what a hostile peer would send: a call on load
        return (os.system, ("true",))


def test_the_trainer_state_a_peer_sends_loads_with_its_rng_states():
    sent = TrainerState(step=7, samples_consumed=84, data_cursor=84).state_dict()
    buffer = io.BytesIO()
    torch.save({"trainer": sent}, buffer)
    received = TrainerState()
    received.load_state_dict(safe_load(buffer.getvalue())["trainer"])
    assert (received.step, received.samples_consumed, received.data_cursor) == (7, 84, 84)


def test_a_state_that_would_run_code_on_load_is_refused():
    buffer = io.BytesIO()
    torch.save({"trainer": _RunsCode()}, buffer)
    with pytest.raises(Exception, match=r"Weights only load failed|Unsupported global"):
        safe_load(buffer.getvalue())


@pytest.mark.parametrize(
    ("value", "step", "rank", "aborted"),
    [("", 5, 1, False), ("5", 5, 0, True), ("5:1", 5, 1, True), ("5:1", 5, 0, False), ("5:1", 4, 1, False)],
    ids=["unset", "every-rank", "that-rank", "other-rank", "other-step"],
)
def test_the_injected_abort_names_a_step_and_optionally_a_rank(value, step, rank, aborted):
    assert gate.injected_abort(step, rank, {gate.FAULT_ABORTED_REDUCTION: value}) is aborted


def test_a_step_abort_counts_as_a_failed_collective():
    from disttrain.trainer.inplace import is_group_failure

    assert is_group_failure(gate.StepAbortedError("step 5: another rank's reductions failed"))
