"""Leaving a group in an in-place reform: abort where a communicator may be dead, destroy gloo, never hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from disttrain.api.exitcodes import ExitCode
from disttrain.common.ports import free_port
from disttrain.trainer import inplace, teardown
from disttrain.trainer.launch import ncclenv


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        ("gloo", teardown.Teardown.DESTROY),
        ("cpu:gloo", teardown.Teardown.DESTROY),
        ("nccl", teardown.Teardown.ABORT),
        ("cpu:gloo,cuda:nccl", teardown.Teardown.ABORT),
        ("cuda:nccl,cpu:gloo", teardown.Teardown.ABORT),
        ("cpu:gloo,xpu:xccl", teardown.Teardown.ABORT),
    ],
    ids=["gloo", "gloo-by-device", "nccl", "gloo-and-nccl", "nccl-first", "another-accelerator"],
)
def test_the_teardown_is_chosen_by_backend_name(backend: str, expected: teardown.Teardown):
    assert teardown.choose(backend) is expected


def test_a_teardown_that_returns_in_time_returns():
    ran = threading.Event()
    teardown.run_with_deadline(ran.set, deadline_s=5.0, what="test")
    assert ran.is_set()


def test_a_teardown_error_reaches_the_caller():
    def failing() -> None:
        raise RuntimeError("Invalid process group specified")

    with pytest.raises(RuntimeError, match="Invalid process group"):
        teardown.run_with_deadline(failing, deadline_s=5.0, what="test")


def test_a_teardown_that_blocks_ends_the_process_with_reform():
    script = textwrap.dedent(
        """
        import logging, threading
        from disttrain.trainer import teardown

        logging.basicConfig(level=logging.INFO)
        never = threading.Event()
        teardown.run_with_deadline(never.wait, deadline_s=0.5, what="abort, backend nccl")
        print("returned")
        """
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == int(ExitCode.REFORM), done.stderr
    assert "returned" not in done.stdout
    assert "did not finish within 0.5 s" in done.stderr
    assert "abort, backend nccl" in done.stderr
    assert time.monotonic() - started < 60


def test_a_hang_that_holds_the_gil_is_ended_by_the_guard_with_every_threads_stack():
    """A Python deadline cannot fire while a C call holds the GIL; the guard's C timer still does, says where."""
    script = textwrap.dedent(
        """
        import re
        from disttrain.trainer import teardown

        def leaving():
            re.fullmatch(r"(a+)+$", "a" * 64 + "b")  # catastrophic backtracking: minutes, GIL held throughout

        with teardown.hang_guard(1.0, "leaving the group"):
            leaving()
        print("returned")
        """
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "returned" not in done.stdout
    assert "Timeout" in done.stderr and "in leaving" in done.stderr, done.stderr
    assert time.monotonic() - started < 60


def test_a_worker_the_guard_ended_counts_as_a_reform_not_as_the_users_failure(tmp_path):
    """The guard can only exit 1; the launcher reads that exit, with the leaving mark, as a reform."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from disttrain.trainer.launch import launcher, leaving

    script = textwrap.dedent(
        """
        import re
        from disttrain.trainer import teardown

        with teardown.hang_guard(1.0, "leaving the group"):
            re.fullmatch(r"(a+)+$", "a" * 64 + "b")
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.DEVNULL)
    assert child.wait(timeout=120) == 1
    try:
        error_file = str(tmp_path / "error.json")
        assert not launcher.is_user_failure(ProcessFailure(0, child.pid, 1, error_file))
        assert launcher.is_user_failure(ProcessFailure(0, child.pid + 1_000_000, 1, error_file))
        # torchrun then stops the sibling, which waited for the next round: SIGTERM, and SIGKILL 30 s later
        guarded = ProcessFailure(0, child.pid, 1, error_file)
        escalated = ProcessFailure(1, child.pid + 1_000_000, -signal.SIGKILL, error_file)
        assert launcher.user_failures({0: guarded, 1: escalated}) == {}
        killed_alone = launcher.user_failures({1: escalated})  # the kernel's OOM killer, say: the user's
        assert killed_alone == {1: escalated}
    finally:
        leaving.marker(child.pid).unlink(missing_ok=True)


def test_a_guarded_section_that_ends_leaves_no_mark():
    from disttrain.trainer.launch import leaving

    with teardown.hang_guard(30.0, "leaving the group"):
        assert leaving.marker(os.getpid()).exists()
    assert not leaving.marker(os.getpid()).exists()


def test_a_guarded_section_that_ends_in_time_cancels_the_guard():
    script = textwrap.dedent(
        """
        import time
        from disttrain.trainer import teardown

        with teardown.hang_guard(1.0, "leaving the group"):
            pass
        time.sleep(2.0)
        print("returned")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "returned" in done.stdout, done.stderr


def test_the_deadline_leaves_time_within_the_launchers_reform_margin():
    assert teardown.LEAVE_DEADLINE_S < ncclenv.REFORM_MARGIN_S


@pytest.mark.parametrize("how", list(teardown.Teardown), ids=lambda t: t.value)
def test_a_left_gloo_group_can_be_joined_again(how: teardown.Teardown):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    dist.new_group(backend="gloo")
    teardown.run_with_deadline(teardown.for_backend(how), deadline_s=30.0, what="test")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 1.0
    finally:
        dist.destroy_process_group()


def test_leave_groups_without_a_group_does_nothing():
    inplace.leave_groups(deadline_s=5.0)
    assert not dist.is_initialized()
