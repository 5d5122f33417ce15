"""Which workers may start in a warm interpreter: only those that would run identically in a cold one."""

from __future__ import annotations

import sys

from disttrain.trainer.warmstart import env_is_compatible, warm_command


def test_this_python_with_a_script_or_module_is_warm_startable() -> None:
    assert warm_command([sys.executable, "-u", "train.py", "--lr", "1"]) == (["-u"], ["train.py", "--lr", "1"])
    assert warm_command([sys.executable, "train.py"]) == ([], ["train.py"])
    assert warm_command([sys.executable, "-u", "-m", "pkg.train", "x"]) == (["-u"], ["-m", "pkg.train", "x"])


def test_anything_else_starts_cold() -> None:
    assert warm_command(["python", "train.py"]) is None  # not an absolute path: which python is unknown
    assert warm_command(["/usr/bin/env", "python", "train.py"]) is None
    assert warm_command([sys.executable, "-O", "train.py"]) is None  # an interpreter flag the pool does not use
    assert warm_command([sys.executable, "-c", "print(1)"]) is None
    assert warm_command([sys.executable, "-m"]) is None
    assert warm_command([sys.executable, "-u"]) is None


def test_only_torchruns_per_worker_variables_may_differ() -> None:
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    worker = {**base, "RANK": "3", "LOCAL_RANK": "1", "MASTER_PORT": "29500", "TORCHELASTIC_ERROR_FILE": "/tmp/e"}
    assert env_is_compatible(base, worker)
    assert not env_is_compatible(base, {**worker, "OMP_NUM_THREADS": "4"})  # read when torch is imported
    assert not env_is_compatible(base, {**worker, "PYTHONHASHSEED": "0"})  # read when Python starts
    assert not env_is_compatible(base, {k: v for k, v in worker.items() if k != "PATH"})
