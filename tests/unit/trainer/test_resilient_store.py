"""The agent's store client outlives the agent: real TCPStore servers in their own processes, killed, frozen and
started again on the same port (as the operator recreates the agent behind the same Service)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from tests.conftest import REPO_ROOT
from tests.storecalls import CountingClient
from torch.distributed import DistStoreError, TCPStore

from disttrain.common.ports import free_port
from disttrain.trainer.store import channel, resilient

SECRET = "r" * 64
SERVER = REPO_ROOT / "tests" / "trainer" / "workers" / "store_server.py"


class Server:
    def __init__(self, port: int) -> None:
        self.port = port
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER), str(self.port)], stdout=subprocess.PIPE, text=True, env=os.environ.copy()
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def freeze(self) -> None:
        """Alive but silent: no answer and no reset, as a server on a powered-off node. Returns once every thread
        of the server has stopped: the kernel stops a process's threads only after the one woken for the signal
        runs, and on a loaded machine the store's own thread answered a request meanwhile."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while not all(state in "Tt" for state in thread_states(self.proc.pid)):
            assert time.monotonic() < deadline, "the server's threads did not stop within 30 s"
            time.sleep(0.01)


def thread_states(pid: int) -> list[str]:
    """The scheduler state letter of each thread of process ``pid`` (``T``: stopped)."""
    states = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            states.append(task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0])
    return states


@pytest.fixture
def server():
    srv = Server(free_port())
    srv.start()
    yield srv
    if srv.proc is not None and srv.proc.poll() is None:
        srv.proc.send_signal(signal.SIGCONT)
        srv.kill()


def client(port: int) -> resilient.ResilientStore:
    def connect(timeout: timedelta) -> TCPStore:
        return TCPStore("127.0.0.1", port, is_master=False, timeout=timeout, wait_for_workers=False)

    return resilient.ResilientStore(connect, timedelta(seconds=30), op_timeout_s=4.0)


def until(predicate, timeout: float = 30.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.05)


@pytest.mark.timeout(90)
def test_a_killed_server_fails_calls_at_once_and_a_new_one_on_the_same_port_is_reconnected(server):
    raw = client(server.port)
    store = channel.scoped(raw, SECRET, "uid-r")
    reconnected = threading.Event()
    raw.on_reconnect.append(reconnected.set)
    state_key = "torch.rendezvous.job"
    state = pickle.dumps({"round": 7})
    store.set(state_key, state)
    assert store.get(state_key) == state
    store.set("progress", "1")

    server.kill()
    with pytest.raises(DistStoreError):
        store.get("progress")
    began = time.monotonic()
    for _ in range(20):  # while the server is away every call fails at once, none waits for it
        with pytest.raises(DistStoreError):
            store.set("progress", "2")
    assert time.monotonic() - began < 1.0
    assert not raw.connected

    server.start()
    assert reconnected.wait(15), "no reconnection to the server on the same port"
    assert raw.connected and raw.generation == 1
    # The new server is empty. The rendezvous state is put back by the first reader that saw it (torch cannot cope
    # with its absence); other keys are simply absent until their writers write again.
    assert store.get(state_key) == state
    assert not store.check(["progress"])
    store.set("progress", "3")
    assert store.get("progress") == b"3"


@pytest.mark.timeout(90)
def test_a_silent_server_costs_a_caller_a_bounded_wait_never_the_connections_timeout(server):
    raw = client(server.port)
    store = channel.scoped(raw, SECRET, "uid-r")
    store.set("k", "v")
    assert store.get("k") == b"v"
    server.freeze()
    failed: list[Exception] = []

    def poll() -> None:
        try:
            store.get("k")
        except DistStoreError as exc:
            failed.append(exc)

    stuck = threading.Thread(target=poll, daemon=True)
    stuck.start()  # a poller caught in a read that the silent server never answers
    until(lambda: raw.busy_seconds > 0.2 or not raw.connected, what="the poller to wait on the silent server")
    waits = []
    for _ in range(6):  # the training thread's best-effort writes meanwhile
        began = time.monotonic()
        with raw.quick(), pytest.raises(DistStoreError):
            store.set("progress", "x")
        waits.append(time.monotonic() - began)
        time.sleep(0.2)
    assert max(waits) < resilient.QUICK_WAIT_S + 0.5, waits
    until(lambda: not raw.connected, what="the stuck connection to be taken for dead")
    began = time.monotonic()
    with pytest.raises(DistStoreError):
        store.set("progress", "y")
    assert time.monotonic() - began < 0.5
    stuck.join(10)
    assert failed, "the read the silent server never answered did not fail"

    server.kill()
    server.start()
    until(lambda: raw.connected, what="a reconnection to the server started again")
    store.set("k", "w")
    assert store.get("k") == b"w"


