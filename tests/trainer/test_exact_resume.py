"""Fixed mode: an interrupted run resumed at another world size ends where the uninterrupted one does.

Reference: W=4 for 10 steps. Interrupted: W=4 drained at step 4 (checkpoint committed, exit DRAINED), then
resumed, each from a copy of the same checkpoint, at W=4 (final parameters and optimizer state bitwise equal to
the reference: DDP's bucket layout is fixed, trainer/parallel.py), at W=2 and at W=3 (final parameters within
the drift docs/trainer.md publishes for this scenario, times the stated headroom: gloo sums in another order).
The multiset of consumed sample indices is exactly equal.
The toy model uses dropout keyed by (seed, step, sample), so this holds with randomness in the model too.
The dataset (97 samples) is not a multiple of the global batch (12), so steps straddle epoch boundaries.
"""

import shutil

import pytest
import torch
from tests.checkpoint_tensors import differing, load_tensors
from tests.trainer import drift
from tests.trainer.conftest import consumed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_resume_at_four_ranks_is_bitwise_exact_and_at_two_or_three_within_the_published_drift(harness):
    contract = harness.contract(global_batch=12, micro=1, max_steps=10, interval=2)
    ref_ckpt = harness.tmp / "ref-ckpt"
    rc, log = harness.run(4, contract, "ref", ckpt=ref_ckpt)
    assert rc == 0, log[-3000:]

    rc, log = harness.run(4, contract, "first", TOY_DRAIN_AT="3")  # acted on at the next agreed boundary: step 4
    harness.assert_exited(rc, log, 83)
    assert "drained at step 4" in log
    first = harness.records("first")
    assert max(r["step"] for r in first) == 4

    ckpt3, ckpt4 = harness.tmp / "ckpt-w3", harness.tmp / "ckpt-w4"
    shutil.copytree(harness.ckpt, ckpt3)
    shutil.copytree(harness.ckpt, ckpt4)
    reference = torch.load(harness.out / "ref-final.pt")
    expected = consumed(harness.records("ref"), range(1, 11))
    assert sum(expected.values()) == 120 and len(expected) == 97  # every sample once, 23 of them twice
    bounds = drift.published("toy AdamW")
    assert set(bounds) == {(4, 2), (4, 3)}, "docs/trainer.md lacks a figure"

    for world, run, ckpt in ((4, "w4", ckpt4), (2, "w2", harness.ckpt), (3, "w3", ckpt3)):
        rc, log = harness.run(world, contract, run, ckpt=ckpt)
        assert rc == 0, log[-3000:]
        assert f"resumed from checkpoint step-4 (saved at world size 4) at world size {world}" in log
        rows = harness.records(run)
        assert {r["world"] for r in rows} == {world}
        assert min(r["step"] for r in rows) == 5 and max(r["step"] for r in rows) == 10
        got = consumed(first, range(1, 5)) + consumed(rows, range(5, 11))
        assert got == expected, f"replayed: {got - expected}, skipped: {expected - got}"
        final = torch.load(harness.out / f"{run}-final.pt")
        if world == 4:
            differ = [name for name, value in reference.items() if not torch.equal(final[name], value)]
            assert differ == [], "a resume at the same world size must be bitwise exact"
            # And so is everything it committed at the end: parameters and AdamW state (exp_avg, exp_avg_sq, step).
            tensors = load_tensors(ckpt / "step-10")
            assert any(key.startswith("app.optim.") for key in tensors), sorted(tensors)
            assert differing(tensors, load_tensors(ref_ckpt / "step-10")) == {}
            continue
        bound = drift.HEADROOM * bounds[(4, world)].max_param_diff
        for name, value in reference.items():
            torch.testing.assert_close(final[name], value, rtol=0, atol=bound, msg=f"{name} at W={world}")
