"""The signed store against a real TCPStore server and an outsider's raw client (no secret): what the outsider
writes is absent to every reader, nothing it plants is unpickled, torch's Store contract holds, readers recover."""

from __future__ import annotations

import base64
import gc
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

from disttrain.api import control, env, storeauth
from disttrain.trainer.agent import heartbeats
from disttrain.trainer.store import channel, signedstore

SECRET, UID = "k" * 64, "uid-1"
PREFIX = storeauth.key_prefix(SECRET)


def full(key: str) -> str:
    """The key as the server (and the outsider, by list_keys) sees it."""
    return f"{PREFIX}/{key}"


class Settled:
    """A plain client whose ``set`` returns once the server has handled it: a TCPStore ``set`` gets no answer, and
    a read on another connection could otherwise overtake it."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def set(self, key: str, value: Any) -> None:
        self.raw.set(key, value)
        self.raw.num_keys()  # answered after the set: one connection's commands are handled in order

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


class Fixture:
    def __init__(self) -> None:
        self.server = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True, timeout=timedelta(seconds=10)
        )
        self.outsider = Settled(self.raw())
        self.rejected: list[tuple[str, str]] = []

    def raw(self, timeout_s: float = 10) -> Any:
        return dist.TCPStore(
            "127.0.0.1", self.server.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )

    def client(self, timeout_s: float = 10, uid: str = UID, secret: str = SECRET) -> Any:
        # The hook holds the list, not the fixture: a SignedStore lives as long as the process
        # (signedstore._ALIVE), and through ``self`` it would keep this test's server and its thread alive too.
        rejected = self.rejected
        return channel.scoped(self.raw(timeout_s), secret, uid, on_reject=lambda k, r: rejected.append((k, r)))


@pytest.fixture
def net() -> Iterator[Fixture]:
    yield Fixture()


def pickle_that_creates(path: Path) -> bytes:
    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (open, (str(path), "w"))

    return base64.b64encode(pickle.dumps(Payload()))


# --- values ----------------------------------------------------------------------------------------------------


def test_values_round_trip_and_are_stored_sealed_under_the_prefixed_key(net: Fixture) -> None:
    store = net.client()
    store.set("a", "plain")
    assert store.get("a") == b"plain"
    raw = net.outsider.get(full("a"))
    assert raw != b"plain" and storeauth.unseal(SECRET, UID, full("a"), raw) is not None


@pytest.mark.parametrize(
    "forge",
    ["plain", "garbled", "other-key", "other-job", "other-secret", "8MiB"],
)
def test_an_outsiders_value_is_absent_to_check_get_and_counted_once(net: Fixture, forge: str) -> None:
    store = net.client(timeout_s=1)
    values = {
        "plain": b'{"generation": 9, "action": "reform"}',
        "garbled": storeauth.seal(SECRET, UID, full("a"), b"x", 1)[:-1] + b"y",
        "other-key": storeauth.seal(SECRET, UID, full("b"), b"x", 1),
        "other-job": storeauth.seal(SECRET, "uid-2", full("a"), b"x", 1),
        "other-secret": storeauth.seal("z" * 64, UID, full("a"), b"x", 1),
        "8MiB": os.urandom(8 << 20),
    }
    net.outsider.set(full("a"), values[forge])
    assert not store.check(["a"])
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="valid value"):
        store.get("a")
    assert time.monotonic() - started >= 0.9, "get waits out the store timeout, as for a missing key"
    assert net.rejected == [(full("a"), "invalid")], "each distinct invalid value is reported once"
    assert channel.signed_of(store).rejection_counts() == {full("a"): 1}  # type: ignore[union-attr]


def test_a_get_waiting_on_a_forged_value_returns_the_valid_one_written_later(net: Fixture) -> None:
    store, writer = net.client(), net.client()
    net.outsider.set(full("a"), b"forged")
    threading.Timer(0.3, lambda: writer.set("a", "real")).start()
    assert store.get("a") == b"real"


def test_a_replayed_older_value_is_refused_by_a_reader_that_saw_a_newer_one(net: Fixture) -> None:
    store, reader = net.client(timeout_s=1), net.client(timeout_s=1)
    store.set("a", "old")
    old = net.outsider.get(full("a"))
    store.set("a", "new")
    assert reader.get("a") == b"new"
    net.outsider.set(full("a"), old)
    assert not reader.check(["a"])
    assert (full("a"), "replay") in net.rejected


def test_sequence_numbers_move_forward_across_writers_and_after_a_delete(net: Fixture) -> None:
    one, two = net.client(), net.client()
    seqs = []
    for store, value in ((one, "1"), (two, "2"), (one, "3")):
        store.set("a", value)
        sealed = storeauth.unseal(SECRET, UID, full("a"), net.outsider.get(full("a")))
        assert sealed is not None
        seqs.append(sealed.seq)
    net.outsider.delete_key(full("a"))
    two.set("a", "4")
    sealed = storeauth.unseal(SECRET, UID, full("a"), net.outsider.get(full("a")))
    assert sealed is not None
    assert seqs == sorted(seqs) and len(set(seqs)) == 3 and sealed.seq > seqs[-1]
    assert one.get("a") == b"4", "a value written after a delete is newer than anything seen before it"


# --- torch's Store contract -------------------------------------------------------------------------------------


def test_compare_set_answers_as_tcpstore_does(net: Fixture) -> None:
    """The same sequence of compare_set calls on the signed store and on a plain TCPStore gives the same answers."""
    signed, plain = net.client(), net.raw()
    steps = [("c", "x", "y"), ("c", "", "v1"), ("c", "", "v2"), ("c", "zz", "v3"), ("c", "v1", "v4"), ("c", "v4", "")]
    for key, expected, desired in steps:
        assert signed.compare_set(key, expected, desired) == plain.compare_set("plain-" + key, expected, desired)
    assert signed.get("c") == plain.get("plain-c")


def test_compare_set_compares_with_the_valid_content_not_the_forged_one(net: Fixture) -> None:
    store = net.client()
    net.outsider.set(full("c"), b"v1")  # an outsider's plain "v1"
    assert store.compare_set("c", "v1", "mine") == b"v1", "a forged value is absent: nothing to compare v1 with"
    assert not store.check(["c"])
    assert store.compare_set("c", "", "mine") == b"mine"
    assert store.get("c") == b"mine"


def test_add_counts_over_sealed_integers_and_treats_a_forged_count_as_absent(net: Fixture) -> None:
    store = net.client()
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5 and store.get("n") == b"5"
    net.outsider.set(full("m"), b"1000")
    assert store.add("m", 1) == 1


def test_wait_multi_get_multi_set_delete_and_num_keys(net: Fixture) -> None:
    store, writer = net.client(timeout_s=2), net.client()
    store.multi_set(["a", "b"], ["1", b"2"])
    store.wait(["a", "b"])
    assert store.multi_get(["a", "b"]) == [b"1", b"2"]
    net.outsider.set(full("w"), b"forged")
    with pytest.raises(dist.DistStoreError):
        store.wait(["w"], timedelta(seconds=0.5))
    threading.Timer(0.3, lambda: writer.set("w", "ok")).start()
    store.wait(["w"], timedelta(seconds=5))
    assert store.delete_key("a") and not store.check(["a"])
    assert store.num_keys() >= 2
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        store.multi_set(["x", "y"], ["1"])


def test_set_timeout_through_the_prefix_store_bounds_the_wait_for_a_valid_value(net: Fixture) -> None:
    store = net.client(timeout_s=30)
    net.outsider.set(full("a"), b"forged")
    store.set_timeout(timedelta(seconds=0.5))
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.get("a")
    assert time.monotonic() - started < 5


def test_the_store_keeps_working_after_its_python_object_is_only_held_by_torch(net: Fixture) -> None:
    """torch's PrefixStore holds only the C++ half of a Python Store; the signed store must outlive its creator."""
    store = dist.PrefixStore("torch.rendezvous.r", net.client())
    gc.collect()
    store.set("MASTER_ADDR", "h")
    assert store.get("MASTER_ADDR") == b"h"


