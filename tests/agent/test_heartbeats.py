"""The job agent's silence report against torch's own rendezvous: two real handlers over the agent's store, one
stops heartbeating (as a dead machine does), and the agent names its pod in ``status.silentNodes``."""

from __future__ import annotations

import threading
import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from disttrain.api import env
from disttrain.trainer import agent as agent_mod
from disttrain.trainer import rendezvous
from tests.agent.test_agent import free_port, write_job

pytestmark = pytest.mark.timeout(60)
RUN_ID = "job-uid-1"


def handler(port: int, monkeypatch: pytest.MonkeyPatch, name: str, uid: str):
    monkeypatch.setenv(env.NODE_NAME, name)
    monkeypatch.setenv(env.POD_UID, uid)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as the pod builder sets it
    params = RendezvousParameters(
        backend="disttrain", endpoint=f"127.0.0.1:{port}", run_id=RUN_ID, min_nodes=2, max_nodes=2,
        local_addr="127.0.0.1", is_host="false", keep_alive_interval=1, keep_alive_max_attempt=2, join_timeout=30,
    )
    return rendezvous.create_handler(params)


def test_a_node_that_stops_heartbeating_is_reported_with_its_pod(tmp_path, monkeypatch):
    monkeypatch.setenv(env.STORE_SECRET, "heartbeats-test-" + "3" * 48)  # every store client signs with it
    monkeypatch.setenv(env.JOB_UID, RUN_ID)
    port = free_port()
    server = agent_mod.start_store(port, "127.0.0.1", timeout_s=10)
    write_job(tmp_path)
    job = (tmp_path / "job.json").read_text().replace('"namespace": "team"}', f'"namespace": "team", "uid": "{RUN_ID}"}}')
    job = job.replace('"spec": {', '"spec": {"rendezvous": {"keepAliveIntervalSeconds": 1, "keepAliveMaxAttempts": 2}, ')
    (tmp_path / "job.json").write_text(job)
    agent = agent_mod.Agent(agent_mod.FileJobSource(tmp_path), agent_mod.scoped_store(server))
    handlers = [handler(port, monkeypatch, f"demo-worker-{i}", f"uid-{i}") for i in range(2)]
    threads = [threading.Thread(target=h.next_rendezvous) for h in handlers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads), "the rendezvous did not complete"
    assert agent.sync()
    assert agent.source.read()["status"].get("silentNodes") is None, "both heartbeat: nobody is silent"
    # The pods of the completed round, read from the same state (a hot spare waiting outside is never among them).
    assert agent.source.read()["status"].get("roundMembers") == ["demo-worker-0", "demo-worker-1"]
    for h in handlers:  # the heartbeats are driven below: two handlers in one process share torch's timer badly
        h._stop_heartbeats()
    # The machine of demo-worker-1 dies; demo-worker-0 goes on heartbeating (torch's own keep-alive).
    deadline = time.monotonic() + 20
    silent = None
    while time.monotonic() < deadline and not silent:
        handlers[0]._keep_alive()
        agent.sync()
        silent = agent.source.read()["status"].get("silentNodes")
        time.sleep(0.25)
    assert silent and [(s["node"], s["podUid"]) for s in silent] == [("demo-worker-1", "uid-1")]
