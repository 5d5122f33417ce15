"""Side effects run exactly once per committed step, and evaluations are not repeated, across a kill at every
phase of the commit (real torchrun, gloo, SIGKILL of global rank 0).

The worker (``workers/effects_worker.py``) declares the effect ``notify`` at every step and evaluates every second
step; both reach a downstream sink that refuses a key it has seen. One chain of runs, each a new torchrun (another
run id, as a recreated job has; one at another world size) resuming from the previous one's checkpoints, each
killed at another moment of a save, the last one finishing.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pytest

from disttrain.trainer.checkpoint.manager import CheckpointPhase

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

WORKER = Path(__file__).resolve().parent / "workers" / "effects_worker.py"

CHAIN = [
    # (run, workers, where rank 0 dies, at which step's save, the checkpoint the run resumed from)
    ("a", 2, CheckpointPhase.FILES_WRITTEN.value, 2, None),  # nothing committed
    ("b", 2, CheckpointPhase.BEFORE_MANIFEST.value, 4, 0),  # step-2 committed, step-4 never
    ("c", 1, CheckpointPhase.BEFORE_PUBLISH.value, 6, 2),  # another world size; COMPLETE.json never published
    ("d", 2, CheckpointPhase.PUBLISHED.value, 8, 4),  # step-8 committed, its effects not carried out
    ("e", 2, "in_handler", 10, 8),  # the sink took step 10's key, the confirmation never came
    ("f", 2, "", 12, 10),  # finishes
]


def run(harness, nproc: int, contract: str, name: str, **env: str) -> tuple[int, str]:
    cmd = [
        sys.executable,
        "-m",
        "disttrain.trainer.launch",
        f"--nproc-per-node={nproc}",
        "--standalone",
        "--max-restarts=0",
    ]
    p = harness.popen([*cmd, str(WORKER)], harness.env(contract, name, **env), harness.out / f"{name}.log")
    return p.wait(timeout=120), harness.log(name)


def lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_each_committed_step_has_its_effect_and_evaluation_exactly_once_across_kills_at_every_phase(harness):
    contract = harness.contract(global_batch=4, micro=1, max_steps=12, interval=2, keep=2)
    for name, nproc, where, step, resumed in CHAIN:
        rc, log = run(harness, nproc, contract, name, EFFECT_FAULT=f"{where}:{step}" if where else "")
        assert (rc == 0) == (not where), log[-3000:]
        assert not where or "fault injection: SIGKILL" in log, log[-3000:]
        if resumed:
            assert f"resumed from checkpoint step-{resumed}" in log, log[-3000:]
    assert "checkpoint step-8 holds 3 side effects not confirmed carried out" in harness.log("e")  # 7, 8, eval of 8

    # Downstream took one key per step, each step's exactly once; none of a step no commit covered.
    notified = lines(harness.out / "notify.sink")
    assert collections.Counter(int(k.split("/")[1]) for k in notified) == dict.fromkeys(range(1, 13), 1), notified
    run_of = {int(k.split("/")[1]): k.split("/")[0] for k in notified}
    # The key is the declaring run's: steps 7-8 were committed by run d and carried out by run e.
    assert run_of[7] == run_of[8] == run_of[5] != run_of[9], notified
    assert len({run_of[s] for s in (2, 4, 6, 10, 12)}) == 5, notified
    # Only the kill between the handler and its confirmation offered a key again, and the sink refused it.
    assert lines(harness.out / "notify.refused") == [notified[9]]
    confirmations = harness.ckpt / "effects"
    assert sorted(p.name for p in confirmations.glob("*-notify.json")) == sorted(
        f"{s}-notify.json" for s in range(1, 13)
    )
    assert json.loads((confirmations / "10-notify.json").read_text())["key"] == notified[9]

    # Every evaluated step's result reached the sink once; a step was evaluated again only when no commit had kept
    # its result (2, 4 and 6 were redone), never after resuming from the checkpoint of an evaluated step (8, 10).
    assert [int(k.split("/")[1]) for k in lines(harness.out / "eval.sink")] == [2, 4, 6, 8, 10, 12]
    assert not lines(harness.out / "eval.refused")
    evals = [line.split() for line in (harness.out / "evals.log").read_text().splitlines()]
    runs = {s: len({pid for step, pid in evals if int(step) == s}) for s in range(2, 13, 2)}
    assert runs == {2: 2, 4: 2, 6: 2, 8: 1, 10: 1, 12: 1}, evals
