"""Nobody outside a job can steer it through the agent's store, and no value read from it can break a reader.

A real TCPStore served by the agent's own ``start_store``; "outsiders" are plain TCPStore clients that can reach the
port (as any pod can where NetworkPolicy is not enforced) but do not hold the job's store secret. They can list every
key (torch >= 2.10), so they write under the job's real key names; what they write does not verify and is absent to
every reader of the job (:mod:`disttrain.trainer.store.signedstore`).
"""

from __future__ import annotations

import copy
import datetime
import json

import pytest
from tests.agent.test_agent import SPEC, checkpoint_manifest
from torch.distributed import DistError, TCPStore

from disttrain.api import control as keys
from disttrain.api import env, storeauth
from disttrain.api.exitcodes import ExitCode
from disttrain.common.ports import free_port
from disttrain.trainer.agent import service as agent_mod
from disttrain.trainer.control import Watchdog
from disttrain.trainer.store import channel

pytestmark = pytest.mark.timeout(60)

SECRET = "0123456789abcdef" * 4


def real_key(key: str) -> str:
    """A key of the job as the server names it (what the outsider finds with ``list_keys``)."""
    return storeauth.key_prefix(SECRET) + "/" + key


def write_job(state, control=None, uid="uid-1"):
    job = {
        "apiVersion": "disttrain.dev/v1alpha1",
        "kind": "DistTrainJob",
        "metadata": {"name": "demo", "namespace": "team", "uid": uid},
        "spec": copy.deepcopy(SPEC),
        "status": {"control": control or {"generation": 0, "action": "none", "targetNodes": 2}},
    }
    (state / "job.json").write_text(json.dumps(job))


def progress(step, time_=1_700_000_000.5, process="p1"):
    return keys.ProgressReport(
        step=step,
        samples_consumed=step * 24,
        world_size=2,
        plan={"worldSize": 2, "globalBatch": 24},
        run_id="r",
        process_id=process,
        time=time_,
    ).model_dump_json()


def failure(code=85, message="bad dataset"):
    return keys.WorkerFailure(
        exit_code=code, node="demo-worker-1", message=message, time=1_700_000_100.0
    ).model_dump_json()


def manifest(step=10, created_at="2023-11-14T22:14:00Z"):
    return json.dumps(checkpoint_manifest(step, created_at))


@pytest.fixture
def job_store(monkeypatch):
    """(port, the agent's scoped store, an outsider's raw client); the job's processes hold SECRET in their env."""
    monkeypatch.setenv(env.STORE_SECRET, SECRET)
    monkeypatch.setenv(env.JOB_UID, "uid-1")
    port = free_port()
    server = agent_mod.start_store(port, "127.0.0.1", timeout_s=30)
    outsider = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    yield port, agent_mod.scoped_store(server), outsider


def agent_and_watchdog(state, port, store):
    """An agent that has synced the job once, and a worker's Watchdog connected to its store, exits recorded."""
    write_job(state)
    agent = agent_mod.Agent(agent_mod.FileJobSource(state), store)
    agent.sync()
    exits: list[int] = []
    watchdog = Watchdog(f"127.0.0.1:{port}", exit_fn=exits.append)
    watchdog.connect(timeout_s=30)
    return agent, watchdog, exits


def test_a_client_without_the_secret_can_neither_fail_nor_fake_progress_nor_checkpoints(tmp_path, job_store):
    port, store, outsider = job_store
    write_job(tmp_path)
    source = agent_mod.FileJobSource(tmp_path)
    agent = agent_mod.Agent(source, store)
    for key, value in (
        (keys.FAILURE_KEY, failure()),
        (keys.PROGRESS_KEY, progress(50)),
        (keys.CHECKPOINT_KEY, manifest(step=50, created_at="2099-01-01T00:00:00Z")),
    ):
        outsider.set(key, value)
        outsider.set(storeauth.key_prefix("guess") + "/" + key, value)
        outsider.set(real_key(key), value)  # the job's own key, as list_keys names it
    agent.sync()
    status = source.agent_status()
    assert "workerFailure" not in status and "step" not in status and "lastCheckpoint" not in status, status

    worker = channel.connect("127.0.0.1", port, 5)  # a process of the job: SECRET from its env
    worker.set(keys.PROGRESS_KEY, progress(3))
    worker.set(keys.FAILURE_KEY, failure(code=3))
    agent.sync()
    status = source.agent_status()
    assert status["step"] == 3 and status["workerFailure"]["exitCode"] == 3


def test_a_client_without_the_secret_cannot_reform_or_drain_the_workers(tmp_path, job_store):
    port, store, outsider = job_store
    agent, watchdog, exits = agent_and_watchdog(tmp_path, port, store)
    watchdog.start()
    watchdog.stop()  # polled by hand below
    forged = keys.ControlSignal(generation=99, action=keys.DirectiveAction.REFORM, job_uid="uid-1").model_dump_json()
    outsider.set(keys.SIGNAL_KEY, forged)
    outsider.set(keys.TARGET_KEY, keys.TargetPlan(generation=99, nodes=1, exclude=["demo-worker-0"]).model_dump_json())
    outsider.set(real_key(keys.SIGNAL_KEY), forged)
    outsider.set(real_key(keys.TARGET_KEY), keys.TargetPlan(generation=99, nodes=1).model_dump_json())
    assert real_key(keys.SIGNAL_KEY) in outsider.list_keys(), "the outsider can name the job's keys"
    watchdog.poll_once()
    assert exits == [] and not watchdog.drain_requested
    assert outsider.get(real_key(keys.SIGNAL_KEY)) == forged.encode(), "the forged signal sat under the job's key"
    signed = channel.signed_of(watchdog.store)
    assert signed is not None and signed.rejection_counts() == {real_key(keys.SIGNAL_KEY): 1}

    write_job(tmp_path, {"generation": 1, "action": "drain", "reason": "ScaledDown", "targetNodes": 2})
    agent.sync()
    watchdog.poll_once()
    assert watchdog.drain_requested, "the job's own directive still arrives"


