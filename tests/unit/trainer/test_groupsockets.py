"""A gloo survivor blocked in a receive is freed by shutting its group's connections down: real sockets, and a real
two-process gloo group under torchrun where one rank waits for a message its live peer never sends."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

from disttrain.common.ports import free_port
from disttrain.trainer import groupsockets

pytestmark = pytest.mark.timeout(120)


def _connected_pair(port: int) -> tuple[socket.socket, socket.socket, socket.socket]:
    listener = socket.create_server(("127.0.0.1", port))
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    return listener, client, accepted


def test_only_the_connections_a_group_opened_are_shut_down_and_the_store_is_kept(monkeypatch):
    groupsockets.forget()
    store_listener, store_client, store_served = _connected_pair(free_port())
    before_listener, before_client, before_served = _connected_pair(free_port())  # opened before: not the group's
    monkeypatch.setenv("MASTER_PORT", str(store_listener.getsockname()[1]))
    with groupsockets.capture():
        group_listener, group_client, group_served = _connected_pair(free_port())
        later_store = socket.create_connection(store_listener.getsockname())  # a store client the group made
        later_store_served, _ = store_listener.accept()
    assert groupsockets.captured() == 2, "the group's two ends; not its listener, not the store connection"
    group_client.settimeout(5)
    assert groupsockets.shut_down() == 2
    assert group_served.recv(1) == b"" and group_client.recv(1) == b"", "both ends see the end of the connection"
    for kept, peer in ((later_store, later_store_served), (before_client, before_served), (store_client, store_served)):
        kept.sendall(b"x")
        assert peer.recv(1) == b"x", "a connection the group did not open is untouched"
    assert groupsockets.captured() == 0 and groupsockets.shut_down() == 0
    for sock in (store_listener, store_client, store_served, before_listener, before_client, before_served):
        sock.close()
    for sock in (group_listener, group_client, group_served, later_store, later_store_served):
        sock.close()


def test_a_descriptor_reused_by_another_socket_is_not_shut_down():
    groupsockets.forget()
    with groupsockets.capture():
        listener, client, served = _connected_pair(free_port())
    other_listener, other_client, other_served = _connected_pair(free_port())
    os.dup2(other_client.fileno(), client.fileno())  # the group's descriptor now names another connection
    assert groupsockets.shut_down() == 1, "only the group's accepted end is still the socket it was"
    other_client.sendall(b"y")
    assert other_served.recv(1) == b"y"
    for sock in (listener, client, served, other_listener, other_client, other_served):
        sock.close()


WORKER = textwrap.dedent(
    """
    import datetime, sys, threading, time
    import torch, torch.distributed as dist
    from disttrain.trainer import groupsockets, teardown

    with groupsockets.capture():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    dist.barrier()
    if rank == 1:
        threading.Timer(1.0, teardown.abort_communicators).start()  # the watchdog, on the reform directive
    began = time.monotonic()
    try:
        if rank == 1:
            dist.recv(torch.zeros(4), src=0)  # rank 0 is alive and never sends
        else:
            dist.recv(torch.zeros(4), src=1)  # nor does rank 1: freed by rank 1's shutdown
        print(f"rank {rank}: received?", flush=True)
    except RuntimeError as exc:
        freed = f"rank {rank}: freed after {time.monotonic() - began:.1f} s: {str(exc).splitlines()[0][:90]}"
        sys.stdout.write(freed + "\\n")  # one write: the ranks share the pipe
    sys.stdout.flush()
    import os; os._exit(0)
    """
)


def test_a_gloo_receive_from_a_live_peer_that_never_sends_ends_on_the_abort(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0",
         "--master-port", str(free_port()), str(script)],
        capture_output=True, text=True, timeout=100, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    # the two ranks share the pipe: one's line may be written in the middle of the other's
    freed = set(re.findall(r"rank (\d): freed after", run.stdout))
    assert freed == {"0", "1"}, out[-3000:]
    assert "timed out" not in run.stdout.lower(), f"freed by the abort, not by the collective timeout: {out[-3000:]}"
