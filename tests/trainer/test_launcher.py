"""The worker launcher (``python -m disttrain.trainer.launch``): real torchrun, real worker exits.

torchrun alone, with the huge ``--max-restarts`` the operator passes, restarts a failing worker forever and exits 1
when it gives up. The launcher must end at the first failure of user code with the user's real exit code and the
last line of the traceback in the termination message, while the protocol exits (drain, reform) still restart
the workers in place.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from tests.trainer.conftest import REPO, TOY

pytestmark = pytest.mark.timeout(240)

LAUNCH = [
    sys.executable,
    "-m",
    "disttrain.trainer.launch",
    "--standalone",
    "--max-restarts=1000000",
    "--monitor-interval=0.2",
    "--no-python",
]


def launch(harness, nproc: int, command: list[str], run: str, **env: str) -> tuple[int, str, str]:
    termination = harness.tmp / f"{run}.termination"
    proc = harness.popen(
        [*LAUNCH, f"--nproc-per-node={nproc}", *command],
        harness.env(harness.contract(max_steps=8), run, DISTTRAIN_TERMINATION_LOG=str(termination), **env),
        harness.out / f"{run}.log",
    )
    try:
        rc = proc.wait(timeout=150)
    except subprocess.TimeoutExpired:
        harness.kill_tree(proc.pid)
        raise AssertionError(f"the launcher kept restarting:\n{harness.log(run)[-3000:]}") from None
    return rc, termination.read_text() if termination.exists() else "", harness.log(run)


def test_a_users_exit_code_ends_the_launcher_with_that_code(harness, tmp_path):
    script = tmp_path / "exit3.py"
    script.write_text("import sys\nsys.exit(3)\n")
    rc, message, log = launch(harness, 1, [sys.executable, str(script)], "exit3")
    assert rc == 3, log[-3000:]
    assert message.strip() == "worker rank 0 failed with exit code 3"
    assert log.count("failed with exit code 3; not restarting in place") == 1


def test_a_raise_mid_training_ends_with_the_traceback_line_while_the_peer_reform_is_no_failure(harness):
    # Rank 1 raises at step 3; rank 0's collective then fails and it exits REFORM (84), a protocol exit. The root
    # cause reported is rank 1's exception, from the error file ElasticTrainer writes.
    rc, message, log = launch(harness, 2, [sys.executable, str(TOY)], "raise", TOY_RAISE_RANK1_AT="3")
    assert rc == 1, log[-3000:]
    assert message.strip() == "worker rank 1 failed with exit code 1: RuntimeError: injected bug at step 3"
    # A step is recorded before the backward that sends its gradient (toymodel.train_step): rank 0 may record step 3,
    # whose all-reduce then fails; rank 1 raised before step 3, and nobody got past it.
    records = harness.records("raise")
    assert max(r["step"] for r in records if r["rank"] == 1) == 2
    assert max(r["step"] for r in records) <= 3


def test_a_drain_exit_restarts_the_workers_in_place(harness):
    # A drain (exit 83) is the elastic protocol: torchrun restarts the workers, they resume and finish.
    rc, message, log = launch(
        harness, 2, [sys.executable, str(TOY)], "drain", TOY_DRAIN_AT="3", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"
    )  # as the pod builder sets it
    assert rc == 0, log[-3000:]
    assert message == ""
    steps = {r["step"] for r in harness.records("drain")}
    assert steps == set(range(1, 9)), "resumed after the drain and finished"
    assert "resumed from checkpoint step-4" in log and "not restarting in place" not in log


WARM_PROBE = """
import json, os, sys
json.dump({"handover": os.environ.get("DISTTRAIN_WARM_HANDOVER_TIME"), "argv": sys.argv, "name": __name__,
           "path0": sys.path[0], "preloaded": "torch._dynamo" in sys.modules, "rank": os.environ.get("RANK"),
           "cwd": os.getcwd(), "policy": os.sched_getscheduler(0)}, open(sys.argv[1], "w"))
