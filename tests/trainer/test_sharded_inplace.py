"""Sharded models re-form in place from memory: real torchrun agents under the worker pod's launcher, gloo, a node's
whole process tree SIGKILLed between checkpoints while a replacement joins at once.

The survivors keep their processes; the new group rebuilds the FSDP2 state from the survivors' own shards and the
partner copies of the lost node's shards (no checkpoint read, no restart), and the run ends bit for bit where the
uninterrupted run of the same world size ends."""

from __future__ import annotations

import re

import pytest
import torch
from tests.trainer.test_inplace_reform import launcher_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

STEPS = 24
NODES = 3


def _run(harness, name: str, kill_at: int | None) -> str:
    """Three one-process nodes training the toy model under FSDP2; with ``kill_at``, the last node's tree is
    SIGKILLed once the group passed that step and a replacement starts at once. Returns the survivors' logs."""
    port = harness.start_store()
    contract = harness.contract(global_batch=12, micro=1, max_steps=STEPS, interval=5, timeout=10, reform_in_place=True)
    extra = {
        "TOY_STEP_SLEEP": "0.15",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "TOY_PARALLELISM": "fsdp2",
    }
    runs = [f"{name}{i}" for i in range(NODES)]
    agents = {
        run: harness.start(
            1, contract, run, ckpt=harness.tmp / f"ckpt-{name}", torchrun_args=launcher_args(port, NODES), **extra
        )
        for run in runs
    }

    def steps_at_full_world() -> list[int]:
        return [r["step"] for run in runs for r in harness.records(run) if r["world"] == NODES]

    if kill_at is not None:
        harness.wait_until(
            "the whole world passes the kill step", lambda: max(steps_at_full_world() or [0]) >= kill_at, 180
        )
        victim = runs[-1]
        harness.kill_tree(agents[victim].pid)
        agents[victim].wait(timeout=10)
        agents["replacement"] = harness.start(
            1,
            contract,
            f"{name}r",
            ckpt=harness.tmp / f"ckpt-{name}",
            torchrun_args=launcher_args(port, NODES),
            **extra,
        )
        runs = [*runs[:-1], f"{name}r"]
    for run, agent in agents.items():
        if kill_at is not None and run == f"{name}{NODES - 1}":
            continue
        assert agent.wait(timeout=240) == 0, harness.log(run if run != "replacement" else f"{name}r")[-4000:]
    return "".join(harness.log(run) for run in runs)


def test_an_fsdp2_node_lost_between_checkpoints_is_rebuilt_from_memory_bit_for_bit(harness):
    reference_log = _run(harness, "ref", None)
    assert "resumed in place" not in reference_log
    logs = _run(harness, "kill", kill_at=8)
    committed = [int(m) for m in re.findall(r"checkpoint step-(\d+) committed", logs)]
    resumed = [int(m) for m in re.findall(r"resumed in place from step (\d+) held in memory", logs)]
    assert resumed and len(set(resumed)) == 1, logs[-4000:]
    from_memory = resumed[0]
    assert from_memory > max(c for c in committed if c <= from_memory), "the memory must hold a newer step than disk"
    after = logs.split("resumed in place from step")[-1]
    assert "resumed from checkpoint" not in after, "a member loaded the checkpoint"
    assert "cannot resume in place" not in logs, logs[-4000:]
    reference = torch.load(harness.out / "ref0-final.pt")
    final = torch.load(harness.out / "kill0-final.pt")
    assert reference.keys() == final.keys()
    for name, value in reference.items():
        assert torch.equal(value, final[name]), f"{name} differs from the uninterrupted run"
