"""Two torchrun agents (nodes) on localhost, c10d rendezvous on a store hosted by a separate process; one node's
whole process tree is SIGKILLed mid-training; the survivor re-forms alone and continues from the last COMPLETE
checkpoint, resharded to world size 1."""

import re

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def torchrun_args(port: int) -> list[str]:
    conf = "is_host=false,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=60"
    return [
        "--nnodes=1:2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=toy",
        f"--rdzv-conf={conf}",
        "--max-restarts=3",
        "--monitor-interval=0.2",
    ]


@pytest.mark.parametrize("victim_rank", [0, 1], ids=["kill-rank0-node", "kill-rank1-node"])
def test_survivor_reforms_alone_and_continues_from_the_last_complete_checkpoint(harness, victim_rank):
    port = harness.start_store()
    contract = harness.contract(global_batch=4, micro=1, max_steps=24, interval=3, timeout=10)
    extra = {"TOY_STEP_SLEEP": "0.1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    agents = {run: harness.start(1, contract, run, torchrun_args=torchrun_args(port), **extra) for run in ("a", "b")}

    def world_two_steps() -> list[int]:
        return [r["step"] for r in harness.records("a") + harness.records("b") if r["world"] == 2]

    # Run at world size 2 long enough to commit a checkpoint there (interval 3) even if one agent came late.
    harness.wait_until("a world of 2", lambda: bool(world_two_steps()), timeout=90)
    first_two = min(world_two_steps())
    harness.wait_until("steps at world 2", lambda: max(world_two_steps()) >= first_two + 4, timeout=60)
    victim = next(
        run for run in ("a", "b") if any(r["rank"] == victim_rank and r["world"] == 2 for r in harness.records(run))
    )
    survivor = "b" if victim == "a" else "a"
    harness.kill_tree(agents[victim].pid)
    agents[victim].wait(timeout=10)
    committed_before = max(
        int(m) for m in re.findall(r"checkpoint step-(\d+) committed", harness.log("a") + harness.log("b"))
    )

    assert agents[survivor].wait(timeout=150) == 0, harness.log(survivor)[-4000:]
    log = harness.log(survivor)
    resumed = re.search(r"resumed from checkpoint step-(\d+) \(saved at world size 2\) at world size 1", log)
    assert resumed, log[-4000:]
    assert int(resumed.group(1)) == committed_before
    after = [r for r in harness.records(survivor) if r["world"] == 1]
    assert sorted(r["step"] for r in after) == list(range(committed_before + 1, 25))
