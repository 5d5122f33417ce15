"""The job agent's store guardian against a real libuv TCPStore and an outsider client with no secret: foreign keys
swept out, sealed values restored, a flood that leaves nothing behind, rejections relayed into the status."""

from __future__ import annotations

import copy
import datetime
import json
import os
import threading
import time

import pytest
from tests.agent.test_agent import SPEC
from tests.storecalls import CountingClient
from torch.distributed import TCPStore

from disttrain.api import control as keys
from disttrain.api import env, storeauth
from disttrain.common.ports import free_port
from disttrain.trainer.agent import guardian
from disttrain.trainer.agent import service as agent_mod
from disttrain.trainer.store import channel

pytestmark = pytest.mark.timeout(90)

SECRET = "guardian-test-" + "7" * 50
UID = "0f0f0f0f-0000-4000-8000-000000000027"
NS = storeauth.key_prefix(SECRET) + "/"
STATE = NS + "torch.rendezvous.run1"


@pytest.fixture
def stores():
    """(server, outsider): the agent's libuv server and a plain client that holds no secret."""
    server = agent_mod.start_store(0, "127.0.0.1", timeout_s=30)  # port 0: the kernel's, no race for a free one
    outsider = TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    yield server, outsider


def settle(client: TCPStore) -> None:
    """Wait until the server has handled ``client``'s writes: a ``set`` gets no answer, a ``num_keys`` does, and
    one connection's commands are handled in order."""
    client.num_keys()


def sealed(key: str, value: bytes, seq: int) -> bytes:
    return storeauth.seal(SECRET, UID, key, value, seq)


def test_foreign_and_unsigned_keys_are_deleted_and_valid_ones_kept(stores):
    server, outsider = stores
    server.set(STATE, sealed(STATE, b"state", 5))
    outsider.set("junk/1", b"x" * 1000)
    outsider.set(NS + "disttrain/failure", b'{"exitCode": 85}')  # forged: the prefix is public, the MAC is not
    outsider.set(NS + "torch.rendezvous.run1.7/MASTER_ADDR", sealed(STATE, b"10.0.0.1", 9))  # another key's value
    settle(outsider)
    g = guardian.Guardian(server, SECRET, UID)
    result = g.sweep()
    assert sorted(server.list_keys()) == [STATE]
    assert result.deleted == 3
    assert g.counts() == {("foreign", "foreign"): 1, ("control", "unsigned"): 1, ("rendezvous", "unsigned"): 1}
    assert storeauth.unseal(SECRET, UID, STATE, server.get(STATE)) == storeauth.Sealed(b"state", 5)


def test_a_value_of_another_job_with_the_same_secret_is_rejected(stores):
    server, outsider = stores
    outsider.set(STATE, storeauth.seal(SECRET, "another-job", STATE, b"state", 1))
    settle(outsider)
    g = guardian.Guardian(server, SECRET, UID)
    g.sweep()
    assert server.list_keys() == []


@pytest.mark.parametrize("attack", ["delete", "garble", "replay"])
def test_a_broken_sealed_value_is_restored(stores, attack):
    server, outsider = stores
    old = sealed(STATE, b"round 3", 3)
    server.set(STATE, sealed(STATE, b"round 4", 4))
    g = guardian.Guardian(server, SECRET, UID)
    g.sweep()
    if attack == "delete":
        outsider.delete_key(STATE)
    elif attack == "garble":
        outsider.set(STATE, b"\x80\x04cos\nsystem\n" + b"A" * 64)
    else:
        outsider.set(STATE, old)
    settle(outsider)
    result = g.sweep()
    assert result.restored == 1
    assert storeauth.unseal(SECRET, UID, STATE, server.get(STATE)) == storeauth.Sealed(b"round 4", 4)
    reason = {"delete": "deleted", "garble": "unsigned", "replay": "replayed"}[attack]
    assert g.counts() == {("rendezvous", reason): 1}


