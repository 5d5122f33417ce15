"""The agent's store front against a real TCPStore server: only a client that proves the job's secret reaches the
store, and what a client may hold there is bounded (:mod:`disttrain.trainer.store.front`)."""

from __future__ import annotations

import datetime
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from torch.distributed import DistNetworkError, TCPStore

from disttrain.trainer.agent import service as agent_mod
from disttrain.trainer.store import front, relay, wire

SECRET = "front-test-" + "7" * 40
SHORT = front.FrontLimits(handshake_s=0.5, half_sent_s=0.5, stall_s=2.0)


RELAYS: list[relay.Relay] = []


@pytest.fixture
def served() -> Iterator[tuple[TCPStore, front.StoreFront]]:
    server = agent_mod.start_store(timeout_s=10)
    gate = front.StoreFront(("127.0.0.1", 0), ("127.0.0.1", int(server.port)), SECRET, SHORT)
    gate.start()
    yield server, gate
    while RELAYS:
        RELAYS.pop().close()
    gate.stop()


def _client(gate: front.StoreFront, secret: str = SECRET) -> TCPStore:
    near = relay.Relay(gate.address, secret)
    RELAYS.append(near)
    return TCPStore(*near.address, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))


def _until(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    return check()


def _proven_socket(gate: front.StoreFront) -> socket.socket:
    """A raw connection that did the handshake by hand (what a relay does)."""
    sock = socket.create_connection(gate.address, timeout=5)
    greeting = sock.recv(wire.GREETING_LEN, socket.MSG_WAITALL)
    sock.sendall(wire.answer(wire.front_key(SECRET), greeting))
    assert len(sock.recv(wire.PROOF_LEN, socket.MSG_WAITALL)) == wire.PROOF_LEN
    return sock


def _closed(sock: socket.socket) -> bool:
    """Whether the front closes ``sock`` (within the socket's timeout), whatever it sent before."""
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        sock.close()


def test_a_client_that_proves_the_secret_uses_the_store_and_a_stranger_reaches_nothing(served):
    server, gate = served
    client = _client(gate)
    client.set("k", "v")
    assert client.get("k") == b"v"
    with pytest.raises(DistNetworkError):
        TCPStore(*gate.address, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=1))
    with pytest.raises(DistNetworkError):
        _client(gate, secret="not-the-jobs-secret")
    junk = socket.create_connection(gate.address, timeout=5)
    junk.sendall(b"\x01" + b"\x00" * (1 << 20))  # a raw 1 MiB "set" before any proof
    assert _closed(junk)
    assert server.num_keys() == 1, "the stranger's bytes never reached the store: only k is there"
    assert gate.counts["unproven"] >= 3


def test_append_and_queue_commands_are_refused_even_to_a_proven_client(served):
    server, gate = served
    client = _client(gate)
    client.set("k", "v")
    client.queue_push("q", "x" * 1024)  # both are sent without an answer
    assert _until(lambda: gate.counts["refused"] == 1)
    client = _client(gate)
    client.append("k", "more")
    assert _until(lambda: gate.counts["refused"] == 2)
    assert server.queue_len("q") == 0
    assert server.get("k") == b"v"


def test_a_key_that_is_not_utf8_is_refused_so_the_store_can_still_be_listed(served):
    """torch's ``list_keys`` decodes every key as UTF-8: one such key in the store would make every listing fail,
    and the agent's guardian could sweep nothing any more."""
    server, gate = served
    sock = _proven_socket(gate)
    key = b"/bad\xff\xfe"
    sock.sendall(bytes([wire.VALIDATE]) + (0x3C85F7CE).to_bytes(4, "little") + b"\x01" + struct_u64(len(key)) + key)
    sock.sendall(struct_u64(1) + b"x")
    assert _closed(sock)
    assert _until(lambda: gate.counts["refused"] == 1)
    assert server.list_keys() == [], "nothing was stored, and the store can be listed"


def test_a_request_left_half_sent_and_a_silent_stranger_are_cut_off(served):
    _, gate = served
    sock = _proven_socket(gate)
    sock.sendall(b"\x01" + struct_u64(2) + b"/k" + struct_u64(1 << 20) + b"x" * 1000)  # 1 MiB announced, 1000 sent
    assert _closed(sock)
    assert _until(lambda: gate.counts["timeout"] == 1)
    silent = socket.create_connection(gate.address, timeout=5)
    assert silent.recv(wire.GREETING_LEN, socket.MSG_WAITALL)
    assert _closed(silent), "the front closes a connection that does not prove the secret in time"


def struct_u64(value: int) -> bytes:
    return value.to_bytes(8, "little")


def test_a_new_client_gets_in_while_a_stranger_holds_a_thousand_idle_connections(served):
    _, gate = served
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 4096), hard), hard))
    holder = subprocess.Popen(  # another process, as a stranger is: it holds 1,000 connections open
        [sys.executable, "-c", HOLD, str(gate.address[1])], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        client = _client(gate)
        client.set("joined", "yes")
        assert client.get("joined") == b"yes"
        assert holder.poll() is None, "the stranger still holds its connections"
        assert gate.counts["evicted"] > 0, "the stranger's connections were evicted to make room"
    finally:
        holder.kill()
        holder.communicate()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


HOLD = """
import resource, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
held = []
for _ in range(1000):
    held.append(socket.create_connection(("127.0.0.1", int(sys.argv[1]))))
print("holding", flush=True)
time.sleep(60)
"""
