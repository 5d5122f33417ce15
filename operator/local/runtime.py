"""The local runtime: the operator's pure ``reconcile`` driving local process trees instead of pods.

One loop, the same shape as the kube adapter: observe (process trees -> PodViews, machines -> NodeViews, the
agent's relayed progress), ``reconcile(job, observed, now)``, apply the Actions (status, deletions, creations,
events), then wait for the next tick. Chaos events and scale requests from other terminals edit the "cluster"
between ticks, as a dying machine or ``kubectl scale`` would.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Optional

from disttrain.api import constants
from disttrain.api.spec import DistTrainJob
from disttrain.common.ports import free_port
from disttrain.operator import agentfields, announcements, eventrate, pods, reconcile
from disttrain.operator.local import agentlink, gpuslices
from disttrain.operator.local.chaos import ChaosEvent
from disttrain.operator.local.forkserver import ForkServers
from disttrain.operator.local.gpuslices import GpuSlices
from disttrain.operator.local.logtail import LogTail
from disttrain.operator.local.metrics import LocalMetrics
from disttrain.operator.local.nodes import LocalPod, chaos_victim
from disttrain.operator.local.spawner import PodPorts, PodSpawner
from disttrain.operator.local.statedir import StateDir
from disttrain.operator.local.summary import Recorder, Summary
from disttrain.operator.observed import Actions, Observed, WorkerCreation

TICK_SECONDS = 0.2
# Frequent events the display leaves out (the panel's checkpoint row shows the newest; events.jsonl keeps all).
QUIET_REASONS = frozenset({"CheckpointCommitted"})


@dataclasses.dataclass
class Snapshot:
    """What the display shows after each tick."""

    job: str
    elapsed: float
    status: dict[str, Any]
    pods: list[tuple[str, str, str]]
    """(pod name, machine, state) of every live pod, the agent first."""
    loss: Optional[float]
    samples_per_second: Optional[float]
    events: list[dict[str, Any]]
    metrics_url: str
    worker_metrics: list[str]


def rendezvous_fallback() -> Optional[str]:
    """None when torchrun here has the pods' rendezvous handler (entry-point group ``torchrun.handlers``), else
    ``c10d``, the stock backend it extends."""
    from importlib.metadata import entry_points

    if any(ep.name == constants.RDZV_BACKEND for ep in entry_points(group="torchrun.handlers")):
        return None
    return "c10d"


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How one local run goes, beside its job and state directory."""

    chaos: Sequence[ChaosEvent] = ()
    """The ``--chaos`` schedule."""
    workdir: Optional[str] = None
    """The nodes' working directory (None: this process's)."""
    metrics_port: int = 0
    """Where the run's Prometheus metrics are served (0: a free port)."""
    on_tick: Optional[Callable[[Snapshot], None]] = None
    """Called with a snapshot after every tick (the live panel, tests)."""
    on_event: Optional[Callable[[dict[str, Any]], None]] = None
    """Called with every event recorded."""
    not_ready_delay_s: float = 0.0
    """How long after a chaos ``kill-node`` its machine reads NotReady (0: at once; 40 is Kubernetes' default
    ``node-monitor-grace-period``). Meanwhile only the rendezvous heartbeats tell."""
    forks: Optional[ForkServers] = None
    """Fork servers the caller keeps across runs (it closes them; a test session runs many jobs of the same programs,
    each of which would otherwise import torch twice more); None: the run's own."""
    gpus: Optional[GpuSlices] = None
    """The machine's GPUs to split between the nodes (each gets its own ``CUDA_VISIBLE_DEVICES``); None leaves the
    nodes' environment as it is (a CPU machine, or a job that pins its devices itself)."""
    pulse_key: Optional[bytes] = None
    """An operator's own pulse key: the agent then pulses as on a cluster (on :attr:`LocalRuntime.pulse_port`, to
    whoever proves the job's key derived from this one), for a caller that links to it as the operator does. None:
    no pulse (the runtime watches the agent's process itself)."""


