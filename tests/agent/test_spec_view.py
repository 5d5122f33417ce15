"""The job agent reads its job through the typed view of ``disttrain.api.agentview``: every value it uses is the
spec's, a field the job leaves out takes the spec's default, and a job it cannot read is refused by name."""

from __future__ import annotations

import base64
import datetime
import json
import logging
import pickle
import time

import pytest
from tests.agent.test_agent import SPEC, progress, rate_limited_agent, write_job
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

from disttrain.api import agentview
from disttrain.api import control as keys
from disttrain.api.spec import DistTrainJobSpec, RendezvousSpec, ReportingSpec
from disttrain.trainer.agent import heartbeats
from disttrain.trainer.agent import service as agent_mod
from disttrain.trainer.control import read_signal

pytestmark = pytest.mark.timeout(60)
T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)


@pytest.mark.parametrize("field", list(agentview.AgentSpec.model_fields))
def test_each_part_the_agent_reads_is_declared_as_the_spec_declares_it(field):
    mine, specs = agentview.AgentSpec.model_fields[field], DistTrainJobSpec.model_fields[field]
    assert mine.annotation is specs.annotation
    assert mine.is_required() == specs.is_required()
    assert mine.default_factory is specs.default_factory


def test_a_job_that_leaves_rendezvous_and_reporting_out_gets_the_specs_defaults(make_job):
    job = agentview.parse_job(make_job().build())
    assert job.spec.rendezvous == RendezvousSpec()
    assert job.spec.rendezvous.keep_alive_interval_seconds == 1
    assert job.spec.rendezvous.silent_after_seconds == 1.0, "as TorchFT's lighthouse: 1 s"
    assert job.spec.reporting.progress_interval_seconds == ReportingSpec().progress_interval_seconds == 60
    assert (job.run_id, job.metadata.namespace) == ("demo", "default")


def test_the_view_reads_what_the_job_says(make_job):
    wire = make_job().set("metadata.uid", "u-1").set("spec.rendezvous.keepAliveIntervalSeconds", 4).build()
    job = agentview.parse_job(wire)
    assert job.spec.rendezvous.keep_alive_interval_seconds == 4
    assert job.run_id == "u-1", "torchrun's run id is the job's uid"


@pytest.mark.parametrize(
    "path, value, expected",
    [
        ("spec.rendezvous.keepAliveIntervalSeconds", 0, "spec.rendezvous.keepAliveIntervalSeconds: Input should be"),
        ("spec.reporting.progressIntervalSeconds", "often", "spec.reporting.progressIntervalSeconds: Input should"),
        ("spec.rendezvous.keepAlive", 1, "spec.rendezvous.keepAlive: unknown field"),
        ("spec.checkpoint.path", "relative", "spec.checkpoint.path: String should match pattern"),
        ("metadata.name", "Not_A_Name", "metadata.name: String should match pattern"),
    ],
    ids=["out-of-range", "wrong-type", "unknown-field", "relative-path", "bad-name"],
)
def test_a_job_the_agent_cannot_read_is_refused_naming_the_field(make_job, path, value, expected):
    with pytest.raises(agentview.SpecRefused) as refused:
        agentview.parse_job(make_job().set(path, value).build())
    assert any(line.startswith(expected) for line in refused.value.problems), refused.value.problems
    assert expected in str(refused.value)


def test_every_problem_is_named_at_once(make_job):
    wire = make_job().delete("spec.training").set("spec.rendezvous.keepAliveMaxAttempts", 0).build()
    with pytest.raises(agentview.SpecRefused) as refused:
        agentview.parse_job(wire)
    assert sorted(p.split(":")[0] for p in refused.value.problems) == [
        "spec.rendezvous.keepAliveMaxAttempts",
        "spec.training",
    ]


def test_the_operators_parts_of_the_spec_are_not_read(make_job):
    """The pod template and the node range are the operator's: the agent neither needs nor checks them."""
    job = agentview.parse_job(make_job().set("spec.nodes", "not a node range").build())
    assert not hasattr(job.spec, "nodes")


class SealedStates:
    """The agent's signed store as the silence rule reads it: values its job's processes sealed (so verified)."""

    verifies_values = True

    def __init__(self, values: dict[str, bytes]) -> None:
        self.values = values

    def check(self, keys: list[str]) -> bool:
        return all(key in self.values for key in keys)

    def get(self, key: str) -> bytes:
        return self.values[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.values[key] for key in keys]

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()


