"""The ``disttrain`` torchrun rendezvous handler with real torchrun agents on localhost and the store in a
separate process (the job agent's role, ``is_host=false``): a round completes as soon as the target node count
joined, without waiting out ``last_call_timeout``; it never completes below the target (no split brain); a node
listed in ``exclude`` stays out of the round; without a target it is stock c10d, except that ranks follow the
nodes' stable indices. Every process holds the job's store secret (the harness's): all of it runs through the
signed store, and an outsider without the secret forging torch's own keys costs a delay, never code or the round."""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from disttrain.api import control
from disttrain.trainer.launch import joins as join_records

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

PROBE = Path(__file__).resolve().parent / "workers" / "rdzv_probe.py"
LAST_CALL_S = 30
STATE_KEY = "torch.rendezvous.probe"  # C10dRendezvousBackend keeps the round state under torch.rendezvous.<run id>


def start_node(
    harness,
    port: int,
    name: str,
    out: Path,
    last_call: int = LAST_CALL_S,
    *,
    index: int | None = None,
    nnodes: str = "1:3",
    keep_alive: int = 1,
    conf_extra: str = "",
    **extra_env: str,
) -> subprocess.Popen:
    conf = f"is_host=false,join_timeout=60,last_call_timeout={last_call},keep_alive_interval={keep_alive}{conf_extra}"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        "--rdzv-backend=disttrain",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=probe",
        f"--rdzv-conf={conf}",
        "--max-restarts=3",
        "--monitor-interval=0.2",
        str(PROBE),
    ]
    env = {
        **os.environ,
        "DISTTRAIN_NODE_NAME": name,
        "PROBE_OUT": str(out),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONUNBUFFERED": "1",
        "DISTTRAIN_STORE_SECRET": harness.secret,
        "DISTTRAIN_JOB_UID": harness.job_uid,
        **extra_env,
    }
    env.pop("DISTTRAIN_NODE_INDEX", None)
    if index is not None:
        env["DISTTRAIN_NODE_INDEX"] = str(index)
    return harness.popen(cmd, env, out / f"{name}.log")


def read_records(out: Path) -> dict[str, dict]:
    records = {}
    for path in out.glob("*.json"):
        try:
            records[path.stem] = json.loads(path.read_text())
        except json.JSONDecodeError:
            pass  # being written
    return records


def wait_for(out: Path, names: set[str], timeout: float) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not names <= read_records(out).keys():
        time.sleep(0.1)
    return read_records(out)


