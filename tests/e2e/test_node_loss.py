"""A node is lost, the group re-forms, the job finishes exactly; the metrics tell the story."""

from __future__ import annotations

import collections
import math

import pytest

from disttrain.operator.local import chaos as chaos_mod
from tests.e2e.conftest import e2e_job, run_job, scrape

pytestmark = [pytest.mark.slow]


def _global_losses(trajectory):
    """step -> the step's loss over the global batch (sum over ranks / global batch)."""
    return {
        step: sum(r["loss_sum"] for r in records) / records[0]["global_batch"] for step, records in trajectory.items()
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    run = run_job(tmp, e2e_job("ref", tmp / "records", replicas=1))
    assert run.summary.succeeded, run.reasons()
    return run


@pytest.fixture(scope="module")
def node_loss(tmp_path_factory):
    """3 nodes; once the trainer is past step 8 a node's machine dies (SIGKILL of torchrun and its worker).

    The operator metrics are scraped as soon as the reform completed and again at the end.
    """
    tmp = tmp_path_factory.mktemp("node-loss")
    scrapes = []
    reforms = []

    def on_tick(runtime, snapshot):
        status = snapshot.status
        reformed = (status.get("lastReform") or {}).get("durationSeconds") is not None
        if reformed and not scrapes:
            scrapes.append(scrape(runtime.metrics_url))
            reforms.append(status["lastReform"])
        if status.get("phase") == "Succeeded" and len(scrapes) == 1:
            scrapes.append(scrape(runtime.metrics_url))

    run = run_job(
        tmp, e2e_job("loss", tmp / "records", replicas=3, step_sleep=0.05), chaos="kill-node@step=8", on_tick=on_tick
    )
    run.scrapes = scrapes
    run.first_reform = reforms[0] if reforms else None
    return run


@pytest.mark.timeout(240)
def test_a_lost_node_is_replaced_the_group_reforms_and_the_job_finishes(node_loss):
    assert node_loss.summary.succeeded, node_loss.reasons()
    reasons = node_loss.reasons()
    assert "ChaosKillNode" in reasons and "NodeLost" in reasons and "Reformed" in reasons
    assert node_loss.summary.steps == 24
    assert sum(node_loss.summary.infrastructure_losses_by_reason.values()) == 1
    assert node_loss.summary.restarts_by_reason == {}, "a node loss is not charged to maxRestarts"
    (reform,) = node_loss.summary.reforms
    assert reform.duration_seconds is not None and reform.duration_seconds > 0


@pytest.mark.timeout(240)
def test_after_the_reform_the_loss_trajectory_equals_an_uninterrupted_reference(node_loss, reference):
    ref = _global_losses(reference.final_trajectory())
    got = _global_losses(node_loss.final_trajectory())
    assert sorted(got) == sorted(ref) == list(range(1, 25))
    resumed = [r["resumed_from"] for recs in node_loss.final_trajectory().values() for r in recs if r["resumed_from"]]
    assert resumed, "the run never resumed from a checkpoint: the kill missed the training"
    for step in ref:
        assert math.isclose(got[step], ref[step], rel_tol=1e-4, abs_tol=1e-6), (step, got[step], ref[step])


@pytest.mark.timeout(240)
def test_the_consumed_sample_indices_cover_the_epoch_exactly(node_loss):
    consumed = collections.Counter(
        i for recs in node_loss.final_trajectory().values() for r in recs for i in r["indices"]
    )
    assert sorted(consumed) == list(range(288))
    assert set(consumed.values()) == {1}


@pytest.mark.timeout(240)
def test_the_operator_metrics_show_losses_by_reason_reform_duration_and_last_checkpoint(node_loss):
    assert len(node_loss.scrapes) == 2, "the metrics endpoint was not scraped while the job ran"
    during, end = node_loss.scrapes
    labels = 'job="loss",namespace="default"'
    reason = next(iter(node_loss.summary.infrastructure_losses_by_reason))
    assert during[f'disttrain_job_infrastructure_losses_total{{{labels},reason="{reason}"}}'] == 1
    assert during[f'disttrain_job_restarts_total{{{labels},reason="{reason}"}}'] == 0
    assert during[f"disttrain_job_reform_duration_seconds_count{{{labels}}}"] == 1
    assert during[f"disttrain_job_reform_duration_seconds_sum{{{labels}}}"] > 0
    assert (
        end[f"disttrain_job_last_complete_checkpoint_step{{{labels}}}"] == 20.0
        or end[f"disttrain_job_last_complete_checkpoint_step{{{labels}}}"] == 24.0
    )
    assert end[f'disttrain_job_phase{{{labels},phase="Succeeded"}}'] == 1


@pytest.mark.timeout(240)
def test_the_reform_reports_its_phases_and_they_add_up(node_loss):
    """status.lastReform.phases: every phase present and non-negative, adding up to the reform's total, which
    is the directive-to-first-step duration plus the detection before it; the metric and the Event say the same."""
    from disttrain.api.reformphases import ReformPhase

    reform = node_loss.first_reform
    assert reform is not None, "the reform never completed"
    phases = reform["phases"]
    assert set(phases) == {p.value for p in ReformPhase} | {"total"}
    assert all(seconds >= 0 for seconds in phases.values()), phases
    parts = sum(phases[p.value] for p in ReformPhase)
    assert parts == pytest.approx(phases["total"], abs=0.01)
    assert phases["total"] - phases["detection"] == pytest.approx(reform["durationSeconds"], abs=0.5)
    # The stamps come from a real restart: a new rendezvous round, a new process group, a checkpoint load. (imports
    # may be 0: a warm interpreter imported before the hand-over, disttrain.trainer.launch.warmstart.)
    assert phases["restart"] > 0 and phases["processGroup"] > 0 and phases["checkpointLoad"] > 0, phases
    for phase in ReformPhase:
        assert (
            node_loss.scrapes[0][
                f'disttrain_job_reform_phase_seconds_count{{namespace="default",phase="{phase.value}"}}'
            ]
            == 1
        )
    assert any(e["reason"] == "Reformed" and "phases: detection" in e["message"] for e in node_loss.events)


@pytest.fixture(scope="module")
def spare_loss(tmp_path_factory):
    """3 nodes and one hot spare (``spec.nodes.spares: 1``); past step 8 a member's machine dies.

    Which three of the four pods form the first group is the rendezvous' choice: the member killed is one whose
    worker recorded steps. The pods that existed before the kill and the replacement created after it are noted.

    Its pods are forked, so the replacement could be up within a second of its creation: the operator creates it
    only once the group re-formed with the spare.
    """
    tmp = tmp_path_factory.mktemp("spare-loss")
    out = tmp / "records"
    seen: dict = {}

    def on_tick(runtime, snapshot):
        if "killed" in seen or snapshot.status.get("step", 0) < 8:
            return
        recording = {path.name.rsplit("-", 1)[0] for path in out.glob("*.jsonl")}
        members = [p for p in runtime.workers.values() if p.is_alive and p.name in recording]
        seen["before"] = {p.name for p in runtime.workers.values()}
        seen["killed"] = max(members, key=lambda p: p.index).name
        runtime.apply_chaos(chaos_mod.parse_chaos(f"kill-node:{max(p.index for p in members)}@0s")[0])

    job = e2e_job("spare", out, replicas=3, step_sleep=0.05).set("spec.nodes.spares", 1)
    run = run_job(tmp, job, on_tick=on_tick)
    run.seen = seen
    return run


@pytest.mark.timeout(240)
def test_a_hot_spare_takes_the_lost_nodes_place_and_the_trajectory_is_unchanged(spare_loss, reference):
    """The group after the loss is the survivors and the spare (a pod that existed before the kill), never the
    replacement created after it; one restart; the losses equal the reference and every sample is read once."""
    assert spare_loss.summary.succeeded, spare_loss.reasons()
    assert "killed" in spare_loss.seen, "the member was never killed"
    assert sum(spare_loss.summary.infrastructure_losses_by_reason.values()) == 1
    assert spare_loss.summary.restarts_by_reason == {}
    trajectory = spare_loss.final_trajectory()
    resumed = [recs for recs in trajectory.values() if recs[0]["resumed_from"]]
    assert resumed, "the run never resumed from a checkpoint: the kill missed the training"
    after = {
        r["process"].rsplit("-", 1)[0]
        for recs in trajectory.values()
        for r in recs
        if r["step"] > resumed[0][0]["resumed_from"]
    }
    assert len(after) == 3 and spare_loss.seen["killed"] not in after
    assert after <= spare_loss.seen["before"], f"a pod created after the loss trained: {after}"
    ref = _global_losses(reference.final_trajectory())
    got = _global_losses(trajectory)
    assert sorted(got) == sorted(ref) == list(range(1, 25))
    for step in ref:
        assert math.isclose(got[step], ref[step], rel_tol=1e-4, abs_tol=1e-6), (step, got[step], ref[step])
    consumed = collections.Counter(i for recs in trajectory.values() for r in recs for i in r["indices"])
    assert sorted(consumed) == list(range(288)) and set(consumed.values()) == {1}


@pytest.fixture(scope="module")
def idle_spare_loss(tmp_path_factory):
    """3 nodes and one hot spare; once the agent reports the round's pods, the spare's machine dies."""
    tmp = tmp_path_factory.mktemp("idle-spare-loss")
    seen: dict = {}

    def on_tick(runtime, snapshot):
        members = snapshot.status.get("roundMembers") or []
        if "killed" in seen or len(members) != 3 or snapshot.status.get("step", 0) < 3:
            return
        (spare,) = [p for p in runtime.workers.values() if p.is_alive and p.name not in members]
        seen["killed"], seen["members"] = spare.name, set(members)
        runtime.apply_chaos(chaos_mod.parse_chaos(f"kill-node:{spare.index}@0s")[0])

    run = run_job(
        tmp, e2e_job("idle", tmp / "records", replicas=3, step_sleep=0.1).set("spec.nodes.spares", 1), on_tick=on_tick
    )
    run.seen = seen
    return run


@pytest.mark.timeout(240)
def test_losing_the_idle_spare_replaces_it_and_the_group_trains_on_without_a_reform(idle_spare_loss):
    run = idle_spare_loss
    assert run.summary.succeeded, run.reasons()
    assert "killed" in run.seen, "the agent never reported the round's pods"
    assert "OutsideTheGroup" in run.reasons() and "Reformed" not in run.reasons()
    assert sum(run.summary.infrastructure_losses_by_reason.values()) == 1 and run.summary.restarts_by_reason == {}
    groups = {r["group"] for r in run.records()}
    assert len(groups) == 1, f"the group was re-formed: {groups}"
    trainers = {r["process"].rsplit("-", 1)[0] for r in run.records()}
    assert trainers == run.seen["members"] and run.seen["killed"] not in trainers
