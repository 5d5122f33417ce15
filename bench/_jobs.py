"""The benchmark's training jobs: the real job agent code, fed by stand-in trainers through its store keys.

Each job runs the real :class:`disttrain.trainer.agent.service.Agent` with the real :class:`KubeJobSource`, logged in
with the job's own ServiceAccount token (so the per-job Role the operator creates is what allows its calls),
in a thread (:class:`JobFleet`), the fleet spread over a few processes (:class:`ShardedJobFleet`). Only two
things are stood in, both below the API: the TCPStore is a dict with the three methods the agent uses, and the
trainer is a loop that writes exactly what rank 0 writes into it (``PROGRESS_KEY`` after every step,
``CHECKPOINT_KEY`` after every commit) and follows the directives the agent relays as the workers do: a drain
commits a checkpoint at the next step boundary and the group re-forms at the target size, a reform re-forms at
once (the new group's rank 0 is a new process). So every API request in the count is one the real agent makes, in
the pattern it makes it, without 2 x J processes importing torch; and a scaled job goes through the whole drain
(checkpoint, victim deleted, new round, directive done), where a stand-in that ignored directives left each
probed job's drain in flight for the rest of the run.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import multiprocessing
import pathlib
import threading
import time
from typing import Any, Optional, Union

from disttrain.api import control as keys
from disttrain.api import timestamps
from disttrain.trainer.agent import service as agent_mod

MICRO_BATCH = 2
WRITES_FILE_SECONDS = 2.0
"""How often each shard process writes its agents' status writes by reason (:meth:`ShardedJobFleet.status_writes`)."""


def global_batch(max_nodes: int) -> int:
    """A fixed global batch that every world size from 1 to ``max_nodes`` divides (``microBatchSize`` 2)."""
    return MICRO_BATCH * math.lcm(*range(1, max_nodes + 1))


