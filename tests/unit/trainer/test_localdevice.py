"""A worker whose LOCAL_RANK has no GPU of its own among those it sees is a PERMANENT error that names the numbers,
not CUDA's "invalid device ordinal" and exit 1 (which the launcher would retry forever)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from disttrain.api import env as env_names
from disttrain.api.exitcodes import ExitCode
from disttrain.trainer import localdevice


@pytest.mark.parametrize("local_rank,count", [(0, 1), (3, 4), (7, 8)])
def test_a_local_rank_within_the_visible_devices_is_fine(local_rank, count):
    assert localdevice.missing_device_message(local_rank, count, None) is None


def test_a_local_rank_beyond_the_visible_devices_names_the_rank_the_devices_and_the_mask():
    message = localdevice.missing_device_message(2, 2, "4,5")
    assert message is not None
    assert "LOCAL_RANK 2" in message
    assert "sees 2 CUDA device(s)" in message
    assert "CUDA_VISIBLE_DEVICES '4,5'" in message
    assert "spec.nprocPerNode" in message


def test_no_device_at_all_and_an_unset_mask_say_so():
    message = localdevice.missing_device_message(0, 0, None)
    assert message is not None and "sees no CUDA device" in message and "unset" in message


CONTRACT = (
    '{"training": {"globalBatchSize": 4, "microBatchSize": 1, "lr": {"base": 0.1}, "maxSteps": 2},'
    ' "checkpoint": {"path": "/tmp/unused"}}'
)
JOIN_ON_CUDA = """
from disttrain.trainer import context
context.init_process_group(context.ElasticContext.from_env(), use_cuda=True)
print("joined")
"""


def test_joining_on_cuda_without_a_device_for_the_local_rank_exits_permanent_before_set_device(tmp_path):
    """On this CPU-only machine torch sees no CUDA device, so any LOCAL_RANK is beyond them: the worker must end
    with PERMANENT and the message, never reach ``torch.cuda.set_device``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DISTTRAIN_") and k != "TORCHELASTIC_ERROR_FILE"}
    environ.update({env_names.CONTRACT: CONTRACT, "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0"})
    done = subprocess.run(
        [sys.executable, "-c", JOIN_ON_CUDA], env=environ, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == int(ExitCode.PERMANENT), done.stderr
    assert "joined" not in done.stdout
    assert "LOCAL_RANK 1 has no GPU" in done.stderr
    assert "invalid device ordinal" not in done.stderr
