"""Scaled mode after a 2 -> 4 resume, and SIGTERM draining at the next step boundary."""

import json
import signal

import pytest

from disttrain.api.plan import ramped_lr_scale

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.mark.parametrize(("scaling", "factor"), [("linear", 2.0), ("sqrt", 2.0**0.5)], ids=["linear", "sqrt"])
def test_scaled_mode_doubles_the_global_batch_and_ramps_the_lr_factor_after_resume_at_four_ranks(
    harness, scaling, factor
):
    base, ramp = 0.01, 4
    contract = harness.contract(
        policy="scaled",
        global_batch=4,
        micro=2,
        accum=1,
        max_steps=8,
        interval=3,
        lr={"base": base, "scaling": scaling, "rampSteps": ramp, "referenceBatchSize": 4},
    )
    rc, log = harness.run(2, contract, "w2", TOY_DRAIN_AT="2")  # drains at step 3
    assert "drained at step 3" in log, log[-3000:]
    rows = harness.records("w2")
    assert {r["global_batch"] for r in rows} == {4}
    assert all(r["lrs"] == [pytest.approx(base)] for r in rows)  # factor 1 at the reference batch

    rc, log = harness.run(4, contract, "w4")
    assert rc == 0, log[-3000:]
    rows = sorted((r for r in harness.records("w4") if r["rank"] == 0), key=lambda r: r["step"])
    assert [r["step"] for r in rows] == [4, 5, 6, 7, 8]
    assert {r["global_batch"] for r in rows} == {8}
    for k, r in enumerate(rows):  # k optimizer steps after the change
        expected = base * ramped_lr_scale(1.0, factor, k, ramp)
        assert r["lrs"] == [pytest.approx(expected)], (k, r["lrs"], expected)
    assert rows[-1]["lrs"] == [pytest.approx(base * factor)]
    manifest = json.loads((harness.ckpt / "step-8" / "COMPLETE.json").read_text())
    assert manifest["samples_consumed"] == 3 * 4 + 5 * 8 and manifest["plan"]["globalBatch"] == 8


def test_sigterm_at_an_arbitrary_moment_checkpoints_at_the_next_boundary_and_exits_drained(harness):
    contract = harness.contract(global_batch=4, micro=1, max_steps=1000, interval=1000)
    proc = harness.start(2, contract, "term", TOY_STEP_SLEEP="0.05")
    harness.wait_for_step("term", 7)
    proc.send_signal(signal.SIGTERM)  # torchrun forwards it to its workers, as the kubelet's SIGTERM would
    rc = proc.wait(timeout=60)
    log = harness.log("term")
    assert rc == 83 or "exitcode  : 83" in log or "exiting 83" in log, log[-3000:]
    last = max(r["step"] for r in harness.records("term"))
    steps = sorted(int(p.name.split("-")[1]) for p in harness.ckpt.glob("step-*"))
    assert steps == [last], (steps, last)  # the checkpoint holds every step that ran: 0 steps lost
    assert f"drained at step {last}" in log

    rc, log = harness.run(2, harness.contract(global_batch=4, micro=1, max_steps=last + 2, interval=1000), "resume")
    assert rc == 0, log[-3000:]
    assert f"resumed from checkpoint step-{last}" in log
