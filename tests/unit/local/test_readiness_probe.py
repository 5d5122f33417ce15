"""A local pod reads Ready as a Kubernetes pod does with the operator's readinessProbe: once its port accepts."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from disttrain.common.ports import free_port
from disttrain.operator.local.nodes import LocalPod


def _pod(readiness_port: int) -> LocalPod:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    return LocalPod(
        name="w-0",
        uid="u",
        index=0,
        node="local-1",
        marker="m",
        proc=proc,
        log=sys.stderr.buffer,
        created_at=time.time(),
        readiness_port=readiness_port,
    )


def test_running_but_unready_until_the_launcher_listens_then_ready_for_good() -> None:
    port = free_port()
    pod = _pod(port)
    try:
        assert pod.view().phase == "Running" and not pod.view().ready
        with socket.create_server(("127.0.0.1", port)):
            assert pod.view().ready
        assert pod.view().ready  # passed once: the launcher keeps the port for its life
    finally:
        pod.proc.kill()
        pod.proc.wait()


def test_a_pod_without_a_readiness_port_is_ready_while_running() -> None:
    pod = _pod(0)
    try:
        assert pod.view().ready
    finally:
        pod.proc.kill()
        pod.proc.wait()
