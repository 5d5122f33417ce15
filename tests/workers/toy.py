"""Toy training program for the multi-process trainer tests: the real loop API on the shared tiny MLP.

Settings come from the worker contract env like any disttrain program. Test-only knobs (``TOY_*``):

- ``TOY_OUT`` (folder), ``TOY_RUN`` (name): records go to ``$TOY_OUT/$TOY_RUN-<pid>.jsonl``, one JSON line per
  step (:func:`toymodel.step_record`); rank 0 saves the final parameters to ``$TOY_OUT/$TOY_RUN-final.pt``.
- ``TOY_DATASET``: number of samples (97). ``TOY_STEP_SLEEP``: seconds to sleep after each step.
- ``TOY_DRAIN_AT``: ask for a drain after this step. ``TOY_HANG_RANK1_AT``: rank 1 stops at this step, so its
  peers block in a collective.
- ``TOY_FAULT``: a checkpoint fault, injected through the trainer's ``on_checkpoint_phase`` hook.
  ``kill_before_commit:<step>`` makes global rank 0 SIGKILL itself once every rank's files of that save are
  written and synced, just before COMPLETE.json (the worst moment); ``fail_write:<step>`` makes every rank's
  part of that save fail after DCP wrote its files.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Optional

import torch

import toymodel  # a sibling: this folder is sys.path[0] of a script started by path
from disttrain.trainer.checkpoint import CheckpointPhase, PhaseHook
from disttrain.trainer.loop import ElasticTrainer


def fault_hook(spec: str) -> Optional[PhaseHook]:
    """The checkpoint hook for a ``TOY_FAULT`` value (None for no fault)."""
    if not spec:
        return None
    kind, _, at = spec.partition(":")
    if kind not in ("kill_before_commit", "fail_write") or not at.isdigit():
        raise ValueError(f"TOY_FAULT={spec!r}: expected kill_before_commit:<step> or fail_write:<step>")
    at_step = int(at)

    def hook(phase: CheckpointPhase, step: int) -> None:
        if step != at_step:
            return
        if kind == "kill_before_commit" and phase is CheckpointPhase.BEFORE_MANIFEST:
            print(f"fault injection: SIGKILL before COMPLETE.json of step {step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "fail_write" and phase is CheckpointPhase.FILES_WRITTEN:
            raise OSError(f"fault injection: write of step {step} failed")

    return hook


def main() -> None:
    dataset = toymodel.regression_dataset(int(os.environ.get("TOY_DATASET", "97")))
    model = toymodel.TinyMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    drain_at = int(os.environ.get("TOY_DRAIN_AT", "0"))
    hang_at = int(os.environ.get("TOY_HANG_RANK1_AT", "0"))
    sleep = float(os.environ.get("TOY_STEP_SLEEP", "0"))
    out_dir, run = os.environ["TOY_OUT"], os.environ.get("TOY_RUN", "run")
    hook = fault_hook(os.environ.get("TOY_FAULT", ""))
    with ElasticTrainer.from_env(model, optimizer, dataset, on_checkpoint_phase=hook) as trainer, \
            toymodel.open_records(out_dir, run) as records:
        for step in trainer.steps():
            if hang_at and step.index + 1 == hang_at and trainer.rank == 1:
                time.sleep(600)
            toymodel.train_step(trainer, step)
            toymodel.write_record(records, toymodel.step_record(trainer, step))
            if sleep:
                time.sleep(sleep)
            if drain_at and step.index + 1 == drain_at:
                trainer.request_drain("TOY_DRAIN_AT")
        if trainer.rank == 0:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                       os.path.join(out_dir, f"{run}-final.pt"))


if __name__ == "__main__":
    main()
