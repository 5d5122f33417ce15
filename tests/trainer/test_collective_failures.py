"""What gloo really raises in a survivor when its peer dies or hangs, and that the trainer calls it a failed
collective (exit REFORM). Guards the message matching in disttrain.trainer.failures against torch upgrades."""

import json
import os
import subprocess
import sys

import pytest
from tests.trainer.conftest import REPO, free_port

PEER = REPO / "tests" / "trainer" / "workers" / "peer_failure.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def survivor_report(how: str, collective: str) -> dict:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", OMP_NUM_THREADS="1")
    command = [sys.executable, str(PEER), how, collective]
    peer = subprocess.Popen(command, env=dict(env, RANK="1"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        survivor = subprocess.run(command, env=dict(env, RANK="0"), capture_output=True, text=True, timeout=90)
    finally:
        peer.kill()
        peer.wait()
    out, err = survivor.stdout, survivor.stderr
    assert out.strip(), err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("how", "collective"),
    [
        ("died", "all_reduce"),
        ("died", "async_all_reduce"),
        ("died", "all_gather_object"),
        ("hung", "barrier"),
    ],
)
def test_a_dead_or_hung_gloo_peer_is_a_collective_failure(how, collective):
    report = survivor_report(how, collective)
    assert report["raised"] is not None, report
    assert report["collective_failure"], report
