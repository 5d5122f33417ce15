"""A step counts only when every rank's reductions succeeded: real torchrun, gloo, one rank's reductions of step 5
reported aborted (fault injection standing for NCCL's early return after an abort). Neither rank applies or counts
step 5: the checkpoint of every step stops at step 4, and both ranks exit REFORM (the other on the collective that
fails when the aborted rank leaves)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]


def test_an_aborted_reduction_on_one_rank_leaves_the_step_uncounted_on_every_rank(harness):
    contract = harness.contract(global_batch=12, micro=1, max_steps=10, interval=1, timeout=10)
    rc, log = harness.run(2, contract, "gate", timeout=150, DISTTRAIN_FAULT_ABORTED_REDUCTION="5:1")
    harness.assert_exited(rc, log, 84)
    assert "step 5: this rank's (fault injection) reductions failed or were aborted" in log, log[-3000:]
    assert harness.ckpt_names()[-1] == "step-4", harness.ckpt_names()
    assert "checkpoint step-5 committed" not in log
