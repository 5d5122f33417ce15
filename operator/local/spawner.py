"""Pods started on this machine: each pod dict becomes a process tree on a fresh local "machine" (``local-N``).

The pod is translated (:mod:`.translate`: addresses, paths, ports), given a uid and a log, and started as a fork of
a fork server that imported torch once (:mod:`.forkserver`; cold where a fork would differ).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
import uuid
from typing import Any, Optional

from disttrain.api import env as env_names
from disttrain.api import storeauth
from disttrain.api.spec import DistTrainJob
from disttrain.common.ports import free_port
from disttrain.operator import names, pods
from disttrain.operator.local import agentlink, forkserver, gpuslices, translate
from disttrain.operator.local.forkserver import ForkServers
from disttrain.operator.local.nodes import LocalPod
from disttrain.operator.local.statedir import StateDir


@dataclasses.dataclass(frozen=True)
class PodPorts:
    """The ports a started pod serves on this machine (0: none)."""

    metrics: int = 0
    readiness: int = 0


@dataclasses.dataclass
class PodSpawner:
    """Starts the pods of one local job, each on a machine of its own, and the fork servers they fork from."""

    state: StateDir
    workdir: str
    forks: ForkServers
    rdzv_backend: Optional[str] = None
    """torchrun's rendezvous backend to use instead of the pod's (None: the pod's handler is installed here)."""
    with_gpus: bool = False
    """Each node gets its own ``CUDA_VISIBLE_DEVICES`` (the fork servers leave it to each pod)."""
    store_port: int = dataclasses.field(default_factory=free_port)
    """Where the local job agent serves the store."""
    store_secret: str = dataclasses.field(default_factory=storeauth.new_secret)
    agent_settings: pods.AgentSettings = pods.LOCAL_AGENT
    """How the job agent runs here (with a pulse key, it pulses as on a cluster)."""
    pulse_port: int = 0
    """Where the agent serves its pulse (0: it does not)."""
    pulse_key_file: str = ""
    """The file the agent reads the job's pulse key from ("" without a pulse)."""
    machine_count: int = 0

    def site(self, job: DistTrainJob) -> translate.LocalSite:
        host = names.agent_service_name(job.metadata.name)
        ns = job.metadata.namespace
        return translate.LocalSite(
            agent_hosts=(f"{host}.{ns}.svc.cluster.local", f"{host}.{ns}.svc", f"{host}.{ns}", host),
            cluster_port=job.spec.rendezvous.port,
            local_port=self.store_port,
            cluster_checkpoint_dir=pods.checkpoint_dir(job),
            checkpoint_dir=str(self.state.checkpoints_dir),
            workdir=self.workdir,
            base_env=dict(os.environ),
            rdzv_backend=self.rdzv_backend,
            store_secret=self.store_secret,
            pulse_port=self.pulse_port,
            pulse_key_file=self.pulse_key_file,
        )

    def spawn(
        self,
        job: DistTrainJob,
        pod: dict[str, Any],
        index: int,
        ports: PodPorts = PodPorts(),
        node_env: Optional[dict[str, str]] = None,
    ) -> LocalPod:
        """Start ``pod``'s process tree on a fresh local machine; ``node_env``: what this node's environment has of
        its own (its GPUs), over the pod's."""
        name = pod["metadata"]["name"]
        self.machine_count += 1
        machine = f"local-{self.machine_count}"
        uid = str(uuid.uuid4())
        pod = copy.deepcopy(pod)
        pod["metadata"]["uid"] = uid
        spec = translate.to_process(pod, self.site(job), machine, ports.metrics, ports.readiness)
        if node_env:
            spec = dataclasses.replace(spec, env={**spec.env, **node_env}, per_pod=spec.per_pod | frozenset(node_env))
        termination_log = ""
        if env_names.TERMINATION_LOG in spec.env:  # a worker: its launcher's failure report, one file per pod
            termination_log = str(self.state.logs_dir / f"{name}.{uid}.termination")
            spec = dataclasses.replace(spec, env={**spec.env, env_names.TERMINATION_LOG: termination_log})
        log = self.state.log_file(name).open("ab")
        log.write(f"==== {time.strftime('%H:%M:%S')} {name} (uid {uid}) on {machine}: {' '.join(spec.argv)}\n".encode())
        log.flush()
        marker = f"{job.metadata.uid}/{uid}"
        proc = forkserver.start_pod(self.forks, spec.argv, spec.env, spec.cwd, log, marker, spec.per_pod)
        return LocalPod(
            name=name,
            uid=uid,
            index=index,
            node=machine,
            marker=marker,
            proc=proc,
            log=log,
            created_at=time.time(),
            metrics_port=ports.metrics,
            readiness_port=ports.readiness,
            termination_log=termination_log,
        )

    def prepare_forks(self, job: DistTrainJob) -> None:
        """Start the fork servers of the agent and the nodes at once: they import torch side by side, and the first
        tick's pods wait for both together rather than one after the other."""
        if not self.forks.enabled:
            return
        agent = agentlink.localize_agent_pod(
            pods.build_agent_pod(job, self.agent_settings), self.state, self.store_port
        )
        worker = pods.build_worker_pod(
            job, 0, endpoint=f"127.0.0.1:{self.store_port}", checkpoint_directory=str(self.state.checkpoints_dir)
        )
        for pod in (agent, worker):
            try:
                spec = translate.to_process(pod, self.site(job), "local-0", 0, 0)
            except ValueError:
                continue  # a pod that cannot run here: creating it reports why
            per_pod = spec.per_pod | ({gpuslices.VISIBLE_DEVICES_ENV} if self.with_gpus else set())
            self.forks.prepare(spec.argv, spec.env, per_pod)
