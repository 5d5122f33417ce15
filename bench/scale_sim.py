"""A large job by simulation: many simulated nodes speak the real protocol to one real job agent.

The agent is the real one (``python -m disttrain.trainer.agent --state-dir``, local mode: it follows ``job.json`` and
writes ``agent-status.json``), with its store, its front and its guardian. Each simulated node is a launcher without
workers: the real ``disttrain`` rendezvous handler (:func:`disttrain.trainer.launch.rendezvous.create_handler`, as
torchrun builds it, over the relay and the signed store, torch's keep-alives included), its node beat (10 a second),
and after the rendezvous one :class:`~disttrain.api.control.StepBeacon` per rank and step, written through the
signed store under ``beacon_key(rank)``, and between steps the handler's ``num_nodes_waiting`` as torchrun's monitor
loop asks it (every 0.1 s). What is simulated: the ranks' beacons of one node go through one
connection of that node (a real rank has a connection of its own), no training process runs, and the operator
is played by this script (it reads ``silentNodes`` and writes the ``reform`` directive with the lost node).
Each simulated node has an address of its own on the loopback (:func:`node_address`, ``127.0.x.y``), as a real
node has its pod's IP: it reaches the agent there, through a relay of its own whose connections leave from that
address, so the front's limits per source address apply to one node, as on a cluster.

Rounds of more than ``--per-node-joins-above`` nodes (the handler's default, 32) are joined by per-node records
(:mod:`disttrain.trainer.launch.joins`). The nodes run as threads, ``--nodes / --processes`` per process. Printed:

* ``rendezvous_seconds``: from the go to the last node's ``next_rendezvous()`` return (every node's join);
* ``agent_cpu_cores`` and ``agent_rss_mb``: the agent process over ``--window`` seconds with every node beating and
  every rank writing its beacon each ``--step-seconds`` (``/proc/<pid>/stat`` utime + stime);
* ``clients_cpu_cores``: the simulated nodes' processes over the same window (they share the machine);
* ``detect_seconds`` (the stop of one node to its name in ``silentNodes``) and ``reform_seconds`` (the stop to the
  last survivor's next round complete, through the operator's ``reform`` directive as the agent relays it);
* where the reform's time went: each survivor's phases (the directive to its ``next_rendezvous``, torch's exit and
  join operations, the rest), when the join records were written and how long a counter's slot took, and the
  tries to close the round.

    python bench/scale_sim.py --nodes 64 --processes 2
    python bench/scale_sim.py --nodes 1024 --processes 8 --keep-alive 5
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import pathlib
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import _localbench  # noqa: F401 - puts the repository on sys.path

from disttrain.api import control, env
from disttrain.api.spec import beat_interval_seconds
from disttrain.common.ports import free_port

SECRET = "scale-sim-bench-" + "5" * 48
RUN_ID = "scale-sim-uid"
TICKS = os.sysconf("SC_CLK_TCK")
MONITOR_INTERVAL_S = 0.1
"""torchrun's ``--monitor-interval`` default: each node's launcher asks ``num_nodes_waiting`` this often."""


def wait_for_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def node_name(index: int) -> str:
    return f"sim-worker-{index}"


def node_address(index: int) -> str:
    """The simulated node's own loopback address (Linux routes all of ``127.0.0.0/8`` to the loopback)."""
    return f"127.0.{1 + index // 250}.{1 + index % 250}"


def connect_from_destination() -> None:
    """Every relay of this process connects to the front from the address it connects to: a node's relay (one per
    store address, :func:`disttrain.trainer.store.relay.route`) then speaks from the node's own address."""
    import asyncio

    plain = asyncio.open_connection

    async def from_destination(host: Any = None, port: Any = None, **kwargs: Any) -> Any:
        return await plain(host, port, local_addr=(host, 0), **kwargs)

    asyncio.open_connection = from_destination  # type: ignore[assignment]