def test_a_process_without_the_secret_refuses_to_use_the_store(net: Fixture, monkeypatch) -> None:
    monkeypatch.delenv(env.STORE_SECRET, raising=False)
    monkeypatch.delenv(env.STORE_SECRET_FILE, raising=False)
    with pytest.raises(channel.MissingSecret, match="DISTTRAIN_STORE_SECRET"):
        channel.scoped(net.raw())
    with pytest.raises(channel.MissingSecret):
        channel.connect("127.0.0.1", net.server.port, 1)


# --- torch's keys and the readers of this project ----------------------------------------------------------------


def test_a_pickle_planted_as_the_rendezvous_state_is_never_unpickled(net: Fixture, tmp_path: Path) -> None:
    planted = tmp_path / "pwned"
    net.outsider.set(full("torch.rendezvous.run"), pickle_that_creates(planted))
    store = net.client(timeout_s=1)
    signed = channel.signed_of(store)
    assert signed is not None
    started = time.monotonic()
    backend = c10d_rendezvous_backend.C10dRendezvousBackend(store, "run")  # compare_set(key, "", sentinel)
    assert time.monotonic() - started >= signedstore.RESTORE_GRACE_S * 0.9, "it waited for a restorer first"
    assert backend.get_state() is None, "the forged state was taken for absent; the sentinel replaced it"
    assert heartbeats.read_state(store, "run") is None
    assert not planted.exists()