sys.exit(int(sys.argv[2]))
"""


@pytest.mark.parametrize("warm", [True, False])
def test_a_worker_runs_in_a_warm_interpreter_exactly_as_python_would_run_it(harness, tmp_path, warm):
    """The worker's script runs as ``__main__`` with its argv, its directory first on sys.path, torchrun's env and
    its exit code; warm, it finds torch's compiler stack already imported, cold (turned off) it does not."""
    import json

    script = tmp_path / "probe.py"
    script.write_text(WARM_PROBE)
    out = tmp_path / "probe.json"
    rc, message, log = launch(
        harness,
        1,
        [sys.executable, "-u", str(script), str(out), "3"],
        f"warm-{warm}",
        DISTTRAIN_WARM_WORKERS="1" if warm else "0",
    )
    assert rc == 3, log[-3000:]
    assert message.strip() == "worker rank 0 failed with exit code 3"
    seen = json.loads(out.read_text())
    assert seen["argv"] == [str(script), str(out), "3"]
    assert (seen["name"], seen["path0"], seen["rank"], seen["cwd"]) == ("__main__", str(tmp_path), "0", str(REPO))
    assert (seen["handover"] is not None) is warm and seen["preloaded"] is warm, (seen, log[-3000:])
    assert seen["policy"] == os.SCHED_OTHER  # a warm interpreter that imported on idle CPU runs the worker normally


@pytest.mark.parametrize(
    "max_nodes",
    [
        2,  # the waiting node joins after the group finished: torch raises RendezvousClosedError
        1,  # it waits in torch's redundancy list (beyond nnodes' maximum) while the group trains: torch returns None
    ],
)
def test_a_node_that_finds_the_rendezvous_closed_by_the_finished_job_exits_0(harness, tmp_path, max_nodes):
    """A hot spare (or a late newcomer) waits outside the group; the group that finished closes the rendezvous on
    its way out. The waiting node must end as Succeeded: a failure would be counted and replaced for a done job."""
    import time

    from disttrain.common.ports import free_port
    from disttrain.trainer.agent import service as agent_mod

    port = free_port()
    server = agent_mod.start_store(port, "127.0.0.1", timeout_s=30)
    script = tmp_path / "train.py"
    script.write_text("import time\ntime.sleep(8)\n")
    argv = [
        sys.executable,
        "-m",
        "disttrain.trainer.launch",
        f"--nnodes=1:{max_nodes}",
        "--nproc-per-node=1",
        "--rdzv-backend=disttrain",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=closed-run",
        "--rdzv-conf=is_host=false,join_timeout=60,last_call_timeout=1",
        "--no-python",
        sys.executable,
        str(script),
    ]
    procs = {}
    for node in ("finished", "waiting"):
        environ = {
            **os.environ,
            "DISTTRAIN_TERMINATION_LOG": str(tmp_path / f"{node}.termination"),
            "DISTTRAIN_WARM_WORKERS": "0",
            "DISTTRAIN_STORE_SECRET": harness.secret,
            "DISTTRAIN_JOB_UID": harness.job_uid,
        }
        procs[node] = subprocess.Popen(
            argv, env=environ, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        harness.procs.append(procs[node])
        if max_nodes == 2:
            procs[node].wait(timeout=120)  # the group finishes before the other node arrives
        else:
            time.sleep(4)  # the group forms (it is full at once) and trains while the other node arrives
    logs = {node: proc.communicate(timeout=120)[0] for node, proc in procs.items()}
    del server
    assert procs["finished"].returncode == 0, logs["finished"][-3000:]
    assert procs["waiting"].returncode == 0, logs["waiting"][-3000:]
    message = (tmp_path / "waiting.termination").read_text()
    assert message.strip() == "rendezvous closed: the job finished while this node waited outside the group"
