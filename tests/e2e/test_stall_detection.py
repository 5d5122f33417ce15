"""A stalled step is found, its lagging node named, dumped, evicted, and the group re-forms without it.

Local mode, 2 nodes x 1 process: at step 7 the ranks of node 1 sleep before their step's gradient reduction (as a rank
stuck in its forward, or a slow machine, would). Their peers wait in the all-reduce; the job agent sees the beacons
disagree for longer than ``stallMinSeconds`` (steps take ~0.3 s, so the floor rules), asks every rank for its stacks,
and reports the node; the operator evicts it under StepStalled, long before the 20 s collective timeout, and the job
finishes with one restart.
"""

from __future__ import annotations

import re

import pytest

from tests.e2e.conftest import e2e_job, run_job

pytestmark = [pytest.mark.slow]

STALL_STEP = 7
COLLECTIVE_TIMEOUT_S = 20


@pytest.mark.timeout(180)
def test_a_stalled_node_is_named_dumped_and_evicted_and_the_job_finishes(tmp_path):
    seen: dict[str, object] = {}

    def on_tick(runtime, snapshot):
        stalled = snapshot.status.get("stalledNodes") or []
        if stalled and "stalled" not in seen:
            seen["stalled"] = stalled

    builder = (
        e2e_job(
            "stall",
            tmp_path / "records",
            replicas=2,
            max_steps=12,
            step_sleep=0.3,  # the agent reads the beacons about once a second: a few reads before the stall
            extra_env={"E2E_STALL_STEP": str(STALL_STEP), "E2E_STALL_NODE": "stall-worker-1"},
        )
        .set("spec.elastic.stallFactor", 5)
        .set("spec.elastic.stallMinSeconds", 3)
        .set("spec.elastic.collectiveTimeoutSeconds", COLLECTIVE_TIMEOUT_S)
    )
    run = run_job(tmp_path, builder, on_tick=on_tick, timeout_s=150)
    assert run.summary.succeeded, run.reasons()
    [entry] = seen["stalled"]
    assert (entry["node"], entry["ranks"], entry["step"]) == ("stall-worker-1", [1], STALL_STEP)
    assert 3 <= entry["waitedSeconds"] < COLLECTIVE_TIMEOUT_S
    [message] = [e["message"] for e in run.events if e["reason"] == "StepStalled"]
    assert "node stall-worker-1" in message and f"step {STALL_STEP}" in message and "rank(s) 1" in message
    assert run.summary.restarts_by_reason == {"StepStalled": 1}
    dumps = run.state.checkpoints_dir / "diagnostics"
    assert f"stacks in {dumps}/stall-worker-1/stall-{STALL_STEP}-rank*" in message, (
        "the Event names this machine's path"
    )
    stacks = dumps / "stall-worker-1" / f"stall-{STALL_STEP}-rank1.stacks.txt"
    assert stacks.exists(), sorted(str(p.relative_to(dumps)) for p in dumps.rglob("*"))
    assert "recorder.py" in stacks.read_text(), "the lagging rank's stack shows where it sleeps"
    assert (dumps / "stall-worker-0" / f"stall-{STALL_STEP}-rank0.stacks.txt").exists(), "its peers dump too"
    steps = run.final_trajectory()
    assert sorted(steps) == list(range(1, 13)), "every step counted once, the stalled one redone without node 1"
    assert not [r for r in steps[STALL_STEP] if re.fullmatch(r"stall-worker-1-\d+", r["process"])], (
        "the stalled step counted in a group without the evicted pod"
    )
