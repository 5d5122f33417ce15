"""Runs a DistTrainJob's pods from an image, as a kubelet would: the agent pod and one worker pod, each in a
container of its own made from the image, with the commands and env the operator's pod builders produce.

What a cluster would provide is stood in for on the host: the pods share the host's network (the agent Service
becomes 127.0.0.1 on a free port), the checkpoint volume is a host folder bind-mounted at ``spec.checkpoint.path``,
and the agent follows a state folder (``--state-dir``, as in local mode) instead of the Kubernetes API, holding a
directive for one node so the ``disttrain`` rendezvous handler completes its round on the operator's target.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from disttrain.api import constants, storeauth
from disttrain.api import env as env_names
from disttrain.api.spec import DistTrainJob
from disttrain.common.ports import free_port
from disttrain.operator import pods
from tests.images.buildah import Container, container, stop
from tests.workerpods import worker_command, worker_env_dict

STATE = "/var/lib/disttrain-state"


@dataclasses.dataclass
class JobRun:
    returncode: int
    log: str
    agent_log: str
    checkpoints: Path
    agent_status: dict[str, Any]
    command: list[str]


def short_job(manifest: Path, max_steps: int) -> DistTrainJob:
    """The manifest's job on one node for ``max_steps`` steps, checkpointed at the end, on a free store port."""
    doc = yaml.safe_load(manifest.read_text())
    doc["metadata"].setdefault("namespace", "default")
    spec = doc["spec"]
    spec["nodes"] = {"min": 1, "max": 1, "replicas": 1}
    spec["training"]["maxSteps"] = max_steps
    spec["checkpoint"]["intervalSteps"] = max_steps
    spec.setdefault("rendezvous", {})["port"] = free_port()
    return DistTrainJob.model_validate(doc)


def run_job(image: str, job: DistTrainJob, tmp: Path, timeout: float = 180) -> JobRun:
    port = job.spec.rendezvous.port
    state, checkpoints = tmp / "state", tmp / "checkpoints"
    for folder in (state, checkpoints):
        folder.mkdir()
        folder.chmod(0o777)  # the pods run as the image's unprivileged user
    wire = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    wire["status"] = {"control": {"generation": 1, "action": "none", "targetNodes": 1}}
    (state / constants.LOCAL_JOB_FILE).write_text(json.dumps(wire))

    agent_pod = pods.build_agent_pod(job)
    agent = pods.trainer_container(agent_pod)
    agent_argv = [*agent["command"], "--state-dir", STATE, "--host", "127.0.0.1"]
    worker_pod = pods.build_worker_pod(job, 0, endpoint=f"127.0.0.1:{port}")
    worker_env = worker_env_dict(worker_pod)
    worker_env[env_names.METRICS_PORT] = str(free_port())  # pods have their own IPs; these share the host's
    # No Secret volume here: the job's store secret goes into both containers' env instead of the mounted file.
    secret_env = {env_names.STORE_SECRET: storeauth.new_secret()}
    worker_env.pop(env_names.STORE_SECRET_FILE, None)
    worker_env.update(secret_env)
    volumes = {checkpoints: job.spec.checkpoint.path}

    hostnames = (agent_pod["metadata"]["name"], worker_pod["spec"]["hostname"])
    with container(image, hostnames[0]) as agent_ctr, container(image, hostnames[1]) as worker_ctr:
        agent_proc = agent_ctr.start(agent_argv, tmp / "agent.log", env=secret_env, volumes={state: STATE})
        try:
            wait_for_port(agent_ctr, port, agent_proc, tmp / "agent.log")
            worker = worker_ctr.start(worker_command(worker_pod), tmp / "worker.log", env=worker_env, volumes=volumes)
            try:
                returncode = worker.wait(timeout)
            except subprocess.TimeoutExpired:
                stop(worker)
                returncode = -1
            if returncode == 0:
                wait_for_relay(state / constants.LOCAL_AGENT_STATUS_FILE, job.spec.training.max_steps or 0)
        finally:
            (state / constants.LOCAL_JOB_FILE).unlink()  # the job is gone: the agent exits
            try:
                agent_proc.wait(15)
            except subprocess.TimeoutExpired:
                stop(agent_proc)
    status_file = state / constants.LOCAL_AGENT_STATUS_FILE
    return JobRun(
        returncode=returncode,
        log=(tmp / "worker.log").read_text(),
        agent_log=(tmp / "agent.log").read_text(),
        checkpoints=checkpoints,
        agent_status=json.loads(status_file.read_text()) if status_file.exists() else {},
        command=worker_command(worker_pod),
    )


def wait_for_port(ctr: Container, port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    """Until the agent's store listens (its pod's readiness probe), or fail with its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the agent in {ctr.name} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"the agent did not listen on {port} within {timeout} s:\n{log.read_text()[-3000:]}")


def wait_for_relay(status_file: Path, step: int, timeout: float = 15) -> None:
    """Until the agent relayed the final checkpoint into the status (it polls its store every 0.25 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads(status_file.read_text()).get("lastCheckpoint", {}).get("step") == step:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.25)
