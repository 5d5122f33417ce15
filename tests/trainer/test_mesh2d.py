"""2-D meshes (``spec.training.mesh``) resume across a change of the elastic dimension with the trajectory kept.

The example GPT (tests/trainer/workers/mesh2d.py) with the example's TP plan, 6 steps of a global batch of 8, its
gradient clipped to a norm of 0.5 (under FSDP x TP the gradients live on two meshes).
Reference: FSDP x TP on 4 ranks (data 2 x tensor 2), uninterrupted. Interrupted: the same, drained after step 3
(checkpoint at step 4), resumed on 2 ranks (data 1 x tensor 2). HSDP: replicate 2 x shard 2 drained the same way,
resumed at replicate 1 x shard 2.

Tolerances. Before the drain the interrupted run is the reference's computation, so its losses are bitwise equal.
After a world-size change the gradient of a step is summed in another order: at data degree 1 one rank
accumulates all 8 micro batches, at data degree 2 two ranks accumulate 4 each and the reduce-scatter adds the two
sums; HSDP splits the batch over 4 data ranks (and TP's all-reduces add partial matmuls in its own order). Sums of
the same fp32 terms in another order differ by a few ulps (fp32 eps 1.2e-7) per step, so losses are compared to
rtol 1e-6 and the weights after 6 AdamW steps to atol 1e-5 (measured: 1.6e-8 relative on the loss of step 6, and
at most 8.2e-7 on the weights, TP and HSDP alike). The one exception is the attention's key bias: softmax ignores
a constant added to every key, so its true gradient is 0 and what it gets is rounding noise, which AdamW's
normalised update turns into steps of up to the LR (1e-3): measured 6.4e-5 apart; it is held to LR x steps.
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests.checkpoint_tensors import assert_readable_by_dcp
from tests.trainer.conftest import REPO, Harness

from disttrain.trainer.checkpoint import export

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WORKER = REPO / "tests" / "trainer" / "workers" / "mesh2d.py"
STEPS = 6
LR = 0.001
HEAD_DIM = 8  # the worker's GPT: width 32, 4 heads
CLIP = "0.5"  # every run clips (FSDP x TP: gradients on two meshes, reduced and scaled per mesh)
TP = {"tensorParallel": 2}
HSDP = {"shard": 2}


def contract(mesh: dict) -> str:
    return json.dumps(
        {
            "training": {
                "globalBatchSize": 8,
                "microBatchSize": 1,
                "lr": {"base": LR},
                "maxSteps": STEPS,
                "seed": 3,
                "mesh": mesh,
            },
            "checkpoint": {"path": "/unused", "intervalSteps": 2, "keep": 3},
            "collective_timeout_seconds": 30,
        }
    )


def launch(harness: Harness, nproc: int, mesh: dict, run: str, ckpt: Path, **extra: str) -> tuple[int, str]:
    """torchrun of the mesh worker; its records and log land in the harness's out folder."""
    env = harness.env(contract(mesh), run, ckpt, MESH_OUT=str(harness.out), MESH_RUN=run, MESH_CLIP=CLIP, **extra)
    cmd = [sys.executable, "-m", "disttrain.trainer.launch", "--standalone", "--max-restarts=0"]
    rc = harness.popen([*cmd, f"--nproc-per-node={nproc}", str(WORKER)], env, harness.out / f"{run}.log").wait()
    return rc, harness.log(run)


def losses(rows: list[dict]) -> dict[int, float]:
    """The step's loss, the same on every rank (an all-reduced sum)."""
    out: dict[int, set[float]] = defaultdict(set)
    for r in rows:
        out[r["step"]].add(r["loss"])
    assert all(len(v) == 1 for v in out.values()), out
    return {step: v.pop() for step, v in sorted(out.items())}


def consumed(rows: list[dict]) -> Counter:
    """Samples read by the data ranks (one TP rank of each group), after checking its group read the same ones."""
    groups: dict[tuple[int, int], list[list[int]]] = defaultdict(list)
    for r in rows:
        groups[(r["step"], r["data_rank"])].append(r["indices"])
    out: Counter = Counter()
    for key, reads in groups.items():
        assert all(read == reads[0] for read in reads), f"step {key[0]}: a TP group read different samples: {reads}"
        out.update(reads[0])
    return out


def assert_same_weights(final: dict, reference: dict) -> None:
    """Within 1e-5, but the key biases (see the module's docstring) within what AdamW can move them."""
    assert final.keys() == reference.keys()
    for name, value in reference.items():
        diff = (final[name] - value).abs()
        if name.endswith("qkv.bias"):  # head by head: q, k, v of HEAD_DIM each
            keys = (torch.arange(value.numel()) % (3 * HEAD_DIM)) // HEAD_DIM == 1
            assert float(diff[keys].max()) <= LR * STEPS, name
            diff = diff[~keys]
        assert float(diff.max()) <= 1e-5, f"{name}: {float(diff.max())}"