def test_a_newer_valid_value_is_never_clobbered(stores):
    server, _ = stores
    server.set(STATE, sealed(STATE, b"round 4", 4))
    g = guardian.Guardian(server, SECRET, UID)
    g.sweep()
    server.set(STATE, sealed(STATE, b"round 5", 5))
    g.sweep()
    assert storeauth.unseal(SECRET, UID, STATE, server.get(STATE)) == storeauth.Sealed(b"round 5", 5)
    assert g.counts() == {}


def test_a_restore_loses_to_a_write_made_after_the_key_was_read(stores):
    """compare_set against what was read: a valid value written in between stays (the guardian's put-back of the
    value it remembered fails)."""
    server, _ = stores
    server.set(STATE, sealed(STATE, b"round 4", 4))
    g = guardian.Guardian(server, SECRET, UID)
    g.sweep()
    server.delete_key(STATE)
    server.set(STATE, sealed(STATE, b"round 5", 5))  # the writer came back before the put-back
    sweep = g.sweep()
    assert sweep.restored == 0
    assert storeauth.unseal(SECRET, UID, STATE, server.get(STATE)) == storeauth.Sealed(b"round 5", 5)


def test_keys_the_job_deletes_on_purpose_are_not_resurrected(stores):
    server, _ = stores
    key = NS + keys.EXIT_FIRST_KEY
    server.set(key, sealed(key, b"1700000000.0", 1))
    g = guardian.Guardian(server, SECRET, UID)
    g.sweep()
    server.delete_key(key)  # trainer/startup.take_exit_times does this after reading the note
    g.sweep()
    assert server.list_keys() == []
    assert g.counts() == {}


def test_the_signed_store_sees_the_restored_value(stores):
    """End to end with the job's real client: a worker's signed store reads the value the guardian put back."""
    server, outsider = stores
    worker = channel.scoped(
        TCPStore(server.host, server.port, is_master=False, timeout=datetime.timedelta(seconds=5)), SECRET, UID
    )
    worker.set(keys.CHECKPOINT_KEY, b'{"step": 40}')
    g = guardian.Guardian(server, SECRET, UID)
    g.sweep()
    outsider.set(NS + keys.CHECKPOINT_KEY, b'{"step": 0}')
    settle(outsider)
    g.sweep()
    assert worker.get(keys.CHECKPOINT_KEY) == b'{"step": 40}'
    assert g.counts() == {("control", "unsigned"): 1}


def test_rejections_are_reported_with_closed_labels_and_bounded_names(stores):
    server, outsider = stores
    for i in range(guardian.MAX_RECENT + 4):
        outsider.set(f"junk/{i}/" + "\x01" * 300, b"x")
    settle(outsider)
    g = guardian.Guardian(server, SECRET, UID, clock=lambda: 1_700_000_000.0)
    g.sweep()
    snap = g.snapshot()
    assert snap is not None and snap["total"] == guardian.MAX_RECENT + 4
    assert snap["counts"] == {"foreign/foreign": guardian.MAX_RECENT + 4}
    assert len(snap["recent"]) == guardian.MAX_RECENT
    assert all(len(r["key"]) <= guardian.MAX_KEY_SHOWN and r["key"].isprintable() for r in snap["recent"])
    assert {(c, r) for (c, r) in g.counts()} <= {(c, r) for c in guardian.KEY_CLASSES for r in guardian.REASONS}


def test_the_namespace_prefix_is_not_shown():
    g = guardian.Guardian(None, SECRET, UID)
    assert g.shown(NS + keys.FAILURE_KEY) == "~/disttrain/failure"
    assert g.key_class(NS + keys.FAILURE_KEY) == "control"
    assert g.key_class(STATE) == "rendezvous"
    assert g.key_class(NS + "torch.rendezvous.run1.3/MASTER_ADDR") == "rendezvous"
    assert g.key_class(NS + "other") == "torch"
    assert g.key_class("other") == "foreign"


def test_the_read_budget_spreads_a_large_backlog_over_sweeps(stores):
    server, outsider = stores
    for i in range(6):
        outsider.set(NS + f"junk{i}", b"y" * (1 << 20))
    settle(outsider)
    g = guardian.Guardian(server, SECRET, UID, max_read_bytes=2 << 20)
    first = g.sweep()
    assert first.truncated and first.read_bytes <= 3 << 20 and first.deleted == 2
    while g.sweep().truncated:
        pass
    assert server.list_keys() == []


