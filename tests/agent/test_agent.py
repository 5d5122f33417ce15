"""The job agent against a real TCPStore: directives out to workers, progress and checkpoints back to status."""

from __future__ import annotations

import copy
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from typing import ClassVar

import pytest
from torch.distributed import DistNetworkError, TCPStore

from disttrain.api import control as keys
from disttrain.api import env
from disttrain.api.reformphases import WorkerStartup
from disttrain.common.ports import free_port
from disttrain.trainer.agent import service as agent_mod
from disttrain.trainer.control import read_signal
from disttrain.trainer.store import channel, relay

pytestmark = pytest.mark.timeout(60)


SPEC = {
    "checkpoint": {"path": "/ckpt"},
    "training": {"globalBatchSize": 24, "microBatchSize": 2, "lr": {"base": 0.1}, "maxSteps": 1000},
}
"""The least spec the agent reads (checkpoint and training are required, as in the CRD); the rest takes defaults."""


def write_job(state, control=None, **status):
    job = {
        "apiVersion": "disttrain.dev/v1alpha1",
        "kind": "DistTrainJob",
        "metadata": {"name": "demo", "namespace": "team"},
        "spec": copy.deepcopy(SPEC),
        "status": {"control": control or {"generation": 0, "action": "none", "targetNodes": 2}, **status},
    }
    (state / "job.json").write_text(json.dumps(job))


def progress(step, world=2, run="r1", restart=0, process="p1", rate=None, loss=None, blocked=None):
    return keys.ProgressReport(
        step=step,
        loss=loss,
        samples_consumed=step * 24,
        world_size=world,
        samples_per_second=rate,
        plan={"worldSize": world, "globalBatch": 24, "microBatch": 2, "accumSteps": 6, "lrScale": 1.0},
        restart_count=restart,
        run_id=run,
        process_id=process,
        time=1_700_000_000.5 + step,
        checkpoint_blocked_seconds=blocked,
    ).model_dump_json()


def checkpoint_manifest(step, created_at="2023-11-14T22:14:00Z", **extra):
    """A checkpoint manifest as the workers write it to the store, 24 samples a step."""
    return {
        "step": step,
        "samples_consumed": step * 24,
        "data_cursor": step * 24,
        "world_size": 2,
        "plan": {},
        "lr_scale": 1.0,
        "dataset": {"length": 1000, "seed": 0},
        "metadata_sha256": "x",
        "files": {},
        "created_at": created_at,
        "code_version": "0.1.0",
        "config_hash": "h",
        **extra,
    }


def test_directive_reaches_the_workers_store_keys(tmp_path, store_pair):
    server, client = store_pair
    write_job(
        tmp_path,
        {"generation": 3, "action": "drain", "reason": "ScaledDown", "targetNodes": 2, "exclude": ["demo-worker-2"]},
    )
    agent = agent_mod.Agent(agent_mod.FileJobSource(tmp_path), server)
    assert agent.sync()
    signal_ = read_signal(client)  # the trainer's own reader
    assert (signal_.generation, signal_.action, signal_.reason) == (3, "drain", "ScaledDown")
    target = keys.TargetPlan.model_validate_json(client.get(keys.TARGET_KEY))
    assert (target.generation, target.nodes, target.exclude) == (3, 2, ["demo-worker-2"])


