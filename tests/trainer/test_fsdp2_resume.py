"""FSDP2 (``fully_shard`` on a CPU mesh, gloo): killed runs resume resharded at other world sizes, exactly.

Reference: FSDP2 at W=4 for 10 steps. Interrupted: the same at W=4, SIGKILLed (the whole process tree) once step 5
ran, then resumed from the newest complete checkpoint at W=2 reading a seekable IterableDataset and, from a copy,
at W=3 reading through 2 DataLoader workers. The final parameters match the reference within float tolerance and
the multiset of consumed sample indices is exactly equal. The same holds with bf16 and gradient clipping on, and
with checkpoints saved asynchronously (both resumed at W=3).
Checkpoints written under DDP load under FSDP2 and back (the state-dict keys are the model's own names under
both), with a user ``Stateful`` carried along; an fp16 GradScaler resumes with the scale and growth tracker it
had.
"""

from __future__ import annotations

import re
import shutil
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file
from tests.checkpoint_tensors import assert_readable_by_dcp
from tests.trainer.conftest import Harness, consumed

from disttrain.trainer.checkpoint import export

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 10
VARIANTS = {
    "fp32": {"TOY_PARALLELISM": "fsdp2"},
    "bf16-clip": {"TOY_PARALLELISM": "fsdp2", "TOY_PRECISION": "bf16", "TOY_CLIP": "0.05"},
    "fp32-async": {"TOY_PARALLELISM": "fsdp2"},
}
ASYNC_SAVES = {"fp32-async"}
"""Variants whose interrupted run saves with ``checkpoint.async`` (DCP's async_save of sharded DTensor state)."""
SAME_MATH_AS = {"fp32-async": "fp32"}
"""Variants whose reference is another's: saving in the background changes when files are written, not the math."""
# Where each variant resumes after the kill, with the extra env of that resume. DataLoader workers and the data's
# form change where samples are read, not the math: the W=2 fp32 resume reads the same samples as a seekable
# IterableDataset, the W=3 one through 2 DataLoader workers, both against the same reference.
RESUMES = {
    "fp32": [(2, {"TOY_STREAM": "1"}), (3, {"TOY_NUM_WORKERS": "2"})],
    "bf16-clip": [(3, {})],
    "fp32-async": [(3, {})],
}


def resumed_step(log: str) -> int:
    found = re.search(r"resumed from checkpoint step-(\d+)", log)
    assert found, log[-3000:]
    return int(found.group(1))


def assert_same_weights(final: dict, reference: dict, what: str) -> None:
    assert final.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-6, msg=f"{name}: {what}")


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory):
    """One uninterrupted W=4 FSDP2 run per variant, run on first use and shared by the tests of this module."""
    harness = Harness(tmp_path_factory.mktemp("fsdp2-ref"))
    contract = harness.contract(global_batch=12, micro=1, max_steps=STEPS, interval=2)
    cache: dict[str, tuple[dict, Counter]] = {}

    def get(variant: str) -> tuple[dict, Counter]:
        variant = SAME_MATH_AS.get(variant, variant)
        if variant not in cache:
            run = f"ref-{variant}"
            rc, log = harness.run(4, contract, run, ckpt=harness.tmp / run, **VARIANTS[variant])
            assert rc == 0, log[-3000:]
            expected = consumed(harness.records(run), range(1, STEPS + 1))
            cache[variant] = (torch.load(harness.out / f"{run}-final.pt"), expected)
        return cache[variant]

    yield get
    harness.cleanup()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_killed_fsdp2_run_resumes_at_other_world_sizes_like_the_four_rank_run(harness, references, variant):
    reference, expected = references(variant)
    assert sum(expected.values()) == 120 and len(expected) == 97
    contract = harness.contract(
        global_batch=12, micro=1, max_steps=STEPS, interval=2, async_save=variant in ASYNC_SAVES
    )
    options = VARIANTS[variant]

    first = harness.start(4, contract, "first", TOY_STEP_SLEEP="0.2", **options)
    harness.wait_for_step("first", 5)
    # An async save commits in the background: kill once step 4's is complete, so every variant resumes past it.
    harness.wait_until("step 4 committed", lambda: "step-4" in harness.ckpt_names(), timeout=120)
    harness.kill_tree(first.pid)
    first.wait(timeout=30)
    before_kill = harness.records("first")

    for world, extra in RESUMES[variant]:
        run, ckpt = f"w{world}", harness.tmp / f"ckpt-w{world}"
        shutil.copytree(harness.ckpt, ckpt, ignore=shutil.ignore_patterns(".tmp-*"))
        rc, log = harness.run(world, contract, run, ckpt=ckpt, **options, **extra)
        assert rc == 0, log[-3000:]
        resumed = resumed_step(log)
        assert resumed >= 4 and f"(saved at world size 4) at world size {world}" in log
        rows = harness.records(run)
        assert {r["world"] for r in rows} == {world}
        assert min(r["step"] for r in rows) == resumed + 1 and max(r["step"] for r in rows) == STEPS
        if "TOY_CLIP" in options:  # a record holds the norm of the step before it (recorded before its update)
            norms = [r["grad_norm"] for r in rows if r["step"] > resumed + 1]
            assert norms and all(n is not None and n > 0 for n in norms)
            assert max(norms) > float(options["TOY_CLIP"]), "the clipping threshold was never reached"
        got = consumed(before_kill, range(1, resumed + 1)) + consumed(rows, range(resumed + 1, STEPS + 1))
        assert got == expected, f"replayed: {got - expected}, skipped: {expected - got}"
        what = f"{variant} at W={world} {extra}"
        assert_same_weights(torch.load(harness.out / f"{run}-final.pt"), reference, what)


