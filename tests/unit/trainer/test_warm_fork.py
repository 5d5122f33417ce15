"""One warm interpreter forks every worker of a node: each runs as a cold ``python script.py`` would (its own
session, argv, environment, exit code, signals), the interpreter stays for the next ones, and where it must not
fork (the CUDA driver loaded into it) it becomes a worker itself, as before."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from disttrain.trainer.launch.warmproc import fork_refusal
from disttrain.trainer.launch.warmstart import ForkedWorker, WarmPool

pytestmark = pytest.mark.timeout(300)

SCRIPT = """
import json, os, sys, time
out = os.environ["OUT"]
with open(os.path.join(out, os.environ["RANK"] + ".json"), "w") as f:
    json.dump({"argv": sys.argv, "pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "cwd": os.getcwd(),
               "rank": os.environ["RANK"], "torch": "torch" in sys.modules, "main": __name__}, f)
plan = os.path.join(out, "plan-" + os.environ["RANK"])  # what this rank does: "sleep code"
sleep, code = open(plan).read().split() if os.path.exists(plan) else ("0", "0")
time.sleep(float(sleep))
sys.exit(int(code))
"""


def worker_env(rank: int, out: Path, sleep: float = 0, code: int = 0) -> dict[str, str]:
    """torchrun's per-worker variables over this environment; the worker's behaviour goes to a file (anything
    else in the environment would make it start cold)."""
    (out / f"plan-{rank}").write_text(f"{sleep} {code}")
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    pool = WarmPool()
    yield pool, [sys.executable, "-u", str(script), "--flag"], out
    pool.close()


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def test_one_interpreter_forks_each_worker_with_its_own_session_argv_and_exit_code(job) -> None:
    pool, command, out = job
    pool.fill(2, command)
    assert len(pool) == 1
    first = pool.take(command, worker_env(0, out, sleep=30))
    second = pool.take(command, worker_env(1, out, code=3))
    assert isinstance(first, ForkedWorker) and isinstance(second, ForkedWorker)
    assert second.wait(timeout=60) == 3 and second.poll() == 3
    with pytest.raises(subprocess.TimeoutExpired):
        first.wait(timeout=0.2)
    seen = {rank: json.loads((out / f"{rank}.json").read_text()) for rank in (0, 1)}
    interpreter = seen[0]["ppid"]
    assert interpreter == seen[1]["ppid"] != os.getpid() and len(pool) == 1  # it stays for the next ones
    for rank in (0, 1):
        assert seen[rank]["argv"] == command[2:] and seen[rank]["rank"] == str(rank)
        assert seen[rank]["main"] == "__main__" and seen[rank]["cwd"] == os.getcwd()
        assert (
            seen[rank]["sid"] == seen[rank]["pid"] and seen[rank]["torch"]
        )  # a session of its own; torch imported before it ran
    os.killpg(first.pid, signal.SIGTERM)  # how torchrun stops a worker
    assert first.wait(timeout=30) == -signal.SIGTERM
    third = pool.take(command, worker_env(0, out))  # a reform's next worker: forked at once, nothing imported again
    assert third is not None and third.wait(timeout=60) == 0
    assert json.loads((out / "0.json").read_text())["ppid"] == interpreter


def test_workers_die_with_their_interpreter_and_read_as_killed(job) -> None:
    pool, command, out = job
    pool.fill(1, command)
    worker = pool.take(command, worker_env(0, out, sleep=60))
    assert worker is not None
    interpreter = parent_of(worker.pid)
    os.kill(interpreter, signal.SIGKILL)
    assert worker.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while Path(f"/proc/{worker.pid}").exists() and parent_of(worker.pid) != 0 and time.monotonic() < deadline:
        if Path(f"/proc/{worker.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.05)
    stat = Path(f"/proc/{worker.pid}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", "an orphan kept running"
    pool.fill(1, command)  # the dead interpreter is replaced
    again = pool.take(command, worker_env(0, out))
    assert again is not None and again.wait(timeout=120) == 0


def fake_cuda_driver(tmp_path: Path) -> Path:
    """A shared library named like the CUDA driver (a copy of libm): what /proc/self/maps shows once CUDA is
    initialised."""
    libm = next(
        p
        for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib/x86_64-linux-gnu/libm.so.6", "/lib64/libm.so.6")
        if os.path.exists(p)
    )
    target = tmp_path / "libcuda.so.1"
    shutil.copy(libm, target)
    return target


def test_the_loaded_cuda_driver_is_a_reason_not_to_fork(tmp_path: Path) -> None:
    assert fork_refusal() is None
    driver = fake_cuda_driver(tmp_path)
    code = "import ctypes, sys; from disttrain.trainer.launch.warmproc import fork_refusal; "
    code += f"ctypes.CDLL({str(driver)!r}); print(fork_refusal())"
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "CUDA driver is loaded" in said


@pytest.mark.parametrize("why", ["cuda-driver-loaded", "spawn-asked"])
def test_an_interpreter_that_must_not_fork_becomes_the_worker_and_the_pool_keeps_one_per_worker(
    job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    pool, command, out = job
    if why == "spawn-asked":
        monkeypatch.setenv("DISTTRAIN_WARM_WORKERS", "spawn")
    else:
        monkeypatch.setenv("LD_PRELOAD", str(fake_cuda_driver(tmp_path)))
    pool.fill(2, command)
    first = pool.take(command, worker_env(0, out))
    assert first is not None and not isinstance(first, ForkedWorker)  # the interpreter's own process
    assert first.wait(timeout=120) == 0 and json.loads((out / "0.json").read_text())["torch"]
    pool.fill(2, command)
    assert len(pool) == 2  # from now on, one per local worker