def test_progress_checkpoint_and_failure_are_relayed_into_status(tmp_path, store_pair):
    server, client = store_pair
    write_job(tmp_path)
    source = agent_mod.FileJobSource(tmp_path)
    agent = agent_mod.Agent(source, server)
    client.set(keys.PROGRESS_KEY, progress(7))
    client.set(
        keys.FAILURE_KEY,
        keys.WorkerFailure(
            exit_code=85, node="demo-worker-1", message="bad dataset", time=1_700_000_100.0
        ).model_dump_json(),
    )
    agent.sync()
    status = source.read()["status"]
    assert status["step"] == 7 and status["samplesConsumed"] == 168 and status["worldSize"] == 2
    assert status["plan"]["accumSteps"] == 6
    assert status["lastProgressTime"] == "2023-11-14T22:13:27.500Z"
    assert status["rendezvousRound"] == 1
    assert status["workerFailure"] == {
        "exitCode": 85,
        "node": "demo-worker-1",
        "message": "bad dataset",
        "time": "2023-11-14T22:15:00.000Z",
    }
    assert status["control"]["targetNodes"] == 2, "the runtime's fields are kept"
    manifest = checkpoint_manifest(10)
    client.set(keys.CHECKPOINT_KEY, json.dumps(manifest))
    client.set(keys.PROGRESS_KEY, progress(11, world=3, restart=1))
    agent.sync()
    status = source.read()["status"]
    assert status["lastCheckpoint"] == {
        "step": 10,
        "samples": 240,
        "path": "/ckpt/team/demo/step-10",
        "time": "2023-11-14T22:14:00Z",
        "worldSize": 2,
    }
    assert status["worldSize"] == 3 and status["rendezvousRound"] == 2


def test_the_last_checkpoint_of_a_bucket_job_is_named_by_its_prefix_in_the_bucket():
    from disttrain.api.agentview import AgentJob
    from disttrain.api.manifest import CheckpointManifest

    manifest = CheckpointManifest.model_validate(checkpoint_manifest(10, fence_round=3))
    job = {"metadata": {"name": "demo", "namespace": "team"}, "spec": copy.deepcopy(SPEC)}
    assert agent_mod._checkpoint_location(AgentJob.model_validate(job), manifest) == "/ckpt/team/demo/step-10"
    job["spec"]["checkpoint"]["uri"] = "s3://ckpt-bucket/runs/demo/"
    location = agent_mod._checkpoint_location(AgentJob.model_validate(job), manifest)
    assert location == "s3://ckpt-bucket/runs/demo/step-10/r3"


def test_a_new_group_at_the_same_size_and_restart_count_is_a_new_round(tmp_path, store_pair):
    """After a reform back to the same size a fresh node can be rank 0 with restart count 0, like the old rank 0:
    only the worker process differs, and it must still count as a new round (the operator waits for one)."""
    server, client = store_pair
    write_job(tmp_path)
    source = agent_mod.FileJobSource(tmp_path)
    agent = agent_mod.Agent(source, server)
    client.set(keys.PROGRESS_KEY, progress(7, process="old-rank0"))
    agent.sync()
    client.set(keys.PROGRESS_KEY, progress(8, process="old-rank0"))
    agent.sync()
    status = source.read()["status"]
    assert status["rendezvousRound"] == 1 and status["roundStartTime"] == "2023-11-14T22:13:27.500Z"
    client.set(keys.PROGRESS_KEY, progress(9, process="new-rank0"))
    agent.sync()
    client.set(keys.PROGRESS_KEY, progress(10, process="new-rank0"))
    agent.sync()
    status = source.read()["status"]
    assert status["rendezvousRound"] == 2
    assert status["roundStartTime"] == "2023-11-14T22:13:29.500Z", "the new round's first report, not its latest"
    assert status["lastProgressTime"] == "2023-11-14T22:13:30.500Z"


def test_an_agent_replacing_a_lost_one_keeps_the_round_of_the_group_that_trained_on(tmp_path, store_pair):
    """The group trained on through the agent's loss and reports to the new agent: the same round (a new one would
    complete a directive in flight); a group that starts later is a new round, as ever."""
    server, client = store_pair
    stamps = WorkerStartup(spawned=1_699_999_990.0, first_step=1_699_999_995.0)
    wire = stamps.model_dump(by_alias=True, exclude_none=True)
    write_job(tmp_path, rendezvousRound=3, roundStartTime="2023-11-14T22:13:00.000Z", worldSize=2, workerStartup=wire)
    source = agent_mod.FileJobSource(tmp_path)
    agent = agent_mod.Agent(source, server)
    report = keys.ProgressReport.model_validate_json(progress(20, process="rank0"))
    client.set(keys.PROGRESS_KEY, report.model_copy(update={"startup": stamps}).model_dump_json())
    agent.sync()
    status = source.read()["status"]
    assert status["rendezvousRound"] == 3 and status["roundStartTime"] == "2023-11-14T22:13:00.000Z"
    later = WorkerStartup(spawned=1_700_000_100.0, first_step=1_700_000_104.0)
    newer = keys.ProgressReport.model_validate_json(progress(21, process="new-rank0"))
    client.set(keys.PROGRESS_KEY, newer.model_copy(update={"startup": later}).model_dump_json())
    agent.sync()
    assert source.read()["status"]["rendezvousRound"] == 4


