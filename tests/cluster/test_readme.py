"""The README's "On Kubernetes" block, command by command, as a new user runs it on a fresh cluster.

A control plane of its own (nothing installed before, as for a new user). The test plays what a cluster has and
this machine lacks: the storage admin's PersistentVolume, the kubelets (simulated nodes), the operator
Deployment's container (``disttrain operator`` as a process with the chart's ServiceAccount token and the
Deployment's own arguments) and the job agent's progress reports (with the agent's token).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from disttrain.api import constants
from disttrain.api.conditions import format_time
from tests.chart.helm import helm_binary, object_name
from tests.cluster.controlplane import ControlPlane, start_or_skip
from tests.cluster.harness import eventually
from tests.cluster.kubelet import Kubelets
from tests.cluster.operator_process import OperatorProcess
from tests.cluster.tables import kubectl_table
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(240)


def readme_commands() -> list[list[str]]:
    """The commands of the fenced block after "**On Kubernetes:**", comments stripped."""
    text = (REPO_ROOT / "README.md").read_text()
    block = re.search(r"\*\*On Kubernetes:\*\*\s*```bash\n(.*?)```", text, re.DOTALL)
    assert block, "README has no 'On Kubernetes' bash block"
    return [shlex.split(line, comments=True) for line in block.group(1).splitlines() if line.strip()]


@pytest.fixture
def fresh_cluster() -> Iterator[ControlPlane]:
    plane = start_or_skip()
    try:
        plane.start_controllers()
        yield plane
    finally:
        plane.stop()


def test_the_readme_kubernetes_walkthrough(fresh_cluster: ControlPlane, tmp_path: Path):
    plane = fresh_cluster
    commands = readme_commands()
    assert [c[:2] for c in commands] == [
        ["helm", "install"],
        ["kubectl", "apply"],
        ["kubectl", "apply"],
        ["kubectl", "get"],
        ["kubectl", "scale"],
        ["kubectl", "get"],
    ], commands
    kubelets = Kubelets(plane)
    operator = None
    try:
        for node in ("node-a", "node-b", "node-c", "node-d"):
            kubelets.add_node(node)
        plane.request(
            "POST",
            "/api/v1/persistentvolumes",
            {  # the storage admin's volume for the claim
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": "nfs-1"},
                "spec": {
                    "capacity": {"storage": "10Gi"},
                    "accessModes": ["ReadWriteMany"],
                    "nfs": {"server": "nfs.example", "path": "/exports/ckpt"},
                },
            },
        )

        helm_install, claim, job, get, scale, watch = commands
        installed = subprocess.run(
            [helm_binary(), *helm_install[1:], f"--kubeconfig={plane.kubeconfig}"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO_ROOT,
            env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
        )
        assert installed.returncode == 0, installed.stderr
        assert "STATUS: deployed" in installed.stdout
        namespace = helm_install[helm_install.index("-n") + 1]

        # The operator Deployment's pod, as its kubelet would run it: the Deployment's args, the chart's token.
        deployment = plane.request("GET", f"/apis/apps/v1/namespaces/{namespace}/deployments/{object_name()}")
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--all-namespaces" in args
        token = plane.service_account_kubeconfig(
            namespace, deployment["spec"]["template"]["spec"]["serviceAccountName"]
        )
        operator = OperatorProcess(token, tmp_path / "operator.log")
        operator.start()

        for command in (claim, job):
            assert "created" in plane.kubectl(*command[1:], timeout=60).stdout
        eventually(lambda: _agent_running(plane), timeout=60, what="agent and workers running")
        agent_token = plane.service_account_kubeconfig("default", "tinylm-agent")

        def report(**status: object) -> None:
            plane.kubectl(
                "patch",
                "dtj/tinylm",
                "--subresource=status",
                "--type=merge",
                "-p",
                json.dumps({"status": status}),
                kubeconfig=agent_token,
            )

        report(
            worldSize=2,
            step=40,
            rendezvousRound=1,
            lastProgressTime=format_time(time.time()),
            lastCheckpoint={"step": 0, "time": format_time(time.time())},
        )
        table = eventually(lambda: _row(plane.kubectl(*get[1:]).stdout, "Running"), what="kubectl get: Running")
        assert [table[c] for c in ("NAME", "PHASE", "WORLD", "STEP")] == ["tinylm", "Running", "2/2", "40"], table

        assert "scaled" in plane.kubectl(*scale[1:]).stdout
        watcher = subprocess.Popen(
            ["kubectl", f"--kubeconfig={plane.kubeconfig}", *watch[1:]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            eventually(
                lambda: (plane.request("GET", _job_path()).get("status") or {}).get("phase") == "Reforming",
                what="the scale-up directive",
            )
            eventually(
                lambda: (
                    len(_workers(plane)) == 3 and all(p["status"].get("phase") == "Running" for p in _workers(plane))
                ),
                what="a third worker running",
            )
            report(
                lastCheckpoint={"step": 50, "time": format_time(time.time() + 1)},
                worldSize=3,
                step=51,
                rendezvousRound=2,
                lastProgressTime=format_time(time.time() + 2),
            )
            eventually(
                lambda: (plane.request("GET", _job_path()).get("status") or {}).get("phase") == "Running",
                what="Running at 3",
            )
            time.sleep(1.5)  # the watch prints the change
        finally:
            watcher.terminate()
            watched, errors = watcher.communicate(timeout=10)
        lines = [line.split() for line in watched.splitlines()]
        assert lines[0][:7] == ["NAME", "PHASE", "WORLD", "STEP", "SAMPLES/S", "CHECKPOINT", "RESTARTS"], (
            watched + errors
        )
        phases = [line[1] for line in lines[1:]]
        assert "Reforming" in phases and phases[-1] == "Running", watched
        # WORLD, LAST REFORM, and -o wide's NODES (the desired node count); a --watch stream re-aligns each row
        assert re.search(
            r"Running\s+3/3\s+51\s.*\sScaledUp\s.*\s3\s+training with 3 nodes", watched.splitlines()[-1]
        ), watched
        # And back down, as a user trying the elastic range would: a drain, the victim deleted, Running at 1.
        assert "scaled" in plane.kubectl("scale", "dtj/tinylm", "--replicas=1").stdout
        drain = eventually(lambda: _phase_status(plane, "Reforming"), what="the scale-down drain")
        assert drain["control"]["action"] == "drain" and len(drain["control"]["exclude"]) == 2
        report(lastCheckpoint={"step": 60, "time": format_time(time.time() + 3)})
        eventually(lambda: len(_workers(plane)) == 1, what="victims deleted after the drain checkpoint")
        report(worldSize=1, step=61, rendezvousRound=3, lastProgressTime=format_time(time.time() + 4))
        row = eventually(lambda: _row(plane.kubectl(*get[1:]).stdout, "Running"), what="Running at 1")
        assert row["WORLD"] == "1/1" and row["LAST REFORM"] == "ScaledDown", row
        assert not operator.forbidden_lines(), operator.forbidden_lines()
    finally:
        if operator is not None:
            operator.kill()
        kubelets.stop()


def _job_path() -> str:
    return f"/apis/{constants.GROUP}/{constants.VERSION}/namespaces/default/{constants.PLURAL}/tinylm"


def _phase_status(plane: ControlPlane, phase: str) -> dict | None:
    status = plane.request("GET", _job_path()).get("status") or {}
    return status if status.get("phase") == phase else None


def _workers(plane: ControlPlane) -> list[dict]:
    pods = plane.request("GET", "/api/v1/namespaces/default/pods")["items"]
    return [
        p
        for p in pods
        if p["metadata"]["labels"].get(constants.LABEL_ROLE) == "worker" and not p["metadata"].get("deletionTimestamp")
    ]


def _agent_running(plane: ControlPlane) -> bool:
    pods = plane.request("GET", "/api/v1/namespaces/default/pods")["items"]
    return len(pods) == 3 and all(p["status"].get("phase") == "Running" for p in pods)


def _row(table: str, phase: str) -> dict[str, str] | None:
    rows = kubectl_table(table)
    return rows[0] if rows and rows[0]["PHASE"] == phase else None