def test_a_flood_of_large_values_leaves_nothing_behind(stores):
    """An outsider sets 8 MiB values under fresh keys (inside and outside the namespace) for 10 s while the
    guardian sweeps: afterwards no foreign value is left, the job's values are intact, and during the flood the
    store never held more than a bounded number of them."""
    server, _ = stores
    server.set(STATE, sealed(STATE, b"state", 1))
    g = guardian.Guardian(server, SECRET, UID)
    g.start()
    stop = threading.Event()
    sent = [0]

    def flood() -> None:
        client = TCPStore(server.host, server.port, is_master=False, timeout=datetime.timedelta(seconds=30))
        value = os.urandom(8 << 20)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            client.set((NS + "x" if sent[0] % 2 else "junk/") + str(sent[0]), value)
            sent[0] += 1
        # A set is a blind write: without this, the last value may still be on its way to the server when the
        # store first reads clean below, and the guardian counts it only after the test stopped it.
        settle(client)

    attacker = threading.Thread(target=flood)
    attacker.start()
    most = 0
    watcher = TCPStore(server.host, server.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    while attacker.is_alive():
        most = max(most, len(watcher.list_keys()) - 1)
        time.sleep(0.05)
    attacker.join()
    for _ in range(100):  # a few sweeps after the last value
        if watcher.list_keys() == [STATE]:
            break
        time.sleep(0.1)
    stop.set()
    g.stop()
    assert sent[0] >= 4, f"the flood sent only {sent[0]} values"
    assert watcher.list_keys() == [STATE]
    assert storeauth.unseal(SECRET, UID, STATE, server.get(STATE)) == storeauth.Sealed(b"state", 1)
    counts = g.counts()
    assert sum(counts.values()) == sent[0]
    # bounded: the sweeper deletes as fast as the server takes values in (most seen at once, of all sent)
    assert most <= max(8, sent[0] // 2), f"{most} foreign values held at once of {sent[0]} sent"


def test_the_agent_relays_rejections_and_rewrites_its_own_keys(tmp_path, stores):
    server, outsider = stores
    job = {
        "apiVersion": "disttrain.dev/v1alpha1",
        "kind": "DistTrainJob",
        "metadata": {"name": "demo", "namespace": "team", "uid": UID},
        "spec": copy.deepcopy(SPEC),
        "status": {"control": {"generation": 2, "action": "drain", "reason": "ScaledDown", "targetNodes": 2}},
    }
    (tmp_path / "job.json").write_text(json.dumps(job))
    source = agent_mod.FileJobSource(tmp_path)
    store = channel.scoped(server, SECRET, UID)
    g = guardian.Guardian(server, SECRET, UID)
    agent = agent_mod.Agent(source, store, guard=g)
    assert agent.sync()
    g.sweep()
    outsider.delete_key(NS + keys.TARGET_KEY)  # the guardian restores this one ...
    outsider.set(NS + keys.SIGNAL_KEY, b'{"generation": 99, "action": "reform"}')  # ... and this one
    outsider.set("junk", b"z")
    settle(outsider)
    g.sweep()
    agent.sync()
    assert keys.ControlSignal.model_validate_json(store.get(keys.SIGNAL_KEY)).generation == 2
    assert keys.TargetPlan.model_validate_json(store.get(keys.TARGET_KEY)).nodes == 2
    rejections = source.read()["status"]["storeRejections"]
    assert rejections["total"] == 3
    assert rejections["counts"] == {"control/deleted": 1, "control/unsigned": 1, "foreign/foreign": 1}
    assert {r["key"] for r in rejections["recent"]} == {"junk", "~/disttrain/signal", "~/disttrain/target"}
    # without the guardian's help (its memory lost: a restarted agent), the agent writes its own keys again
    outsider.delete_key(NS + keys.SIGNAL_KEY)
    settle(outsider)
    agent.sync()
    assert keys.ControlSignal.model_validate_json(store.get(keys.SIGNAL_KEY)).generation == 2


def test_the_mmap_threshold_can_be_pinned():
    assert guardian.pin_mmap_threshold() in (True, False)  # False only without glibc


def test_a_real_rendezvous_under_the_guardian_loses_nothing_and_survives_a_deleted_state(tmp_path, monkeypatch):
    """torchrun's rendezvous (our handler, torch's c10d backend, its per-round keys) through the signed store
    while the guardian sweeps: no legitimate value is ever rejected; the state deleted by an outsider is back and
    the nodes' keep-alives go on writing it."""
    from tests.agent.test_heartbeats import complete_round, handler

    monkeypatch.setenv(env.STORE_SECRET, SECRET)
    monkeypatch.setenv(env.JOB_UID, UID)
    port = free_port()
    server = agent_mod.start_store(port, "127.0.0.1", timeout_s=10)
    own = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    g = guardian.Guardian(own, SECRET, UID, interval_s=0.05)
    g.start()
    try:
        handlers = [handler(port, monkeypatch, f"demo-worker-{i}", f"uid-{i}") for i in range(2)]
        complete_round(handlers)
        time.sleep(0.5)
        assert g.counts() == {}, f"the guardian rejected a legitimate value: {g.snapshot()}"
        state_keys = [k for k in server.list_keys() if k.endswith("torch.rendezvous.job-uid-1")]
        assert state_keys
        outsider = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
        outsider.delete_key(state_keys[0])
        deadline = time.monotonic() + 10
        while state_keys[0] not in server.list_keys() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state_keys[0] in server.list_keys()
        for h in handlers:
            h._stop_heartbeats()
        handlers[0]._keep_alive()  # a compare_set on the restored state: it verifies and moves on
        assert set(g.counts()) == {("rendezvous", "deleted")}
    finally:
        g.stop()


def test_a_large_store_is_swept_in_few_round_trips_and_a_garbled_value_is_still_restored(stores):
    """A 1,024-node job holds ten thousand keys: read one by one every sweep, they were the agent's largest cost."""
    server, outsider = stores
    names = [f"{NS}disttrain/beacon/{rank}" for rank in range(1000)]
    server.multi_set(names, [sealed(name, b"step 7", 7) for name in names])
    counting = CountingClient(server)
    g = guardian.Guardian(counting, SECRET, UID)
    g.sweep()  # first sight: every key read alone, then remembered
    outsider.set(names[500], b"garbled")
    settle(outsider)
    counting.calls.clear()
    result = g.sweep()
    assert result.restored == 1 and g.counts() == {("control", "unsigned"): 1}
    assert storeauth.unseal(SECRET, UID, names[500], server.get(names[500])) == storeauth.Sealed(b"step 7", 7)
    assert len(counting.calls) <= 3 * (1000 // guardian.BATCH_KEYS + 1) + 2, counting.calls[:20]


def test_a_key_deleted_after_the_listing_is_read_alone_and_restored_next(stores):
    """Deleted between the sweep's listing and its batched read: the batch's ``check`` fails, so its keys are read
    one by one (a ``multi_get`` would wait for the missing key), and the next sweep puts the key back."""
    server, outsider = stores
    names = [f"{NS}disttrain/beacon/{rank}" for rank in range(10)]
    server.multi_set(names, [sealed(name, b"step 7", 7) for name in names])
    g = guardian.Guardian(server, SECRET, UID)
    g.sweep()

    class DeletingAfterListing(CountingClient):
        def list_keys(self):
            listed = self.client.list_keys()
            outsider.delete_key(names[3])
            settle(outsider)
            return listed

    counting = DeletingAfterListing(server)
    g.server = counting
    first = g.sweep()
    assert counting.calls.count("compare_set") == 10 and first.restored == 0
    g.server = server
    assert g.sweep().restored == 1
    assert sorted(server.list_keys()) == sorted(names)


def test_a_slow_sweep_pauses_longer():
    assert guardian.sweep_pause(0.01) == guardian.SWEEP_INTERVAL_S
    assert guardian.sweep_pause(0.3) == pytest.approx(0.9)  # sweeping takes a quarter of the sweeper's time