def test_only_changes_are_patched(tmp_path, store_pair):
    server, client = store_pair
    write_job(tmp_path)

    class Counting(agent_mod.FileJobSource):
        patches: ClassVar[list[dict]] = []

        def patch_status(self, patch):
            self.patches.append(patch)
            super().patch_status(patch)

    source = Counting(tmp_path)
    agent = agent_mod.Agent(source, server)
    client.set(keys.PROGRESS_KEY, progress(1))
    agent.sync()
    agent.sync()
    agent.sync()
    assert len(source.patches) == 1
    client.set(keys.PROGRESS_KEY, progress(2))
    agent.sync()
    assert len(source.patches) == 2 and set(source.patches[1]) == {"step", "samplesConsumed", "lastProgressTime"}


def test_the_agent_stops_when_its_job_is_gone(tmp_path, store_pair):
    server, _ = store_pair
    agent = agent_mod.Agent(agent_mod.FileJobSource(tmp_path), server)
    assert agent.sync() is False
    assert agent.run() == 0


def test_agent_process_serves_the_store_and_exits_on_sigterm(tmp_path):
    port = free_port()
    write_job(tmp_path, {"generation": 1, "action": "reform", "reason": "NodeLost", "targetNodes": 1})
    log = (tmp_path / "agent.log").open("wb")
    secret, uid = "agent-process-test-" + "5" * 40, "0000-agent-process"
    environ = {**os.environ, env.STORE_SECRET: secret, env.JOB_UID: uid}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "disttrain.trainer.agent",
            "--state-dir",
            str(tmp_path),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--poll-seconds",
            "0.05",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=environ,
    )
    try:
        near = relay.Relay(("127.0.0.1", port), secret)  # the store is behind its front: a relay proves the secret
        deadline = time.monotonic() + 20
        client = None
        while client is None and time.monotonic() < deadline:
            try:
                raw = TCPStore(*near.address, is_master=False, timeout=datetime.timedelta(seconds=30))
                client = channel.scoped(raw, secret, uid)
            except DistNetworkError:  # the agent is still starting
                time.sleep(0.2)
        assert client is not None, "no store behind the agent's front"
        with pytest.raises(DistNetworkError):  # a plain client, without the secret, never reaches the store
            TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=2)).set("junk", b"x")
        while read_signal(client) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert read_signal(client).action == "reform"
        client.set(keys.PROGRESS_KEY, progress(4, world=1))
        while "step" not in agent_mod.FileJobSource(tmp_path).agent_status() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert agent_mod.FileJobSource(tmp_path).agent_status()["step"] == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


class RateLimited(agent_mod.FileJobSource):
    """The local source, counting its writes and rate-limited as the Kubernetes one is."""

    rate_limited = True

    def __init__(self, state_dir):
        super().__init__(state_dir)
        self.patches = []

    def patch_status(self, patch):
        self.patches.append(patch)
        super().patch_status(patch)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rate_limited_agent(state, server, *, jitter: bool = True):
    """An agent over a rate-limited source on a clock of the test's own: (agent, source, clock)."""
    source, clock = RateLimited(state), Clock()
    agent = agent_mod.Agent(source, server, clock=clock)
    if not jitter:
        agent.throttle.draw = lambda: 0.0  # the periodic write is due exactly an interval later
    return agent, source, clock


