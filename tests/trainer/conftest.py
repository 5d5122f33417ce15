"""Harness for the multi-process trainer tests: real ``python -m torch.distributed.run``, gloo, CPU, real kills.

Each scenario runs ``tests/workers/toy.py`` (the real loop API on the shared tiny MLP) with a worker contract in the
env, and reads back what the processes recorded (steps, consumed indices, LRs) and what they committed on disk.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import pytest

from disttrain.common.ports import free_port
from disttrain.operator.local.forkserver import ForkServers

REPO = Path(__file__).resolve().parents[2]
TOY = REPO / "tests" / "workers" / "toy.py"
STORE_SERVER = REPO / "tests" / "trainer" / "workers" / "store_server.py"


def make_contract(
    global_batch: int = 12,
    micro: int = 1,
    max_steps: int = 10,
    interval: int = 2,
    keep: int = 3,
    policy: str = "fixed",
    accum: int = 1,
    lr: Optional[dict] = None,
    async_save: bool = False,
    seed: int = 3,
    timeout: int = 10,
    interval_seconds: Optional[int] = None,
    reform_in_place: bool = False,
) -> str:
    training: dict[str, Any] = {
        "globalBatchSize": global_batch,
        "microBatchSize": micro,
        "batchPolicy": policy,
        "accumulationSteps": accum,
        "lr": lr or {"base": 0.01},
        "maxSteps": max_steps,
        "seed": seed,
    }
    checkpoint: dict[str, Any] = {"path": "/unused", "intervalSteps": interval, "keep": keep, "async": async_save}
    if interval_seconds is not None:
        checkpoint["intervalSeconds"] = interval_seconds
    return json.dumps(
        {
            "training": training,
            "checkpoint": checkpoint,
            "collective_timeout_seconds": timeout,
            "reform_in_place": reform_in_place,
        }
    )


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun puts workers in new sessions, so a process group is not enough)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants, as a dying node takes everything with it."""
    victims = [pid, *descendants(pid)]
    for p in victims:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Harness:
    def __init__(self, tmp: Path, forks: Optional[ForkServers] = None) -> None:
        """``forks``: launchers start as forks of a process that imported torch (local mode's fork servers), the
        same launcher without its import; None: as cold interpreters."""
        self.forks = forks
        self.tmp = tmp
        self.out = tmp / "out"
        self.out.mkdir()
        self.secret = secrets.token_hex(32)
        """The job's store secret: every process the harness starts gets it, as every pod of a job does."""
        self.job_uid = "uid-harness"
        self.ckpt = tmp / "ckpt"
        self.procs: list[subprocess.Popen] = []

    contract = staticmethod(make_contract)
    kill_tree = staticmethod(kill_tree)
    free_port = staticmethod(free_port)

    def env(self, contract: str, run: str, ckpt: Optional[Path] = None, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "DISTTRAIN_CONTRACT": contract,
                "DISTTRAIN_CHECKPOINT_DIR": str(ckpt or self.ckpt),
                "DISTTRAIN_JOB_NAME": "toy",
                "TOY_OUT": str(self.out),
                "TOY_RUN": run,
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
                "DISTTRAIN_STORE_SECRET": self.secret,
                "DISTTRAIN_JOB_UID": self.job_uid,
            }
        )
        env.pop("DISTTRAIN_AGENT_ENDPOINT", None)
        env.update(extra)
        return env

    def start(
        self,
        nproc: int,
        contract: str,
        run: str,
        torchrun_args: Optional[list[str]] = None,
        ckpt: Optional[Path] = None,
        launcher: str = "disttrain.trainer.launch",
        **extra: str,
    ) -> subprocess.Popen:
        """``launcher``: the worker pod's launcher ``disttrain.trainer.launch`` (torchrun with the project's agent:
        workers forked from one warm interpreter, in-place reforms, the worker's own exit code), or
        ``torch.distributed.run``, torchrun itself, which the trainer library also runs under."""
        args = torchrun_args if torchrun_args is not None else ["--standalone", "--max-restarts=0"]
        cmd = [sys.executable, "-m", launcher, f"--nproc-per-node={nproc}", *args, str(TOY)]
        return self.popen(cmd, self.env(contract, run, ckpt, **extra), self.out / f"{run}.log")

    def popen(self, cmd: list[str], env: dict[str, str], log_path: Path, cwd: Path = REPO) -> subprocess.Popen:
        """``cmd`` with its output in ``log_path``: a fork of a fork server where one can run it (a Python launcher
        or torchrun: the same program without its import of torch), else a cold process. The harness ends it."""
        with open(log_path, "w") as log:
            p = self.forks.start(cmd, env, str(cwd), log) if self.forks else None
            if p is None:
                p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
        self.procs.append(p)
        return p

    def run(self, nproc: int, contract: str, run: str, timeout: float = 120, **kw: Any) -> tuple[int, str]:
        p = self.start(nproc, contract, run, **kw)
        rc = p.wait(timeout=timeout)
        return rc, self.log(run)

    @staticmethod
    def assert_exited(rc: int, log: str, code: int) -> None:
        """The run ended with the workers' exit ``code``: the launcher's own exit code, or torchrun's failure
        table (torchrun itself exits 1)."""
        assert rc == code or f"exitcode  : {code}" in log, f"exit {rc}:\n{log[-3000:]}"

    def ckpt_names(self, ckpt: Optional[Path] = None) -> list[str]:
        """What the checkpoint directory holds, sorted, without the fence records (``.fence``)."""
        return sorted(p.name for p in (ckpt or self.ckpt).iterdir() if p.name != ".fence")

    def log(self, run: str) -> str:
        return (self.out / f"{run}.log").read_text()

    def records(self, run: str) -> list[dict]:
        rows = []
        for path in sorted(self.out.glob(f"{run}-*.jsonl")):
            rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return rows

    def wait_until(self, what: str, predicate, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def wait_for_step(self, run: str, step: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(r["step"] >= step for r in self.records(run)):
                return
            time.sleep(0.05)
        raise AssertionError(f"{run} never reached step {step}:\n{self.log(run)[-3000:]}")

    def start_store(self, port: Optional[int] = None) -> int:
        """A TCPStore server in its own process (the job agent's role), on ``port`` or a free one; returns its port."""
        port = port or free_port()
        log = self.tmp / f"store-{port}.log"
        p = self.popen([sys.executable, str(STORE_SERVER), str(port)], dict(os.environ), log)
        self.wait_until(f"the store server on port {port}", lambda: "ready" in log.read_text() or p.poll() is not None)
        assert p.poll() is None, f"the store server exited {p.returncode}:\n{log.read_text()[-3000:]}"
        return port

    def client(self, port: int, job_uid: Optional[str] = None, timeout_s: float = 10) -> Any:
        """A client of the store as a process of the job sees it: signed with the harness's secret."""
        from torch.distributed import TCPStore

        from disttrain.trainer.store import channel

        raw = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        return channel.scoped(raw, self.secret, self.job_uid if job_uid is None else job_uid)

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait(timeout=10)


RUN_TIME_SETTINGS = ("TOY_", "MESH_", "PROBE_", "EFFECT_", "PYTEST_CURRENT_TEST")
"""Variables the test programs (tests/trainer/workers, tests/workers) read when they run, never torch or disttrain
at import: a fork server's pods may differ in them."""


@pytest.fixture(scope="session")
def fork_servers(tmp_path_factory: pytest.TempPathFactory):
    """Fork servers shared by the session's tests, under ``DISTTRAIN_LOCAL_FORK`` as local mode uses them (on by
    default; ``DISTTRAIN_LOCAL_FORK=0`` starts every launcher cold), :data:`RUN_TIME_SETTINGS` apart."""
    servers = ForkServers(tmp_path_factory.mktemp("fork-servers"), run_time=RUN_TIME_SETTINGS)
    yield servers
    servers.close()


@pytest.fixture
def harness(tmp_path: Path, fork_servers: ForkServers):
    h = Harness(tmp_path, fork_servers)
    yield h
    h.cleanup()


def consumed(records: list[dict], steps: range) -> Counter:
    """How often each sample index was trained on in ``steps``, from a run's records (a replayed step counts again)."""
    out: Counter = Counter()
    for r in records:
        if r["step"] in steps:
            out.update(r["indices"])
    return out


def bucket_contract(harness: Harness, s3_server: Any, bucket: str, prefix: str, **kw: Any) -> str:
    """``harness.contract(**kw)`` with its checkpoints in ``s3://<bucket>/<prefix>/`` of ``s3_server``."""
    contract = json.loads(harness.contract(**kw))
    contract["checkpoint"] |= {
        "uri": f"s3://{bucket}/{prefix}/",
        "s3": {"endpoint": s3_server.endpoint, "region": "us-east-1", "addressingStyle": "path"},
    }
    return json.dumps(contract)


def bucket_credentials(s3_server: Any) -> dict[str, str]:
    """What the pod gets from checkpoint.s3.credentialsSecret."""
    return {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key}


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 server (Ceph RADOS Gateway, tests/s3server.py), started once per session on first use (~12 s)."""
    from tests import s3server

    server = s3server.start_or_skip()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh bucket for one test: (client, bucket name)."""
    client = s3_server.client()
    name = f"t-{secrets.token_hex(6)}"
    client.create_bucket(Bucket=name)
    return client, name
