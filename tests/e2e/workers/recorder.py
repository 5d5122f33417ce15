"""The e2e training program: the real loop API on a tiny MLP that records what every step did.

Settings come from the worker contract env like any disttrain program. ``E2E_OUT`` is a folder; each process
appends JSON lines to its own file: step, world size, global batch, the dataset indices this rank consumed,
this rank's loss sum and sample count, and the param-group LRs. ``E2E_STEP_SLEEP`` slows steps down so chaos
lands mid-run; ``E2E_HOLD_SAVE_STEP`` holds that step's commit open after the
files are written, before COMPLETE.json, so a node kill lands inside the checkpoint write.
"""

import json
import os
import time

import torch

from disttrain.trainer import randomness
from disttrain.trainer.loop import ElasticTrainer


class Tiny(torch.nn.Module):
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
    n = int(os.environ.get("E2E_DATASET", "480"))
    x = torch.randn(n, 8, generator=g)
    y = x.sum(-1) * 0.3 + torch.randn(n, generator=g) * 0.1
    dataset = torch.utils.data.TensorDataset(x, y)
    model = Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sleep = float(os.environ.get("E2E_STEP_SLEEP", "0"))
    hold_step = int(os.environ.get("E2E_HOLD_SAVE_STEP", "0"))
    out_dir = os.environ["E2E_OUT"]
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{os.environ.get('DISTTRAIN_NODE_NAME', 'node')}-{os.getpid()}.jsonl")
    with ElasticTrainer(model, optimizer, dataset, log_every=1) as trainer, open(path, "a", buffering=1) as record:
        _time_loads(trainer)
        if hold_step:
            _hold_save(trainer, hold_step, 30.0)
        # One torchrun round = one group; its store port is fresh each round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE).
        group = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}:{os.environ.get('MASTER_PORT', '')}:{trainer.world_size}"
        for step in trainer.steps():
            loss_sum, count = 0.0, 0
            for mb in step:
                xb, yb = mb.data
                loss = torch.nn.functional.mse_loss(trainer.model(xb, mb.seeds), yb, reduction="sum")
                step.backward(loss)
                loss_sum += float(loss.detach())
                count += len(mb.indices)
            record.write(json.dumps({"step": step.index + 1, "rank": trainer.rank, "world": trainer.world_size,
                                     "global_batch": trainer.plan.global_batch, "indices": step.indices,
                                     "loss_sum": loss_sum, "count": count, "time": time.time(),
                                     "resumed_from": trainer.resumed_from, "load_seconds": trainer.load_seconds,
                                     "group": f"{group}:{trainer.resumed_from}",
                                     "lrs": [grp["lr"] for grp in optimizer.param_groups]}) + "\n")
            if sleep:
                time.sleep(sleep)


def _time_loads(trainer: ElasticTrainer) -> None:
    """Record how long loading the checkpoint took (the reform benchmark subtracts it)."""
    manager = trainer.checkpoints
    original = manager.load
    trainer.load_seconds = 0.0

    def timed_load(*args, **kwargs):
        began = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            trainer.load_seconds = time.perf_counter() - began

    manager.load = timed_load


def _hold_save(trainer: ElasticTrainer, at_step: int, seconds: float) -> None:
    """Hold the commit of ``at_step`` open for ``seconds`` once, after every rank's files are written and before
    COMPLETE.json: a window for a node kill inside the checkpoint write. A marker file names the step and node."""
    manager = trainer.checkpoints
    original = manager._commit_collectively

    def slow_commit(step, *args, **kwargs):
        out = os.environ["E2E_OUT"]
        held = any(name.startswith(f"saving-{step}-") for name in os.listdir(out))
        if trainer.rank == 0 and step == at_step and not held:
            node = os.environ.get("DISTTRAIN_NODE_NAME", "node")
            open(os.path.join(out, f"saving-{step}-{node}"), "w").close()
            time.sleep(seconds)
        return original(step, *args, **kwargs)

    manager._commit_collectively = slow_commit


if __name__ == "__main__":
    main()
