"""A worker whose contract requests GPUs and that finds no CUDA device exits PERMANENT at once, never trains on the
CPU: the real trainer under torchrun, on this CPU machine."""

import json

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"),
    pytest.mark.timeout(180),
]


def test_device_auto_with_a_gpu_request_and_no_cuda_exits_permanent_before_the_first_step(harness):
    contract = json.loads(harness.contract(global_batch=4, micro=1, max_steps=2))
    contract["gpus_per_node"] = 8
    rc, log = harness.run(1, json.dumps(contract), "gpus")
    harness.assert_exited(rc, log, 85)  # PERMANENT: the operator fails the job at once
    assert "the trainer container requests 8 GPU(s) per node" in log
    assert f"torch {torch.__version__} (built for CPU only) sees 0 CUDA device(s)" in log
    assert harness.records("gpus") == []  # not one step on the CPU
