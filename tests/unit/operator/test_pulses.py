"""The job agent's pulse end to end on real sockets: the agent's server (trainer/agent/pulse.py), the operator's
links (operator/pulses.py), the handshake that proves the job's pulse key, and the rule (operator/agentbeat.py) on
the operator's real clock."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from disttrain.api import constants, handshake
from disttrain.api import pulse as wire
from disttrain.operator import access, agentbeat, pulses
from disttrain.operator.agentbeat import PULSE, AgentBeats
from disttrain.operator.observed import PodView
from disttrain.trainer.agent.pulse import MAX_LINKS, MAX_PENDING, MAX_PENDING_PER_SOURCE, PulseServer

KEY = ("ns", "job")
UID = "uid-agent-1"
JOB_UID = "uid-job-1"
AGENT = PodView(name="job-agent", uid=UID)
PERIOD_S = 0.05
OPERATOR_KEY = bytes(range(32))
"""The operator's own key (``--agent-pulse-key-file``)."""
JOB_KEY = wire.job_key(OPERATOR_KEY, JOB_UID)
"""The job's pulse key, as the operator put it in the job's Secret."""


def agent_pod(port: int, uid: str = UID, ip: str = "127.0.0.1", phase: str = "Running") -> dict:
    return {
        "metadata": {"name": "job-agent", "uid": uid, "labels": {access.LABEL_JOB_UID: JOB_UID}},
        "spec": {"containers": [{"ports": [{"name": constants.AGENT_PULSE_PORT_NAME, "containerPort": port}]}]},
        "status": {"phase": phase, "podIP": ip},
    }


