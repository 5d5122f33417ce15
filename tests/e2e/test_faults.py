"""The job agent dies, a node dies inside a checkpoint write, a manifest is malformed."""

from __future__ import annotations

import collections
import os
import pathlib
import subprocess
import sys

import pytest
import yaml

from disttrain.operator.local.chaos import ChaosEvent
from tests.conftest import REPO_ROOT, JobBuilder
from tests.e2e.conftest import e2e_job, run_job

pytestmark = [pytest.mark.slow]


def _covers_epoch_once(run, samples: int) -> None:
    consumed = collections.Counter(i for recs in run.final_trajectory().values() for r in recs for i in r["indices"])
    assert sorted(consumed) == list(range(samples)) and set(consumed.values()) == {1}


@pytest.mark.timeout(240)
def test_a_killed_job_agent_is_recreated_and_the_group_trains_on_through_its_loss(tmp_path):
    """The agent is no single point. Its replacement serves an empty store on the same address; the
    workers reconnect, put the rendezvous state back and keep training: no restart, no reform, no step redone."""
    run = run_job(
        tmp_path, e2e_job("agentkill", tmp_path / "records", replicas=2, step_sleep=0.8), chaos="kill-agent@step=6"
    )
    assert run.summary.succeeded, run.reasons()
    reasons = run.reasons()
    assert "ChaosKillAgent" in reasons and "AgentRestarted" in reasons
    assert reasons.index("ChaosKillAgent") < reasons.index("AgentRestarted")
    agent_log = run.state.log_file("agentkill-agent").read_text()
    assert agent_log.count("serving the store") == 2, "the agent was not recreated"
    assert "silent in the rendezvous heartbeats" not in agent_log, "the new agent took the survivors for dead"
    assert dict(run.summary.restarts_by_reason) == {}, run.summary.restarts_by_reason
    assert run.summary.reforms == (), run.summary.reforms
    executions = run.executions()
    assert sorted(executions) == list(range(1, 25))
    assert all(len(runs) == 1 for runs in executions.values()), "a step ran twice"
    assert len({r["group"] for r in run.records()}) == 1, "the group re-formed"
    logs = "".join(p.read_text() for p in run.state.logs_dir.glob("agentkill-worker*.log"))
    # 18 steps of 0.8 s after the kill outlast the new agent's start (Python and torch: seconds on a loaded machine);
    # the trainers' own channels and the launchers' rendezvous clients both reconnect.
    assert "[disttrain rank 0] WARNING agent store reconnected" in logs
    assert "disttrain.store: agent store 127.0.0.1" in logs and "reconnected after" in logs
    assert run.summary.steps == 24  # relayed by the new agent
    _covers_epoch_once(run, 288)


@pytest.mark.timeout(240)
def test_the_agent_and_a_worker_lost_together_re_form_in_place_with_no_step_lost(tmp_path):
    """The agent's machine also ran a worker: both die at once. The survivors keep their state in memory, wait for
    the new agent's store (their rendezvous retries while it is away) and re-form in place with the replacement:
    one incident, nothing charged, no step run twice."""
    run = run_job(
        tmp_path,
        e2e_job("both", tmp_path / "records", replicas=3, max_steps=30, dataset=360, step_sleep=0.3),
        chaos="kill-agent@step=8,kill-node@step=8",
    )
    assert run.summary.succeeded, run.reasons()
    reasons = run.reasons()
    assert "ChaosKillAgent" in reasons and "ChaosKillNode" in reasons and "AgentRestarted" in reasons
    assert "PartOfIncident" not in reasons, "a survivor exited: it did not wait for the new agent"
    [reform] = run.summary.reforms
    assert reform.lost_steps == 0 and reform.resumed_from_step >= 8, reform
    assert dict(run.summary.restarts_by_reason) == {}, run.summary.restarts_by_reason
    reformed = [e["message"] for e in run.events if e["reason"] == "Reformed"]
    assert len(reformed) == 1 and "state from memory" in reformed[0], reformed
    executions = run.executions()
    assert sorted(executions) == list(range(1, 31))
    # Only the step the kill interrupted runs again (its records are written before its reduction), in place.
    again = sorted(step for step, runs in executions.items() if len(runs) > 1)
    assert again in ([], [reform.resumed_from_step + 1]), (again, reform)
    _covers_epoch_once(run, 360)


