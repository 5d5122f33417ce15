"""The example GPT (examples/gptlm) on the mesh the worker contract declares, for tests/trainer/test_mesh2d.py.

A smaller GPT than the example's (width 32, 2 blocks, 4 heads, 32 tokens) so four CPU processes train it in
seconds. The TP plan is the example's. Knobs: ``MESH_OUT`` (folder), ``MESH_RUN`` (name): every rank writes one
JSON line per step to ``$MESH_OUT/$MESH_RUN-<pid>.jsonl`` (its rank, data rank, the indices it read, the step's
global mean token loss); rank 0 saves the full final weights to ``$MESH_RUN-final.pt``. ``MESH_DRAIN_AT``: ask for
a drain after this step. ``MESH_CLIP``: the clipping norm (gradients on two meshes under FSDP x TP).
``MESH_STEP_SLEEP``: seconds to sleep after each step (so a test can kill a node between steps).
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from disttrain.trainer.loop import ElasticTrainer

REPO = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("gptlm_train", REPO / "examples" / "gptlm" / "train.py")
assert _spec is not None and _spec.loader is not None
gptlm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gptlm)

WIDTH, LAYERS, HEADS, BLOCK = 32, 2, 4, 32


def main() -> None:
    torch.set_num_threads(1)
    dataset, vocab = gptlm.build_dataset(BLOCK)
    torch.manual_seed(0)
    model = gptlm.GPT(vocab, WIDTH, LAYERS, HEADS, BLOCK)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    out, run = Path(os.environ["MESH_OUT"]), os.environ["MESH_RUN"]
    drain_at = int(os.environ.get("MESH_DRAIN_AT", "0"))
    sleep = float(os.environ.get("MESH_STEP_SLEEP", "0"))
    options: dict = {"parallelism": "fsdp2"}
    mesh = gptlm.trainer_mesh()
    if mesh is not None and mesh.tensor_parallel:
        options["tp_plan"] = gptlm.TP_PLAN
    if os.environ.get("MESH_CLIP"):
        options["clip_grad_norm"] = float(os.environ["MESH_CLIP"])
    with (
        ElasticTrainer.from_env(model, optimizer, dataset, **options) as trainer,
        open(out / f"{run}-{os.getpid()}.jsonl", "a", buffering=1) as records,
    ):
        for step in trainer.steps():
            tokens = step.global_count(sum(len(mb) for mb in step.micro_indices) * BLOCK)
            for batch in step:
                x, y = batch.data
                loss = F.cross_entropy(trainer.model(x).reshape(-1, vocab), y.reshape(-1), reduction="sum")
                step.backward(loss, denominator=tokens, count=y.numel())
            # The step's mean loss over all samples: each TP rank of a group holds its group's sum.
            total = torch.tensor([step.loss_sum], dtype=torch.float64)
            with trainer.keeping_group_failures():  # in place, a peer lost here is the trainer's to handle
                dist.all_reduce(total)
            if trainer.group_failure is not None:
                continue
            readers = trainer.world_size // trainer.plan.data_degree
            record = {
                "step": step.index + 1,
                "rank": trainer.rank,
                "data_rank": trainer.data_rank,
                "world": trainer.world_size,
                "accum": trainer.plan.accum_steps,
                "indices": step.indices,
                "loss": float(total) / readers / tokens,
                "grad_norm": trainer.last_grad_norm,  # the step before's (recorded before this step's update)
            }
            records.write(json.dumps(record) + "\n")
            if drain_at and step.index + 1 == drain_at:
                trainer.request_drain("MESH_DRAIN_AT")
            time.sleep(sleep)
        weights = trainer.full_model_state_dict()
        if trainer.rank == 0:
            torch.save(weights, out / f"{run}-final.pt")


if __name__ == "__main__":
    main()
