"""Which workers may start in a warm interpreter: only those that would run identically in a cold one."""

from __future__ import annotations

import os
import sys

import pytest

from disttrain.api import env
from disttrain.trainer.launch.warmstart import WarmPool, env_is_compatible, warm_command, workers_environment


def test_this_python_with_a_script_or_module_is_warm_startable() -> None:
    assert warm_command([sys.executable, "-u", "train.py", "--lr", "1"]) == (["-u"], ["train.py", "--lr", "1"])
    assert warm_command([sys.executable, "train.py"]) == ([], ["train.py"])
    assert warm_command([sys.executable, "-u", "-m", "pkg.train", "x"]) == (["-u"], ["-m", "pkg.train", "x"])


def test_anything_else_starts_cold(tmp_path) -> None:
    # A bare name that the worker's PATH does not resolve to this interpreter (here: to nothing at all).
    assert warm_command(["python", "train.py"], {"PATH": str(tmp_path)}) is None
    assert warm_command(["/usr/bin/env", "python", "train.py"]) is None
    assert warm_command([sys.executable, "-O", "train.py"]) is None  # an interpreter flag the pool does not use
    assert warm_command([sys.executable, "-c", "print(1)"]) is None
    assert warm_command([sys.executable, "-m"]) is None
    assert warm_command([sys.executable, "-u"]) is None


def test_only_torchruns_per_worker_variables_may_differ() -> None:
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    worker = {**base, "RANK": "3", "LOCAL_RANK": "1", "MASTER_PORT": "29500", "TORCHELASTIC_ERROR_FILE": "/tmp/e"}
    assert env_is_compatible(base, worker)
    # The round joined is set by the rendezvous handler after the interpreters started: a new node's first workers,
    # and every later round's, start warm.
    assert env_is_compatible(base, {**worker, env.RENDEZVOUS_ROUND: "2"})
    assert env_is_compatible({**base, env.RENDEZVOUS_ROUND: "1"}, {**worker, env.RENDEZVOUS_ROUND: "2"})
    assert not env_is_compatible(base, {**worker, "OMP_NUM_THREADS": "4"})  # read when torch is imported
    assert not env_is_compatible(base, {**worker, "PYTHONHASHSEED": "0"})  # read when Python starts
    assert not env_is_compatible(base, {k: v for k, v in worker.items() if k != "PATH"})


def test_a_bare_interpreter_name_is_looked_up_on_the_workers_path(tmp_path) -> None:
    """On Kubernetes the container command is plain ``python``: it is this interpreter when the worker's PATH
    finds this interpreter's directory first, and not when it finds another Python."""
    here = os.path.dirname(sys.executable)
    name = os.path.basename(sys.executable)
    assert warm_command([name, "-u", "train.py"], {"PATH": here}) == (["-u"], ["train.py"])
    other = tmp_path / "bin"
    other.mkdir()
    (other / name).symlink_to(os.path.realpath(sys.executable))  # the same binary reached from elsewhere: a
    assert warm_command([name, "train.py"], {"PATH": str(other)}) is None  # base install, not this venv
    assert warm_command([name, "train.py"], {"PATH": str(tmp_path / "nothing")}) is None
    assert warm_command(["bin/python", "train.py"], {"PATH": here}) is None  # relative to some working directory


def test_the_first_workers_interpreters_start_from_the_launchers_own_command_line(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    pool = WarmPool()
    try:
        pool.prestart(
            [
                "--nnodes=1:4",
                "--nproc-per-node=2",
                "--rdzv-backend=disttrain",
                "--no-python",
                sys.executable,
                "-u",
                str(script),
            ]
        )
        assert len(pool) == 1  # one interpreter forks both workers
        pool.prestart(["--nproc-per-node", "2", "--no-python", sys.executable, str(script)])  # not the operator's
        pool.prestart(["--nproc-per-node=2", sys.executable, str(script)])  # form: left to the agent's fill
        assert len(pool) == 1
    finally:
        pool.close()


def test_prestarted_interpreters_get_the_thread_count_torchrun_gives_several_workers_per_node(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun sets ``OMP_NUM_THREADS=1`` for ``nproc-per-node > 1`` when it is unset, after the launcher prestarted
    its interpreters; torch reads it at import, so without the same value in the prestart no worker of a multi-GPU
    node could be taken warm."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert workers_environment(2)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in workers_environment(1)
    assert workers_environment(2, {"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "8"  # the user's value stays
    script = tmp_path / "train.py"
    script.write_text("import os, sys; sys.exit(0 if os.environ['RANK'] == '1' else 3)\n")
    command = [sys.executable, "-u", str(script)]
    pool = WarmPool()
    try:
        pool.prestart(["--nproc-per-node=2", "--rdzv-backend=disttrain", "--no-python", *command])
        assert len(pool) == 1
        worker_env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
        proc = pool.take(command, worker_env)  # the environment torchrun's worker gets
        assert proc is not None and proc.wait(timeout=120) == 0
        assert len(pool) == 1
    finally:
        pool.close()