@pytest.mark.timeout(90)
def test_a_frozen_server_does_not_hold_the_reconnection_thread(server):
    """A server that accepts connections but never answers (its process stopped) must not capture the reconnecting
    thread: torch's constructor pings without a bound, so each attempt is abandoned and the next one made."""
    attempts: list[float] = []

    def connect(timeout: timedelta) -> TCPStore:
        attempts.append(time.monotonic())
        return TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout, wait_for_workers=False)

    raw = resilient.ResilientStore(connect, timedelta(seconds=30), op_timeout_s=1.0)
    raw.set("k", b"v")
    server.freeze()
    with pytest.raises(DistStoreError):
        raw.get("k")  # unanswered: the connection is dropped and the reconnection begins
    first = len(attempts)
    until(lambda: len(attempts) >= first + 3, what="three reconnection attempts against the frozen server")
    assert not raw.connected
    server.proc.send_signal(signal.SIGCONT)
    until(lambda: raw.connected, what="a reconnection once the server answers again")
    assert raw.get("k") == b"v"
    raw.close()


class SlowLink:
    """A real client behind a slow network: every operation takes 0.3 s more."""

    def __init__(self, raw: TCPStore) -> None:
        self.raw = raw

    def __getattr__(self, name: str):
        op = getattr(self.raw, name)

        def slow(*args):
            time.sleep(0.3)
            return op(*args)

        return slow


@pytest.mark.timeout(60)
def test_a_caller_that_waited_for_a_connection_another_dropped_fails_at_once(server):
    def connect(timeout: timedelta) -> SlowLink:
        return SlowLink(TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout, wait_for_workers=False))

    address = ("127.0.0.1", server.port)  # reconnections probe it first, as channel.connect's do
    raw = resilient.ResilientStore(connect, timedelta(seconds=30), op_timeout_s=4.0, address=address)
    raw.set("k", b"v")
    server.kill()
    failures: dict[str, float] = {}

    def call(name: str, op) -> None:
        began = time.monotonic()
        with pytest.raises(DistStoreError):
            op()
        failures[name] = time.monotonic() - began

    first = threading.Thread(target=call, args=("poller", lambda: raw.get("k")))
    first.start()  # its read fails on the dead server and drops the connection...
    time.sleep(0.1)
    call("training", lambda: raw.set("progress", b"x"))  # ...while this write waits for the connection
    first.join(10)
    assert failures["training"] < 1.0, failures  # not the operation's 4 s on a connection nobody serves


@pytest.mark.timeout(60)
def test_batched_reads_and_writes_are_one_round_trip_through_the_signed_store(server):
    links: list[CountingClient] = []

    def connect(timeout: timedelta) -> CountingClient:
        links.append(
            CountingClient(TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout, wait_for_workers=False))
        )
        return links[-1]

    store = channel.scoped(resilient.ResilientStore(connect, timedelta(seconds=30), op_timeout_s=4.0), SECRET, "uid")
    keys = [f"k{i}" for i in range(64)]
    store.multi_set(keys, [f"v{i}".encode() for i in range(64)])
    assert store.multi_get(keys) == [f"v{i}".encode() for i in range(64)]
    assert links[-1].calls == ["multi_set", "check", "multi_get"], "not a request per key (torch's base class)"