def write_spec_job(state, control=None, **status):
    write_job(state, control, **status)
    job = json.loads((state / "job.json").read_text())
    job["spec"]["training"] = {"globalBatchSize": 24, "microBatchSize": 2, "lr": {"base": 0.1}, "maxSteps": 50}
    job["spec"]["reporting"] = {"progressIntervalSeconds": 10}
    (state / "job.json").write_text(json.dumps(job))


def test_on_kubernetes_progress_is_written_once_an_interval_and_what_the_operator_acts_on_at_once(tmp_path, store_pair):
    server, client = store_pair
    write_spec_job(tmp_path)
    agent, source, clock = rate_limited_agent(tmp_path, server, jitter=False)
    client.set(keys.PROGRESS_KEY, progress(1))
    agent.sync()
    assert len(source.patches) == 1 and source.patches[0]["rendezvousRound"] == 1, "a new round: at once"
    for step in range(2, 12):  # steps and a routine checkpoint within one interval: nothing written
        clock.now += 0.5
        client.set(keys.PROGRESS_KEY, progress(step))
        agent.sync()
    assert len(source.patches) == 1
    clock.now += 5.0  # the interval is over: the newest progress goes out
    agent.sync()
    assert len(source.patches) == 2 and source.patches[1]["step"] == 11
    clock.now += 1.0
    client.set(keys.PROGRESS_KEY, progress(12, world=1, process="p2"))  # a new group: at once
    agent.sync()
    assert len(source.patches) == 3 and source.patches[2]["rendezvousRound"] == 2
    clock.now += 1.0
    client.set(
        keys.FAILURE_KEY,
        keys.WorkerFailure(exit_code=85, node="demo-worker-0", message="bad", time=1_700_000_100.0).model_dump_json(),
    )
    agent.sync()
    assert len(source.patches) == 4 and "workerFailure" in source.patches[3]
    clock.now += 1.0
    client.set(keys.PROGRESS_KEY, progress(50, world=1, process="p2"))  # the last step: at once
    agent.sync()
    assert len(source.patches) == 5 and source.patches[4]["step"] == 50


class SlowServer(RateLimited):
    """Each write takes ``seconds`` on the agent's clock, as on a saturated API server."""

    def __init__(self, state_dir, clock, seconds):
        super().__init__(state_dir)
        self.clock, self.seconds = clock, seconds

    def patch_status(self, patch):
        self.clock.now += self.seconds
        super().patch_status(patch)


def test_while_its_writes_are_slow_the_agent_writes_progress_less_often_but_a_new_round_at_once(tmp_path, store_pair):
    server, client = store_pair
    write_spec_job(tmp_path)
    clock = Clock()
    source = SlowServer(tmp_path, clock, seconds=0.4)  # 0.4 s a write: the next periodic one 40 s later, not 10
    agent = agent_mod.Agent(source, server, clock=clock)
    agent.throttle.draw = lambda: 0.0
    client.set(keys.PROGRESS_KEY, progress(1))
    agent.sync()
    for step in range(2, 40):  # 38 s of steps after the write
        clock.now += 1.0
        client.set(keys.PROGRESS_KEY, progress(step))
        agent.sync()
    assert len(source.patches) == 1, "a periodic write came sooner than the slow server allows"
    clock.now += 2.0
    agent.sync()
    assert len(source.patches) == 2 and source.patches[1]["step"] == 39
    client.set(keys.PROGRESS_KEY, progress(40, world=1, process="p2"))  # a new group: never held back
    agent.sync()
    assert len(source.patches) == 3 and source.patches[2]["rendezvousRound"] == 2
    source.seconds = 0.0  # the server recovered: back to one write an interval within a few writes
    for step in range(41, 45):
        clock.now += 60.0
        client.set(keys.PROGRESS_KEY, progress(step, world=1, process="p2"))
        agent.sync()
    assert len(source.patches) == 7 and agent.throttle.period(10) == 10


