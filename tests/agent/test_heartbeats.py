"""The job agent's silence report against torch's own rendezvous: two real handlers over the agent's store, one
stops heartbeating (as a dead machine does), and the agent names its pod in ``status.silentNodes``."""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta

import pytest
from tests.agent.test_agent import free_port, write_job
from torch.distributed.elastic.rendezvous import RendezvousParameters

from disttrain.api import env
from disttrain.trainer.agent import service as agent_mod
from disttrain.trainer.launch import rendezvous

pytestmark = pytest.mark.timeout(60)
RUN_ID = "job-uid-1"


def handler(port: int, monkeypatch: pytest.MonkeyPatch, name: str, uid: str):
    monkeypatch.setenv(env.NODE_NAME, name)
    monkeypatch.setenv(env.POD_UID, uid)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as the pod builder sets it
    params = RendezvousParameters(
        backend="disttrain",
        endpoint=f"127.0.0.1:{port}",
        run_id=RUN_ID,
        min_nodes=2,
        max_nodes=2,
        local_addr="127.0.0.1",
        is_host="false",
        keep_alive_interval=1,
        keep_alive_max_attempt=2,
        join_timeout=30,
    )
    return rendezvous.create_handler(params)


def complete_round(handlers) -> None:
    """Every handler joins the next rendezvous round, each on a thread of its own, and the round completes."""
    threads = [threading.Thread(target=h.next_rendezvous) for h in handlers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads), "the rendezvous did not complete"


def start_store(monkeypatch: pytest.MonkeyPatch, secret: str):
    """(port, the agent's store server) for the job RUN_ID, whose processes sign with ``secret``."""
    monkeypatch.setenv(env.STORE_SECRET, secret)
    monkeypatch.setenv(env.JOB_UID, RUN_ID)
    port = free_port()
    return port, agent_mod.start_store(port, "127.0.0.1", timeout_s=10)


def write_rendezvous_job(state) -> dict:
    """The job RUN_ID with a 1 s keep-alive, 2 attempts (torch's expiry: 2 s), written where the agent reads it."""
    write_job(state)
    job = json.loads((state / "job.json").read_text())
    job["metadata"]["uid"] = RUN_ID
    job["spec"]["rendezvous"] = {"keepAliveIntervalSeconds": 1, "keepAliveMaxAttempts": 2}
    (state / "job.json").write_text(json.dumps(job))
    return job


def test_a_node_that_stops_heartbeating_is_reported_with_its_pod(tmp_path, monkeypatch):
    port, server = start_store(monkeypatch, "heartbeats-test-" + "3" * 48)
    write_rendezvous_job(tmp_path)
    agent = agent_mod.Agent(agent_mod.FileJobSource(tmp_path), agent_mod.scoped_store(server))
    handlers = [handler(port, monkeypatch, f"demo-worker-{i}", f"uid-{i}") for i in range(2)]
    complete_round(handlers)
    assert agent.sync()
    assert agent.source.read()["status"].get("silentNodes") is None, "both heartbeat: nobody is silent"
    # The pods of the completed round, read from the same state (a hot spare waiting outside is never among them).
    assert agent.source.read()["status"].get("roundMembers") == ["demo-worker-0", "demo-worker-1"]
    for h in handlers:  # the heartbeats are driven below: two handlers in one process share torch's timer badly
        h._stop_heartbeats()
    # Beyond torch's expiry (2 s) without a torch heartbeat, as a node inside a blocking store call or a join: the
    # launchers' beats keep both alive.
    until = time.monotonic() + 3.0
    while time.monotonic() < until:
        agent.sync()
        assert agent.source.read()["status"].get("silentNodes") is None, "a node that beats is not silent"
        time.sleep(0.25)
    # The machine of demo-worker-1 dies (its beat stops with it); demo-worker-0 goes on (torch's keep-alive too).
    handlers[1].beat.stop()
    deadline = time.monotonic() + 20
    silent = None
    while time.monotonic() < deadline and not silent:
        handlers[0]._keep_alive()
        agent.sync()
        silent = agent.source.read()["status"].get("silentNodes")
        time.sleep(0.25)
    assert silent and [(s["node"], s["podUid"]) for s in silent] == [("demo-worker-1", "uid-1")]
    handlers[0].beat.stop()


