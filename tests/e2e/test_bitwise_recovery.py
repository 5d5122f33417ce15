"""Bitwise-identical recovery: a node lost and replaced at the same world size changes no bit.

SIGKILL path (default ``gradientReduction: ddp``): a 3-node job whose node 0 (the one holding rank 0) loses its
whole process tree to SIGKILL at step 8. The operator replaces it; the replacement takes node index 0 and so
rank 0 again. Restarting (``spec.elastic.reformInPlace: false``), the group resumes from the step-5 checkpoint and
replays the steps since. Every replayed step is
compared with its first execution, before the kill: every rank read the same samples and computed the same
loss, to the bit (the recorder writes exact JSON floats). The first replayed step runs on a freshly built DDP
and the rest depend on its gradient reduction, which is where a drift would begin. (The uninterrupted
run is the reference at the trainer level: ``tests/trainer/test_exact_resume.py`` resumes at the same world
size and compares every parameter and optimizer tensor with ``torch.equal``. That test is also the one that
catches DDP's bucket rebuild: with it turned back on, it fails, while this 3-node replay still matched.)
In place (the default), the same kill: the survivors keep their processes and the state of the step they hold in
memory, the replacement receives it, and only the step the kill interrupted runs again. The whole trajectory and the
final checkpoint are compared with the restarting run's, to the bit.

Drain path: planned scale-down 3 -> 2, then, as soon as the drain is issued, scale-up back to 3: two drains
(checkpoint at a step boundary) and two reforms. The steps at 2 nodes sum the gradient over other ranks, which
DDP's all-reduce does in another order, so this run uses ``gradientReduction: ordered`` (the gradient summed in
a fixed order of micro-batch index, the same at every world size). Its reference is therefore an uninterrupted
run at *one* node (the cheapest, and the strongest check of that claim): every step's loss over the global
batch and every tensor of the final checkpoint are bitwise equal.

Lean on purpose (the suite's budget): 1 process per node, the tiny MLP, three jobs.
"""

from __future__ import annotations

import collections

import pytest

from tests.checkpoint_tensors import differing, load_tensors
from tests.e2e.conftest import Run, e2e_job, run_job

pytestmark = [pytest.mark.slow]

STEPS = 16


def final_state(run: Run, steps: int) -> dict:
    return load_tensors(run.state.checkpoints_dir / f"step-{steps}")


def global_losses(run: Run) -> dict[int, float]:
    """step -> the loss over the global batch. Each rank's sum adds its micro batches' float32 losses in float64,
    which is exact for a handful of terms, so the value does not depend on how the batch was split."""
    return {
        step: sum(r["loss_sum"] for r in records) / records[0]["global_batch"]
        for step, records in run.final_trajectory().items()
    }


def ranks_by_node(run: Run) -> dict[str, set[int]]:
    """Node index (from the pod name ``<job>-worker-<index>[-<n>]``) -> every rank its processes held."""
    held: dict[str, set[int]] = collections.defaultdict(set)
    for record in run.records():
        index = record["process"].split("-worker-")[1].split("-")[0]
        held[index].add(record["rank"])
    return dict(held)


def _node_0_killed_at_step_8(tmp_path_factory: pytest.TempPathFactory, name: str, in_place: bool) -> Run:
    tmp = tmp_path_factory.mktemp(f"bitwise-{name}")
    builder = e2e_job(name, tmp / "records", replicas=3, max_steps=STEPS, step_sleep=0.3)
    # Wait for the replacement however slow the machine: this test is about the same world size.
    builder.obj["spec"]["elastic"]["replacementWaitSeconds"] = 120
    builder.obj["spec"]["elastic"]["reformInPlace"] = in_place
    # Killed at step 8 (the status relay lags a little): restarting, steps 6.. are replayed from the step-5
    # checkpoint. The sleep leaves eight steps' margin, so the kill lands during training even on a loaded machine.
    run = run_job(tmp, builder, chaos="kill-node:0@step=8")
    assert run.summary.succeeded, run.reasons()
    return run