def test_while_a_drain_is_in_flight_its_checkpoint_is_written_at_once(tmp_path, store_pair):
    server, client = store_pair
    write_spec_job(tmp_path, {"generation": 2, "action": "drain", "reason": "ScaledDown", "targetNodes": 1})
    agent, source, clock = rate_limited_agent(tmp_path, server)
    client.set(keys.PROGRESS_KEY, progress(7))
    agent.sync()
    manifest = checkpoint_manifest(8)
    clock.now += 0.5
    client.set(keys.CHECKPOINT_KEY, json.dumps(manifest))
    agent.sync()
    assert len(source.patches) == 2 and source.patches[1]["lastCheckpoint"]["step"] == 8


def test_failed_rounds_back_off_with_jitter_up_to_a_cap():
    delays = [agent_mod.retry_delay(0.25, failures) for failures in range(1, 12)]
    assert 0.125 <= delays[0] <= 0.25
    assert all(
        0.5 * min(30, 0.25 * 2 ** (n - 1)) <= d <= min(30, 0.25 * 2 ** (n - 1)) for n, d in enumerate(delays, start=1)
    )
    assert max(delays) <= agent_mod.MAX_RETRY_S


def test_a_429_is_told_apart_and_its_retry_after_honoured():
    from kubernetes.client.exceptions import ApiException

    throttled = ApiException(status=429, reason="Too Many Requests")
    throttled.headers = {"Retry-After": "1"}
    assert agent_mod.is_throttled(throttled) and agent_mod.retry_after(throttled) == 1.0
    throttled.headers = {"Retry-After": "3600"}
    assert agent_mod.retry_after(throttled) == agent_mod.MAX_RETRY_S
    refused = ApiException(status=403, reason="Forbidden")
    assert not agent_mod.is_throttled(refused) and agent_mod.retry_after(refused) == 0.0
    assert not agent_mod.is_throttled(TimeoutError()) and agent_mod.retry_after(TimeoutError()) == 0.0


@pytest.mark.parametrize(
    ("field", "reported", "relayed"),
    [
        # the SAMPLES/S column of kubectl get: the trainer's own figure, rounded
        ("samplesPerSecond", {"rate": 812.4567}, 812.5),
        # feeds the goodput account's checkpointBlocked cause
        ("checkpointBlockedSeconds", {"blocked": 1.25}, 1.25),
    ],
)
def test_a_figure_of_rank_0_is_relayed_with_the_progress_once_reported(tmp_path, store_pair, field, reported, relayed):
    server, client = store_pair
    write_job(tmp_path)
    source = agent_mod.FileJobSource(tmp_path)
    agent = agent_mod.Agent(source, server)
    client.set(keys.PROGRESS_KEY, progress(3))
    agent.sync()
    assert field not in source.read()["status"], "no figure yet: nothing invented"
    client.set(keys.PROGRESS_KEY, progress(4, **reported))
    agent.sync()
    assert source.read()["status"][field] == relayed


def test_the_global_loss_is_relayed_with_the_progress_and_a_non_finite_one_never(tmp_path, store_pair):
    """status.loss is the step's global, token-weighted loss as rank 0 reports it; NaN or infinity (a diverged step)
    cannot go into a JSON status and is left out rather than written as something else."""
    server, client = store_pair
    write_job(tmp_path)
    source = agent_mod.FileJobSource(tmp_path)
    agent = agent_mod.Agent(source, server)
    client.set(keys.PROGRESS_KEY, progress(4, loss=130 / 110))
    agent.sync()
    assert source.read()["status"]["loss"] == 1.18182
    client.set(keys.PROGRESS_KEY, progress(5, loss=float("nan")))
    agent.sync()
    status = source.read()["status"]
    assert status["step"] == 5 and status["loss"] == 1.18182, "the last finite value stays"