def drain_and_resume(harness: Harness, mesh: dict, name: str) -> tuple[list[dict], list[dict], str]:
    """4 ranks drained after step 3, then 2 ranks from its checkpoint: their records and the resume's log."""
    ckpt = harness.tmp / f"ckpt-{name}"
    rc, log = launch(harness, 4, mesh, f"{name}-w4", ckpt, MESH_DRAIN_AT="3")
    harness.assert_exited(rc, log, 83)  # drained: every worker exits DRAINED
    rc, log = launch(harness, 2, mesh, f"{name}-w2", ckpt)
    assert rc == 0, log[-3000:]
    assert "resumed from checkpoint step-4 (saved at world size 4) at world size 2" in log, log[-3000:]
    return harness.records(f"{name}-w4"), harness.records(f"{name}-w2"), log


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    harness = Harness(tmp_path_factory.mktemp("mesh-ref"))
    rc, log = launch(harness, 4, TP, "ref", harness.tmp / "ckpt-ref")
    assert rc == 0, log[-3000:]
    rows = harness.records("ref")
    yield losses(rows), consumed(rows), torch.load(harness.out / "ref-final.pt")
    harness.cleanup()


def test_an_fsdp_x_tp_run_resumed_on_half_the_ranks_follows_the_uninterrupted_trajectory(harness, reference):
    ref_losses, ref_samples, ref_weights = reference
    assert list(ref_losses) == list(range(1, STEPS + 1)) and sum(ref_samples.values()) == 8 * STEPS
    before, after, _ = drain_and_resume(harness, TP, "tp")
    assert {(r["world"], r["accum"]) for r in before} == {(4, 4)} and {(r["world"], r["accum"]) for r in after} == {
        (2, 8)
    }, "the plan must see the data degree (2, then 1), not the world size"
    assert {r["data_rank"] for r in before} == {0, 1} and {r["data_rank"] for r in after} == {0}
    norms = [r["grad_norm"] for r in before + after if r["grad_norm"] is not None]  # None: no step before it ran
    assert len(norms) >= STEPS - 2 and max(norms) > float(CLIP), "the clipping threshold was never reached"
    first, second = losses(before), losses(after)
    assert list(first) == [1, 2, 3, 4] and list(second) == [5, 6]
    assert first == {s: ref_losses[s] for s in first}, "same world, same mesh: the losses must be bitwise equal"
    for step, loss in second.items():
        assert loss == pytest.approx(ref_losses[step], rel=1e-6), f"step {step}"
    assert consumed(before) + consumed(after) == ref_samples, "a sample was replayed or skipped"
    final = torch.load(harness.out / "tp-w2-final.pt")
    assert_same_weights(final, ref_weights)
    # The FSDP x TP checkpoint of the last step, read by DCP's own tools and exported: the run's final weights.
    last = harness.tmp / "ckpt-tp" / f"step-{STEPS}"
    assert_readable_by_dcp(last, harness.tmp / "tp.pt")
    assert export.main([str(harness.tmp / "ckpt-tp"), str(harness.tmp / "tp-export")]) == 0
    exported = load_file(harness.tmp / "tp-export" / export.SINGLE_FILE)
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], v) for k, v in final.items())


def test_an_hsdp_run_resumed_at_one_replica_follows_the_same_trajectory(harness, reference):
    ref_losses, ref_samples, ref_weights = reference
    before, after, _ = drain_and_resume(harness, HSDP, "hsdp")
    assert {(r["world"], r["accum"]) for r in before} == {(4, 2)} and {(r["world"], r["accum"]) for r in after} == {
        (2, 4)
    }, "under HSDP every rank reads its own samples"
    trajectory = {**losses(before), **losses(after)}
    assert list(trajectory) == list(range(1, STEPS + 1))
    for step, loss in trajectory.items():
        assert loss == pytest.approx(ref_losses[step], rel=1e-6), f"step {step}"
    assert consumed(before) + consumed(after) == ref_samples
    assert_same_weights(torch.load(harness.out / "hsdp-w2-final.pt"), ref_weights)


def test_a_world_size_the_tp_degree_does_not_divide_exits_permanent_naming_the_field(harness):
    rc, log = launch(harness, 3, TP, "odd", harness.tmp / "ckpt-odd")
    harness.assert_exited(rc, log, 85)  # PERMANENT: a restart cannot fix it
    assert "not a multiple of training.mesh.tensorParallel = 2" in log, log[-3000:]
