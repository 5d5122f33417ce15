"""A checkpoint that never committed, or was corrupted after committing, is never loaded."""

import re

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_kill_during_save_before_commit_leaves_the_previous_checkpoint_loaded_and_kept(harness):
    contract = harness.contract(global_batch=4, micro=1, max_steps=8, interval=2, keep=1)
    rc, log = harness.run(2, contract, "crash", TOY_FAULT="kill_before_commit:4")
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
    shard = max((harness.ckpt / "step-4").glob("__*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the digest can tell
    shard.write_bytes(bytes(data))

    longer = harness.contract(global_batch=4, micro=1, max_steps=6, interval=2, keep=3)
    rc, log = harness.run(2, longer, "second")
    assert rc == 0, log[-3000:]
    assert f"checkpoint step-4 is not usable (file {shard.name} is corrupt" in log
    assert "falling back to an older checkpoint" in log
    assert "resumed from checkpoint step-2" in log
    assert min(r["step"] for r in harness.records("second")) == 3


def test_a_failed_async_save_surfaces_at_a_boundary_is_retried_and_async_checkpoints_resume(harness):
    contract = harness.contract(global_batch=4, micro=1, max_steps=12, interval=4, keep=3, async_save=True)
    rc, log = harness.run(2, contract, "fail", TOY_FAULT="fail_write:4", TOY_STEP_SLEEP="0.15",
                          TOY_DRAIN_AT="9")  # drains at step 10
    assert "drained at step 10" in log, log[-3000:]
    failed = re.search(r"checkpoint save at step 4 FAILED \(1 in a row\): OSError\('fault injection.*\n.*"
                       r"checkpoint step-(\d+) committed", log)
    assert failed, log[-3000:]
    retry = int(failed.group(1))
    assert 4 < retry < 8  # retried at the boundary where the failure surfaced, not at the next interval
    assert {p.name for p in harness.ckpt.iterdir()} == {f"step-{retry}", "step-8", "step-10"}

    rc, log = harness.run(2, contract, "rest")
    assert rc == 0, log[-3000:]
    assert "resumed from checkpoint step-10" in log
    rows = harness.records("fail") + harness.records("rest")
    assert sorted(r["step"] for r in rows if r["rank"] == 0) == list(range(1, 13))
    assert sum(len(r["indices"]) for r in rows) == 12 * 4