def cpu_seconds(pid: int) -> float:
    return cpu_seconds_of(pathlib.Path(f"/proc/{pid}/stat"))


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of ``pid`` (the main thread's id is ``pid``: the agent's loop)."""
    found = {}
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            found[int(task.name)] = cpu_seconds_of(task / "stat")
        except (OSError, ValueError):
            continue
    return found


def cpu_seconds_of(stat: pathlib.Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def job_document(nodes: int, keep_alive: int, silent_after: float, control_: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "disttrain.dev/v1alpha1",
        "kind": "DistTrainJob",
        "metadata": {"name": "scale-sim", "namespace": "bench", "uid": RUN_ID},
        "spec": {
            "nodes": {"min": 1, "max": nodes, "replicas": nodes},
            "rendezvous": {
                "keepAliveIntervalSeconds": keep_alive,
                "keepAliveMaxAttempts": 3,
                "silentAfterSeconds": silent_after,
            },
            "checkpoint": {"path": "/ckpt"},
            "training": {"globalBatchSize": 24, "microBatchSize": 2, "lr": {"base": 0.1}, "maxSteps": 1000},
        },
        "status": {"control": control_},
    }


def write_job(state: pathlib.Path, document: dict[str, Any]) -> None:
    tmp = state / ".job.json.tmp"
    tmp.write_text(json.dumps(document))
    os.replace(tmp, state / "job.json")


class SimNode:
    """One launcher: the handler (its beat starts with it), then rounds and the ranks' beacons until stopped."""

    def __init__(self, index: int, opts: dict[str, Any], events: Any) -> None:
        from torch.distributed.elastic.rendezvous import RendezvousParameters

        from disttrain.trainer.launch import rendezvous
        from disttrain.trainer.store import channel

        self.index, self.opts, self.events = index, opts, events
        os.environ[env.NODE_NAME] = node_name(index)
        os.environ[env.POD_UID] = f"uid-{index}"
        os.environ[env.NODE_INDEX] = str(index)
        params = RendezvousParameters(
            backend="disttrain",
            endpoint=f"{node_address(index)}:{opts['port']}",
            run_id=RUN_ID,
            min_nodes=1,
            max_nodes=opts["nodes"],
            local_addr=node_address(index),
            is_host="false",
            keep_alive_interval=opts["keep_alive"],
            keep_alive_max_attempt=3,
            join_timeout=600,
            last_call_timeout=30,
            read_timeout=120,
            per_node_joins_above=opts["joins_above"],
            silent_after=opts["silent_after"],
        )
        self.handler = rendezvous.create_handler(params)
        if opts["beat_interval"] and self.handler.beat is not None:
            self.handler.beat.interval_s = opts["beat_interval"]
        self.beacons = channel.connect(node_address(index), opts["port"], 120.0, SECRET)
        self.stopped = threading.Event()
        self.rejoin = threading.Event()
        self.rounds = 0
        self.joined = False
        self.thread = threading.Thread(target=self.run, name=f"sim-node-{index}", daemon=True)
        self.op_ends: dict[str, float] = {}
        self._time_ops()

    def _time_ops(self) -> None:
        """Note when each of torch's operations (exit, join) of ``next_rendezvous`` ends: where a reform's time goes."""
        executor = self.handler._op_executor
        run = executor.run

        def timed(state_handler: Any, deadline: float, update_deadline: Any = None) -> None:
            run(state_handler, deadline, update_deadline)
            self.op_ends[type(state_handler).__name__] = time.time()

        executor.run = timed

    def run(self) -> None:
        nproc, step_s = self.opts["nproc"], self.opts["step_seconds"]
        round_no = 0
        while not self.stopped.is_set():
            self.joined = False
            called = time.time()
            info = self.handler.next_rendezvous()
            self.joined = True
            round_no += 1
            self.rounds = round_no
            ends = self.op_ends
            exit_at, join_at = ends.get("_RendezvousExitOp", called), ends.get("_RendezvousJoinOp", called)
            self.events.put(("phases", self.index, round_no, called, exit_at, join_at, time.time()))
            world = info.world_size * nproc
            group = f"round-{round_no}"
            self.events.put(("round", self.index, round_no, time.time(), info.world_size))
            step = 0
            self.rejoin.clear()
            while not self.stopped.is_set() and not self.rejoin.is_set():
                step += 1
                began = time.time()
                for local in range(nproc):
                    rank = info.rank * nproc + local
                    beacon = control.StepBeacon(
                        step=step,
                        rank=rank,
                        world_size=world,
                        group=group,
                        node=node_name(self.index),
                        pod_uid=f"uid-{self.index}",
                        time=time.time(),
                    )
                    try:
                        self.beacons.set(control.beacon_key(rank), beacon.model_dump_json())
                    except Exception:  # noqa: BLE001 - a loaded store: the next step writes again
                        pass
                while not self.stopped.is_set() and not self.rejoin.is_set():
                    left = step_s - (time.time() - began)
                    if left <= 0:
                        break
                    self.stopped.wait(min(MONITOR_INTERVAL_S, left))
                    try:
                        self.handler.num_nodes_waiting()  # torchrun's monitor loop asks this every interval
                    except Exception:  # noqa: BLE001 - torchrun would restart the workers; the step goes on
                        pass

    def stop(self) -> None:
        """The node's machine dies: beats, torch's keep-alives and beacons stop without a word."""
        self.stopped.set()
        if self.handler.beat is not None:
            self.handler.beat.stop()
        self.handler._stop_heartbeats()


