"""The loss in rank 0's log and progress record is the step's global, token-weighted loss, with unequal token counts
and padding per rank, before and after a world-size change (2 -> 3 processes).

It runs under torchrun itself (``torch.distributed.run``), where the other scenarios use the worker pod's launcher:
the trainer library needs nothing of the disttrain launcher."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from disttrain.api import control

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "trainer" / "workers" / "global_loss.py"

pytestmark = [pytest.mark.trainer, pytest.mark.timeout(180)]


def _train(harness, nproc: int, max_steps: int, run: str, port: int) -> str:
    contract = harness.contract(global_batch=12, micro=2, max_steps=max_steps, interval=2)
    env = harness.env(contract, run, DISTTRAIN_AGENT_ENDPOINT=f"127.0.0.1:{port}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(WORKER)]
    rc = harness.popen(cmd, env, harness.out / f"{run}.log").wait(timeout=150)
    log = harness.log(run)
    assert rc == 0, log[-3000:]
    return log


def _logged(log: str) -> dict[int, tuple[str, int]]:
    """Rank 0's ``step N loss X ... world W`` lines: step -> (loss as printed, world size)."""
    lines = re.findall(r"\[disttrain rank 0\] INFO step (\d+) loss (\S+) lr \S+ world (\d+)", log)
    return {int(step): (loss, int(world)) for step, loss, world in lines}


def test_the_reported_loss_is_the_global_token_weighted_one_across_a_world_size_change(harness):
    port = harness.start_store()
    store = harness.client(port)

    log = _train(harness, 2, 4, "w2", port)
    # 100 tokens at loss 1 on rank 0, 10 at loss 3 on rank 1 (3 micro batches each, padded): 130/110, not 2 or 1.
    assert _logged(log) == dict.fromkeys(range(1, 5), ("1.1818", 2)), log[-3000:]
    progress = control.ProgressReport.model_validate_json(store.get(control.PROGRESS_KEY))
    assert (progress.step, progress.world_size, progress.loss) == (4, 2, 130 / 110)

    log = _train(harness, 3, 6, "w3", port)  # resumes the step-4 checkpoint with a third rank (40 tokens at loss 2)
    assert _logged(log) == dict.fromkeys((5, 6), ("1.4000", 3)), log[-3000:]
    progress = control.ProgressReport.model_validate_json(store.get(control.PROGRESS_KEY))
    assert (progress.step, progress.world_size, progress.resumed_from_step, progress.loss) == (6, 3, 4, 210 / 150)