class LocalRuntime:
    def __init__(self, job: DistTrainJob, state: StateDir, options: RunOptions = RunOptions()) -> None:
        self.state = state
        self.options = options
        obj = job.model_dump(mode="json", by_alias=True, exclude_none=True)
        obj["metadata"]["uid"] = obj["metadata"].get("uid") or str(uuid.uuid4())
        obj["metadata"]["generation"] = obj["metadata"].get("generation") or 1
        obj["status"] = {}
        self.obj = obj
        self.chaos = list(options.chaos)
        self.workers: dict[str, LocalPod] = {}
        self.agent: Optional[LocalPod] = None
        self.lost_machines: list[LocalPod] = []
        self.agent_settings = pods.LOCAL_AGENT
        if options.pulse_key is not None:
            self.agent_settings = dataclasses.replace(
                pods.LOCAL_AGENT, pulse_s=constants.AGENT_PULSE_SECONDS, pulse_key=options.pulse_key
            )
        self.started = time.time()
        self.events: list[dict[str, Any]] = []
        self.event_filter = eventrate.EventFilter()
        """Rate-limits the store-rejection Warnings as the operator's adapter does on a cluster (one per key per
        window); the other reconcile Events are recorded as they come, as they always were here."""
        self.logs = LogTail(state.logs_dir)
        self.recorder = Recorder()
        self.recorder.job = obj["metadata"]["name"]
        self.metrics = LocalMetrics(obj["metadata"].get("namespace", "default"), obj["metadata"]["name"])
        self.metrics_url = ""
        self._status_written: Optional[dict[str, Any]] = None
        self.interrupted = False
        self.stop_requested = ""
        self.rdzv_fallback = rendezvous_fallback()
        self.cluster_checkpoint_dir = pods.checkpoint_dir(job)
        self._owns_forks = options.forks is None
        self.spawner = PodSpawner(
            state,
            options.workdir or os.getcwd(),
            options.forks if options.forks is not None else ForkServers(state.logs_dir),
            self.rdzv_fallback,
            with_gpus=options.gpus is not None,
            agent_settings=self.agent_settings,
            pulse_port=free_port() if options.pulse_key is not None else 0,
            pulse_key_file=str(state.path / "pulse-key") if options.pulse_key is not None else "",
        )
        """Pods start as forks of a process that imported torch once (the same program, without the import)."""
        self.store_port = self.spawner.store_port
        self.pulse_port = self.spawner.pulse_port
        self.pulse_key_file = self.spawner.pulse_key_file
        self.gpus = options.gpus
        self._waiting_for_gpus: set[str] = set()
        """Workers not created yet because no GPU slice was free (reported once each)."""

    # ---- the job object --------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return str(self.obj["metadata"]["name"])

    def job(self) -> DistTrainJob:
        return DistTrainJob.model_validate(self.obj)

    def set_replicas(self, replicas: int, why: str) -> None:
        nodes = self.obj["spec"]["nodes"]
        if nodes["replicas"] == replicas:
            return
        nodes["replicas"] = replicas
        self.obj["metadata"]["generation"] += 1
        self.record_event("Normal", "ScaleRequested", f"spec.nodes.replicas set to {replicas} ({why})")

    # ---- events ----------------------------------------------------------------------------------------
    def record_event(self, type_: str, reason: str, message: str, source: str = "local") -> None:
        event = {
            "time": time.time(),
            "elapsed": round(time.time() - self.started, 2),
            "type": type_,
            "reason": reason,
            "message": message,
            "source": source,
        }
        self.events.append(event)
        self.state.append_event(event)
        self.recorder.on_event(event)
        if self.options.on_event:
            self.options.on_event(event)

    # ---- process management ----------------------------------------------------------------------------
    def create_worker(self, worker: WorkerCreation) -> None:
        node_env = None
        if self.gpus is not None:
            devices = self.gpus.take(worker.name)
            if devices is None:
                self._wait_for_gpus(worker.name)
                return
            node_env = GpuSlices.env(devices)
        try:
            self._create_worker(worker, node_env)
        except BaseException:
            if self.gpus is not None:
                self.gpus.release(worker.name)
            raise

    def _wait_for_gpus(self, name: str) -> None:
        """No GPU slice is free for worker ``name``: it is not created (reconcile asks again at the next tick), as a
        pod the scheduler cannot place stays Pending."""
        if name in self._waiting_for_gpus:
            return
        self._waiting_for_gpus.add(name)
        assert self.gpus is not None
        self.record_event(
            "Warning",
            "NoFreeGpus",
            f"{name} waits: {len(self.gpus.free())} of this machine's {len(self.gpus.devices)} GPU(s) are free and "
            f"a node needs {self.gpus.per_node} (at most {self.gpus.capacity} node(s) fit); it starts once a node's "
            "processes are gone",
        )

    def _create_worker(self, worker: WorkerCreation, node_env: Optional[dict[str, str]]) -> None:
        job = self.job()
        pod = pods.build_worker_pod(
            job,
            worker.node_index,
            name=worker.name,
            endpoint=f"127.0.0.1:{self.store_port}",
            checkpoint_directory=str(self.state.checkpoints_dir),
        )
        port = free_port()
        local = self.spawner.spawn(job, pod, worker.node_index, PodPorts(port, free_port()), node_env)
        local.ready_port = self.store_port
        self.workers[local.name] = local
        self._waiting_for_gpus.discard(local.name)
        gpus = f", GPUs {node_env[gpuslices.VISIBLE_DEVICES_ENV]}" if node_env else ""
        self.record_event(
            "Normal",
            "NodeStarted",
            f"{local.name} on machine {local.node}{gpus}: log {self.state.log_file(local.name)}, worker "
            f"metrics http://127.0.0.1:{port}/metrics",
        )

    def create_agent(self) -> None:
        self.write_state()  # the agent takes a missing job.json for a deleted job, and a forked one reads it at once
        job = self.job()
        key = self.agent_settings.job_pulse_key(job)
        if key is not None and self.pulse_key_file:  # the job's Secret's pulse key, as the operator writes it
            fd = os.open(self.pulse_key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="ascii") as file:
                file.write(key.hex())
        pod = pods.build_agent_pod(job, self.agent_settings)
        pod = agentlink.localize_agent_pod(pod, self.state, self.store_port)
        self.agent = self.spawner.spawn(job, pod, -1)
        self.record_event(
            "Normal",
            "AgentStarted",
            f"{self.agent.name}: store on 127.0.0.1:{self.store_port}, log {self.state.log_file(self.agent.name)}",
        )

    def all_pods(self) -> list[LocalPod]:
        return [*([self.agent] if self.agent else []), *self.workers.values()]

    # ---- chaos and scale requests ----------------------------------------------------------------------
    def fire_chaos(self, now: float) -> None:
        step = int(self.obj["status"].get("step", 0))
        for event in [e for e in self.chaos if e.is_due(now - self.started, step)]:
            self.chaos.remove(event)
            self.apply_chaos(event)

    def chaos_victim(self, event: ChaosEvent) -> Optional[LocalPod]:
        """:func:`nodes.chaos_victim` among the workers; None (and a ChaosSkipped event) when none runs."""
        victim = chaos_victim(self.workers.values(), event.index)
        if victim is None:
            self.record_event("Warning", "ChaosSkipped", f"{event}: no running node")
        return victim

    def apply_chaos(self, event: ChaosEvent) -> None:
        if event.action == "drain-node":
            victim = self.chaos_victim(event)
            if victim is not None:
                self.record_event(
                    "Normal", "ChaosDrainNode", f"{event}: cordon of machine {victim.node} ({victim.name})"
                )
                victim.cordoned = True
        elif event.action == "kill-node":
            victim = self.chaos_victim(event)
            if victim is None:
                return
            self.record_event(
                "Warning",
                "ChaosKillNode",
                f"{event}: SIGKILL of machine {victim.node} ({victim.name}: torchrun and all its workers)",
            )
            victim.kill_machine(self.options.not_ready_delay_s)
        elif event.action == "kill-agent":
            if self.agent is None or not self.agent.is_alive:
                self.record_event("Warning", "ChaosSkipped", f"{event}: no running agent")
                return
            self.record_event("Warning", "ChaosKillAgent", f"{event}: SIGKILL of the job agent ({self.agent.name})")
            self.agent.kill_machine()
        elif event.action in ("add-node", "remove-node"):
            current = int(self.obj["status"].get("desiredNodes") or self.obj["spec"]["nodes"]["replicas"])
            self.set_replicas(current + (1 if event.action == "add-node" else -1), f"chaos {event}")

    def take_requests(self) -> None:
        for replicas in self.state.take_scale_requests():
            self.set_replicas(replicas, "disttrain local scale")

    # ---- one tick --------------------------------------------------------------------------------------
    def observe(self, now: float) -> Observed:
        machines = {p.node: p.node_view() for p in self.all_pods()}
        return Observed(
            workers=tuple(p.view() for p in self.workers.values()),
            agent=self.agent.view() if self.agent else None,
            nodes=machines,
        )

    def finish_deletions(self, now: float) -> None:
        for name, pod in list(self.workers.items()):
            if pod.is_gone(now):
                pod.close()
                del self.workers[name]
                if self.gpus is not None:
                    self.gpus.release(name)
        if self.agent is not None and self.agent.is_gone(now):
            self.agent.close()
            self.agent = None

    def apply(self, actions: Actions, now: float) -> None:
        self.obj["status"] = copy.deepcopy(dict(actions.status))
        for deletion in actions.delete_pods:
            pod = self.workers.get(deletion.name)
            if pod is None and self.agent is not None and self.agent.name == deletion.name:
                pod = self.agent
            if pod is None:
                continue
            if deletion.force or pod.node_lost or not pod.is_alive:
                pod.force_delete()
                pod.deleting_since = pod.deleting_since or now
            else:
                pod.terminate(now)
        self.finish_deletions(now)
        if actions.create_agent and self.agent is None:
            self.create_agent()
        for worker in actions.create_workers:
            if worker.name not in self.workers:
                self.create_worker(worker)
        for event in actions.events:
            if event.reason == announcements.STORE_VALUE_REJECTED and not self.event_filter.admit(
                (self.obj["metadata"].get("namespace", ""), self.name, event.type, event.reason, event.message), now
            ):
                continue
            self.record_event(event.type, event.reason, event.message, source="reconcile")

    def tick(self) -> Actions:
        now = time.time()
        self.take_requests()
        self.fire_chaos(now)
        self.finish_deletions(now)
        relayed = agentlink.read_relayed(self.state, self.cluster_checkpoint_dir)
        if relayed:
            self.obj["status"] = {**self.obj["status"], **relayed}
            self.obj = agentfields.sanitized_job(self.obj, self.obj["metadata"].get("namespace", ""), self.name)
        facts = self.logs.poll(now)
        self.recorder.on_status(self.obj["status"], facts, now)
        began = time.perf_counter()
        actions = reconcile.reconcile(self.job(), self.observe(now), now)
        self.metrics.observe_reconcile(time.perf_counter() - began)
        try:
            self.apply(actions, now)
        except Exception as exc:  # noqa: BLE001 - count, report, keep the loop alive like an operator
            self.metrics.observe_error(type(exc).__name__)
            self.record_event("Warning", "LocalError", f"applying actions failed: {exc!r}")
        policy = self.obj["spec"].get("restartPolicy", {})
        self.metrics.observe(
            self.obj["status"],
            now,
            max_restarts=policy.get("maxRestarts"),
            max_infrastructure_losses_per_hour=policy.get("maxInfrastructureLossesPerHour"),
        )
        self.write_state()
        if self.options.on_tick:
            self.options.on_tick(self.snapshot(now))
        return actions

    def snapshot(self, now: float) -> Snapshot:
        facts = self.logs.facts
        pods_shown = []
        for pod in self.all_pods():
            view = pod.view()
            state: str = "Terminating" if view.is_terminating else ("NodeLost" if pod.node_lost else view.phase)
            if view.exit_code is not None and view.phase == "Failed":
                state += f" ({view.exit_code})"
            pods_shown.append((pod.name, pod.node, state))
        return Snapshot(
            job=self.name,
            elapsed=now - self.started,
            status=self.obj["status"],
            pods=pods_shown,
            loss=facts.loss,
            samples_per_second=facts.samples_per_second,
            events=[e for e in self.events if e["reason"] not in QUIET_REASONS][-10:],
            metrics_url=self.metrics_url,
            worker_metrics=[
                f"http://127.0.0.1:{p.metrics_port}/metrics" for p in self.workers.values() if p.metrics_port
            ],
        )

    def write_state(self) -> None:
        status = self.obj["status"]
        if status != self._status_written:
            self.state.write_json(self.state.status_file, status)
            self.state.write_json(self.state.job_file, self.obj)
            self._status_written = copy.deepcopy(status)
        self.state.write_json(
            self.state.runtime_file,
            {
                "pid": os.getpid(),
                "job": self.name,
                "metricsUrl": self.metrics_url,
                "storePort": self.store_port,
                "started": self.started,
                "workerMetrics": {p.name: p.metrics_port for p in self.workers.values()},
                "finished": False,
            },
        )

    # ---- the whole run ---------------------------------------------------------------------------------
    def stop(self, reason: str) -> None:
        """End the run after the current tick (benchmarks stop long jobs at a fixed wall time)."""
        self.stop_requested = reason

    def is_done(self) -> bool:
        phase = self.obj["status"].get("phase")
        return phase in ("Succeeded", "Failed") and not self.all_pods()

    def run(self, timeout_s: Optional[float] = None) -> Summary:
        self.state.create()
        self.metrics_url = self.metrics.serve(self.options.metrics_port)
        self.record_event(
            "Normal", "LocalRunStarted", f"state in {self.state.path}; operator metrics at {self.metrics_url}"
        )
        if self.rdzv_fallback:
            self.record_event(
                "Warning",
                "RendezvousFallback",
                f"torchrun handler {constants.RDZV_BACKEND!r} is not installed in this environment; "
                f"nodes use {self.rdzv_fallback!r} (rounds wait for last-call timeouts, scale-ups may "
                "reform twice)",
            )
        self.spawner.prepare_forks(self.job())
        try:
            while not self.is_done() and not self.stop_requested:
                actions = self.tick()
                if timeout_s is not None and time.time() - self.started > timeout_s:
                    self.record_event("Warning", "LocalTimeout", f"run exceeded {timeout_s:.0f}s; stopping")
                    break
                wait = TICK_SECONDS if actions.requeue_after is None else min(TICK_SECONDS, actions.requeue_after)
                time.sleep(max(0.02, wait))
        except KeyboardInterrupt:
            self.interrupted = True
            self.record_event("Warning", "Interrupted", "stopped by the user (Ctrl-C); killing every local process")
        finally:
            self.shutdown()
        summary = self.recorder.summary(self.obj["status"], time.time() - self.started, self.logs.facts)
        self.state.write_json(self.state.summary_file, summary.to_dict())
        runtime = self.state.read_json(self.state.runtime_file) or {}
        runtime["finished"] = True
        self.state.write_json(self.state.runtime_file, runtime)
        return summary

    def shutdown(self) -> None:
        for pod in self.all_pods():
            pod.force_delete()
            pod.close()
            if self.gpus is not None:
                self.gpus.release(pod.name)
        self.workers.clear()
        self.agent = None
        if self._owns_forks:
            self.spawner.forks.close()
        self.metrics.shutdown()
        self.write_state()