@pytest.mark.parametrize(
    ("field", "reported", "value"),
    [
        # why spec.elastic.reformInPlace does not apply (FSDP2, ...); a later group for which it applies removes it
        (
            "inPlaceFallback",
            "in_place_fallback",
            "parallelism='fsdp2' shards the state: in-place reform needs parallelism='ddp'",
        ),
        (
            "checkpointUpload",
            "checkpoint_upload",
            "2 save(s) not yet COMPLETE in the bucket (oldest step-2): EndpointConnectionError: Could not connect",
        ),
    ],
)
def test_a_reported_condition_is_relayed_and_cleared_by_a_report_without_it(
    tmp_path, store_pair, field, reported, value
):
    """Rather than left stale: a new group in place (no fallback), a bucket that caught up."""
    server, client = store_pair
    write_job(tmp_path)
    source = agent_mod.FileJobSource(tmp_path)
    agent = agent_mod.Agent(source, server)
    report = keys.ProgressReport.model_validate_json(progress(3))
    client.set(keys.PROGRESS_KEY, report.model_copy(update={reported: value}).model_dump_json())
    agent.sync()
    assert source.read()["status"][field] == value
    client.set(keys.PROGRESS_KEY, progress(4, process="p2"))
    agent.sync()
    assert source.read()["status"].get(field) is None


def test_the_step_a_group_resumed_from_is_relayed_and_cleared_by_a_fresh_group(tmp_path, store_pair):
    """status.resumedFromStep and resumedFromJobUid: the checkpoint the current group loaded and the job that wrote
    it (the operator's ResumedFromStep and ResumedFromEarlierJob Events name them); a group that started without a
    checkpoint leaves neither behind."""
    server, client = store_pair
    write_job(tmp_path)
    source = agent_mod.FileJobSource(tmp_path)
    agent = agent_mod.Agent(source, server)
    report = keys.ProgressReport.model_validate_json(progress(6))
    resumed = report.model_copy(update={"resumed_from_step": 5, "resumed_from_job_uid": "uid-0"})
    client.set(keys.PROGRESS_KEY, resumed.model_dump_json())
    agent.sync()
    status = source.read()["status"]
    assert status["resumedFromStep"] == 5 and status["resumedFromJobUid"] == "uid-0"
    client.set(keys.PROGRESS_KEY, progress(1, process="p2"))
    agent.sync()
    status = source.read()["status"]
    assert status.get("resumedFromStep") is None and status.get("resumedFromJobUid") is None


def test_failure_history_goes_to_the_trainer_and_its_interval_comes_back_to_status(tmp_path, store_pair):
    """intervalSteps: auto: the operator's failure count reaches the trainer through the store, and rank 0's
    choice reaches status.checkpointInterval."""
    server, client = store_pair
    write_job(
        tmp_path,
        startTime="2026-01-01T00:00:00Z",
        restarts={"total": 3, "byReason": {"NodeLost": 3}},
        suspendedSeconds=10.0,
    )
    agent = agent_mod.Agent(agent_mod.FileJobSource(tmp_path), server)
    assert agent.sync()
    history = keys.read_model(client, keys.RELIABILITY_KEY, keys.ReliabilityReport)
    assert history is not None and history.failures == 3 and history.suspended_seconds == 10.0
    assert history.age_seconds(history.started_at + 610.0) == 600.0
    assert "checkpointInterval" not in agent_mod.FileJobSource(tmp_path).agent_status()

    client.set(
        keys.INTERVAL_KEY,
        keys.IntervalReport(
            steps=40, save_seconds=0.25, step_seconds=0.05, mtbf_seconds=200.0, failures=3, time=1_767_225_600.0
        ).model_dump_json(),
    )
    write_job(tmp_path, startTime="2026-01-01T00:00:00Z", restarts={"total": 4, "byReason": {"NodeLost": 4}})
    assert agent.sync()
    assert keys.read_model(client, keys.RELIABILITY_KEY, keys.ReliabilityReport).failures == 4
    written = json.loads((tmp_path / "agent-status.json").read_text())
    assert written["checkpointInterval"] == {
        "steps": 40,
        "saveSeconds": 0.25,
        "stepSeconds": 0.05,
        "mtbfSeconds": 200.0,
        "failures": 3,
        "time": "2026-01-01T00:00:00.000Z",
    }
