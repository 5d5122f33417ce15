"""The launcher forks its workers' warm interpreter from itself once it has imported torch, so a node imports torch
once: the workers still run as a cold ``python [-u] script.py`` would (argv, ``__main__``, stdio buffering, the
thread count torch read at import, exit codes), and where a fork of the launcher would not be that interpreter, a
fresh one starts as before."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from disttrain.trainer.launch import warmstart

pytestmark = pytest.mark.timeout(300)

SCRIPT = """
import json, os, sys, torch
def cmdline(pid):
    return open(f"/proc/{pid}/cmdline").read().split("\\0")[:-1]
def parent(pid):
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
interpreter = os.getppid()
record = {"argv": sys.argv, "main": __name__, "interpreter": cmdline(interpreter), "own": cmdline(os.getpid()),
          "launcher": parent(interpreter), "unbuffered": type(sys.stdout.buffer).__name__ == "FileIO",
          "omp": os.environ.get("OMP_NUM_THREADS"), "threads": torch.get_num_threads(),
          "warm": "DISTTRAIN_WARM_HANDOVER_TIME" in os.environ}
with open(os.path.join(os.environ["OUT"], os.environ["RANK"] + ".json"), "w") as f:
    json.dump(record, f)
sys.exit(int(sys.argv[1]) if os.environ["RANK"] == "1" else 0)
"""


def launch(tmp_path: Path, flags: list[str], code: int, **env: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONUNBUFFERED")}
    environ.update(OUT=str(out), **env)
    launcher = [sys.executable, "-m", "disttrain.trainer.launch", "--nproc-per-node=2", "--standalone"]
    if flags == ["torchrun's own"]:  # torchrun builds the worker command: python -u script
        command = [*launcher, str(script), str(code)]
    else:  # the operator's form
        command = [*launcher, "--no-python", sys.executable, *flags, str(script), str(code)]
    done = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    records = {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}
    return done, records


@pytest.mark.parametrize(("flags", "code"), [([], 0), (["-u"], 7), (["torchrun's own"], 0)])
def test_workers_fork_from_an_interpreter_forked_from_the_launcher_and_run_as_cold_ones(
    tmp_path: Path, flags: list[str], code: int
) -> None:
    done, records = launch(tmp_path, flags, code)
    assert done.returncode == code, done.stderr[-3000:]  # rank 1's exit code is the pod's
    assert sorted(records) == ["0", "1"]
    for record in records.values():
        assert record["warm"], "a warm interpreter ran the worker"
        assert record["interpreter"][1:3] == ["-m", "disttrain.trainer.launch"], "a fork of the launcher"
        assert record["argv"] == [str(tmp_path / "train.py"), str(code)] and record["main"] == "__main__"
        assert record["unbuffered"] == (flags != [])
        assert record["omp"] == "1" and record["threads"] == 1  # torchrun's default for 2 workers, read at import


def test_where_several_interpreters_are_wanted_they_start_afresh(tmp_path: Path) -> None:
    done, records = launch(tmp_path, ["-u"], code=0, DISTTRAIN_WARM_WORKERS="spawn")
    assert done.returncode == 0, done.stderr[-3000:]
    for record in records.values():  # each worker is an interpreter started for it, which became the worker
        assert record["warm"] and record["own"][-2:] == ["-m", "disttrain.trainer.launch.warmproc"]


REFUSALS = """
import os, threading, torch
from disttrain.trainer.launch.warmstart import fork_here_refusal
environ = dict(os.environ)
said = [fork_here_refusal((), environ), fork_here_refusal((), {**environ, "ONLY_IN_WORKERS": "1"})]
stop = threading.Event()
threading.Thread(target=stop.wait).start()
said.append(fork_here_refusal((), environ))
stop.set()
print(said)
"""


def test_a_fork_is_refused_where_it_would_not_be_the_interpreter_a_worker_gets() -> None:
    said = subprocess.run([sys.executable, "-c", REFUSALS], capture_output=True, text=True, timeout=120, check=True)
    clean, other_environment, threads = ast.literal_eval(said.stdout)
    assert clean is None
    assert "environment" in other_environment and "threads" in threads
    assert warmstart.interpreter_options(["python", "-u", "-X", "dev", "-m", "x", "-u"]) == ["-u", "-X"]
    assert warmstart.interpreter_options(["python", "-m", "disttrain.trainer.launch", "-u"]) == []