def test_a_reader_restores_the_rendezvous_state_it_saw_when_it_is_garbled_or_deleted(
    net: Fixture, tmp_path: Path
) -> None:
    planted = tmp_path / "pwned"
    writer, reader = net.client(), net.client(timeout_s=2)
    backend = c10d_rendezvous_backend.C10dRendezvousBackend(writer, "run")
    result = backend.set_state(b"state-1")
    assert result is not None and result[2]
    reader_backend = c10d_rendezvous_backend.C10dRendezvousBackend(reader, "run")
    seen = reader_backend.get_state()
    assert seen is not None and seen[0] == b"state-1"

    net.outsider.set(full("torch.rendezvous.run"), pickle_that_creates(planted))
    again = reader_backend.get_state()
    assert again is not None and again[0] == b"state-1", "restored, not unpickled, not a fresh state"
    net.outsider.delete_key(full("torch.rendezvous.run"))
    again = reader_backend.get_state()
    assert again is not None and again[0] == b"state-1"
    # the writer's next compare_set, with the token it holds, still works on the restored value
    assert backend.set_state(b"state-2", result[1]) is not None
    assert reader_backend.get_state()[0] == b"state-2"  # type: ignore[index]
    assert not planted.exists()


def test_a_restore_never_clobbers_a_newer_valid_state(net: Fixture) -> None:
    one, two = net.client(), net.client()
    one.set("torch.rendezvous.run", "old")
    one.num_keys()  # a set gets no answer: a round trip on its connection proves the server handled it
    assert two.get("torch.rendezvous.run") == b"old"
    one.set("torch.rendezvous.run", "new")
    one.num_keys()
    assert two.get("torch.rendezvous.run") == b"new"
    assert net.outsider.get(full("torch.rendezvous.run")) != b""


def test_a_forged_master_addr_is_absent_and_the_real_one_is_read(net: Fixture) -> None:
    rank0 = dist.PrefixStore("torch.rendezvous.run.1", net.client())
    rank1 = dist.PrefixStore("torch.rendezvous.run.1", net.client(timeout_s=1))
    net.outsider.set(full("torch.rendezvous.run.1/MASTER_ADDR"), b"evil.example")
    with pytest.raises(dist.DistStoreError):
        rank1.get("MASTER_ADDR")
    rank0.set("MASTER_ADDR", "10.0.0.1")
    assert rank1.get("MASTER_ADDR") == b"10.0.0.1"


@pytest.mark.parametrize("key", [control.SIGNAL_KEY, control.FAILURE_KEY, control.TARGET_KEY])
def test_forged_control_keys_read_as_absent(net: Fixture, key: str) -> None:
    store = net.client(timeout_s=1)
    forged = {
        control.SIGNAL_KEY: control.ControlSignal(generation=9, action="reform").model_dump_json(),
        control.FAILURE_KEY: control.WorkerFailure(
            exit_code=85, node="outsider", message="x", time=1.0
        ).model_dump_json(),
        control.TARGET_KEY: control.TargetPlan(generation=9, nodes=1).model_dump_json(),
    }[key]
    net.outsider.set(full(key), forged)
    assert control.read_model(store, key, control.ControlSignal) is None
    assert net.rejected == [(full(key), "invalid")]


def test_heartbeats_read_the_state_only_through_a_verifying_store(net: Fixture, tmp_path: Path) -> None:
    planted = tmp_path / "pwned"
    net.outsider.set("torch.rendezvous.run", pickle_that_creates(planted))
    with pytest.raises(heartbeats.StateRefused, match="signed store"):
        heartbeats.read_state(net.outsider, "run")
    assert heartbeats.is_verifying(net.client()) and not heartbeats.is_verifying(net.outsider)
    assert not planted.exists()


