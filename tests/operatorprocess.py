"""``disttrain operator`` started as a separate process with a kubeconfig, as the operator and cluster tiers run it.

A separate process can be SIGKILLed at any instant, as a crashing pod is. ``--all-namespaces``, because
``--namespace`` makes kopf scan /api/v1/namespaces, which the kmock emulator answers with 500.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tests.conftest import REPO_ROOT


def spawn_operator(
    kubeconfig: Path, log: Path, metrics_port: int, liveness_port: int, extra_args: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    """The operator process in a session of its own, its output appended to ``log``, live at ``/healthz``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("KUBECONFIG", None)
    command = [
        sys.executable,
        "-m",
        "disttrain.operator.cli",
        "operator",
        "--all-namespaces",
        f"--kubeconfig={kubeconfig}",
        f"--metrics-port={metrics_port}",
        "--metrics-address=127.0.0.1",
        f"--liveness=http://127.0.0.1:{liveness_port}/healthz",
        *extra_args,
    ]
    with open(log, "ab") as out:
        return subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True
        )