class StateCounts:
    """Counts of this process's reads and compare-and-sets of the shared rendezvous state (torch's c10d backend,
    wrapped, behaviour unchanged): where a round's time goes is in how many writes lose the race."""

    def __init__(self) -> None:
        from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as backend

        self.lock = threading.Lock()
        self.counts = {"reads": 0, "writes": 0, "lost": 0, "state_bytes": 0, "read_s": 0.0, "write_s": 0.0}
        get_state, set_state = backend.C10dRendezvousBackend.get_state, backend.C10dRendezvousBackend.set_state

        def counted_get(this: Any) -> Any:
            began = time.monotonic()
            found = get_state(this)
            self.add(reads=1, read_s=time.monotonic() - began, state_bytes=len(found[1]) if found else 0)
            return found

        def counted_set(this: Any, state: bytes, token: Any = None) -> Any:
            began = time.monotonic()
            found = set_state(this, state, token)
            lost = found is None or not found[2]
            logging.getLogger("scale_sim.state").info(
                "state write of %d bytes %s", len(state), "lost" if lost else "landed"
            )
            self.add(writes=1, lost=int(lost), write_s=time.monotonic() - began, state_bytes=len(state))
            return found

        backend.C10dRendezvousBackend.get_state = counted_get  # type: ignore[method-assign]
        backend.C10dRendezvousBackend.set_state = counted_set  # type: ignore[method-assign]

    def add(self, **amounts: float) -> None:
        with self.lock:
            for name, amount in amounts.items():
                if name == "state_bytes":
                    self.counts[name] = max(self.counts[name], amount)
                else:
                    self.counts[name] += amount

    def snapshot(self) -> dict[str, float]:
        with self.lock:
            return dict(self.counts)


def time_joins(events: Any) -> None:
    """Events for the steps of a join by record (:mod:`disttrain.trainer.launch.joins`, wrapped, behaviour unchanged):
    ``slot`` (the time a node took to win a counter's slot), ``record`` (when its record was written) and ``claim``
    (a try to close the round: when, and whether the claim landed)."""
    from disttrain.trainer.launch import joins

    take_slot, write_record, claim_closing = joins.take_slot, joins.write_record, joins.claim_closing

    def timed_take_slot(*args: Any, **kwargs: Any) -> Any:
        began = time.time()
        slot = take_slot(*args, **kwargs)
        events.put(("slot", time.time() - began))
        return slot

    def timed_write_record(*args: Any, **kwargs: Any) -> None:
        write_record(*args, **kwargs)
        events.put(("record", time.time()))

    def timed_claim_closing(*args: Any, **kwargs: Any) -> bool:
        claimed = bool(claim_closing(*args, **kwargs))
        events.put(("claim", time.time(), claimed))
        return claimed

    joins.take_slot, joins.write_record, joins.claim_closing = timed_take_slot, timed_write_record, timed_claim_closing


