"""The job agent of a large job in steady state: every node's beats and every rank's beacons at that job's rates.

``bench/scale_sim.py`` runs the real rendezvous handler in every simulated node, and on a 2-core machine its
clients saturate the cores above 256 nodes. This benchmark measures what that one cannot reach: the agent's CPU and
memory at 1,024 nodes x 8 ranks, and how soon it reports a silent node there. The agent is the real one (local
mode, its front, store, guardian and loop, as in ``scale_sim``). The load is written to the wire directly, from
asyncio in a few processes, which costs a fraction of a Python ``TCPStore`` client per request:

* one round of ``--nodes`` nodes, written once as the closing node writes it (torch's ``_RendezvousState`` through
  its c10d backend, over the signed store), with each node's pod identity;
* each node, from a loopback address of its own and on connections of its own that prove the job's secret at the
  front: its beat every period of a job of that size (:func:`disttrain.api.spec.beat_interval_seconds`), its
  ranks' beacons (``--nproc`` per node, each a signed ``set`` under ``beacon_key(rank)``) every ``--step-seconds``,
  and every ``nodes / 32`` seconds the read of the state and of the agent's beat summary that its monitor loop and
  torch's sanitizer make at that size;
* every value sealed as the signed store seals it (checked at the start: the product's client reads one back).

What it leaves out: the rendezvous and the reform (``scale_sim`` runs those); torch's keep-alives (not written into
the state while the beat runs, at ``keepAliveIntervalSeconds`` 5). Printed: ``agent_cpu_cores`` (and its busiest
threads), ``agent_rss_mb``, the generator's own CPU, and ``detect_seconds``: from one node's last beat to its name
in ``silentNodes``.

    python bench/agent_load.py --nodes 1024 --nproc 8 --window 30
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import multiprocessing
import os
import pathlib
import pickle
import random
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

import scale_sim
from scale_sim import RUN_ID, SECRET, cpu_seconds, node_address, node_name, rss_mb, stop, thread_cpu

from disttrain.api import control, env, handshake, storeauth
from disttrain.api.spec import beat_interval_seconds
from disttrain.common.ports import free_port
from disttrain.trainer.agent import heartbeats
from disttrain.trainer.store import wire

VALIDATION_MAGIC = 0x3C85F7CE
"""torch's TCPStore client sends it first on every connection (``validationMagicNumber``)."""
HANDSHAKES_AT_ONCE = 32
"""Connections proving the secret at the same time: under the front's ``unproven_total``."""
STATE_READS_PER_SECOND = 32
"""A node of a large round reads the state from its monitor loop every ``nodes / 32`` seconds."""


def node_desc_name(index: int) -> str:
    """``repr`` of the node's torch ``_NodeDesc`` (``addr_pid_localid``), which its beat key names."""
    return f"{node_address(index)}_{10_000 + index}_0"


class Sealer:
    """Seals values as the signed store under the job's prefix does (``channel.scoped``): the seal names the job's
    prefix and the key; on the wire torch's client puts its own ``/`` before that (``TCPStore::keyPrefix_``)."""

    def __init__(self) -> None:
        self.mac_key = storeauth.mac_key(SECRET)
        self.prefix = storeauth.key_prefix(SECRET) + "/"

    def raw_key(self, key: str) -> bytes:
        return ("/" + self.prefix + key).encode()

    def sealed(self, key: bytes, value: str) -> bytes:
        return storeauth.seal_with(self.mac_key, RUN_ID, key.decode()[1:], value.encode(), time.time_ns())


def frame_set(key: bytes, value: bytes) -> bytes:
    return bytes([wire.SET]) + struct.pack("<Q", len(key)) + key + struct.pack("<Q", len(value)) + value


def frame_get(key: bytes) -> bytes:
    return bytes([wire.GET]) + struct.pack("<Q", len(key)) + key


async def open_proven(host: str, port: int, source: str, front_key: bytes) -> tuple[Any, Any]:
    """A connection from ``source`` that proved the secret at the front and validated with torch's server."""
    reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
    greeting = await reader.readexactly(wire.GREETING_LEN)
    answer = handshake.answer(front_key, greeting)
    writer.write(answer)
    proof = await reader.readexactly(wire.PROOF_LEN)
    if not handshake.check_proof(front_key, greeting, answer, proof):
        raise ConnectionError("the front did not prove the job's secret")
    writer.write(bytes([wire.VALIDATE]) + struct.pack("<I", VALIDATION_MAGIC))
    return reader, writer