async def judge_until(beats: AgentBeats, agent: PodView, seconds: float, links: pulses.PulseLinks | None = None) -> str:
    """Check every 0.1 s, as the adapter does (probing the nodes of silent pulses through ``links``), for
    ``seconds`` or until the agent is found silent; the verdict."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        beats.checked(time.monotonic())
        if links is not None:
            for key, uid in beats.to_probe(time.monotonic()):
                links.probe(key, uid, time.monotonic())
        why = beats.silence(KEY, agent, time.monotonic())
        if why:
            return why
    return ""


@pytest.fixture
def agent_process():
    """An agent's pulse server in a process of its own, which the test may freeze (SIGSTOP: a starved process; with
    its accept queue full, a machine that died, which answers nothing) or kill; its port."""
    code = (
        "import sys, time\n"
        "from disttrain.trainer.agent.pulse import PulseServer\n"
        f"server = PulseServer('127.0.0.1', 0, {UID!r}, {PERIOD_S}, {JOB_KEY!r})\n"
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
    started = PulseServer("127.0.0.1", 0, UID, PERIOD_S, JOB_KEY)
    started.start()
    yield started
    started.stop()


def stop(proc: subprocess.Popen) -> None:
    """SIGSTOP, returning once every thread of ``proc`` has stopped (the kernel stops them only after the one woken
    for the signal runs: on a loaded machine the server accepted connections meanwhile)."""
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while True:
        states = []
        for task in pathlib.Path(f"/proc/{proc.pid}/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                states.append(task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0])
        if all(state in "Tt" for state in states):
            return
        assert time.monotonic() < deadline, "the agent's threads did not stop within 30 s"
        time.sleep(0.01)


def fill_backlog(port: int, count: int = MAX_PENDING + 16) -> list[socket.socket]:
    """Connections that fill the accept queue of a stopped server's port: its kernel then drops new SYNs, as a
    powered-off machine answers nothing."""
    held = []
    for _ in range(count):
        client = socket.socket()
        client.setblocking(False)
        client.connect_ex(("127.0.0.1", port))
        held.append(client)
    return held


@pytest.mark.parametrize("death", ["machine", "process"])
async def test_a_live_agent_is_never_silent_and_a_dead_one_is_found_about_a_second_after_its_last_pulse(
    agent_process, death
):
    proc, port = agent_process
    beats = AgentBeats()
    links = pulses.PulseLinks(beats, OPERATOR_KEY)
    links.follow(KEY, agent_pod(port))
    held: list[socket.socket] = []
    try:
        assert await judge_until(beats, AGENT, 2.0, links) == "", "pulsing: never silent"
        if death == "machine":  # nothing more is sent, not even a FIN, and no connection is accepted
            stop(proc)
            held = fill_backlog(port)
        else:  # its process is killed: a FIN, and its port refuses
            proc.send_signal(signal.SIGKILL)
        stopped = time.monotonic()
        assert await judge_until(beats, AGENT, 3.0, links) == PULSE
        noticed = time.monotonic() - stopped
        assert constants.AGENT_PULSE_SILENT_SECONDS - PERIOD_S <= noticed < constants.AGENT_PULSE_SILENT_SECONDS + 0.8
    finally:
        for client in held:
            client.close()
        await links.close()


async def test_an_agent_starved_for_seconds_is_not_taken_for_lost_and_a_hung_one_is(agent_process, monkeypatch):
    """A process that gets no CPU (SIGSTOP: the pulse thread does not run) on a node that is up: its kernel still
    accepts the probes' connections, so its silence is no loss; it pulses again once it runs. One that never pulses
    again is taken for hung after ``HUNG_S``."""
    proc, port = agent_process
    beats = AgentBeats()
    links = pulses.PulseLinks(beats, OPERATOR_KEY)
    links.follow(KEY, agent_pod(port))
    try:
        assert await judge_until(beats, AGENT, 0.5, links) == ""
        stop(proc)
        assert await judge_until(beats, AGENT, 2 * constants.AGENT_PULSE_SILENT_SECONDS, links) == "", "starved: alive"
        proc.send_signal(signal.SIGCONT)
        assert await judge_until(beats, AGENT, 0.5, links) == ""
        assert links.count == 1
        monkeypatch.setattr(agentbeat, "HUNG_S", 1.5)
        stop(proc)
        stopped = time.monotonic()
        assert await judge_until(beats, AGENT, 3.0, links) == PULSE
        assert time.monotonic() - stopped >= 1.5 - PERIOD_S, "judged before it was hung"
    finally:
        proc.send_signal(signal.SIGCONT)
        await links.close()


async def test_a_link_whose_target_was_dropped_ends_even_when_its_cancellation_was_lost():
    """``asyncio.wait_for`` (Python < 3.12) can swallow a cancellation that arrives as its connection completes: the
    link must still end once its target is no longer followed, or :meth:`PulseLinks.close` waits for ever."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens: every connection is refused, and the link retries
    links = pulses.PulseLinks(AgentBeats(), OPERATOR_KEY)
    pod = agent_pod(port)
    links.follow(KEY, pod)
    ((_target, task),) = links._links.values()
    await asyncio.sleep(2 * pulses.RETRY_S)
    assert not task.done(), "a followed link retries"
    links._links.clear()  # what forget does, without the cancel that wait_for may swallow
    await asyncio.wait_for(asyncio.shield(task), 4 * pulses.RETRY_S)
    await links.close()


async def test_a_pod_that_is_not_the_one_meant_gives_no_pulse(server):
    beats = AgentBeats()
    links = pulses.PulseLinks(beats, OPERATOR_KEY)
    other = PodView(name="job-agent", uid="uid-replacement")
    links.follow(KEY, agent_pod(server.address[1], uid=other.uid))  # the IP now answers for another pod
    try:
        await asyncio.sleep(0.5)
        assert beats.silence(KEY, other, time.monotonic() + 10) == "", "no pulse taken: nothing to judge"
    finally:
        await links.close()


def test_only_a_running_pod_with_an_ip_and_a_pulse_port_is_linked():
    assert pulses.target_of(KEY, agent_pod(29401)) == pulses.Target(KEY, UID, "127.0.0.1", 29401, JOB_UID)
    assert pulses.target_of(KEY, agent_pod(29401, phase="Pending")) is None
    assert pulses.target_of(KEY, agent_pod(29401, ip="")) is None
    no_port = agent_pod(29401)
    no_port["spec"]["containers"][0]["ports"] = [{"name": "rendezvous", "containerPort": 29400}]
    assert pulses.target_of(KEY, no_port) is None, "an agent built without a pulse"
    deleting = agent_pod(29401)
    deleting["metadata"]["deletionTimestamp"] = "2026-12-06T10:00:00Z"
    assert pulses.target_of(KEY, deleting) is None


