"""In-place reforms under the worker pod's launcher: real torchrun agents on localhost, gloo, a node's whole process
tree SIGKILLed mid-training. The survivors keep their worker processes, re-join the next round and continue from the
step they hold in memory (newer than any checkpoint), with every local worker of a node handed its round."""

from __future__ import annotations

import re

import pytest

from disttrain.trainer.sampler import GlobalSampler

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LAUNCHER = "disttrain.trainer.launch"


def launcher_args(port: int, nodes: int) -> list[str]:
    """``last_call_timeout`` 30 s: the first round waits that long for a node started late on a loaded machine (at
    1 s the others completed it without that node, trained to the end at the smaller size, and the test waited for a
    whole world in vain); a round with every node completes at once. ``join_timeout`` leaves a round that completes
    below the maximum (a survivor alone: the last call, after the lost nodes' keep-alives expire) room on a loaded
    machine: at 60 s such a join timed out behind the 30 s last call."""
    conf = "is_host=false,last_call_timeout=30,keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=180"
    return [
        f"--nnodes=1:{nodes}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=toy",
        f"--rdzv-conf={conf}",
        "--max-restarts=100",
        "--monitor-interval=0.1",
    ]


@pytest.mark.parametrize(("nodes", "nproc"), [(3, 1), (2, 2)], ids=["3x1-kill-one", "2x2-kill-one"])
def test_survivors_keep_their_processes_and_continue_from_memory_not_from_the_checkpoint(harness, nodes, nproc):
    port = harness.start_store()
    steps = 30
    contract = harness.contract(global_batch=12, micro=1, max_steps=steps, interval=5, timeout=10, reform_in_place=True)
    extra = {"TOY_STEP_SLEEP": "0.15", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    runs = [chr(ord("a") + i) for i in range(nodes)]
    agents = {
        run: harness.start(nproc, contract, run, torchrun_args=launcher_args(port, nodes), launcher=LAUNCHER, **extra)
        for run in runs
    }
    world = nodes * nproc

    def full_world_steps() -> list[int]:
        return [r["step"] for run in runs for r in harness.records(run) if r["world"] == world]

    try:
        harness.wait_until("the whole world trains", lambda: bool(full_world_steps()), timeout=120)
    except AssertionError as exc:  # a rare CI failure: what each node said, to find out why
        tails = "\n".join(f"--- node {run}:\n{harness.log(run)[-2500:]}" for run in runs)
        raise AssertionError(f"{exc}\n{tails}") from None
    first = min(full_world_steps())
    # Past a checkpoint (every 5 steps) and a few steps more, so the survivors hold a newer step than the disk.
    harness.wait_until("steps at the whole world", lambda: max(full_world_steps()) >= first + 8, timeout=90)
    victim, survivors = runs[-1], runs[:-1]
    pids_before = {run: {path.name for path in harness.out.glob(f"{run}-*.jsonl")} for run in survivors}
    assert all(len(pids) == nproc for pids in pids_before.values()), pids_before
    harness.kill_tree(agents[victim].pid)
    agents[victim].wait(timeout=10)

    for run in survivors:
        assert agents[run].wait(timeout=200) == 0, harness.log(run)[-4000:]
    logs = "".join(harness.log(run) for run in survivors)
    committed = [int(m) for m in re.findall(r"checkpoint step-(\d+) committed", logs)]
    resumed = [int(m) for m in re.findall(r"resumed in place from step (\d+) held in memory", logs)]
    assert resumed and len(set(resumed)) == 1, logs[-4000:]
    from_memory = resumed[0]
    before_kill = [c for c in committed if c <= from_memory]
    assert from_memory > max(before_kill), f"resumed from step {from_memory}, the disk held {max(before_kill)}"
    assert "resumed from checkpoint" not in logs.split("re-forming in place")[-1], "a survivor loaded the disk"

    # The same worker processes, before and after: one records file each, no new one.
    for run in survivors:
        assert {path.name for path in harness.out.glob(f"{run}-*.jsonl")} == pids_before[run]
    # Every step after the reform ran once, at the survivors' world size, from the step after the one in memory.
    after = [r for run in survivors for r in harness.records(run) if r["world"] == world - nproc]
    ranks = (nodes - 1) * nproc
    by_step: dict[int, int] = {}
    for record in after:
        by_step[record["step"]] = by_step.get(record["step"], 0) + 1
    assert sorted(by_step) == list(range(from_memory + 1, steps + 1)), f"{sorted(by_step)}\n{logs[-6000:]}"
    assert set(by_step.values()) == {ranks}
    # Nothing replayed or skipped: each step's samples, over all its ranks, are exactly the global sampler's.
    final: dict[int, list[int]] = {}
    for record in [r for run in runs for r in harness.records(run)]:
        kept = (record["step"] <= from_memory and record["world"] == world) or record["world"] == world - nproc
        if kept:
            final.setdefault(record["step"], []).extend(record["indices"])
    sampler = GlobalSampler(97, 3)  # the toy dataset and the contract's seed
    assert sorted(final) == list(range(1, steps + 1))
    for step, indices in final.items():
        assert sorted(indices) == sorted(sampler.indices(list(range(12 * (step - 1), 12 * step)))), step