def _attack_state(port: int, key: str, stop: threading.Event) -> dict[str, int]:
    """An outsider without the secret deleting and garbling the rendezvous state, as tests/security/outsider.py's
    delete and pickle attacks do, every 10 ms until ``stop``."""
    import torch.distributed as dist

    outsider = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))
    done = {"delete": 0, "garble": 0}
    while not stop.wait(0.01):
        if done["delete"] <= done["garble"]:
            outsider.delete_key(key)
            done["delete"] += 1
        elif outsider.check([key]):
            value = bytes(outsider.get(key))
            outsider.set(
                key, value[: len(value) // 2] + bytes([value[len(value) // 2] ^ 1]) + value[len(value) // 2 + 1 :]
            )
            done["garble"] += 1
    return done


def test_an_outsider_deleting_and_garbling_the_state_costs_no_silence_verdict(tmp_path, monkeypatch):
    """Readers restore the state an outsider deleted or garbled from the last valid copy each saw, so the
    heartbeats in it may go back, and keep-alive writes are lost or late. Both nodes keep heartbeating through the
    attack and the agent (with its guardian, as in a pod) reports nobody silent, then or after. (That a node that
    really stops is still named once the hold is over is shown in tests/unit/trainer/test_heartbeats.py; without an
    attack, by the test above.)"""
    port, server = start_store(monkeypatch, "heartbeats-test-" + "4" * 48)
    write_rendezvous_job(tmp_path)
    store = agent_mod.scoped_store(server)
    guard = agent_mod.start_guardian(port, store)
    assert guard is not None
    agent = agent_mod.Agent(agent_mod.FileJobSource(tmp_path), store, guard=guard)
    handlers = [handler(port, monkeypatch, f"demo-worker-{i}", f"uid-{i}") for i in range(2)]
    complete_round(handlers)
    for h in handlers:
        h._stop_heartbeats()
    state_key = next(k for k in server.list_keys() if k.endswith("/torch.rendezvous." + RUN_ID))

    def beat_and_sync(live) -> list:
        for h in live:
            h._keep_alive()
        agent.sync()
        return agent.source.read()["status"].get("silentNodes") or []

    stop = threading.Event()
    attack: dict[str, dict[str, int]] = {}
    attacker = threading.Thread(target=lambda: attack.update(done=_attack_state(port, state_key, stop)))
    try:
        attacker.start()
        verdicts = []
        deadline = time.monotonic() + 8  # four times the expiry (1 s x 2)
        while time.monotonic() < deadline:
            verdicts += beat_and_sync(handlers)
            time.sleep(0.25)
    finally:
        stop.set()
        attacker.join(10)
        for h in handlers:
            h._keep_alive()  # a lost keep-alive of the last attack round is made up
    assert attack["done"]["delete"] >= 20 and attack["done"]["garble"] >= 10, attack
    assert guard.counts(), "the guardian saw the attack"
    assert verdicts == [], f"a stranger's writes cost a silence verdict: {verdicts}"

    # Past the attack, through the hold and as long again, still nobody is fenced: not even a live node that torch's
    # sanitizer dropped from the round on a heartbeat a stale restore put back (it vanished under attack).
    after = time.monotonic() + 2 * 3
    while time.monotonic() < after:
        verdicts += beat_and_sync(handlers)
        time.sleep(0.25)
    assert verdicts == [], f"a verdict after the attack: {verdicts}"
    guard.stop()


def test_a_directive_is_stamped_with_the_round_it_was_issued_for_and_keeps_it(tmp_path, monkeypatch):
    """The launcher hands its workers the round it joined; the agent stamps each directive generation with the last
    complete round when it first publishes it, and keeps that stamp for the generation: written again after a
    stranger deleted it, the directive that formed round 1 still says round 0, so round 1's workers never act on it."""
    from disttrain.api import control as keys

    monkeypatch.setenv(env.RENDEZVOUS_ROUND, "")  # restored after the test: the handlers set it in os.environ
    port, server = start_store(monkeypatch, "heartbeats-test-" + "5" * 48)
    job = write_rendezvous_job(tmp_path)
    store = agent_mod.scoped_store(server)
    agent = agent_mod.Agent(agent_mod.FileJobSource(tmp_path), store)
    handlers = [handler(port, monkeypatch, f"demo-worker-{i}", f"uid-{i}") for i in range(2)]

    def directive(generation: int, action: str) -> keys.ControlSignal:
        job["status"]["control"] = {"generation": generation, "action": action, "targetNodes": 2}
        (tmp_path / "job.json").write_text(json.dumps(job))
        assert agent.sync()
        signal = keys.read_model(store, keys.SIGNAL_KEY, keys.ControlSignal)
        target = keys.read_model(store, keys.TARGET_KEY, keys.TargetPlan)
        assert signal is not None and target is not None and signal.generation == generation
        assert target.round == signal.round, "the plan carries the directive's round"
        return signal

    try:
        assert directive(0, "none").round == keys.NO_ROUND, "no round complete yet"
        complete_round(handlers)
        assert os.environ[env.RENDEZVOUS_ROUND] == "0", "the launcher passes its workers the round they joined"
        assert directive(1, "reform").round == 0
        complete_round(handlers)  # the reform: both leave round 0 and form round 1
        assert os.environ[env.RENDEZVOUS_ROUND] == "1"
        assert directive(1, "reform").round == 0, "a generation keeps the round it was issued for"
        store.delete_key(keys.SIGNAL_KEY)  # a stranger's deletion: the agent writes it again
        assert directive(1, "reform").round == 0
        assert directive(2, "drain").round == 1
        # A replay of the older plan: a node's rendezvous keeps the newer plan it read.
        assert handlers[0].target().generation == 2
        replayed = keys.TargetPlan(generation=1, nodes=2, job_uid=RUN_ID, round=0)
        store.set(keys.TARGET_KEY, replayed.model_dump_json())
        fresh_store = agent_mod.scoped_store(server)  # a client with no memory of the newer value takes the replay
        assert keys.read_model(fresh_store, keys.TARGET_KEY, keys.TargetPlan) == replayed
        assert handlers[0].target().generation == 2, "the handler's plan never goes back"
    finally:
        for h in handlers:
            h._stop_heartbeats()
            if h.beat is not None:
                h.beat.stop()