async def _prove(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes) -> None:
    """The agent's side of the handshake with ``key``, answered whatever the operator proved."""
    greeting = handshake.greeting()
    writer.write(greeting)
    answer = await reader.readexactly(handshake.ANSWER_LEN)
    proof = handshake.check_answer(key, greeting, answer)
    writer.write(proof if proof is not None else bytes(handshake.PROOF_LEN))


@contextlib.asynccontextmanager
async def links_to_impostor(serve):
    """The operator's pulse links following KEY to an agent address where ``serve`` answers; yields their beats."""
    impostor = await asyncio.start_server(serve, "127.0.0.1", 0)
    beats = AgentBeats()
    links = pulses.PulseLinks(beats, OPERATOR_KEY)
    links.follow(KEY, agent_pod(impostor.sockets[0].getsockname()[1]))
    try:
        yield beats
    finally:
        await links.close()
        impostor.close()
        await impostor.wait_closed()


async def test_bytes_that_are_not_pulses_end_the_link_and_count_for_nothing():
    """A server at the agent's address that holds the job's key, names the right pod and then sends anything else
    (and names another pod when the link comes back)."""
    connections = []

    async def serve(reader, writer):
        connections.append(writer)
        try:
            await _prove(reader, writer, JOB_KEY)
        except (ConnectionError, asyncio.IncompleteReadError):
            writer.close()
            return
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

    async with links_to_impostor(serve) as beats:
        await asyncio.sleep(0.1)
        beats.checked(time.monotonic())
        assert await judge_until(beats, AGENT, 3.0) == PULSE, "the two pulses before the junk, then silence"
        assert len(connections) >= 2, "the link came back"


async def test_a_server_without_the_jobs_key_gives_no_pulse():
    """Something at the agent's address that greets and pulses but cannot prove the job's key: no pulse counts."""
    proofs_sent = []

    async def serve(reader, writer):
        try:
            await _prove(reader, writer, wire.job_key(OPERATOR_KEY, "uid-another-job"))
            proofs_sent.append(True)
            writer.write(wire.hello(UID) + wire.PULSE * 8)
            await writer.drain()
            await asyncio.sleep(0.5)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the operator closed its end first
        finally:
            writer.close()

    async with links_to_impostor(serve) as beats:
        await asyncio.sleep(1.0)
        assert proofs_sent, "the operator answered the greeting"
        assert beats.silence(KEY, AGENT, time.monotonic() + 10) == "", "no pulse taken: nothing to judge"