def first_contact(store: dist.Store, timeout: float = 30) -> float:
    """When the first torchrun agent reached the rendezvous state in the store: the clock starts there, so the
    figure measures the rendezvous and not how long a loaded machine takes to start Python and import torch."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if store.check([STATE_KEY]):
            return time.time()
        time.sleep(0.02)
    raise AssertionError("no torchrun agent reached the store")


def logs_of(out: Path, names) -> str:
    return "\n".join(f"--- {n}\n" + (out / f"{n}.log").read_text()[-2000:] for n in names)


def test_round_completes_once_the_target_joined_without_waiting_out_last_call(harness):
    port = harness.start_store()
    store = harness.client(port)
    store.set(control.TARGET_KEY, control.TargetPlan(generation=1, nodes=2).model_dump_json())
    nodes = {name: start_node(harness, port, name, harness.out) for name in ("node-0", "node-1")}
    started = first_contact(store)
    records = wait_for(harness.out, set(nodes), 20)
    assert set(nodes) <= records.keys(), logs_of(harness.out, nodes)
    # Stock c10d with --nnodes=1:3 completes only last_call_timeout (30 s) after min_nodes (1) joined.
    assert max(r["time"] for r in records.values()) - started < 10, logs_of(harness.out, nodes)
    assert {r["WORLD_SIZE"] for r in records.values()} == {"2"}
    assert all(p.wait(timeout=30) == 0 for p in nodes.values()), logs_of(harness.out, nodes)


def _pickle_that_creates(path: Path) -> bytes:
    """base64 of a pickle that, once ``pickle.loads``-ed (as torch's c10d backend does with the state), creates
    ``path``: the payload of the issue-27 attack."""

    class Payload:
        def __reduce__(self):
            return (open, (str(path), "w"))

    return base64.b64encode(pickle.dumps(Payload()))


def _outsider(port: int) -> dist.TCPStore:
    """A client with no secret: it can list, read, write and delete every key."""
    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))


def _full_key(outsider: dist.TCPStore, suffix: str, timeout_s: float = 10.0) -> str:
    """The full name of the one key ending in ``suffix``, once it is there: a ``set`` on another connection gets no
    answer, so the key may not be listed yet when the writer returns."""
    deadline = time.monotonic() + timeout_s
    while True:
        keys = [k for k in outsider.list_keys() if k.endswith("/" + suffix)]
        if keys or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(keys) == 1, outsider.list_keys()
    return keys[0]


def test_an_outsider_forging_the_rendezvous_state_runs_no_code_and_the_group_still_forms_and_re_forms(harness):
    """An outsider's attack on a real torchrun rendezvous through the signed store. Before any node starts, an outsider
    (no secret) plants a pickle that would create a file under the state key and a forged target; once the group
    runs it plants the pickle again and garbles the per-round keys; then a node dies and a replacement joins. The
    pickle is never unpickled (no file), the forged target is ignored (the job's own target rules), and the group
    forms and re-forms with the ranks it should have."""
    port = harness.start_store()
    out = harness.out
    store = harness.client(port)
    outsider = _outsider(port)
    planted = out.parent / "pwned"
    store.set(control.TARGET_KEY, control.TargetPlan(generation=1, nodes=3).model_dump_json())
    target_key = _full_key(outsider, control.TARGET_KEY)
    state_key = target_key[: -len(control.TARGET_KEY)] + STATE_KEY
    outsider.set(state_key, _pickle_that_creates(planted))
    forged_target = control.TargetPlan(generation=9, nodes=1).model_dump_json()
    outsider.set(target_key, forged_target)  # the job's target is gone: the forged one is absent to readers
    store.set(control.TARGET_KEY, control.TargetPlan(generation=1, nodes=3).model_dump_json())  # the agent's guardian

    nodes = {}
    for index in (0, 1, 2):
        name = f"node-{index}"
        nodes[name] = start_node(harness, port, name, out, index=index, nnodes="1:3", PROBE_SLEEP="120")
    records = wait_for(out, set(nodes), 40)
    assert set(nodes) <= records.keys(), logs_of(out, nodes)
    assert {records[n]["WORLD_SIZE"] for n in nodes} == {"3"}, "the job's target (3), not the forged one (1)"
    assert {n: records[n]["GROUP_RANK"] for n in nodes} == {"node-0": "0", "node-1": "1", "node-2": "2"}

    # While the group runs: the pickle again over the (now valid) state, junk over every per-round key.
    outsider.set(state_key, _pickle_that_creates(planted))
    for key in outsider.list_keys():
        if "torch.rendezvous.probe." in key:
            outsider.set(key, b"garbled")
    harness.kill_tree(nodes.pop("node-0").pid)
    for path in out.glob("*.json"):
        path.unlink()
    store.set(control.TARGET_KEY, control.TargetPlan(generation=2, nodes=3, lost=["node-0"]).model_dump_json())
    for proc in nodes.values():  # the survivors' collectives would fail: their workers exit, torchrun restarts them
        subprocess.run(["pkill", "-KILL", "-P", str(proc.pid)], check=False)
    nodes["node-0-1"] = start_node(harness, port, "node-0-1", out, index=0, nnodes="1:3", PROBE_SLEEP="120")
    records = wait_for(out, set(nodes), 60)
    assert set(nodes) <= records.keys(), logs_of(out, nodes)
    assert {n: records[n]["GROUP_RANK"] for n in nodes} == {"node-0-1": "0", "node-1": "1", "node-2": "2"}
    assert not planted.exists(), "the outsider's pickle was unpickled"
    assert outsider.get(state_key) != _pickle_that_creates(planted), "the state was restored by the job's processes"


def test_round_completes_at_the_target_and_leaves_excluded_nodes_out(harness):
    port = harness.start_store()
    store = harness.client(port)
    store.set(control.TARGET_KEY, control.TargetPlan(generation=1, nodes=2, exclude=["node-2"]).model_dump_json())
    out = harness.out

    nodes = {name: start_node(harness, port, name, out) for name in ("node-2", "node-0", "node-1")}
    started = first_contact(store)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not {"node-0", "node-1"} <= read_records(out).keys():
        time.sleep(0.1)
    records = read_records(out)
    logs = "\n".join(f"--- {n}\n" + (out / f"{n}.log").read_text()[-2000:] for n in nodes)
    assert {"node-0", "node-1"} <= records.keys(), logs

    # Stock c10d with --nnodes=1:3 would wait last_call_timeout (30 s) after the first node joined, then complete
    # with whoever was there (all three here).
    completed_after = max(records[n]["time"] for n in ("node-0", "node-1")) - started
    assert completed_after < 10, logs
    assert {records[n]["WORLD_SIZE"] for n in ("node-0", "node-1")} == {"2"}
    assert sorted(records[n]["GROUP_RANK"] for n in ("node-0", "node-1")) == ["0", "1"]

    # The excluded node is still outside while the round runs (and it never ran a worker).
    time.sleep(1.5)
    assert "node-2" not in read_records(out), logs
    assert nodes["node-0"].wait(timeout=30) == 0 and nodes["node-1"].wait(timeout=30) == 0, logs
    assert "node-2" not in read_records(out), logs


def test_the_target_is_a_floor_a_lone_node_does_not_form_a_group_of_its_own(harness):
    """Split brain seen in demo runs: with nodes.min 1 a late node completed a round alone after a short last call.
    With the operator's target published, a round waits for the target however short the last call is."""
    port = harness.start_store()
    store = harness.client(port)
    store.set(control.TARGET_KEY, control.TargetPlan(generation=1, nodes=2).model_dump_json())
    out = harness.out
    nodes = {"node-0": start_node(harness, port, "node-0", out, last_call=1)}
    first_contact(store)
    time.sleep(8)  # 8 last calls long
    assert "node-0" not in read_records(out), "a lone node completed a round below the target: " + logs_of(out, nodes)
    assert nodes["node-0"].poll() is None, logs_of(out, nodes)
    nodes["node-1"] = start_node(harness, port, "node-1", out, last_call=1)
    records = wait_for(out, set(nodes), 30)
    assert set(nodes) <= records.keys(), logs_of(out, nodes)
    assert {records[n]["WORLD_SIZE"] for n in nodes} == {"2"}
    assert all(p.wait(timeout=30) == 0 for p in nodes.values()), logs_of(out, nodes)


def test_without_a_target_it_is_stock_c10d_min_nodes_after_the_last_call(harness):
    """The control case of the floor test: no target published, the same lone node completes after the last call."""
    port = harness.start_store()
    store = harness.client(port)
    nodes = {"node-0": start_node(harness, port, "node-0", harness.out, last_call=1)}
    first_contact(store)
    records = wait_for(harness.out, set(nodes), 20)
    assert "node-0" in records, logs_of(harness.out, nodes)
    assert records["node-0"]["WORLD_SIZE"] == "1"
    assert nodes["node-0"].wait(timeout=30) == 0, logs_of(harness.out, nodes)


def test_ranks_follow_node_indices_and_a_replacement_takes_the_lost_nodes_rank(harness):
    """Issue "bitwise-identical recovery": ranks by node index, not arrival. Nodes start in reverse index order
    (c10d alone would rank them by agent pid, i.e. by arrival); then node index 0 dies (its whole tree) and a
    replacement with index 0 joins: it gets rank 0 back and the survivors keep ranks 1 and 2."""
    port = harness.start_store()
    out = harness.out
    nodes = {}
    for index in (2, 1, 0):
        name = f"node-{index}"
        nodes[name] = start_node(harness, port, name, out, index=index, nnodes="3:3", PROBE_SLEEP="120")
        time.sleep(0.5)
    records = wait_for(out, set(nodes), 30)
    assert set(nodes) <= records.keys(), logs_of(out, nodes)
    assert {n: records[n]["GROUP_RANK"] for n in nodes} == {"node-0": "0", "node-1": "1", "node-2": "2"}

    harness.kill_tree(nodes.pop("node-0").pid)
    for path in out.glob("*.json"):
        path.unlink()
    nodes["node-0-1"] = start_node(harness, port, "node-0-1", out, index=0, nnodes="3:3", PROBE_SLEEP="120")
    records = wait_for(out, set(nodes), 45)
    assert set(nodes) <= records.keys(), logs_of(out, nodes)
    assert {n: records[n]["GROUP_RANK"] for n in nodes} == {"node-0-1": "0", "node-1": "1", "node-2": "2"}


@pytest.mark.parametrize("joins", ["compare-and-set", "per-node"])
def test_survivors_drop_a_node_declared_lost_from_the_finished_round_without_waiting_for_its_heartbeats(
    harness, joins: str
):
    """A node dies (its whole tree) while the group runs; the operator declares its pod lost and lowers the target.
    The survivors' workers fail and their agents re-join: they drop the dead participant from the finished round
    at once. Without that, torch keeps it a participant until its heartbeats expire (keep_alive_interval 20 s x 3
    attempts = 60 s here), and the survivors could not open the next round before this test gives up. Both ways
    of joining: torch's (a compare-and-set of the state per node) and per-node join records, closed by one node
    (``per_node_joins_above=0``: every round; by default only rounds of more than 32 nodes)."""
    conf_extra = ",per_node_joins_above=0" if joins == "per-node" else ""
    port = harness.start_store()
    store = harness.client(port)
    store.set(control.TARGET_KEY, control.TargetPlan(generation=1, nodes=3).model_dump_json())
    out = harness.out
    nodes = {
        name: start_node(harness, port, name, out, index=i, keep_alive=20, conf_extra=conf_extra, PROBE_SLEEP="120")
        for i, name in enumerate(("node-0", "node-1", "node-2"))
    }
    records = wait_for(out, set(nodes), 30)
    assert set(nodes) <= records.keys(), logs_of(out, nodes)
    assert {r["WORLD_SIZE"] for r in records.values()} == {"3"}

    harness.kill_tree(nodes.pop("node-2").pid)
    for path in out.glob("*.json"):
        path.unlink()
    store.set(control.TARGET_KEY, control.TargetPlan(generation=2, nodes=2, lost=["node-2"]).model_dump_json())
    for proc in nodes.values():  # the survivors' collectives fail: their workers exit and torchrun restarts them
        subprocess.run(["pkill", "-KILL", "-P", str(proc.pid)], check=False)
    records = wait_for(out, set(nodes), 40)
    assert set(nodes) <= records.keys(), logs_of(out, nodes)
    assert {records[n]["WORLD_SIZE"] for n in nodes} == {"2"}
    assert {records[n]["GROUP_RANK"] for n in nodes} == {"0", "1"}
    closed_from_records = [join_records.is_closed(store, "probe", round_) for round_ in (0, 1)]
    assert closed_from_records == [joins == "per-node"] * 2


def test_the_handler_writes_nothing_outside_the_jobs_key_namespace(harness, monkeypatch):
    """Building the handler (what torchrun does on every node) leaves no raw key on the store: torch's
    ``create_backend`` would write an unsigned ``torch.rendezvous.<run id>`` placeholder on the raw client, which the
    agent's guardian then has to delete. Only the sealed state under the job's namespace is written."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from disttrain.api import storeauth
    from disttrain.trainer.agent import heartbeats
    from disttrain.trainer.launch import rendezvous

    port = harness.start_store()
    monkeypatch.setenv("DISTTRAIN_STORE_SECRET", harness.secret)
    monkeypatch.setenv("DISTTRAIN_JOB_UID", harness.job_uid)
    params = RendezvousParameters("disttrain", f"127.0.0.1:{port}", "probe", 1, 1, is_host="false", read_timeout=10)
    handler = rendezvous.create_handler(params)
    assert handler.get_backend() == "disttrain"

    handler.beat.stop()
    listed = _outsider(port).list_keys()
    namespace = storeauth.key_prefix(harness.secret) + "/"
    beat = namespace + heartbeats.beat_key("probe", handler._this_node)  # the launcher's liveness beat, sealed too
    assert namespace + STATE_KEY in listed and set(listed) <= {namespace + STATE_KEY, beat}, listed
    assert harness.client(port).check([STATE_KEY])  # the placeholder is there, sealed, for torch's first read

    with pytest.raises(ValueError, match="store_type"):
        rendezvous.create_handler(
            RendezvousParameters("disttrain", f"127.0.0.1:{port}", "probe", 1, 1, store_type="file")
        )
