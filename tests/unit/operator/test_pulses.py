"""The job agent's pulse end to end on real sockets: the agent's server (trainer/agent/pulse.py), the operator's
links (operator/pulses.py) and the rule (operator/agentbeat.py) on the operator's real clock."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time

import pytest

from disttrain.api import constants
from disttrain.api import pulse as wire
from disttrain.operator import pulses
from disttrain.operator.agentbeat import PULSE, AgentBeats
from disttrain.operator.observed import PodView
from disttrain.trainer.agent.pulse import MAX_CLIENTS, PulseServer, evictee

KEY = ("ns", "job")
UID = "uid-agent-1"
AGENT = PodView(name="job-agent", uid=UID)
PERIOD_S = 0.05


def agent_pod(port: int, uid: str = UID, ip: str = "127.0.0.1", phase: str = "Running") -> dict:
    return {
        "metadata": {"name": "job-agent", "uid": uid},
        "spec": {"containers": [{"ports": [{"name": constants.AGENT_PULSE_PORT_NAME, "containerPort": port}]}]},
        "status": {"phase": phase, "podIP": ip},
    }


async def judge_until(beats: AgentBeats, agent: PodView, seconds: float) -> str:
    """Check every 0.1 s, as the adapter does, for ``seconds`` or until the agent is found silent; the verdict."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        beats.checked(time.monotonic())
        why = beats.silence(KEY, agent, time.monotonic())
        if why:
            return why
    return ""


