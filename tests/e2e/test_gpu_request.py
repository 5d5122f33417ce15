"""A job that requests GPUs on a machine without CUDA: ``disttrain local run`` refuses it at once, saying why and
what to do; ``--device cpu`` makes it a CPU job that really trains."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
import yaml

from tests.conftest import REPO_ROOT
from tests.e2e.conftest import e2e_job

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"),
    pytest.mark.timeout(300),
]
CLI = [sys.executable, "-m", "disttrain.operator.cli"]


def _local_run(*args: str, timeout: float) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    done = subprocess.run(
        [*CLI, "local", "run", *args], capture_output=True, text=True, cwd=REPO_ROOT, timeout=timeout, check=False
    )
    return done, time.monotonic() - start


def test_a_gpu_job_is_refused_at_once_naming_the_request_what_torch_found_and_the_way_out(tmp_path):
    state = tmp_path / "state"
    done, seconds = _local_run(
        "examples/jobs/gpu-finetune.yaml", "--nodes", "2", "--state-dir", str(state), "--plain", timeout=120
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "requests 8 GPU(s) per node (spec.template.spec.containers[trainer].resources" in done.stderr
    assert f"torch {torch.__version__} (built for CPU only) sees 0 CUDA device(s)" in done.stderr
    assert "--device cpu" in done.stderr and "nothing was started." in done.stderr
    assert not state.exists()  # no node, no agent, no state
    assert seconds < 90, f"the refusal took {seconds:.0f} s (starting the nodes first took 140 s to step 1)"


@pytest.mark.slow
def test_device_cpu_drops_the_gpu_request_and_trains_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    builder = e2e_job("gpu-on-cpu", out, replicas=1, max_steps=3)
    builder.obj["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(builder.build()))
    state = tmp_path / "state"
    done, _ = _local_run(
        str(manifest), "--device", "cpu", "--state-dir", str(state), "--plain", "--timeout", "240", timeout=280
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "request of 1 GPU(s) is dropped; training on the CPU" in done.stdout
    steps = sorted(json.loads(line)["step"] for path in out.glob("*.jsonl") for line in path.read_text().splitlines())
    assert steps == [1, 2, 3]
    job = json.loads((state / "job.json").read_text())
    trainer = job["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in trainer["resources"]["limits"]
    assert {"name": "CUDA_VISIBLE_DEVICES", "value": ""} in trainer["env"]
