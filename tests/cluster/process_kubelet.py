"""Kubelets that run the pods: each pod the real scheduler binds to a live node runs as local processes.

:class:`tests.cluster.kubelet.Kubelets` only reports pods Running; this one starts what each pod's container says,
translated to this machine exactly as local mode does (:mod:`disttrain.operator.local.translate`: the agent
Service's name becomes ``127.0.0.1:<port of that job>``, the checkpoint volume a directory, ports free local
ones), with what a kubelet provides: the downward API, the mounted store Secret (read from the API server), and
for a pod that keeps its ServiceAccount token a kubeconfig with a token of that account (the TokenRequest API, as
a projected token). So the real job agent follows its job and patches its status under its own Role, and real
torchrun and trainer processes train and reform. The kubelet reports what the processes do: Running, Ready once
the container's readinessProbe port accepts, Failed or Succeeded with the exit code, and a graceful deletion
(SIGTERM, then SIGKILL after the grace period) before it confirms it. :meth:`power_off` is a machine dying: every
process of its pods is SIGKILLed, and its kubelet stops renewing the Lease and reporting. A pod that is no job's
(no ``disttrain.dev/job-name`` label: an outsider's) runs its container's ``command + args`` as they are, with
each argument that is a job agent Service's cluster address (``<job>-agent.<ns>.svc:<port>``) turned into that
agent's local one. There is no network plugin here: NetworkPolicy is not enforced, every process reaches every
port.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import signal
import socket
import sys
import time
import urllib.error
import uuid
from pathlib import Path
from typing import IO, Any, Optional

from disttrain.api import constants, env, pulse, storeauth
from disttrain.api.spec import DistTrainJob
from disttrain.common.ports import free_port
from disttrain.operator import access, names, pods
from disttrain.operator.local import forkserver, proctree, translate
from disttrain.operator.local.forkserver import ForkServers
from tests.cluster.controlplane import ControlPlane
from tests.cluster.kubelet import Kubelets

GRACE_SECONDS = 5.0
"""terminationGracePeriodSeconds, shortened: SIGTERM, then SIGKILL this long after."""


@dataclasses.dataclass
class _Container:
    pod: str
    namespace: str
    uid: str
    node: str
    marker: str
    proc: Any
    log: IO[bytes]
    readiness_port: int
    ready_reported: bool = False
    exit_reported: bool = False
    term_sent_at: float | None = None


class ProcessKubelets(Kubelets):
    """Nodes whose pods run as local process trees (one tree per pod, like a container)."""

    def __init__(
        self,
        plane: ControlPlane,
        volume_root: Path,
        logs: Path,
        namespaces: set[str],
        forks: Optional[ForkServers] = None,
    ) -> None:
        """``namespaces``: whose pods run here. A pod of another namespace bound to these nodes stays Pending (the
        jobs of earlier tests, replaced by the operator when their nodes went away, must not run in this one).
        ``forks``: a job's pods start as forks of these fork servers where one can run them (as local mode's do:
        the same programs without their import of torch; the caller closes them); None: cold, as on a node, for
        benchmarks that time a pod's start."""
        self.volume_root, self.logs, self.namespaces, self.forks = volume_root, logs, namespaces, forks
        self.containers: dict[str, _Container] = {}
        self._store_ports: dict[str, int] = {}
        self._agent_addresses: dict[str, str] = {}
        """A job agent Service's cluster address (each DNS form, with the port) -> its local ``127.0.0.1:port``."""
        logs.mkdir(parents=True, exist_ok=True)
        super().__init__(plane)

    # --- what a dying machine and the end of a test do -------------------------------------------------

    def power_off(self, name: str) -> None:
        super().power_off(name)
        for container in [c for c in self.containers.values() if c.node == name]:
            proctree.kill_tree(container.marker, container.proc.pid)

    def stop(self) -> None:
        super().stop()
        for container in self.containers.values():
            proctree.kill_tree(container.marker, container.proc.pid)
            container.proc.wait(timeout=10)
            container.log.close()

    def log_of(self, pod: str) -> str:
        path = self.logs / f"{pod}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # --- the sync loop -----------------------------------------------------------------------------------

    def _sync_pods(self, alive: set[str], exits: dict[str, int]) -> None:
        for pod in self.plane.request("GET", "/api/v1/pods")["items"]:
            meta, status = pod["metadata"], pod["status"]
            if pod["spec"].get("nodeName") not in alive or meta["namespace"] not in self.namespaces:
                continue
            path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
            container = self.containers.get(meta["uid"])
            try:
                if meta.get("deletionTimestamp"):
                    self._terminate(path, meta, container)
                elif container is None and status.get("phase", "Pending") == "Pending":
                    self.containers[meta["uid"]] = container = self._start(pod)
                    self._report(path, pod, exit_code=None, ready_when_running=container.readiness_port == 0)
                elif container is not None and not container.exit_reported:
                    code = container.proc.poll()
                    if code is not None and pod["spec"].get("nodeName") not in self.alive:
                        continue  # its machine lost power while this sync ran: a dead machine reports nothing
                    if code is not None:
                        self._report(path, pod, exit_code=128 - code if code < 0 else code)
                        container.exit_reported = True
                    elif not container.ready_reported and _accepts(container.readiness_port):
                        self._report(path, pod, exit_code=None)
                        container.ready_reported = True
            except urllib.error.HTTPError as error:
                if error.code not in (404, 409):
                    raise
                error.close()  # it holds the answer's TLS socket (a ResourceWarning when collected later)

    def _terminate(self, path: str, meta: dict[str, Any], container: _Container | None) -> None:
        if container is not None and container.proc.poll() is None:
            if container.term_sent_at is None:
                container.term_sent_at = time.monotonic()
                proctree.signal_tree(container.marker, container.proc.pid, signal.SIGTERM)
                return
            if time.monotonic() - container.term_sent_at < GRACE_SECONDS:
                return
            proctree.kill_tree(container.marker, container.proc.pid)
        self._delete_now(path, meta)

    # --- starting a pod's container ----------------------------------------------------------------------

    def _start(self, pod: dict[str, Any]) -> _Container:
        meta = pod["metadata"]
        ns = meta["namespace"]
        if constants.LABEL_JOB_NAME not in (meta.get("labels") or {}):
            return self._start_plain(pod)
        job_name = meta["labels"][constants.LABEL_JOB_NAME]
        job = DistTrainJob.model_validate(
            self.plane.request(
                "GET", f"/apis/{constants.GROUP}/{constants.VERSION}/namespaces/{ns}/{constants.PLURAL}/{job_name}"
            )
        )
        base_env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "PYTEST_CURRENT_TEST")}
        if pod["spec"].get("automountServiceAccountToken", True):  # the agent: its account's token, projected
            account = pod["spec"].get("serviceAccountName", "default")
            base_env["KUBECONFIG"] = str(self.plane.service_account_kubeconfig(ns, account))
        # As the kubelet does: the Secret the pod's volume names.
        secret_name = next(v["secret"]["secretName"] for v in pod["spec"]["volumes"] if v["name"] == access.VOLUME)
        secret = self.plane.request("GET", f"/api/v1/namespaces/{ns}/secrets/{secret_name}")
        host = names.agent_service_name(job_name)
        store_port = self._store_ports.setdefault(job.metadata.uid or job_name, free_port())
        agent_hosts = (f"{host}.{ns}.svc.cluster.local", f"{host}.{ns}.svc", f"{host}.{ns}")
        for alias in agent_hosts:
            self._agent_addresses[f"{alias}:{job.spec.rendezvous.port}"] = f"127.0.0.1:{store_port}"
        cluster_dir = pods.checkpoint_dir(job)
        site = translate.LocalSite(
            agent_hosts=(f"{host}.{ns}.svc.cluster.local", f"{host}.{ns}.svc", f"{host}.{ns}", host),
            cluster_port=job.spec.rendezvous.port,
            local_port=store_port,
            cluster_checkpoint_dir=cluster_dir,
            checkpoint_dir=str(self.volume_root / os.path.relpath(cluster_dir, job.spec.checkpoint.path)),
            workdir=str(Path(__file__).resolve().parents[2]),
            base_env=base_env,
            store_secret=base64.b64decode(secret["data"][storeauth.SECRET_KEY]).decode(),
            # The pod has an address of its own (POD_IP below): its pulse port is the cluster's.
            pulse_port=names.agent_pulse_port(job.spec.rendezvous.port),
        )
        is_worker = meta["labels"].get(constants.LABEL_ROLE) == constants.ROLE_WORKER
        readiness_port = free_port() if is_worker else 0
        spec = translate.to_process(pod, site, pod["spec"]["nodeName"], free_port() if is_worker else 0, readiness_port)
        if env.POD_IP in spec.env:  # the downward API's status.podIP: an address of the pod's own, not 127.0.0.1
            spec = dataclasses.replace(spec, env={**spec.env, env.POD_IP: self.pod_ip(pod)})
        if env.AGENT_PULSE_KEY_FILE in spec.env:  # the agent's pulse key, from the same Secret: a file of its own here
            key_file = self.logs / f"{meta['name']}.pulse-key"
            key_file.write_bytes(base64.b64decode(secret["data"].get(pulse.SECRET_KEY, "")))
            spec = dataclasses.replace(spec, env={**spec.env, env.AGENT_PULSE_KEY_FILE: str(key_file)})
        if env.TERMINATION_LOG in spec.env:  # the container's terminationMessagePath: a file of its own here
            spec = dataclasses.replace(
                spec, env={**spec.env, env.TERMINATION_LOG: str(self.logs / f"{meta['name']}.termination")}
            )
        log = (self.logs / f"{meta['name']}.log").open("ab")
        marker = f"cluster-{uuid.uuid4().hex}"
        # KUBECONFIG names the agent's own account's token: read when it runs, one per job
        per_pod = spec.per_pod | {"KUBECONFIG"}
        proc = forkserver.start_pod(self.forks, spec.argv, spec.env, spec.cwd, log, marker, per_pod)
        return _Container(meta["name"], ns, meta["uid"], pod["spec"]["nodeName"], marker, proc, log, readiness_port)

    def _start_plain(self, pod: dict[str, Any]) -> _Container:
        """A pod that is no job's: its first container's command and literal env, agent addresses made local."""
        meta = pod["metadata"]
        container = pod["spec"]["containers"][0]
        argv = [
            self._agent_addresses.get(arg, arg) for arg in [*container.get("command", []), *container.get("args", [])]
        ]
        if argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        base_env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "PYTEST_CURRENT_TEST")}
        literal = {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}
        log = (self.logs / f"{meta['name']}.log").open("ab")
        marker = f"cluster-{uuid.uuid4().hex}"
        proc = proctree.spawn(argv, {**base_env, **literal}, str(Path(__file__).resolve().parents[2]), log, marker)
        return _Container(meta["name"], meta["namespace"], meta["uid"], pod["spec"]["nodeName"], marker, proc, log, 0)


def _accepts(port: int) -> bool:
    if not port:
        return False
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False
