"""When the fork server may fork a local pod, and when the pod must start cold (pure rules, no process started)."""

from __future__ import annotations

import json
import sys

import pytest
from tests.trainer.conftest import make_contract

from disttrain.api import env as env_names
from disttrain.operator.local.forkserver import enabled, server_key
from disttrain.trainer.launch.forkserver import import_environment, pod_refusal

PY = sys.executable
LAUNCHER = [PY, "-m", "disttrain.trainer.launch", "--nnodes=1:3", "--nproc-per-node=2", "--no-python", PY, "t.py"]
BASE = {"PATH": "/usr/bin", "HOME": "/root", "E2E_VALUE": "1"}


def _refusal(argv: list[str], environ: dict[str, str], *, imported: dict[str, str], flags: tuple[str, ...] = ()):
    return pod_refusal({"argv": argv, "env": environ}, flags, imported)


def test_the_launcher_imports_torch_with_one_thread_per_worker_when_it_runs_several():
    assert import_environment(LAUNCHER[1:], BASE)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in import_environment([*LAUNCHER[1:3], "--nproc-per-node=1"], BASE)
    assert import_environment(LAUNCHER[1:], {**BASE, "OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"
    assert "OMP_NUM_THREADS" not in import_environment(["-m", "disttrain.trainer.agent"], BASE)


def test_pods_that_differ_only_in_disttrain_variables_are_forked():
    imported = import_environment(LAUNCHER[1:], {**BASE, "DISTTRAIN_NODE_INDEX": "0"})
    pod = {**BASE, "DISTTRAIN_NODE_INDEX": "2", env_names.LOCAL_MARKER: "job/pod", "DISTTRAIN_METRICS_PORT": "9"}
    assert _refusal(LAUNCHER, pod, imported=imported) is None


@pytest.mark.parametrize(
    "change, why",
    [
        ({"TORCH_LOGS": "+dynamo"}, "TORCH_LOGS"),
        ({"E2E_VALUE": "2"}, "E2E_VALUE"),
        ({"OMP_NUM_THREADS": "2"}, "OMP_NUM_THREADS"),
        ({env_names.LOCAL_MARKER: "x" * (env_names.LOCAL_MARKER_ROOM + 1)}, "marker is longer"),
    ],
)
def test_a_pod_whose_import_would_differ_starts_cold(change: dict[str, str], why: str):
    imported = import_environment(LAUNCHER[1:], BASE)
    refusal = _refusal(LAUNCHER, {**BASE, **change}, imported=imported)
    assert refusal is not None and why in refusal


def test_debug_mode_and_other_interpreters_or_options_start_cold():
    imported = import_environment(LAUNCHER[1:], BASE)
    contract = json.dumps({**json.loads(make_contract()), "debug": {"distributed": "DETAIL"}})
    refusal = _refusal(LAUNCHER, {**BASE, env_names.CONTRACT: contract}, imported=imported)
    assert refusal is not None and "debug mode" in refusal
    assert "not this interpreter" in _refusal(["/bin/sh", "-c", "true"], BASE, imported=imported)
    assert "not this interpreter" in _refusal([PY, "-c", "print(1)"], BASE, imported=imported)
    assert "options" in _refusal([PY, "-u", *LAUNCHER[1:]], BASE, imported=imported)
    assert _refusal([PY, "-u", *LAUNCHER[1:]], BASE, imported=imported, flags=("-u",)) is None


def test_one_server_serves_every_node_of_a_job_and_another_kind_of_pod_gets_its_own():
    node = server_key(LAUNCHER, {**BASE, "DISTTRAIN_NODE_INDEX": "0"})
    assert node is not None
    assert server_key(LAUNCHER, {**BASE, "DISTTRAIN_NODE_INDEX": "1"}) == node
    assert server_key([PY, "-m", "disttrain.trainer.agent"], BASE) not in (None, node)
    assert server_key(LAUNCHER, {**BASE, "E2E_VALUE": "2"}) != node
    assert server_key([PY, "-u", *LAUNCHER[1:]], BASE) != node
    assert server_key(["/bin/sh", "-c", "true"], BASE) is None
    assert server_key([PY, "-c", "print(1)"], BASE) is None


def test_local_pods_are_forked_unless_cold_starts_are_asked_for():
    assert enabled({})
    assert not enabled({env_names.LOCAL_FORK: "0"})
    assert enabled({env_names.LOCAL_FORK: "1"})