class NodeLoad:
    """One simulated node's traffic; :meth:`run` until ``end``, silent from the moment ``victim`` names it."""

    def __init__(self, index: int, opts: dict[str, Any], sealer: Sealer) -> None:
        self.index, self.opts, self.sealer = index, opts, sealer
        self.beat_key = sealer.raw_key(heartbeats.beat_key(RUN_ID, node_desc_name(index)))
        nproc = opts["nproc"]
        self.ranks = range(index * nproc, (index + 1) * nproc)
        self.beacon_keys = [sealer.raw_key(control.beacon_key(rank)) for rank in self.ranks]
        self.reads = [
            sealer.raw_key(heartbeats.state_key(RUN_ID)),
            sealer.raw_key(heartbeats.beat_summary_key(RUN_ID)),
        ]
        self.read_bytes = 0
        self.sent = [0, 0]
        """Beats and beacons handed to the kernel (past the transport's buffer)."""

    async def run(self, gate: asyncio.Semaphore, victim: Any, end: Any, started: list[int]) -> None:
        opts, front_key = self.opts, wire.front_key(SECRET)
        async with gate:
            launcher = await open_proven(opts["host"], opts["port"], node_address(self.index), front_key)
            ranks = await open_proven(opts["host"], opts["port"], node_address(self.index), front_key)
        started.append(self.index)
        beat_s, step_s = opts["beat_seconds"], opts["step_seconds"]
        read_s = max(1.0, opts["nodes"] / STATE_READS_PER_SECOND)
        now = time.time()
        next_beat = now + random.uniform(0, beat_s)
        next_step = now + random.uniform(0, step_s)
        next_read = now + random.uniform(0, read_s)
        step = 0
        while not end.is_set() and victim.value != self.index:
            now = time.time()
            if now >= next_beat:
                launcher[1].write(
                    frame_set(self.beat_key, self.sealer.sealed(self.beat_key, heartbeats.encode_beat(now)))
                )
                await launcher[1].drain()  # a front that falls behind slows the load: the counts say so
                self.sent[0] += 1
                next_beat += beat_s
            if now >= next_step:
                step += 1
                ranks[1].write(b"".join(self._beacons(step, now)))
                await ranks[1].drain()
                self.sent[1] += len(self.ranks)
                next_step += step_s
            if now >= next_read:
                await self._read(launcher)
                next_read += read_s
            await asyncio.sleep(max(0.0, min(next_beat, next_step, next_read) - time.time()))
        while not end.is_set():  # a dead machine: its connections stay open, nothing more comes
            await asyncio.sleep(0.5)

    def _beacons(self, step: int, now: float) -> list[bytes]:
        frames = []
        world = self.opts["nodes"] * self.opts["nproc"]
        for rank, key in zip(self.ranks, self.beacon_keys, strict=True):
            beacon = control.StepBeacon(
                step=step,
                rank=rank,
                world_size=world,
                group="round-1",
                node=node_name(self.index),
                pod_uid=f"uid-{self.index}",
                time=now,
            )
            frames.append(frame_set(key, self.sealer.sealed(key, beacon.model_dump_json())))
        return frames

    async def _read(self, conn: tuple[Any, Any]) -> None:
        reader, writer = conn
        writer.write(b"".join(frame_get(key) for key in self.reads))
        for _ in self.reads:
            size = struct.unpack("<Q", await reader.readexactly(8))[0]
            self.read_bytes += len(await reader.readexactly(size))


def load_process(first: int, count: int, opts: dict[str, Any], ready: Any, victim: Any, end: Any, sent: Any) -> None:
    """``count`` nodes from index ``first`` on one asyncio loop; ``sent`` (beats, beacons) totals this process's."""

    async def run_nodes() -> None:
        sealer = Sealer()
        gate = asyncio.Semaphore(HANDSHAKES_AT_ONCE)
        started: list[int] = []
        nodes = [NodeLoad(first + i, opts, sealer) for i in range(count)]
        tasks = [asyncio.create_task(node.run(gate, victim, end, started)) for node in nodes]
        while len(started) < count:
            await asyncio.sleep(0.1)
            for task in tasks:
                if task.done() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        ready.put(("ready", first, os.getpid()))
        while not all(task.done() for task in tasks):
            await asyncio.sleep(0.25)
            with sent.get_lock():
                for kind in (0, 1):
                    sent[kind] += sum(node.sent[kind] for node in nodes)
            for node in nodes:
                node.sent = [0, 0]

    asyncio.run(run_nodes())