def _link(host: str, port: int, key: bytes = JOB_KEY, source: str = "127.0.0.1") -> socket.socket:
    """A raw client that proves ``key`` as the operator does; returns it after the agent's proof and hello."""
    sock = _from(source, port, host)
    greeting = _recv_exactly(sock, handshake.GREETING_LEN)
    answer = handshake.answer(key, greeting)
    sock.sendall(answer)
    proof = _recv_exactly(sock, handshake.PROOF_LEN)
    assert handshake.check_proof(key, greeting, answer, proof), "the agent proves the key back"
    assert _recv_exactly(sock, len(wire.hello(UID))) == wire.hello(UID)
    return sock


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return data
        data += chunk
    return data


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (it sends an unproven connection nothing but its greeting)."""
    try:
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                return True
            if wire.PULSE in chunk:
                return False
    except (ConnectionResetError, TimeoutError):
        return False


def _ends(sock: socket.socket) -> bool:
    """Whether the server closes ``sock`` (a reset too: it closed with bytes of ours unread) within its timeout."""
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def test_only_a_connection_that_proves_the_key_is_pulsed_to(server):
    host, port = server.address
    silent = _from("127.0.0.1", port)
    silent.settimeout(wire.HANDSHAKE_S + 3)
    wrong = _from("127.0.0.1", port)
    wrong_greeting = _recv_exactly(wrong, handshake.GREETING_LEN)
    wrong.sendall(handshake.answer(wire.job_key(OPERATOR_KEY, "uid-another-job"), wrong_greeting))
    operator = _link(host, port)
    try:
        assert operator.recv(1) == wire.PULSE
        assert _closed(wrong), "a wrong answer: closed, no pulse"
        assert len(_recv_exactly(silent, handshake.GREETING_LEN)) == handshake.GREETING_LEN
        assert _closed(silent), "no answer within the handshake's time: closed, never a pulse"
        assert server.clients == 1 and server.pending == 0
        operator.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert _ends(operator), "a link that sends anything is dropped"
    finally:
        for sock in (silent, wrong, operator):
            sock.close()


def test_a_new_link_replaces_the_oldest_when_all_are_taken(server):
    host, port = server.address
    held = [_link(host, port) for _ in range(MAX_LINKS)]
    newest = _link(host, port)
    try:
        assert _ends(held[0]), "the oldest link made room"
        assert newest.recv(1) == wire.PULSE and held[1].recv(1) == wire.PULSE
    finally:
        for sock in [*held, newest]:
            sock.close()


async def test_an_agent_that_stops_cleanly_says_so_and_is_not_taken_for_lost(server):
    beats = AgentBeats()
    links = pulses.PulseLinks(beats, OPERATOR_KEY)
    links.follow(KEY, agent_pod(server.address[1]))
    try:
        assert await judge_until(beats, AGENT, 1.0) == ""
        server.stop()  # its job ended: the agent exits
        assert await judge_until(beats, AGENT, 2.5) == "", "a clean stop is no loss"
    finally:
        await links.close()


async def test_links_of_pods_that_are_no_longer_their_jobs_agent_are_closed(server):
    links = pulses.PulseLinks(AgentBeats(), OPERATOR_KEY)
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


def _from(source: str, port: int, host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.settimeout(5)
    sock.bind((source, 0))
    sock.connect((host, port))
    return sock


async def test_strangers_holding_every_connection_cannot_keep_the_operator_from_linking_and_linking_again(server):
    """Strangers from many addresses hold every unproven place the agent has (and one address more than its share),
    and keep opening new connections; the operator links, gets its pulse, and links again after its link broke."""
    port = server.address[1]
    addresses = [f"127.0.0.{n}" for n in range(10, 10 + MAX_PENDING // MAX_PENDING_PER_SOURCE + 2)]
    held = [_from(address, port) for address in addresses for _ in range(MAX_PENDING_PER_SOURCE)]
    held += [_from(addresses[0], port) for _ in range(2)]  # beyond its address's share: refused at once
    stop = asyncio.Event()

    async def churn() -> None:  # new connections from ever other addresses: each closes the oldest unproven one
        for n in itertools.count():
            if stop.is_set():
                return
            held.append(await asyncio.to_thread(_from, f"127.0.1.{n % 250 + 1}", port))
            await asyncio.sleep(0.01)

    churner = asyncio.create_task(churn())
    beats = AgentBeats()
    links = pulses.PulseLinks(beats, OPERATOR_KEY)
    try:
        await asyncio.sleep(0.3)
        assert server.pending == MAX_PENDING and server.clients == 0, "the strangers hold every unproven place"
        links.follow(KEY, agent_pod(port))
        assert await judge_until(beats, AGENT, 2.0) == "", "linked: pulsed, never silent"
        assert server.clients == 1
        links.forget(UID)  # the link breaks (a restart of the operator, a reset on the way)
        await asyncio.sleep(0.1)
        links.follow(KEY, agent_pod(port))
        assert await judge_until(beats, AGENT, 2.0) == "", "linked again: still pulsed, never silent"
        assert server.clients == 1, "the old link closed, the new one held"
        assert server.pending <= MAX_PENDING
    finally:
        stop.set()
        await churner
        await links.close()
        for sock in held:
            sock.close()
