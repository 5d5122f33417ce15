"""The worker pod's readiness port: closed until the node's workers can start warm, then open for good."""

from __future__ import annotations

import socket
import sys
import threading
import time

import pytest

from disttrain.api import env
from disttrain.common.ports import free_port
from disttrain.trainer.launch.readiness import Readiness, ready_port
from disttrain.trainer.launch.warmstart import WarmPool

pytestmark = pytest.mark.timeout(120)


def accepts(port: int, timeout: float = 1.0) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=timeout).close()
        return True
    except OSError:
        return False


def eventually(check, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_the_port_opens_only_once_the_condition_holds_and_answers_every_probe() -> None:
    warm = threading.Event()
    readiness = Readiness(free_port())
    try:
        readiness.arm(warm.is_set)
        readiness.arm(lambda: True)  # armed once: a second call changes nothing
        time.sleep(0.3)
        assert not accepts(readiness.port)
        warm.set()
        assert readiness.listening.wait(10)
        # A kubelet probes every second for the pod's whole life: far more connections than a listen backlog.
        assert all(accepts(readiness.port, timeout=10) for _ in range(300))  # (a dropped SYN is retried after 1 s)
        warm.clear()
        assert accepts(readiness.port, timeout=10), "once ready, the pod stays ready"
    finally:
        readiness.close()


def test_no_port_in_the_environment_means_no_readiness_port() -> None:
    assert ready_port({}) == 0
    assert ready_port({env.READY_PORT: "9399"}) == 9399
    assert ready_port({env.READY_PORT: "ninety"}) == 0
    readiness = Readiness(0)
    readiness.arm(lambda: True)
    assert not readiness.listening.wait(0.3)


def test_a_pool_is_warm_once_its_interpreters_imported_torch(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('worker')\n")
    pool = WarmPool()
    try:
        assert pool.is_warm()  # empty: nothing to wait for (the workers took them, or none can be warm)
        pool.fill(1, [sys.executable, "-u", str(script)], idle=True)
        assert pool.is_warm()  # an idle refill while training runs never makes a pod unready
        pool.close()
        pool.fill(1, [sys.executable, "-u", str(script)])
        assert not pool.is_warm()  # importing torch takes far longer than this line
        eventually(pool.is_warm)
    finally:
        pool.close()