@pytest.fixture(scope="module")
def node_killed(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The restart path: the replay from the checkpoint."""
    return _node_0_killed_at_step_8(tmp_path_factory, "kill3", in_place=False)


@pytest.mark.timeout(300)
def test_the_replacement_of_a_killed_node_takes_its_index_and_ranks(node_killed):
    reasons = node_killed.reasons()
    assert "ChaosKillNode" in reasons and "NodeLost" in reasons and "Reformed" in reasons, reasons
    assert any(r["process"].startswith("kill3-worker-0-1-") for r in node_killed.records()), (
        "the replacement is named after the index it took"
    )
    assert ranks_by_node(node_killed) == {"0": {0}, "1": {1}, "2": {2}}
    assert {r["resumed_from"] for r in node_killed.records() if r["resumed_from"]}, "nothing resumed"


@pytest.mark.timeout(300)
def test_after_a_sigkill_at_the_same_world_size_every_replayed_step_is_bitwise_equal_to_its_first_run(node_killed):
    executions = node_killed.executions()
    assert sorted(executions) == list(range(1, STEPS + 1))
    replayed = {step: runs for step, runs in executions.items() if len(runs) > 1}
    assert len(replayed) >= 2, f"the kill must land two steps or more after the step-5 checkpoint: {sorted(replayed)}"
    assert min(replayed) == 6, sorted(replayed)
    for step, runs in sorted(replayed.items()):
        first, last = (
            [(r["rank"], r["world"], r["indices"], r["loss_sum"]) for r in records] for records in (runs[0], runs[-1])
        )
        assert len(first) == 3 or step == max(replayed), f"step {step} ran on fewer ranks before the kill"
        # Before the kill a step may have been recorded by the survivors only (the victim died mid-step).
        assert [row for row in last if row[0] in {r[0] for r in first}] == first, f"step {step} differs"
    assert {len(records) for records in node_killed.final_trajectory().values()} == {3}


@pytest.fixture(scope="module")
def node_killed_in_place(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _node_0_killed_at_step_8(tmp_path_factory, "kill3ip", in_place=True)


@pytest.mark.timeout(400)
def test_in_place_only_the_interrupted_step_runs_again_and_the_run_is_bitwise_the_restarting_one(
    node_killed_in_place, node_killed
):
    executions = node_killed_in_place.executions()
    assert sorted(executions) == list(range(1, STEPS + 1))
    again = {step: runs for step, runs in executions.items() if len(runs) > 1}
    assert len(again) <= 1, f"in place only the step the kill interrupted runs twice: {sorted(again)}"
    resumed = {r["resumed_from"] for r in node_killed_in_place.records() if r["resumed_from"]}
    assert resumed and min(resumed) > 5, f"resumed from the step-5 checkpoint, not from memory: {resumed}"
    # The interrupted step's first run may have stopped after some of its micro batches; its second run counts, and
    # is compared below with the restarting run's with everything else.
    assert all(step == min(resumed) + 1 for step in again), (sorted(again), resumed)
    assert ranks_by_node(node_killed_in_place) == {"0": {0}, "1": {1}, "2": {2}}
    got, ref = global_losses(node_killed_in_place), global_losses(node_killed)
    assert {s: (got[s], ref[s]) for s in got if got[s] != ref[s]} == {}
    assert differing(final_state(node_killed_in_place, STEPS), final_state(node_killed, STEPS)) == {}
    survivors = {
        r["process"] for r in node_killed_in_place.records() if not r["process"].startswith("kill3ip-worker-0")
    }
    assert len(survivors) == 2, f"the survivors kept their processes (one records file each): {survivors}"


DRAIN_STEPS = 40


def ordered_job(name: str, out, replicas: int, **kw):
    builder = e2e_job(name, out, replicas=replicas, max_steps=DRAIN_STEPS, dataset=12 * DRAIN_STEPS, **kw)
    builder.obj["spec"]["training"]["gradientReduction"] = "ordered"
    return builder


class DownThenUp:
    """Once the 3-node group made progress: replicas 2 (a drain); once the group trained two steps at 2 nodes,
    replicas 3 again. (Requested while the drain is in flight, a newcomer that starts warm joins the re-forming
    round at once, and no step runs at 2 nodes.)"""

    def __init__(self) -> None:
        self.requests: list[int] = []
        self.at_two_from: int | None = None

    def __call__(self, runtime, snapshot) -> None:
        status = snapshot.status
        running, step = status.get("phase") == "Running", status.get("step", 0)
        if not self.requests and running and step >= 4:
            self.requests.append(2)
            runtime.set_replicas(2, "test: planned scale-down")
        elif self.requests == [2] and running and status.get("worldSize") == 2:
            if self.at_two_from is None:
                self.at_two_from = step
            elif step >= self.at_two_from + 2:
                self.requests.append(3)
                runtime.set_replicas(3, "test: scale back up")


@pytest.fixture(scope="module")
def drained_down_and_up(tmp_path_factory: pytest.TempPathFactory) -> Run:
    tmp = tmp_path_factory.mktemp("bitwise-drain")
    scaler = DownThenUp()
    # 36 steps of 0.3 s after the scale-down: room for the new node's cold start (an in-place drain takes ~1 s).
    run = run_job(tmp, ordered_job("drain3", tmp / "records", 3, step_sleep=0.3), on_tick=scaler, timeout_s=240)
    assert run.summary.succeeded, run.reasons()
    assert scaler.requests == [2, 3], f"scale requests made: {scaler.requests}; events {run.reasons()}"
    return run


@pytest.fixture(scope="module")
def ordered_reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    tmp = tmp_path_factory.mktemp("bitwise-ordered-reference")
    run = run_job(tmp, ordered_job("oref1", tmp / "records", 1))
    assert run.summary.succeeded, run.reasons()
    return run


@pytest.mark.timeout(400)
def test_drained_down_to_two_and_up_to_three_nodes_the_run_is_bitwise_equal_to_one_node(
    drained_down_and_up, ordered_reference
):
    reasons = drained_down_and_up.reasons()
    assert "ScaledDown" in reasons and "ScaledUp" in reasons and "NodeLost" not in reasons, reasons
    worlds = [records[0]["world"] for _, records in sorted(drained_down_and_up.final_trajectory().items())]
    changes = [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]
    assert changes == [3, 2, 3], f"world size per step: {worlds}"
    got, ref = global_losses(drained_down_and_up), global_losses(ordered_reference)
    assert sorted(got) == sorted(ref) == list(range(1, DRAIN_STEPS + 1))
    assert {s: (got[s], ref[s]) for s in got if got[s] != ref[s]} == {}
    tensors, ref_tensors = final_state(drained_down_and_up, DRAIN_STEPS), final_state(ordered_reference, DRAIN_STEPS)
    assert differing(tensors, ref_tensors) == {}
