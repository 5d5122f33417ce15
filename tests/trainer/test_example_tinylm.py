"""The shipped examples really train under torchrun, their loss falls: examples/tinylm (DDP) and examples/gptlm
(FSDP2, bf16, clipping)."""

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_tinylm_loss_falls_within_a_minute_on_two_processes(harness):
    contract = {
        "training": {"globalBatchSize": 32, "microBatchSize": 8, "lr": {"base": 0.003}, "maxSteps": 80, "seed": 1},
        "checkpoint": {"path": "/unused", "intervalSteps": 40, "keep": 1},
    }
    env = harness.env(json.dumps(contract), "tinylm")
    cmd = [
        sys.executable,
        "-m",
        "disttrain.trainer.launch",
        "--standalone",
        "--nproc-per-node=2",
        "examples/tinylm/train.py",
        "--d-model",
        "32",
        "--layers",
        "1",
    ]
    rc = harness.popen(cmd, env, harness.out / "tinylm.log").wait(timeout=150)
    log = harness.log("tinylm")
    assert rc == 0, log[-3000:]
    losses = [float(x) for x in re.findall(r"\[disttrain rank 0\] INFO step \d+ loss ([\d.]+)", log)]
    assert len(losses) >= 3, log[-3000:]
    assert losses[-1] < losses[0] - 0.8, losses
    assert (harness.ckpt / "step-80" / "COMPLETE.json").is_file()


def test_the_gpt_example_trains_with_fsdp2_bf16_and_clipping_on_two_processes(harness):
    contract = {
        "training": {"globalBatchSize": 32, "microBatchSize": 8, "lr": {"base": 0.003}, "maxSteps": 60, "seed": 1},
        "checkpoint": {"path": "/unused", "intervalSteps": 30, "keep": 1},
    }
    env = harness.env(json.dumps(contract), "gptlm")
    cmd = [
        sys.executable,
        "-m",
        "disttrain.trainer.launch",
        "--standalone",
        "--nproc-per-node=2",
        "examples/gptlm/train.py",
        "--size",
        "small",
    ]
    rc = harness.popen(cmd, env, harness.out / "gptlm.log").wait(timeout=150)
    log = harness.log("gptlm")
    assert rc == 0, log[-3000:]
    assert "gptlm (small, FSDP2, bf16)" in log
    losses = [float(x) for x in re.findall(r"\[disttrain rank 0\] INFO step \d+ loss ([\d.]+)", log)]
    assert len(losses) >= 3, log[-3000:]
    assert losses[-1] < losses[0] - 0.5, losses
    assert (harness.ckpt / "step-60" / "COMPLETE.json").is_file()
