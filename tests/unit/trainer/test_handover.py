"""The launcher's handover channel: a waiting worker process is handed the next round instead of being replaced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from disttrain.api import env as env_names
from disttrain.trainer.inplace import NO_STATE, Holding, choose_source
from disttrain.trainer.launch.handover import Broker, WorkerLink

WORKER = textwrap.dedent(
    """
    import json, os, sys
    from disttrain.trainer.launch.handover import WorkerLink
    link = WorkerLink.connect()
    assert link is not None
    env = link.request_round(int(sys.argv[1]), timeout_s=30)
    print(json.dumps(env), flush=True)
    """
)


def _wait(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _worker(broker: Broker, local_rank: int, step: int) -> subprocess.Popen[bytes]:
    environ = {**os.environ, env_names.LAUNCHER_SOCKET: broker.name, "LOCAL_RANK": str(local_rank)}
    return subprocess.Popen([sys.executable, "-c", WORKER, str(step)], env=environ, stdout=subprocess.PIPE)


def test_a_waiting_worker_takes_the_next_round_and_keeps_its_process() -> None:
    broker = Broker.listen()
    assert broker is not None and broker.name.startswith("@")  # abstract: no file on a read-only root
    try:
        proc = _worker(broker, local_rank=1, step=41)
        _wait(lambda: broker.is_waiting(proc.pid))
        assert broker.all_waiting({1: proc.pid})
        assert not broker.all_waiting({0: proc.pid + 100000, 1: proc.pid})  # one worker of the node still trains
        broker.detach(1, proc)
        assert broker.take({"LOCAL_RANK": "0", "RANK": "5"}) is None  # no waiting worker of local rank 0
        taken = broker.take({"LOCAL_RANK": "1", "RANK": "7", "WORLD_SIZE": "9"})
        assert taken is proc  # torchrun keeps this very Popen: pid, exit code, signals
        out, _ = proc.communicate(timeout=30)
        assert json.loads(out) == {"LOCAL_RANK": "1", "RANK": "7", "WORLD_SIZE": "9"}
        assert proc.returncode == 0
    finally:
        broker.close()


def test_a_worker_no_round_came_for_is_told_so_and_ended() -> None:
    broker = Broker.listen()
    assert broker is not None
    try:
        proc = _worker(broker, local_rank=0, step=3)
        _wait(lambda: broker.is_waiting(proc.pid))
        broker.detach(0, proc)
        broker.release("the node left the job")
        out, _ = proc.communicate(timeout=30)
        assert json.loads(out) is None and proc.returncode == 0  # request_round answered None
    finally:
        broker.close()


def test_a_closed_launcher_ends_the_wait() -> None:
    broker = Broker.listen()
    assert broker is not None
    proc = _worker(broker, local_rank=0, step=3)
    _wait(lambda: broker.is_waiting(proc.pid))
    broker.close()
    out, _ = proc.communicate(timeout=30)
    assert json.loads(out) is None


SIGTERMED_WORKER = textwrap.dedent(
    """
    import json, signal, sys
    from disttrain.trainer.launch.handover import WorkerLink

    def drain(signum, frame):  # as the trainer's: a drain at the next step boundary, which a waiting worker never has
        pass

    signal.signal(signal.SIGTERM, drain)
    link = WorkerLink.connect()
    assert link is not None
    env = link.request_round(3, timeout_s=120)
    print(json.dumps({"env": env, "handler_back": signal.getsignal(signal.SIGTERM) is drain}), flush=True)
    """
)


def test_sigterm_ends_a_workers_wait_for_the_next_round_at_once() -> None:
    """torchrun stops a node's workers with SIGTERM, then SIGKILL 30 s later: a waiting worker must not need the
    SIGKILL."""
    broker = Broker.listen()
    assert broker is not None
    try:
        environ = {**os.environ, env_names.LAUNCHER_SOCKET: broker.name, "LOCAL_RANK": "0"}
        proc = subprocess.Popen([sys.executable, "-c", SIGTERMED_WORKER], env=environ, stdout=subprocess.PIPE)
        _wait(lambda: broker.is_waiting(proc.pid))
        proc.terminate()
        out, _ = proc.communicate(timeout=20)  # well before the 120 s the wait would take
        assert json.loads(out) == {"env": None, "handler_back": True}
        assert proc.returncode == 0
    finally:
        broker.close()


def test_without_a_launcher_socket_there_is_no_link() -> None:
    assert WorkerLink.connect({}) is None
    assert WorkerLink.connect({env_names.LAUNCHER_SOCKET: "@disttrain-handover-nobody-listens"}) is None


@pytest.mark.parametrize(
    ("holdings", "source"),
    [
        ([Holding(NO_STATE, NO_STATE)] * 3, None),  # a fresh job: nothing to take
        ([Holding(NO_STATE, 40)] * 2, None),  # all fresh: the checkpoint
        ([Holding(57, 40), Holding(57, 40), Holding(NO_STATE, 40)], 0),  # survivors ahead of the checkpoint
        ([Holding(NO_STATE, 40), Holding(56, 40), Holding(57, 40)], 2),  # the newest step wins, not the lowest rank
        ([Holding(40, 40), Holding(NO_STATE, 40)], 0),  # as new as the checkpoint: memory is as good
        ([Holding(30, 40), Holding(NO_STATE, 40)], None),  # behind a committed checkpoint: never roll back
    ],
)
def test_the_group_takes_the_newest_state_never_older_than_the_checkpoint(holdings, source) -> None:
    assert choose_source(holdings) == source