def write_round(port: int, nodes: int) -> Any:
    """The complete first round, as the closing node writes it, and every node's identity; returns the client."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    from disttrain.trainer.store import channel

    os.environ.update({env.STORE_SECRET: SECRET, env.STORE_FRONT: "1", env.JOB_UID: RUN_ID})  # through the front
    client = channel.connect("127.0.0.1", port, 120.0, SECRET)
    state = _RendezvousState()
    state.round, state.complete = 1, True
    now = datetime.datetime.now(datetime.timezone.utc)
    for index in range(nodes):
        desc = _NodeDesc(node_address(index), 10_000 + index, 0)
        assert repr(desc) == node_desc_name(index)
        state.participants[desc] = index
        state.last_heartbeats[desc] = now
    identities = [heartbeats.identity_key(RUN_ID, node_desc_name(i)) for i in range(nodes)]
    values = [heartbeats.NodeIdentity(node_name(i), f"uid-{i}").to_json() for i in range(nodes)]
    for at in range(0, nodes, 256):
        client.multi_set(identities[at : at + 256], values[at : at + 256])
    backend = C10dRendezvousBackend(client, RUN_ID)
    written = backend.set_state(pickle.dumps(state))
    if written is None or not written[2]:
        raise RuntimeError("the round's state was not written")
    return client


def check_sealing(client: Any, port: int) -> None:
    """One beat written by this script's sealer must read back through the product's signed client."""
    sealer, key = Sealer(), heartbeats.beat_key(RUN_ID, "seal-check")
    raw = sealer.raw_key(key)

    async def write() -> None:
        _, writer = await open_proven("127.0.0.1", port, "127.0.0.1", wire.front_key(SECRET))
        writer.write(frame_set(raw, sealer.sealed(raw, heartbeats.encode_beat(time.time()))))
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()

    asyncio.run(write())
    deadline = time.monotonic() + 10.0
    while not client.check([key]):  # the signed check: present and valid
        if time.monotonic() > deadline:
            raise RuntimeError("the product's client found no valid value where this script sealed one")
        time.sleep(0.1)
    if heartbeats.parse_beat(client.get(key)) is None:
        raise RuntimeError("the product's client did not read back a beat sealed here")


def wait_ready(queue: Any, count: int, timeout: float) -> list[int]:
    pids, deadline = [], time.monotonic() + timeout
    while len(pids) < count:
        pids.append(queue.get(timeout=max(0.1, deadline - time.monotonic()))[2])
    return pids


def status(state: pathlib.Path) -> dict[str, Any]:
    try:
        return dict(json.loads((state / "agent-status.json").read_text()))
    except (OSError, json.JSONDecodeError):
        return {}


@dataclasses.dataclass
class Sample:
    """The agent's and the generator's CPU seconds, the load sent so far, at one moment."""

    at: float
    agent: float
    generator: float
    threads: dict[int, float]
    sent: list[int]

    @classmethod
    def take(cls, agent_pid: int, generator_pids: list[int], sent: Any) -> Sample:
        generator = sum(map(cpu_seconds, generator_pids))
        return cls(time.monotonic(), cpu_seconds(agent_pid), generator, thread_cpu(agent_pid), list(sent))


def measure_window(agent_pid: int, pids: list[int], sent: Any, state: pathlib.Path, window_s: float) -> None:
    """The agent's CPU (by thread) and memory with every node beating and every rank sending its beacon."""
    before = Sample.take(agent_pid, pids, sent)
    peak, silent_seen, stalled_seen = 0.0, 0, 0
    while time.monotonic() - before.at < window_s:
        time.sleep(0.5)
        peak = max(peak, rss_mb(agent_pid))
        now = status(state)
        silent_seen = max(silent_seen, len(now.get("silentNodes") or []))
        stalled_seen = max(stalled_seen, len(now.get("stalledNodes") or []))
    after = Sample.take(agent_pid, pids, sent)
    span = after.at - before.at
    delivered = [(b - a) / span for a, b in zip(before.sent, after.sent, strict=True)]
    print(f"delivered_per_second: beats {delivered[0]:.0f}, beacons {delivered[1]:.0f}", flush=True)
    print(f"agent_cpu_cores: {(after.agent - before.agent) / span:.3f}", flush=True)
    busy = sorted(((after.threads[t] - before.threads.get(t, 0.0)) / span, t) for t in after.threads)[::-1]
    loop = next((c for c, t in busy if t == agent_pid), 0.0)
    print(f"agent_loop_thread_cpu_cores: {loop:.3f}", flush=True)
    others = [f"{c:.3f}" for c, t in busy if t != agent_pid][:4]
    print(f"agent_other_threads_cpu_cores: {' '.join(others)}", flush=True)
    print(f"generator_cpu_cores: {(after.generator - before.generator) / span:.3f}", flush=True)
    print(f"agent_rss_mb: {rss_mb(agent_pid):.0f}; peak {peak:.0f}", flush=True)
    members = len(status(state).get("roundMembers") or [])
    print(f"round_members: {members}", flush=True)
    print(f"most_silent_at_once: {silent_seen}", flush=True)
    print(f"most_stalled_at_once: {stalled_seen}", flush=True)