def test_a_ddp_checkpoint_resumes_under_fsdp2_and_an_fsdp2_one_under_ddp_with_user_state(harness, references):
    """DDP W=2 steps 1-4, FSDP2 W=3 steps 5-7, DDP W=4 steps 8-10: the fp32 FSDP2 reference's weights."""
    reference, expected = references("fp32")
    contract = harness.contract(global_batch=12, micro=1, max_steps=STEPS, interval=2)
    legs = [(2, "ddp", "3", 4), (3, "fsdp2", "6", 7), (4, "ddp", "", STEPS)]  # a drain is acted on a step late
    got: Counter = Counter()
    start = 1
    for world, parallelism, drain_at, last in legs:
        run = f"{parallelism}-w{world}"
        extra = {"TOY_DRAIN_AT": drain_at} if drain_at else {}
        rc, log = harness.run(world, contract, run, TOY_PARALLELISM=parallelism, TOY_USER_STATE="1", **extra)
        harness.assert_exited(rc, log, 83 if drain_at else 0)
        rows = harness.records(run)
        assert min(r["step"] for r in rows) == start and max(r["step"] for r in rows) == last, log[-3000:]
        assert all(r["counter"] == r["step"] for r in rows), "the user Stateful did not follow the checkpoint"
        got += consumed(rows, range(start, last + 1))
        start = last + 1
        newest = max(harness.ckpt.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
        assert_readable_by_dcp(newest, harness.tmp / f"{run}.pt")  # by DCP's own tools, DDP and FSDP2 alike
    assert got == expected, f"replayed: {got - expected}, skipped: {expected - got}"
    final = torch.load(harness.out / "ddp-w4-final.pt")
    assert_same_weights(final, reference, "DDP -> FSDP2 -> DDP")
    assert export.main([str(harness.ckpt), str(harness.tmp / "export")]) == 0  # the last step's checkpoint
    exported = load_file(harness.tmp / "export" / export.SINGLE_FILE)
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], v) for k, v in final.items())


def test_an_fp16_grad_scaler_resumes_with_the_same_scale_and_growth_tracker(harness):
    """The scale starts at 1024 and doubles every 3 steps without overflow (fp32 master weights, tiny
    gradients): before step s it is 1024 * 2**((s-1) // 3) with a growth tracker of (s-1) % 3, across the drain
    at step 4 and the resume at W=3 alike."""
    contract = harness.contract(global_batch=12, micro=2, max_steps=8, interval=2)
    options = {"TOY_PARALLELISM": "fsdp2", "TOY_PRECISION": "fp16", "TOY_SCALER_GROWTH_INTERVAL": "3"}
    rc, log = harness.run(2, contract, "first", TOY_DRAIN_AT="3", **options)
    assert "drained at step 4" in log, log[-3000:]
    rc, log = harness.run(3, contract, "w3", **options)
    assert rc == 0, log[-3000:]
    assert "resumed from checkpoint step-4" in log
    seen = {(r["step"], r["scale"], r["growth_tracker"]) for r in harness.records("first") + harness.records("w3")}
    assert seen == {(s, 1024.0 * 2 ** ((s - 1) // 3), (s - 1) % 3) for s in range(1, 9)}