def test_a_signal_with_generation_2_62_does_not_disable_later_directives(tmp_path, job_store):
    """Even written inside the namespace (a buggy worker), an out-of-bounds generation is refused, not obeyed."""
    port, store, _ = job_store
    agent, watchdog, exits = agent_and_watchdog(tmp_path, port, store)
    store.set(keys.SIGNAL_KEY, json.dumps({"generation": 2**62, "action": "none", "reason": "", "job_uid": "uid-1"}))
    watchdog.poll_once()
    assert watchdog.seen_generation < 2**31
    write_job(tmp_path, {"generation": 1, "action": "reform", "reason": "NodeLost", "targetNodes": 2})
    agent.sync()
    watchdog.poll_once()
    assert exits == [int(ExitCode.REFORM)]


def test_directives_count_within_one_job_uid(tmp_path, job_store):
    """A job recreated under the same name resumes the old job's checkpoint, which recorded generation 7: the new
    job's generation 1 is still obeyed, and a signal left by the old job is not."""
    port, store, _ = job_store
    write_job(tmp_path, {"generation": 5, "action": "drain", "reason": "old", "targetNodes": 2}, uid="old-uid")
    agent = agent_mod.Agent(agent_mod.FileJobSource(tmp_path), store)
    agent.sync()
    exits: list[int] = []
    watchdog = Watchdog(f"127.0.0.1:{port}", exit_fn=exits.append)  # $DISTTRAIN_JOB_UID is uid-1
    watchdog.connect(timeout_s=30)
    watchdog.start(recorded_generation=7, recorded_uid="old-uid")
    watchdog.stop()
    watchdog.poll_once()
    assert not watchdog.drain_requested, "the old job's drain is not this job's"
    write_job(tmp_path, {"generation": 1, "action": "drain", "reason": "ScaledDown", "targetNodes": 2})
    agent.sync()
    watchdog.poll_once()
    assert watchdog.drain_requested and "generation 1" in watchdog.drain_reason

    same = Watchdog(f"127.0.0.1:{port}", exit_fn=exits.append)
    same.start(recorded_generation=7, recorded_uid="uid-1")
    assert same.seen_generation == 7, "the job's own checkpoint still says which directives are history"


@pytest.mark.parametrize(
    "bad",
    [
        progress(5).replace("1700000000.5", "NaN"),
        json.dumps({**json.loads(progress(5)), "time": 1e300}),
        json.dumps({**json.loads(progress(5)), "time": "NaN"}),
        '{"step": 5, "time": NaN}',
        "x" * (keys.MAX_VALUE_BYTES + 1),
    ],
    ids=["nan-time", "1e300-time", "string-time", "partial-nan", "too-large"],
)
def test_a_malformed_progress_is_skipped_and_everything_else_still_flows(tmp_path, job_store, bad, caplog):
    _, store, _ = job_store
    write_job(tmp_path)
    source = agent_mod.FileJobSource(tmp_path)
    agent = agent_mod.Agent(source, store)
    store.set(keys.PROGRESS_KEY, bad)
    store.set(keys.FAILURE_KEY, failure())
    store.set(keys.CHECKPOINT_KEY, manifest(step=10))
    agent.sync()
    status = source.agent_status()
    assert "step" not in status
    assert status["workerFailure"]["exitCode"] == 85 and status["lastCheckpoint"]["step"] == 10
    assert "ignoring" in caplog.text
    store.set(keys.PROGRESS_KEY, progress(6))
    agent.sync()
    assert source.agent_status()["step"] == 6


@pytest.mark.parametrize("created_at", ["yesterday", "2023-14-40T00:00:00Z", "99999-01-01T00:00:00Z"])
def test_a_checkpoint_with_an_unknown_timestamp_format_is_skipped(tmp_path, job_store, created_at):
    _, store, _ = job_store
    write_job(tmp_path)
    source = agent_mod.FileJobSource(tmp_path)
    agent = agent_mod.Agent(source, store)
    store.set(keys.CHECKPOINT_KEY, manifest(step=10, created_at=created_at))
    store.set(keys.PROGRESS_KEY, progress(5))
    agent.sync()
    status = source.agent_status()
    assert "lastCheckpoint" not in status and status["step"] == 5
    store.set(keys.CHECKPOINT_KEY, manifest(step=12))
    agent.sync()
    assert source.agent_status()["lastCheckpoint"]["step"] == 12


def test_the_store_refuses_a_value_over_8_mib(job_store):
    """The libuv server bounds one value, so one write cannot make the agent hold more than 8 MiB for it."""
    _, store, outsider = job_store
    with pytest.raises(DistError):
        outsider.set("huge", b"x" * (9 * 1024 * 1024))
    store.set("after", b"ok")
    assert store.get("after") == b"ok", "the server survived"