def measure_detection(victim: Any, target: int, state: pathlib.Path, timeout_s: float) -> None:
    """Silence node ``target`` and time its name's arrival in the agent's ``silentNodes``."""
    victim.value = target
    stopped_at, detected = time.time(), None
    deadline = time.monotonic() + timeout_s
    while detected is None and time.monotonic() < deadline:
        if any(s.get("node") == node_name(target) for s in status(state).get("silentNodes") or []):
            detected = time.time()
        time.sleep(0.02)
    print(f"detect_seconds: {detected - stopped_at:.2f}" if detected else "detect_seconds: none", flush=True)


def start_agent(state: pathlib.Path, port: int, log: Any) -> subprocess.Popen:
    agent_env = dict(os.environ, **{env.STORE_SECRET: SECRET, env.JOB_UID: RUN_ID, env.STORE_FRONT: "1"})
    where = ["--state-dir", str(state), "--port", str(port), "--host", "0.0.0.0"]  # every node's 127.0.x.y
    return subprocess.Popen(
        [sys.executable, "-m", "disttrain.trainer.agent", *where], env=agent_env, stdout=log, stderr=log
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--nodes", type=int, default=1024)
    parser.add_argument("--nproc", type=int, default=8, help="ranks per node (beacons per node and step)")
    parser.add_argument("--processes", type=int, default=2, help="generator processes")
    parser.add_argument("--step-seconds", type=float, default=1.0)
    parser.add_argument("--silent-after", type=float, default=1.0, help="spec.rendezvous.silentAfterSeconds")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds between the load's start and the window")
    parser.add_argument("--window", type=float, default=30.0, help="seconds of the steady window")
    parser.add_argument("--timeout", type=float, default=120.0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    state = pathlib.Path(tempfile.mkdtemp(prefix="agent-load-"))
    port = free_port()
    control_ = {"generation": 1, "action": "none", "targetNodes": args.nodes}
    scale_sim.write_job(state, scale_sim.job_document(args.nodes, 5, args.silent_after, control_))
    agent_log = open(state / "agent.log", "w")  # noqa: SIM115 - open for the agent's lifetime
    agent = start_agent(state, port, agent_log)
    beat_s = beat_interval_seconds(args.nodes, args.silent_after)
    opts = {
        "host": "127.0.0.1",
        "port": port,
        "nodes": args.nodes,
        "nproc": args.nproc,
        "beat_seconds": beat_s,
        "step_seconds": args.step_seconds,
    }
    ctx = multiprocessing.get_context("spawn")
    ready, victim, end, sent = ctx.Queue(), ctx.Value("i", -1), ctx.Event(), ctx.Array("q", 2)
    procs = []
    try:
        scale_sim.wait_for_port(port, 60.0)
        check_sealing(write_round(port, args.nodes), port)
        per = -(-args.nodes // args.processes)
        for first in range(0, args.nodes, per):
            load = (first, min(per, args.nodes - first), opts, ready, victim, end, sent)
            procs.append(ctx.Process(target=load_process, args=load))
            procs[-1].start()
        pids = wait_ready(ready, len(procs), args.timeout)
        print(f"nodes: {args.nodes}, ranks: {args.nodes * args.nproc}, generator processes: {len(procs)}", flush=True)
        print(f"beat_interval_seconds: {beat_s:g}; step_seconds: {args.step_seconds:g}", flush=True)
        rates = args.nodes / beat_s, args.nodes * args.nproc / args.step_seconds
        print(f"offered_per_second: beats {rates[0]:.0f}, beacons {rates[1]:.0f}", flush=True)
        time.sleep(args.settle)
        measure_window(agent.pid, pids, sent, state, args.window)
        measure_detection(victim, args.nodes - 1, state, args.timeout)
    finally:
        stop(end, agent, procs, agent_log, state)


if __name__ == "__main__":
    main()