def _kill_inside_the_step_10_write(tmp_path, in_place: bool):
    """Rank 0 holds the commit of step 10 open after every shard is written; its machine dies right then."""
    out = tmp_path / "records"
    killed: list[str] = []

    def kill_inside_the_write(runtime, snapshot):
        if killed:
            return
        marker = next(iter(out.glob("saving-10-*")), None) if out.exists() else None
        if marker is None:
            return
        node = marker.name.removeprefix("saving-10-")
        index = int(node.rsplit("-", 1)[1])
        partial = [p.name for p in runtime.state.checkpoints_dir.iterdir() if "10" in p.name]
        killed.append(f"{node}: {partial}")
        runtime.apply_chaos(ChaosEvent("kill-node", at_seconds=0, index=index))

    builder = e2e_job("ckptkill", out, replicas=2, step_sleep=0.05, extra_env={"E2E_HOLD_SAVE_STEP": "10"})
    builder.obj["spec"]["elastic"]["reformInPlace"] = in_place
    run = run_job(tmp_path, builder, on_tick=kill_inside_the_write)
    assert killed, "the held checkpoint write was never seen"
    assert run.summary.succeeded, run.reasons()
    logs = "".join(p.read_text() for p in run.state.logs_dir.glob("*.log"))
    return run, killed, logs


@pytest.mark.timeout(240)
def test_a_node_killed_during_a_checkpoint_write_resumes_from_the_previous_complete_checkpoint(tmp_path):
    run, killed, logs = _kill_inside_the_step_10_write(tmp_path, in_place=False)
    # The write in flight left files but no step-10 commit; the group resumed from step 5.
    resumes = [r["resumed_from"] for r in run.records() if r["resumed_from"]]
    assert resumes and min(resumes) == 5, (killed, sorted(set(resumes)))
    assert "resumed from checkpoint step-5" in logs
    assert run.summary.steps == 24
    _covers_epoch_once(run, 288)


@pytest.mark.timeout(240)
def test_in_place_a_node_killed_during_a_checkpoint_write_leaves_the_survivor_its_step_and_no_partial_save(tmp_path):
    """In place the survivor holds step 10 itself: it goes on from there; the save the dead group could not finish is
    neither published nor loaded, and its files are gone by the end."""
    run, killed, logs = _kill_inside_the_step_10_write(tmp_path, in_place=True)
    assert "resumed in place from step 10 held in memory" in logs, killed
    assert "resumed from checkpoint" not in logs
    executions = run.executions()
    assert sorted(executions) == list(range(1, 25)) and all(len(runs) == 1 for runs in executions.values()), {
        step: len(runs) for step, runs in executions.items() if len(runs) > 1
    }
    leftovers = [p.name for p in run.state.checkpoints_dir.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers == [], leftovers
    assert run.summary.steps == 24 and run.summary.lost_steps == 0
    _covers_epoch_once(run, 288)


@pytest.mark.timeout(60)
def test_a_malformed_manifest_is_refused_naming_the_field_and_nothing_starts(tmp_path):
    bad = JobBuilder("bad").nodes(4, 2, 3).set("spec.training.microBatchSize", 0).build()
    bad["spec"]["checkpoint"]["intervalStep"] = 5  # typo: unknown field

    manifest = tmp_path / "bad.yaml"
    manifest.write_text(yaml.safe_dump(bad))
    before = set(os.listdir("/proc"))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "disttrain.operator.cli",
            "local",
            "run",
            str(manifest),
            "--state-dir",
            str(tmp_path / "state"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 2, result.stderr
    assert "spec.training.microBatchSize" in result.stderr
    assert "spec.checkpoint.intervalStep: unknown field" in result.stderr
    assert "nothing was started" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "state").exists()
    # No process of ours outlived the command (no agent, no torchrun).
    assert [pid for pid in set(os.listdir("/proc")) - before if pid.isdigit() and _is_ours(pid, tmp_path)] == []


def _is_ours(pid: str, tmp_path: pathlib.Path) -> bool:
    """A disttrain process this test's command started: it names the test's folder (state dir, manifest) in its
    command line or environment. Other tiers' jobs run on the machine meanwhile."""
    try:
        proc = pathlib.Path(f"/proc/{pid}")
        cmdline = (proc / "cmdline").read_bytes()
        return b"disttrain" in cmdline and str(tmp_path).encode() in cmdline + (proc / "environ").read_bytes()
    except OSError:
        return False