def plan(world_size: int, batch: int) -> dict[str, float | int]:
    """The batch plan rank 0 reports: the job's fixed global batch ``batch`` over ``world_size`` one-process nodes."""
    accum = max(1, batch // (MICRO_BATCH * world_size))
    return {
        "worldSize": world_size,
        "globalBatch": batch,
        "microBatch": MICRO_BATCH,
        "accumSteps": accum,
        "lrScale": 1.0,
    }


class DictStore:
    """The part of a TCPStore the agent uses (``check``, ``get``, ``set``), in memory."""

    verifies_values = True
    """Only the stand-in trainer writes it, so the agent may read the rendezvous state from it (absent here: no
    round members and no silent nodes), as it reads it from its signed store in a pod."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def check(self, names: list[str]) -> bool:
        with self._lock:
            return all(name in self._values for name in names)

    def get(self, name: str) -> bytes:
        with self._lock:
            return self._values[name]

    def multi_get(self, names: list[str]) -> list[bytes]:
        with self._lock:
            return [self._values[name] for name in names]

    def set(self, name: str, value: Union[str, bytes]) -> None:
        with self._lock:
            self._values[name] = value.encode() if isinstance(value, str) else value


@dataclasses.dataclass
class SimulatedTrainer:
    """What global rank 0 of a group of one-process nodes writes into the agent's store: a step's progress, a
    commit's manifest; and how the group follows a directive (:meth:`_follow_directive`)."""

    store: DictStore
    world_size: int = 3
    batch: int = 24
    """The job's ``globalBatchSize`` (:func:`global_batch`)."""
    step: int = 0
    run_id: str = "bench"
    group: int = 0
    """Groups (rendezvous rounds) so far: each has a rank-0 process of its own, which the agent counts rounds by."""
    seen_generation: Optional[int] = None
    """The directive generation acted on last; the one present at start is history, as for a starting worker."""

    def advance(self, checkpoint_every: int) -> None:
        if self._follow_directive():
            return  # the old group exited at this step boundary; the new one reports from the next step on
        self.step += 1
        now = time.time()
        self.store.set(
            keys.PROGRESS_KEY,
            json.dumps(
                {
                    "step": self.step,
                    "samples_consumed": self.step * self.batch,
                    "world_size": self.world_size,
                    "plan": plan(self.world_size, self.batch),
                    "loss": 1.0,
                    "samples_per_second": 96.0,
                    "restart_count": 0,
                    "run_id": self.run_id,
                    "process_id": f"{self.run_id}-group{self.group}-rank0",
                    "time": now,
                }
            ),
        )
        if self.step % checkpoint_every == 0:
            self._write_checkpoint(now)

    def _write_checkpoint(self, now: float) -> None:
        self.store.set(
            keys.CHECKPOINT_KEY,
            json.dumps(
                {
                    "step": self.step,
                    "samples_consumed": self.step * self.batch,
                    "data_cursor": self.step * self.batch,
                    "world_size": self.world_size,
                    "plan": plan(self.world_size, self.batch),
                    "lr_scale": 1.0,
                    "dataset": {"length": 10**9, "seed": 0},
                    "metadata_sha256": "0" * 64,
                    "files": {},
                    "created_at": timestamps.format_time(now),
                    "code_version": "bench",
                    "config_hash": "bench",
                }
            ),
        )

    def _follow_directive(self) -> bool:
        """A new drain or reform in the store: the group exits (a drain after a checkpoint of the last step) and the
        next round forms with the target's node count. Returns whether it did."""
        signal = keys.read_model(self.store, keys.SIGNAL_KEY, keys.ControlSignal)
        if signal is None:
            return False
        if self.seen_generation is None or signal.generation <= self.seen_generation:
            self.seen_generation = signal.generation if self.seen_generation is None else self.seen_generation
            return False
        self.seen_generation = signal.generation
        if signal.action is keys.DirectiveAction.NONE:
            return False
        if signal.action is keys.DirectiveAction.DRAIN:
            self._write_checkpoint(time.time())
        target = keys.read_model(self.store, keys.TARGET_KEY, keys.TargetPlan)
        if target is not None and target.generation == signal.generation and target.nodes > 0:
            self.world_size = target.nodes
        self.group += 1
        return True


class JobFleet:
    """J agents (threads) and one loop stepping every stand-in trainer whose agent runs."""

    def __init__(
        self, step_seconds: float, checkpoint_every: int, poll_seconds: float = 0.25, job_nodes: int = 3
    ) -> None:
        self.step_seconds = step_seconds
        self.checkpoint_every = checkpoint_every
        self.poll_seconds = poll_seconds
        self.job_nodes = job_nodes
        self.trainers: list[SimulatedTrainer] = []
        self.agents: list[Any] = []
        self._waiting: list[tuple[Any, SimulatedTrainer]] = []
        self._stop = threading.Event()
        self._driver = threading.Thread(target=self._drive, name="trainers", daemon=True)

    def add(self, namespace: str, name: str, api_client: Any) -> None:
        store = DictStore()
        agent = agent_mod.Agent(
            agent_mod.KubeJobSource(namespace, name, api_client), store, poll_seconds=self.poll_seconds
        )
        trainer = SimulatedTrainer(
            store, world_size=self.job_nodes, batch=global_batch(self.job_nodes + 1), run_id=name
        )
        self._waiting.append((agent, trainer))

    def start(self, jobs_per_second: float = 25.0) -> None:
        """Start the jobs a few at a time, as pods start in a cluster (500 first writes at once would be refused
        with 429 by a small API server): each agent, and its trainer with it."""
        self._driver.start()
        for agent, trainer in self._waiting:
            threading.Thread(target=agent.run, name=f"agent-{agent.source.name}", daemon=True).start()
            self.agents.append(agent)
            self.trainers.append(trainer)
            time.sleep(1.0 / jobs_per_second)

    def status_writes(self) -> collections.Counter[str]:
        """The agents' status writes so far, by reason (:attr:`Agent.status_writes`)."""
        total: collections.Counter[str] = collections.Counter()
        for agent in list(self.agents):
            total.update(dict(agent.status_writes))
        return total

    def stop(self) -> None:
        self._stop.set()
        for agent in self.agents:
            agent.stop_event.set()
            close = getattr(agent.source, "close", None)  # the watching source (the polling one has none)
            if close is not None:
                close()

    def _drive(self) -> None:
        tick = time.monotonic()
        while not self._stop.is_set():
            for trainer in list(self.trainers):
                trainer.advance(self.checkpoint_every)
            tick += self.step_seconds
            self._stop.wait(max(0.0, tick - time.monotonic()))


@dataclasses.dataclass(frozen=True)
class JobEntry:
    """What a process needs to run one job's agent: where the job is and the kubeconfig of its ServiceAccount."""

    namespace: str
    name: str
    kubeconfig: str


@dataclasses.dataclass(frozen=True)
class ShardOptions:
    """How every shard's jobs run, and where a shard reports its agents' writes."""

    step_seconds: float
    checkpoint_every: int
    poll_seconds: float
    job_nodes: int
    jobs_per_second: float
    writes_dir: pathlib.Path


def _run_shard(entries: list[JobEntry], options: ShardOptions, index: int, delay: float, stop: Any) -> None:
    """One process of a :class:`ShardedJobFleet`: a :class:`JobFleet` of ``entries`` until ``stop`` is set; every
    :data:`WRITES_FILE_SECONDS` its agents' status writes by reason go to ``writes_dir/shard-<index>.json``."""
    from kubernetes import config as kube_config

    fleet = JobFleet(options.step_seconds, options.checkpoint_every, options.poll_seconds, options.job_nodes)
    for entry in entries:
        fleet.add(entry.namespace, entry.name, kube_config.new_client_from_config(config_file=entry.kubeconfig))
    time.sleep(delay)
    threading.Thread(target=fleet.start, args=(options.jobs_per_second,), name="starter", daemon=True).start()
    path = options.writes_dir / f"shard-{index}.json"
    while not stop.wait(WRITES_FILE_SECONDS):
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps(dict(fleet.status_writes())))
        partial.replace(path)
    fleet.stop()