def rendezvous_store(run_id: str, beats: dict[str, float]) -> SealedStates:
    """A completed round whose node ``demo-worker-<i>`` last beat ``beats[...]`` seconds after T0."""
    state = dyn._RendezvousState()
    state.round, state.complete = 1, True
    values = {}
    for rank, (pod, seconds) in enumerate(beats.items()):
        node = dyn._NodeDesc(f"10.0.0.{rank}", 100 + rank, 0)
        state.participants[node] = rank
        state.last_heartbeats[node] = T0 + datetime.timedelta(seconds=seconds)
        values[heartbeats.identity_key(run_id, node)] = heartbeats.NodeIdentity(pod, f"uid-{rank}").to_json().encode()
    values[heartbeats.state_key(run_id)] = base64.b64encode(pickle.dumps(state))
    return SealedStates(values)


@pytest.mark.parametrize(
    "rendezvous, silent",
    [
        ({}, ["demo-worker-1"]),  # the spec's 1 s x 3 attempts: 3 s behind is silent
        ({"keepAliveIntervalSeconds": 2}, []),  # 2 s x 3: 3 s behind is within the rule
        ({"keepAliveMaxAttempts": 2}, ["demo-worker-1"]),
    ],
    ids=["spec-defaults", "longer-interval", "fewer-attempts"],
)
def test_the_heartbeat_rule_is_the_jobs_rendezvous_spec_with_its_defaults(make_job, rendezvous, silent):
    job = agentview.parse_job(make_job().set("metadata.uid", "run-1").set("spec.rendezvous", rendezvous).build())
    watch = heartbeats.HeartbeatWatch(rendezvous_store("run-1", {"demo-worker-0": 3.0, "demo-worker-1": 0.0}))
    assert [entry["node"] for entry in watch.report(job, now=0.0)] == silent


@pytest.mark.parametrize("size", [40, 3])
def test_the_agent_publishes_the_beats_of_a_large_round_in_one_value(make_job, size):
    job = agentview.parse_job(make_job().set("metadata.uid", "run-1").build())
    store = rendezvous_store("run-1", {f"demo-worker-{i}": 0.0 for i in range(size)})
    nodes = [str(dyn._NodeDesc(f"10.0.0.{rank}", 100 + rank, 0)) for rank in range(size)]
    beat_at = time.time() - 0.5
    for index, node in enumerate(nodes):  # the first launcher is leaving: its last beat is no sign of life
        store.values[heartbeats.beat_key("run-1", node)] = heartbeats.encode_beat(beat_at, leaving=index == 0).encode()

    heartbeats.HeartbeatWatch(store).report(job, now=0.0)

    summary = heartbeats.read_beat_summary(store, "run-1")
    if size <= heartbeats.SUMMARY_ABOVE_NODES:
        assert summary is None, "a small round's launchers read the beats themselves"
        return
    assert summary is not None and abs(summary.time - time.time()) < 5
    assert set(summary.beats) == set(nodes[1:])
    assert all(abs(at - beat_at) < 0.01 for at in summary.beats.values())


def test_without_a_reporting_interval_the_agent_writes_progress_at_the_specs_default(tmp_path, store_pair):
    server, client = store_pair
    write_job(tmp_path)
    agent, source, clock = rate_limited_agent(tmp_path, server, jitter=False)
    client.set(keys.PROGRESS_KEY, progress(1))
    agent.sync()
    client.set(keys.PROGRESS_KEY, progress(2))
    clock.now += ReportingSpec().progress_interval_seconds - 0.1
    agent.sync()
    assert len(source.patches) == 1
    clock.now += 0.1
    agent.sync()
    assert [patch["step"] for patch in source.patches] == [1, 2]


def write_spec(state, spec):
    job = json.loads((state / "job.json").read_text())
    job["spec"] = spec
    (state / "job.json").write_text(json.dumps(job))


def test_a_job_the_agent_cannot_read_is_logged_once_and_the_directive_still_flows(tmp_path, store_pair, caplog):
    server, client = store_pair
    write_job(tmp_path, {"generation": 2, "action": "drain", "reason": "ScaledDown", "targetNodes": 1})
    write_spec(tmp_path, {**SPEC, "rendezvous": {"keepAliveIntervalSeconds": 0}})
    source = agent_mod.FileJobSource(tmp_path)
    agent = agent_mod.Agent(source, server)
    client.set(keys.PROGRESS_KEY, progress(3))
    with caplog.at_level(logging.INFO, logger="disttrain.agent"):
        assert agent.sync() and agent.sync(), "the agent keeps its store up: it does not exit"
    refusals = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(refusals) == 1, "one error per version of the job, not one per round"
    assert "spec.rendezvous.keepAliveIntervalSeconds: Input should be greater than or equal to 1" in (
        refusals[0].getMessage()
    )
    assert read_signal(client).action == "drain"
    assert source.agent_status() == {}, "no status from a job the agent cannot read"

    write_spec(tmp_path, SPEC)  # fixed: the status flows again
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="disttrain.agent"):
        assert agent.sync()
    assert source.agent_status()["step"] == 3
    assert any("can be read again" in r.getMessage() for r in caplog.records)
