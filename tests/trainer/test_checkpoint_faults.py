"""A checkpoint that never committed, or was corrupted after committing, is never loaded."""

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_kill_during_save_before_commit_leaves_the_previous_checkpoint_loaded_and_kept(harness):
    contract = harness.contract(global_batch=4, micro=1, max_steps=8, interval=2, keep=1)
    rc, log = harness.run(2, contract, "crash", DISTTRAIN_FAULT_INJECT="kill_before_commit:4")
    assert rc != 0, log[-3000:]
    assert "SIGKILL before COMPLETE.json of step 4" in log
    names = sorted(p.name for p in harness.ckpt.iterdir())
    assert "step-2" in names and "step-4" not in names, names  # keep=1 never removed the newest complete one
    assert any(n.startswith(".tmp-step-4-") for n in names), names  # the torn save is still there, uncommitted

    rc, log = harness.run(2, contract, "after")
    assert rc == 0, log[-3000:]
    assert "resumed from checkpoint step-2" in log
    assert min(r["step"] for r in harness.records("after")) == 3
    names = sorted(p.name for p in harness.ckpt.iterdir())
    assert names == ["step-8"], names  # the torn temp dir was cleaned up by retention


def test_a_corrupt_shard_is_detected_and_the_previous_checkpoint_is_used(harness):
    contract = harness.contract(global_batch=4, micro=1, max_steps=4, interval=2, keep=3)
    rc, log = harness.run(2, contract, "first")
    assert rc == 0, log[-3000:]
    shard = harness.ckpt / "step-4" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the digest can tell
    shard.write_bytes(bytes(data))

    longer = harness.contract(global_batch=4, micro=1, max_steps=6, interval=2, keep=3)
    rc, log = harness.run(2, longer, "second")
    assert rc == 0, log[-3000:]
    assert "checkpoint step-4 is not usable (file __1_0.distcp is corrupt" in log
    assert "falling back to an older checkpoint" in log
    assert "resumed from checkpoint step-2" in log
    assert min(r["step"] for r in harness.records("second")) == 3