EXIT_SCRIPT = """
import sys, threading, time
from datetime import timedelta
import torch.distributed as dist
from disttrain.trainer.store import channel
from disttrain.trainer.control import Watchdog

port, secret, forged_key = int(sys.argv[1]), sys.argv[2], sys.argv[3]
raw = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60))
store = channel.scoped(raw, secret, "uid-1")
for _ in range(8):  # each waits for a valid value; several, so one is still on its way back when another ends
    threading.Thread(target=store.get, args=(forged_key,), daemon=True).start()
watchdog = Watchdog(f"127.0.0.1:{port}", poll_seconds=0.0, job_uid="uid-1")
watchdog.store = store
watchdog.start()  # polls the signal key through torch's C++ PrefixStore without a pause
time.sleep(0.5)
watchdog.stop()
print("main done", flush=True)
"""


@pytest.mark.parametrize("attempt", range(3))
def test_a_process_exits_cleanly_with_threads_inside_signed_store_calls(net: Fixture, attempt: int) -> None:
    """A worker that finished training exits 0 even while daemon threads wait in SignedStore calls on a forged
    value and the watchdog polls: before the exit drain such a process died in finalisation with SIGSEGV/SIGABRT
    (exit 139/134), which the pod reported as a failure after the forge attack; and, before the prefix store
    counted its calls too, when a thread was still on its way back through torch's binding (3 runs in 9 here)."""
    net.outsider.set(full("forged"), b"not a sealed value")
    proc = subprocess.Popen(
        [sys.executable, "-c", EXIT_SCRIPT, str(net.server.port), SECRET, "forged"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the interpreter's start (seconds under load) is not what this test times
    main_done = time.monotonic()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode} (attempt {attempt}): {stderr[-2000:]}"
    assert line.strip() == "main done"
    assert time.monotonic() - main_done < 30, "the exit waited for the store timeout (60 s) instead of ending the calls"


class Counting:
    """A raw client that counts the requests made through it (the signed store's round trips)."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.calls = raw, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.raw, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return attr(*args, **kwargs)

        return counted


def test_check_and_multi_get_of_many_keys_cost_two_round_trips_each_and_verify_every_value(net: Fixture) -> None:
    """The agent reads one beat per node and one beacon per rank: a read of many keys must not cost a round trip
    per key, and must refuse what a per-key read refuses."""
    writer = net.client()
    names = [f"beacon/{rank}" for rank in range(200)]
    for rank, name in enumerate(names):
        writer.set(name, str(rank))
    counting = Counting(net.raw(timeout_s=2))
    store = signedstore.SignedStore(counting, SECRET, UID, on_reject=lambda k, r: net.rejected.append((k, r)))
    keys = [full(name) for name in names]
    assert store.check(keys)
    assert store.multi_get(keys) == [str(rank).encode() for rank in range(200)]
    assert counting.calls == 2, "a check and the multi_get of the same 200 keys after it: two round trips in all"
    assert store.multi_get(keys[:5]) == [str(rank).encode() for rank in range(5)] and counting.calls == 4
    net.outsider.set(keys[7], b"forged")
    assert not store.check(keys), "one invalid value among many: not all there"
    assert net.rejected == [(keys[7], "invalid")]
    threading.Timer(0.3, lambda: writer.set(names[7], "seven")).start()
    values = store.multi_get(keys)
    assert values[7] == b"seven" and values[8] == b"8", "multi_get waits for the valid value, as get does"
    old = net.outsider.get(keys[9])
    writer.set(names[9], "nine")
    assert store.multi_get(keys)[9] == b"nine"
    net.outsider.set(keys[9], old)
    assert not store.check(keys) and (keys[9], "replay") in net.rejected
    assert not store.check([*keys, full("absent")]), "an absent key among many"


def test_a_multi_get_after_a_check_reads_back_what_the_thread_wrote_between(net: Fixture) -> None:
    store = net.client()
    names = [f"beat/{node}" for node in range(4)]
    store.multi_set(names, ["a", "b", "c", "d"])
    assert store.check(names)
    store.set(names[2], "C")  # any call between the two drops what the check kept
    assert store.multi_get(names) == [b"a", b"b", b"C", b"d"]
    assert store.check(names)
    other = threading.Thread(target=lambda: store.check(names[:2]))  # another thread's check keeps its own
    other.start()
    other.join()
    assert store.multi_get(names) == [b"a", b"b", b"C", b"d"]