@pytest.fixture
def agent_process():
    """An agent's pulse server in a process of its own, which the test may freeze (SIGSTOP: a machine that died
    sends nothing, not even a FIN) or kill; its port."""
    code = (
        "import sys, time\n"
        "from disttrain.trainer.agent.pulse import PulseServer\n"
        f"server = PulseServer('127.0.0.1', 0, {UID!r}, {PERIOD_S})\n"
        "server.start()\n"
        "print(server.address[1], flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        port = int(proc.stdout.readline())
        yield proc, port
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


@pytest.fixture
def server():
    started = PulseServer("127.0.0.1", 0, UID, PERIOD_S)
    started.start()
    yield started
    started.stop()


@pytest.mark.parametrize("death", [signal.SIGSTOP, signal.SIGKILL])
async def test_a_live_agent_is_never_silent_and_a_dead_one_is_found_about_a_second_after_its_last_pulse(
    agent_process, death
):
    proc, port = agent_process
    beats = AgentBeats()
    links = pulses.PulseLinks(beats)
    links.follow(KEY, agent_pod(port))
    try:
        assert await judge_until(beats, AGENT, 2.0) == "", "pulsing: never silent"
        proc.send_signal(death)  # the agent's machine dies (nothing more is sent) or its process is killed (a FIN)
        stopped = time.monotonic()
        assert await judge_until(beats, AGENT, 3.0) == PULSE
        noticed = time.monotonic() - stopped
        assert constants.AGENT_PULSE_SILENT_SECONDS - PERIOD_S <= noticed < constants.AGENT_PULSE_SILENT_SECONDS + 0.8
    finally:
        await links.close()


async def test_a_pod_that_is_not_the_one_meant_gives_no_pulse(server):
    beats = AgentBeats()
    links = pulses.PulseLinks(beats)
    other = PodView(name="job-agent", uid="uid-replacement")
    links.follow(KEY, agent_pod(server.address[1], uid=other.uid))  # the IP now answers for another pod
    try:
        await asyncio.sleep(0.5)
        assert beats.silence(KEY, other, time.monotonic() + 10) == "", "no pulse taken: nothing to judge"
    finally:
        await links.close()


def test_only_a_running_pod_with_an_ip_and_a_pulse_port_is_linked():
    assert pulses.target_of(KEY, agent_pod(29401)) == pulses.Target(KEY, UID, "127.0.0.1", 29401)
    assert pulses.target_of(KEY, agent_pod(29401, phase="Pending")) is None
    assert pulses.target_of(KEY, agent_pod(29401, ip="")) is None
    no_port = agent_pod(29401)
    no_port["spec"]["containers"][0]["ports"] = [{"name": "rendezvous", "containerPort": 29400}]
    assert pulses.target_of(KEY, no_port) is None, "an agent built without a pulse"
    deleting = agent_pod(29401)
    deleting["metadata"]["deletionTimestamp"] = "2026-12-06T10:00:00Z"
    assert pulses.target_of(KEY, deleting) is None


async def test_bytes_that_are_not_pulses_end_the_link_and_count_for_nothing():
    """A server at the agent's address that names the right pod and then sends anything else (and names another
    pod when the link comes back)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    connections = []

    async def serve(reader, writer):
        connections.append(writer)
        if len(connections) == 1:
            for sent in (wire.hello(UID) + wire.PULSE, wire.PULSE):  # two pulses: a stream to judge
                writer.write(sent)
                await writer.drain()
                await asyncio.sleep(0.1)
            writer.write(b"x" * 64 + b"." * 64)
        else:
            writer.write(wire.hello("uid-someone-else") + b"." * 64)
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()

    listener.close()
    impostor = await asyncio.start_server(serve, "127.0.0.1", port)
    beats = AgentBeats()
    links = pulses.PulseLinks(beats)
    links.follow(KEY, agent_pod(port))
    try:
        await asyncio.sleep(0.1)
        beats.checked(time.monotonic())
        assert await judge_until(beats, AGENT, 3.0) == PULSE, "the two pulses before the junk, then silence"
        assert len(connections) >= 2, "the link came back"
    finally:
        await links.close()
        impostor.close()
        await impostor.wait_closed()


def test_the_server_reads_nothing_holds_at_most_its_clients_and_drops_one_that_talks(server):
    host, port = server.address
    held = [socket.create_connection((host, port), timeout=2) for _ in range(MAX_CLIENTS)]
    try:
        for client in held:
            assert client.recv(len(wire.hello(UID))) == wire.hello(UID)
        extra = socket.create_connection((host, port), timeout=2)
        assert extra.recv(len(wire.hello(UID))) == wire.hello(UID), "full: a newcomer takes its address's newest place"
        evicted = held.pop()
        assert evicted.recv(64) == b"", "the newest connection of the busiest address made room"
        evicted.close()
        held.append(extra)
        talker = held.pop()
        talker.sendall(b"GET / HTTP/1.0\r\n\r\n")
        deadline = time.monotonic() + 2
        while server.clients > MAX_CLIENTS - 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.clients == MAX_CLIENTS - 1, "a client that sends anything is dropped"
        talker.close()
        assert held[0].recv(1) == wire.PULSE
    finally:
        for client in held:
            client.close()


async def test_an_agent_that_stops_cleanly_says_so_and_is_not_taken_for_lost(server):
    beats = AgentBeats()
    links = pulses.PulseLinks(beats)
    links.follow(KEY, agent_pod(server.address[1]))
    try:
        assert await judge_until(beats, AGENT, 1.0) == ""
        server.stop()  # its job ended: the agent exits
        assert await judge_until(beats, AGENT, 2.5) == "", "a clean stop is no loss"
    finally:
        await links.close()


async def test_links_of_pods_that_are_no_longer_their_jobs_agent_are_closed(server):
    links = pulses.PulseLinks(AgentBeats())
    links.follow(KEY, agent_pod(server.address[1]))
    links.follow(("ns", "other"), agent_pod(server.address[1], uid="uid-other"))
    try:
        links.prune({KEY: UID}.get)  # the other job's agent is gone, and the watch never said so
        assert links.count == 1
        links.prune(lambda key: "uid-replacement")
        assert links.count == 0
    finally:
        await links.close()


def test_pulses_fall_on_the_same_wall_clock_instants_for_every_agent():
    from disttrain.trainer.agent.pulse import next_boundary

    assert next_boundary(100.05, 0.2) == pytest.approx(100.2)
    assert next_boundary(100.2, 0.2) == pytest.approx(100.4), "the next instant, never the current one"
    assert next_boundary(7.99, 0.25) == pytest.approx(8.0)


def _from(source: str, port: int) -> socket.socket:
    sock = socket.socket()
    sock.settimeout(2)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def test_a_stranger_holding_every_slot_cannot_keep_the_operator_from_linking_again(server):
    """The stranger (127.0.0.2) holds all the connections; the operator (127.0.0.3) links and gets its pulse."""
    port = server.address[1]
    stranger = [_from("127.0.0.2", port) for _ in range(MAX_CLIENTS)]
    try:
        for sock in stranger:
            assert sock.recv(len(wire.hello(UID))) == wire.hello(UID)
        operator = _from("127.0.0.3", port)
        assert operator.recv(len(wire.hello(UID))) == wire.hello(UID)
        assert operator.recv(1) == wire.PULSE
        assert server.clients == MAX_CLIENTS
        operator.close()
    finally:
        for sock in stranger:
            sock.close()


@pytest.mark.parametrize(
    "sources, new, expected",
    [
        (["a", "b"], "c", None),  # room left
        (["op", "s", "s", "s"], "op2", 3),  # the busiest address's newest
        (["op", "s", "s", "s"], "s", 3),  # the stranger replaces its own newest
        (["a", "b", "c", "d"], "e", -1),  # one each: the newcomer is refused
        (["op", "a", "a", "b", "b"], "c", 2),  # ties: the first busiest address's newest
    ],
)
def test_which_connection_a_newcomer_replaces(sources, new, expected):
    assert evictee(sources, new, max_clients=len(sources) if len(sources) > 2 else 4) == expected
