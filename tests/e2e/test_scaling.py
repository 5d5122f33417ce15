"""Planned scale-down and scale-up lose no step; in scaled mode each reform applies the plan."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from disttrain.api.plan import plan as make_plan
from disttrain.api.spec import TrainingSpec
from disttrain.operator import cli
from tests.e2e.conftest import e2e_job, run_job, scrape

pytestmark = [pytest.mark.slow]


class Scaler:
    """Requests each node count of ``sizes`` in turn, once the group runs at the previous one and made progress.

    Requests go through ``disttrain local scale`` (the state directory), as from another terminal.
    """

    def __init__(self, sizes: list[int], progress_steps: int = 3) -> None:
        self.sizes = list(sizes)
        self.progress_steps = progress_steps
        self.world = 0  # world size of the last scrape
        self.since_step = 0  # step seen at that scrape
        self.leaving: int | None = None  # world size a request is moving away from
        self.scrapes: list[dict[str, float]] = []
        self.status_seen: dict | None = None

    def __call__(self, runtime, snapshot) -> None:
        status = snapshot.status
        world, step = status.get("worldSize", 0), status.get("step", 0)
        if status.get("phase") != "Running" or world == self.leaving:
            return
        self.leaving = None
        if world != self.world:
            try:
                sample = dict(
                    scrape(runtime.metrics_url),
                    world=world,
                    **{f"worker:{k}": v for url in snapshot.worker_metrics[:1] for k, v in scrape(url).items()},
                )
            except OSError:  # a worker's endpoint going away in a reform (connection reset): the next tick retries
                return
            self.world, self.since_step = world, step
            self.scrapes.append(sample)
            return
        if self.sizes and step >= self.since_step + self.progress_steps:
            if self.status_seen is None:
                self.status_seen = _status_from_another_terminal(runtime.state.path)
            size = self.sizes.pop(0)
            assert cli.main(["local", "scale", str(runtime.state.path), "--replicas", str(size)]) == 0
            self.leaving = world


def _status_from_another_terminal(state_dir) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "disttrain.operator.cli", "local", "status", str(state_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return json.loads(result.stdout)


@pytest.mark.timeout(300)
def test_planned_scale_down_and_scale_up_lose_no_step(tmp_path):
    scaler = Scaler([2, 3])
    # Long enough that a scale-up node starting slowly on a loaded machine (8 s seen) joins before the last step.
    steps = 160
    run = run_job(
        tmp_path,
        e2e_job("scale", tmp_path / "records", replicas=3, max_steps=steps, dataset=960, step_sleep=0.1),
        on_tick=scaler,
    )
    assert run.summary.succeeded, run.reasons()
    assert not scaler.sizes, f"scale requests left: {scaler.sizes}; events {run.reasons()}"
    seen = scaler.status_seen
    assert seen["running"] and seen["status"]["phase"] == "Running" and seen["status"]["worldSize"] == 3
    reforms = [(r.reason, r.from_nodes, r.to_nodes) for r in run.summary.reforms]
    assert reforms == [("ScaledDown", 3, 2), ("ScaledUp", 2, 3)], reforms
    executions = run.executions()
    redone = {step: len(runs) for step, runs in executions.items() if len(runs) > 1}
    assert redone == {}, f"steps executed more than once (lost work): {redone}"
    assert sorted(executions) == list(range(1, steps + 1))
    # The step after each reform is the step after the checkpoint it resumed from.
    first_step: dict[str, int] = {}
    resumed_from: dict[str, int] = {}
    for record in run.records():
        group = record["group"]
        first_step[group] = min(first_step.get(group, record["step"]), record["step"])
        resumed_from[group] = record["resumed_from"] or 0
    assert len(first_step) == 3, first_step
    assert all(first_step[g] == resumed_from[g] + 1 for g in first_step), (first_step, resumed_from)
    assert run.summary.lost_steps == 0
    assert run.summary.restarts_by_reason == {}
    # Every node's workers, the scale-up node's too, started in a warm interpreter: a cold start imports torch
    # again, and a newcomer late past the group's collective timeout fails the reform.
    cold = [p.name for p in (run.state.path / "logs").glob("*.log") if "worker starts cold" in p.read_text()]
    assert cold == [], f"workers started cold on {cold}"


@pytest.mark.timeout(300)
def test_scaled_batch_policy_applies_the_plan_after_each_reform(tmp_path):
    builder = e2e_job("scaled", tmp_path / "records", replicas=2, max_steps=250, dataset=2000, step_sleep=0.1)
    builder.set(
        "spec.training",
        {
            "globalBatchSize": 4,
            "microBatchSize": 2,
            "batchPolicy": "scaled",
            "accumulationSteps": 1,
            "lr": {"base": 0.05, "scaling": "linear"},
            "maxSteps": 250,
            "seed": 3,
        },
    )
    scaler = Scaler([3, 2])
    run = run_job(tmp_path, builder, on_tick=scaler)
    assert run.summary.succeeded, run.reasons()
    training = TrainingSpec.model_validate(builder.obj["spec"]["training"])
    worlds = [s["world"] for s in scaler.scrapes]
    assert worlds[:3] == [2, 3, 2], worlds
    labels = 'job="scaled",namespace="default"'
    for sample in scaler.scrapes:
        expected = make_plan(training, int(sample["world"]))
        assert sample[f"disttrain_job_global_batch{{{labels}}}"] == expected.global_batch
        assert math.isclose(sample[f"disttrain_job_lr_scale{{{labels}}}"], expected.lr_scale)
        if "worker:disttrain_trainer_lr_scale" in sample:
            assert math.isclose(sample["worker:disttrain_trainer_lr_scale"], expected.lr_scale)
    # The optimizer really used it: every step's LR and batch match the plan of the world that ran it.
    for step, records in run.final_trajectory().items():
        world = records[0]["world"]
        expected = make_plan(training, world)
        assert records[0]["global_batch"] == expected.global_batch, step
        assert math.isclose(records[0]["lrs"][0], 0.05 * expected.lr_scale, rel_tol=1e-6), (step, records[0]["lrs"])


@pytest.mark.timeout(300)
def test_a_drained_node_leaves_at_a_checkpoint_and_the_job_grows_back_without_a_restart(tmp_path):
    """``kubectl drain`` (chaos drain-node: its machine is cordoned) with real trainers: the worker leaves at a
    checkpoint, its replacement starts on another machine and is drained in, and no step runs twice."""
    steps = 300  # 30 s of training after the drain: the replacement is Ready in time even on a loaded machine
    run = run_job(
        tmp_path,
        e2e_job("departure", tmp_path / "records", replicas=2, max_steps=steps, dataset=960, step_sleep=0.1),
        chaos="drain-node@step=15",
    )
    assert run.summary.succeeded, run.reasons()
    reforms = [(r.reason, r.from_nodes, r.to_nodes) for r in run.summary.reforms]
    assert reforms == [("NodeDeparting", 2, 1), ("ScaledUp", 1, 2)], (reforms, run.reasons())
    executions = run.executions()
    redone = {step: len(runs) for step, runs in executions.items() if len(runs) > 1}
    assert redone == {}, f"steps executed more than once (lost work): {redone}"
    assert sorted(executions) == list(range(1, steps + 1))
    assert run.summary.lost_steps == 0 and run.summary.restarts_by_reason == {}
    assert "NodeDeparting" in run.reasons()
