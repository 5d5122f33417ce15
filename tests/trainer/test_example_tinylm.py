"""The shipped examples really train under torchrun, their loss falls: examples/tinylm (DDP) and examples/gptlm
(FSDP2, bf16, clipping)."""

import json
import re
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.mark.parametrize(
    ("example", "steps", "args", "banner", "drop"),
    [
        ("tinylm", 80, ["--d-model", "32", "--layers", "1"], "", 0.8),
        ("gptlm", 60, ["--size", "small"], "gptlm (small, FSDP2, bf16)", 0.5),
    ],
)
def test_an_example_trains_on_two_processes_and_its_loss_falls(harness, example, steps, args, banner, drop):
    """Checkpoints at half the steps and at the last, keep 1: the last one stays."""
    contract = {
        "training": {"globalBatchSize": 32, "microBatchSize": 8, "lr": {"base": 0.003}, "maxSteps": steps, "seed": 1},
        "checkpoint": {"path": "/unused", "intervalSteps": steps // 2, "keep": 1},
    }
    env = harness.env(json.dumps(contract), example)
    cmd = [
        sys.executable,
        "-m",
        "disttrain.trainer.launch",
        "--standalone",
        "--nproc-per-node=2",
        f"examples/{example}/train.py",
        *args,
    ]
    rc = harness.popen(cmd, env, harness.out / f"{example}.log").wait(timeout=150)
    log = harness.log(example)
    assert rc == 0, log[-3000:]
    assert banner in log
    losses = [float(x) for x in re.findall(r"\[disttrain rank 0\] INFO step \d+ loss ([\d.]+)", log)]
    assert len(losses) >= 3, log[-3000:]
    assert losses[-1] < losses[0] - drop, losses
    assert (harness.ckpt / f"step-{steps}" / "COMPLETE.json").is_file()
