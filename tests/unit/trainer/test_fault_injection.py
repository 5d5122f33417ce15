"""The fault hook that makes a CPU survivor die as NCCL's watchdog kills a GPU one (SIGABRT on a failed collective)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from disttrain.trainer.failures import FAULT_ABORT_ON_COLLECTIVE_FAILURE

pytestmark = pytest.mark.timeout(60)

PROGRAM = """
from disttrain.trainer.failures import is_collective_failure
print(is_collective_failure(ValueError("a bug")), flush=True)
is_collective_failure(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:20866"))
print("survived", flush=True)
"""


def run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROGRAM], env={**os.environ, **env}, capture_output=True, text=True, timeout=50
    )


def test_with_the_hook_set_a_failed_collective_aborts_the_process_and_a_bug_does_not():
    done = run({FAULT_ABORT_ON_COLLECTIVE_FAILURE: "1"})
    assert done.returncode == -signal.SIGABRT, done.stderr
    assert done.stdout.split() == ["False"]


def test_without_the_hook_a_failed_collective_is_only_classified():
    done = run({FAULT_ABORT_ON_COLLECTIVE_FAILURE: ""})
    assert done.returncode == 0 and done.stdout.split() == ["False", "survived"], done.stderr