class ShardedJobFleet:
    """The J agents spread over ``processes`` interpreters, as a cluster spreads them over pods.

    In one interpreter, 500 agents' watch and write threads share one GIL: an agent then reads its watch late, and
    the API server's watch cache, which waits a while for a slow reader before it drops it, holds back every other
    watcher of the resource (the operator's among them). Agents in pods have no such neighbour."""

    def __init__(self, processes: int, options: ShardOptions) -> None:
        self.processes = processes
        self.options = options
        options.writes_dir.mkdir(parents=True, exist_ok=True)
        self.entries: list[JobEntry] = []
        self._context = multiprocessing.get_context("spawn")
        self._stop = self._context.Event()
        self.shards: list[Any] = []

    def add(self, namespace: str, name: str, kubeconfig: str) -> None:
        self.entries.append(JobEntry(namespace, name, kubeconfig))

    def start(self) -> None:
        """Start every shard; together they start ``options.jobs_per_second`` agents a second, interleaved."""
        rate = self.options.jobs_per_second
        shard_options = dataclasses.replace(self.options, jobs_per_second=rate / self.processes)
        for index in range(self.processes):
            entries = self.entries[index :: self.processes]
            shard = self._context.Process(
                target=_run_shard,
                args=(entries, shard_options, index, index / rate, self._stop),
                name=f"agents-{index}",
                daemon=True,
            )
            shard.start()
            self.shards.append(shard)

    def status_writes(self) -> collections.Counter[str]:
        """Every agent's status writes so far, by reason, as the shards last reported them."""
        total: collections.Counter[str] = collections.Counter()
        for path in self.options.writes_dir.glob("shard-*.json"):
            total.update(json.loads(path.read_text()))
        return total

    @property
    def pids(self) -> list[int]:
        return [shard.pid for shard in self.shards if shard.pid is not None]

    def stop(self) -> None:
        self._stop.set()
        for shard in self.shards:
            shard.join(timeout=10)
            if shard.is_alive():
                shard.kill()
