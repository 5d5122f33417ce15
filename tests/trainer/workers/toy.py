"""Toy training program for the multi-process trainer tests: the real loop API on a tiny MLP.

Settings come from the worker contract env like any disttrain program; test-only knobs (``TOY_*``) make it
record what it consumed and ask for a drain at a given step. Records go to ``$TOY_OUT`` as JSON lines, one
file per process and run: the step, the dataset indices this rank consumed in it, and its param-group LRs.
"""

import json
import os
import time

import torch

from disttrain.trainer import randomness
from disttrain.trainer.loop import ElasticTrainer


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)  # identical init on every rank and every run
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 1)

    def forward(self, x, seeds=None):
        h = torch.tanh(self.l1(x))
        if seeds is not None:
            h = randomness.keyed_dropout(h, 0.1, seeds)
        return self.l2(h).squeeze(-1)


def main() -> None:
    g = torch.Generator().manual_seed(7)
    n = int(os.environ.get("TOY_DATASET", "97"))
    x = torch.randn(n, 8, generator=g)
    y = x.sum(-1) * 0.3 + torch.randn(n, generator=g) * 0.1
    dataset = torch.utils.data.TensorDataset(x, y)
    model = Toy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    drain_at = int(os.environ.get("TOY_DRAIN_AT", "0"))
    hang_at = int(os.environ.get("TOY_HANG_RANK1_AT", "0"))  # rank 1 stops at this step: its peers block
    sleep = float(os.environ.get("TOY_STEP_SLEEP", "0"))
    out_dir = os.environ["TOY_OUT"]
    tag = f"{os.environ.get('TOY_RUN', 'run')}-{os.getpid()}"
    path = os.path.join(out_dir, f"{tag}.jsonl")
    with ElasticTrainer(model, optimizer, dataset) as trainer, open(path, "a", buffering=1) as record:
        for step in trainer.steps():
            if hang_at and step.index + 1 == hang_at and trainer.rank == 1:
                time.sleep(600)
            for mb in step:
                xb, yb = mb.data
                loss = torch.nn.functional.mse_loss(trainer.model(xb, mb.seeds), yb, reduction="sum")
                step.backward(loss)
            record.write(json.dumps({"step": step.index + 1, "rank": trainer.rank, "world": trainer.world_size,
                                     "indices": step.indices, "resumed_from": trainer.resumed_from,
                                     "global_batch": trainer.plan.global_batch,
                                     "lrs": [grp["lr"] for grp in optimizer.param_groups]}) + "\n")
            if sleep:
                time.sleep(sleep)
            if drain_at and step.index + 1 == drain_at:
                trainer.request_drain("TOY_DRAIN_AT")
        if trainer.rank == 0:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                       os.path.join(out_dir, f"{os.environ.get('TOY_RUN', 'run')}-final.pt"))


if __name__ == "__main__":
    main()