def sim_process(first: int, count: int, opts: dict[str, Any], events: Any, go: Any, kill: Any, end: Any) -> None:
    """``count`` simulated nodes from index ``first``; a watcher re-joins them on a new directive, as workers that
    exit on ``reform`` make their launchers do."""
    os.environ.update(
        {
            env.STORE_SECRET: SECRET,
            env.STORE_FRONT: "1",
            env.JOB_UID: RUN_ID,
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
    )
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

    from disttrain.trainer.launch import rendezvous
    from disttrain.trainer.store import channel

    time_joins(events)
    if opts["stock"]:  # the handler with torch's writes of the state: side by side with the handler's own
        rendezvous.LOST_WRITE_BACKOFF_S = 0.0  # a lost write decides and writes again at once

        def leave_alone(self: Any, leave: Any, ctx: Any, deadline: float) -> Any:
            return leave(ctx, deadline)  # each survivor of a reform removes itself

        rendezvous._TargetAwareOpExecutor._exit_with_target = leave_alone  # type: ignore[method-assign]

        def keep_alive_in_state(self: Any, ctx: Any) -> Any:
            return dyn._Action.KEEP_ALIVE if dyn._should_keep_alive(ctx) else dyn._Action.SYNC

        rendezvous._TargetAwareOpExecutor._keep_alive_or_sync = keep_alive_in_state  # type: ignore[method-assign]
    if opts["log_dir"]:
        import faulthandler
        import signal as signals

        stacks = open(f"{opts['log_dir']}/stacks-{first}.txt", "w")  # noqa: SIM115 - for the process's lifetime
        faulthandler.register(signals.SIGUSR1, stacks, all_threads=True)  # kill -USR1: every thread's stack
        logging.basicConfig(
            filename=f"{opts['log_dir']}/nodes-{first}.log",
            level=logging.INFO,
            format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s",
        )
    connect_from_destination()
    counts = StateCounts()
    nodes = [SimNode(first + i, opts, events) for i in range(count)]
    events.put(("ready", first, os.getpid()))
    go.wait()
    for node in nodes:
        node.thread.start()
    watcher = channel.connect("127.0.0.1", opts["port"], 120.0, SECRET)
    seen_generation = None
    reported = 0
    progress_at = time.monotonic()
    while not end.is_set():
        if time.monotonic() - progress_at >= 10:
            progress_at = time.monotonic()
            joined = sum(node.joined for node in nodes)
            events.put(("progress", first, time.time(), counts.snapshot(), joined))
        rounds = min((node.rounds for node in nodes if not node.stopped.is_set()), default=0)
        if rounds > reported:  # every node of this process is in its next round: the counts so far
            reported = rounds
            events.put(("counts", first, rounds, counts.snapshot()))
        victim = kill.value
        for node in nodes:
            if node.index == victim and not node.stopped.is_set():
                node.stop()
                events.put(("stopped", node.index, time.time()))
        signal = control.read_model(watcher, control.SIGNAL_KEY, control.ControlSignal)
        if signal is not None:
            if seen_generation is not None and signal.generation != seen_generation and signal.action != "none":
                for node in nodes:
                    node.rejoin.set()
            seen_generation = signal.generation
        end.wait(0.1)
    os._exit(0)  # the nodes' threads block in store calls; the machine is done with them


def stop(end: Any, agent: subprocess.Popen, procs: list[Any], agent_log: Any, state: pathlib.Path) -> None:
    """Ends the load's processes (through ``end``), then the agent; says where its state directory is."""
    end.set()
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    agent.terminate()
    try:
        agent.wait(10)
    except subprocess.TimeoutExpired:
        agent.kill()
    agent_log.close()
    print(f"state: {state}", flush=True)


def print_phases(events: Any, sink: list[tuple[Any, ...]], directive_at: float) -> None:
    """The survivors' reform by phase, median and 90th percentile: from the directive to ``next_rendezvous``, torch's
    exit operation, its join operation (the round complete), and the rest (rank assignment, the round's store)."""
    while True:
        try:
            sink.append(events.get_nowait())
        except queue.Empty:
            break
    rows = [e for e in sink if e[0] == "phases" and e[2] == 2]
    if not rows:
        return
    phases = {
        "to_call": [e[3] - directive_at for e in rows],
        "exit": [e[4] - e[3] for e in rows],
        "join": [e[5] - e[4] for e in rows],
        "after_join": [e[6] - e[5] for e in rows],
    }
    shown = []
    for name, values in phases.items():
        ordered = sorted(values)
        shown.append(f"{name} {ordered[len(ordered) // 2]:.2f} {ordered[int(0.9 * (len(ordered) - 1))]:.2f}")
    print("reform_phases_median_p90_seconds: " + "; ".join(shown), flush=True)
    called = min(e[3] for e in rows)
    records = sorted(e[1] - directive_at for e in sink if e[0] == "record" and e[1] >= called)
    slots = sorted(e[1] for e in sink if e[0] == "slot")[-len(rows) :]
    claims = [(e[1] - directive_at, e[2]) for e in sink if e[0] == "claim" and e[1] >= called]
    if records and slots:
        print(
            f"reform_join_records_written_median_last_seconds: {records[len(records) // 2]:.2f} {records[-1]:.2f};"
            f" slot_taking_median_max_seconds: {slots[len(slots) // 2]:.2f} {slots[-1]:.2f}",
            flush=True,
        )
    if claims:
        landed = [at for at, won in claims if won]
        first_won = f"{min(landed):.2f}" if landed else "none"
        print(
            f"reform_close_claims: {len(claims)} tried, {len(landed)} landed, first landed at {first_won}", flush=True
        )


def first_key(found: dict[Any, Any]) -> Any:
    return next(iter(found))


def wait_events(events: Any, kind: str, count: int, timeout: float, sink: list[tuple[Any, ...]]) -> None:
    deadline = time.monotonic() + timeout
    found = sum(1 for e in sink if e[0] == kind)
    while found < count:
        left = deadline - time.monotonic()
        if left <= 0:
            latest = {e[1]: e for e in sink if e[0] == "progress"}
            if latest:
                total = {name: sum(e[3][name] for e in latest.values()) for name in latest[first_key(latest)][3]}
                joined = sum(e[4] for e in latest.values())
                print(f"progress: {joined} nodes past their join; state so far: {total}", flush=True)
            raise TimeoutError(f"{found} of {count} {kind!r} events within {timeout:.0f} s")
        try:
            event = events.get(timeout=min(left, 1.0))
        except queue.Empty:
            continue
        sink.append(event)
        found += event[0] == kind


def print_counts(
    events: Any, seen: list[tuple[Any, ...]], processes: int, round_no: int, since: dict[str, float], timeout: float
) -> dict[str, float]:
    """The simulated nodes' reads and writes of the rendezvous state up to their ``round_no``-th round (less
    ``since``); returns the totals."""
    wait_events(events, "counts", processes * round_no, timeout, seen)
    total: dict[str, float] = {}
    for event in seen:
        if event[0] == "counts" and event[2] == round_no:
            for name, amount in event[3].items():
                total[name] = max(total.get(name, 0), amount) if name == "state_bytes" else total.get(name, 0) + amount
    delta = {name: amount if name == "state_bytes" else amount - since.get(name, 0) for name, amount in total.items()}
    writes, reads = max(1, int(delta["writes"])), max(1, int(delta["reads"]))
    print(
        f"round_{round_no}_state_reads: {delta['reads']:.0f}, writes: {delta['writes']:.0f}, lost writes: "
        f"{delta['lost']:.0f}, largest state: {delta['state_bytes'] / 1024:.0f} KiB, write round trip "
        f"{1000 * delta['write_s'] / writes:.0f} ms, read {1000 * delta['read_s'] / reads:.0f} ms",
        flush=True,
    )
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--nodes", type=int, default=1024)
    parser.add_argument("--nproc", type=int, default=8, help="ranks per node (beacons per node and step)")
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--step-seconds", type=float, default=1.0)
    parser.add_argument("--keep-alive", type=int, default=1, help="spec.rendezvous.keepAliveIntervalSeconds")
    parser.add_argument("--silent-after", type=float, default=1.0, help="spec.rendezvous.silentAfterSeconds")
    parser.add_argument(
        "--beat-interval",
        type=float,
        default=0.0,
        help="each node's beat period (default: the launcher's, for --nodes and --silent-after)",
    )
    parser.add_argument("--settle", type=float, default=5.0, help="seconds between the rendezvous and the window")
    parser.add_argument("--window", type=float, default=20.0, help="seconds of the steady window")
    parser.add_argument("--log", action="store_true", help="the nodes' logs into the state directory")
    parser.add_argument("--profile", action="store_true", help="cProfile the agent's loop into <state>/agent.prof")
    parser.add_argument(
        "--stock",
        action="store_true",
        help="the state written as torch writes it: every join a compare-and-set of it, no pause after a lost write, "
        "survivors of a reform leave one by one, waiting nodes keep alive in the state",
    )
    parser.add_argument(
        "--per-node-joins-above",
        type=int,
        default=32,
        help="rdzv-conf per_node_joins_above: larger rounds join by per-node records (a huge number: compare-and-set)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="longest wait for the rendezvous or the reform")
    args = parser.parse_args()
    state = pathlib.Path(tempfile.mkdtemp(prefix="scale-sim-"))
    port = free_port()
    first_control = {"generation": 1, "action": "none", "targetNodes": args.nodes}
    write_job(state, job_document(args.nodes, args.keep_alive, args.silent_after, first_control))
    agent_env = dict(os.environ, **{env.STORE_SECRET: SECRET, env.JOB_UID: RUN_ID, env.STORE_FRONT: "1"})
    agent_log = open(state / "agent.log", "w")  # noqa: SIM115 - open for the agent's lifetime
    profile = ["-m", "cProfile", "-o", str(state / "agent.prof")] if args.profile else []
    where = ["--state-dir", str(state), "--port", str(port), "--host", "0.0.0.0"]  # every node's 127.0.x.y
    agent = subprocess.Popen(
        [sys.executable, *profile, "-m", "disttrain.trainer.agent", *where],
        env=agent_env,
        stdout=agent_log,
        stderr=subprocess.STDOUT,
    )
    ctx = multiprocessing.get_context("spawn")
    events, go, end, kill = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Value("i", -1)
    opts = {
        "port": port,
        "nodes": args.nodes,
        "nproc": args.nproc,
        "step_seconds": args.step_seconds,
        "keep_alive": args.keep_alive,
        "silent_after": args.silent_after,
        "beat_interval": args.beat_interval,
        "log_dir": str(state) if args.log else "",
        "stock": args.stock,
        "joins_above": 1 << 30 if args.stock else args.per_node_joins_above,
    }
    per = -(-args.nodes // args.processes)
    sims = []
    seen: list[tuple[Any, ...]] = []
    try:
        wait_for_port(port, 60.0)  # the front listens once the agent's store serves
        for first in range(0, args.nodes, per):
            proc = ctx.Process(
                target=sim_process, args=(first, min(per, args.nodes - first), opts, events, go, kill, end)
            )
            proc.start()
            sims.append(proc)
        wait_events(events, "ready", len(sims), args.timeout, seen)
        sim_pids = [e[2] for e in seen if e[0] == "ready"]
        print(f"nodes: {args.nodes}, ranks: {args.nodes * args.nproc}, processes: {len(sims)}", flush=True)
        beat_s = args.beat_interval or beat_interval_seconds(args.nodes, args.silent_after)
        print(f"beat_interval_seconds: {beat_s:g}", flush=True)
        cpu_before = cpu_seconds(agent.pid), sum(cpu_seconds(p) for p in sim_pids)
        began = time.time()
        go.set()
        wait_events(events, "round", args.nodes, args.timeout, seen)
        done = max(e[3] for e in seen if e[0] == "round" and e[2] == 1)
        print(f"rendezvous_seconds: {done - began:.2f}", flush=True)
        cpu_after = cpu_seconds(agent.pid), sum(cpu_seconds(p) for p in sim_pids)
        print(f"rendezvous_agent_cpu_seconds: {cpu_after[0] - cpu_before[0]:.1f}", flush=True)
        print(f"rendezvous_clients_cpu_seconds: {cpu_after[1] - cpu_before[1]:.1f}", flush=True)
        first_counts = print_counts(events, seen, len(sims), 1, {}, args.timeout)

        time.sleep(args.settle)  # every beat and beacon flowing
        a0, c0, t0 = cpu_seconds(agent.pid), sum(cpu_seconds(p) for p in sim_pids), time.monotonic()
        threads0 = thread_cpu(agent.pid)
        peak = 0.0
        while time.monotonic() - t0 < args.window:
            time.sleep(0.5)
            peak = max(peak, rss_mb(agent.pid))
        a1, c1, t1 = cpu_seconds(agent.pid), sum(cpu_seconds(p) for p in sim_pids), time.monotonic()
        threads1 = thread_cpu(agent.pid)
        busy = sorted(((threads1[t] - threads0.get(t, 0.0)) / (t1 - t0), t) for t in threads1)[::-1]
        status = json.loads((state / "agent-status.json").read_text())
        print(f"agent_cpu_cores: {(a1 - a0) / (t1 - t0):.3f}", flush=True)
        loop = next((c for c, t in busy if t == agent.pid), 0.0)
        print(f"agent_loop_thread_cpu_cores: {loop:.3f}", flush=True)
        others = [f"{c:.3f}" for c, t in busy if t != agent.pid][:3]
        print(f"agent_other_threads_cpu_cores: {' '.join(others)}", flush=True)
        print(f"clients_cpu_cores: {(c1 - c0) / (t1 - t0):.3f}", flush=True)
        print(f"agent_rss_mb: {rss_mb(agent.pid):.0f}", flush=True)
        print(f"agent_rss_peak_mb: {peak:.0f}", flush=True)
        print(f"silent_in_steady_window: {len(status.get('silentNodes') or [])}", flush=True)
        print(f"stalled_in_steady_window: {len(status.get('stalledNodes') or [])}", flush=True)
        members = len(status.get("roundMembers") or [])
        print(f"round_members_in_steady_window: {members}", flush=True)  # torch's sanitizer drops late keep-alives

        victim = args.nodes - 1
        kill.value = victim
        wait_events(events, "stopped", 1, 30, seen)
        stopped_at = next(e[2] for e in seen if e[0] == "stopped")
        name, detected = node_name(victim), None
        deadline = time.monotonic() + args.timeout
        while detected is None and time.monotonic() < deadline:
            try:
                silent = json.loads((state / "agent-status.json").read_text()).get("silentNodes") or []
            except json.JSONDecodeError:
                silent = []
            if any(s.get("node") == name for s in silent):
                detected = time.time()
            else:
                time.sleep(0.05)
        if detected is None:
            print(f"detect_seconds: none within {args.timeout:.0f} s", flush=True)
            return
        print(f"detect_seconds: {detected - stopped_at:.2f}", flush=True)
        reform = {"generation": 2, "action": "reform", "targetNodes": args.nodes - 1, "lost": [name]}
        write_job(state, job_document(args.nodes, args.keep_alive, args.silent_after, reform))
        wait_events(events, "round", args.nodes + args.nodes - 1, args.timeout, seen)
        reformed = max(e[3] for e in seen if e[0] == "round" and e[2] == 2)
        sizes = {e[4] for e in seen if e[0] == "round" and e[2] == 2}
        print(f"reform_seconds: {reformed - stopped_at:.2f}", flush=True)
        print(f"reform_after_directive_seconds: {reformed - detected:.2f}", flush=True)
        arrivals = sorted(e[3] - detected for e in seen if e[0] == "round" and e[2] == 2)
        quartiles = [arrivals[int(q * (len(arrivals) - 1))] for q in (0.0, 0.5, 0.9)]
        print("reform_after_directive_first_median_p90_seconds: " + " ".join(f"{t:.2f}" for t in quartiles), flush=True)
        print_phases(events, seen, detected)
        print_counts(events, seen, len(sims), 2, first_counts, args.timeout)
        print(f"reformed_world_nodes: {','.join(map(str, sorted(sizes)))}", flush=True)
        print(f"agent_rss_end_mb: {rss_mb(agent.pid):.0f}", flush=True)
        print(f"agent_rss_hwm_mb: {rss_mb(agent.pid, 'VmHWM'):.0f}", flush=True)
    finally:
        stop(end, agent, sims, agent_log, state)


if __name__ == "__main__":
    main()
