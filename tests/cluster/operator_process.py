"""``disttrain operator`` as a real process, logged in as the chart's ServiceAccount (a TokenRequest token).

Running it as a separate process under the chart's RBAC is the point: a missing permission shows as a 403 in
its log, as it would in a cluster, and the process can be SIGKILLed at any instant.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from tests.cluster.controlplane import free_port
from tests.cluster.rbac import chart_operator_flags
from tests.operatorprocess import spawn_operator

FORBIDDEN = re.compile(r"(?<![,.:\d])\b403\b|forbidden", re.IGNORECASE)  # not a log timestamp ",403"
# A pod refused by Pod Security admission is a 403 too, but about the pod, not the operator's RBAC.
POD_SECURITY = re.compile(r"violates PodSecurity")
# ServiceAccount admission refuses pods until the controller created the namespace's account: a 403 that is no
# permission of ours (the operator retries it like any failed call).
NOT_RBAC = re.compile(r"violates PodSecurity|error looking up service account")


class OperatorProcess:
    def __init__(self, kubeconfig: Path, log: Path, extra_args: Sequence[str] = ()) -> None:
        self.kubeconfig = kubeconfig
        self.log = log
        self.extra_args = tuple(extra_args)
        """More ``disttrain operator`` flags (a benchmark's old path, for one)."""
        self.proc: subprocess.Popen[bytes] | None = None
        self.metrics_port = 0

    def start(self, timeout: float = 30) -> None:
        self.metrics_port, liveness = free_port(), free_port()
        self.proc = spawn_operator(
            self.kubeconfig,
            self.log,
            self.metrics_port,
            liveness,
            # as the chart runs it: the agents' NetworkPolicies admit its pods to their pulse port
            [*chart_operator_flags("--operator-namespace", "--operator-pod-selector"), *self.extra_args],
        )
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"operator exited:\n{self.log_text()[-4000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{liveness}/healthz", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"operator not live:\n{self.log_text()[-4000:]}"
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL: no cleanup, no graceful stop, as when the operator's node or container dies."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def forbidden_lines(self) -> list[str]:
        return [line for line in self.log_text().splitlines() if FORBIDDEN.search(line) and not NOT_RBAC.search(line)]
