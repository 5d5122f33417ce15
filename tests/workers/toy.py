"""Toy training program for the multi-process trainer tests: the real loop API on the shared tiny MLP.

Settings come from the worker contract env like any disttrain program. Test-only knobs (``TOY_*``):

- ``TOY_OUT`` (folder), ``TOY_RUN`` (name): records go to ``$TOY_OUT/$TOY_RUN-<pid>.jsonl``, one JSON line per
  step (:func:`toymodel.step_record`); rank 0 saves the final parameters to ``$TOY_OUT/$TOY_RUN-final.pt``.
- ``TOY_DATASET``: number of samples (97). ``TOY_STEP_SLEEP``: seconds to sleep after each step.
- ``TOY_LOG_EVERY``: rank 0 logs every that many steps (the trainer's ``log_every``; 10).
- ``TOY_DRAIN_AT``: ask for a drain after this step. ``TOY_HANG_RANK1_AT``: rank 1 stops at this step, so its
  peers block in a collective.
- ``TOY_PARALLELISM`` (``ddp``/``fsdp2``), ``TOY_PRECISION`` (``fp32``/``bf16``/``fp16``), ``TOY_CLIP`` (max
  gradient norm): the trainer options of the same names. ``TOY_SCALER_GROWTH_INTERVAL``: an fp16 GradScaler
  that grows its scale every that many steps (so a resume has a scale and tracker worth checking).
  ``TOY_USER_STATE=1``: register a :class:`toymodel.StepCounter` as user state. ``TOY_STREAM=1``: the samples as a
  seekable IterableDataset. ``TOY_NUM_WORKERS``: DataLoader worker processes. ``TOY_DEVICE``: the trainer's
  ``device`` option.
- ``TOY_UPLOAD_RETRY=<initial s>,<max s>``: the backoff of the bucket's uploads (``checkpoint_upload_retry``), with
  5 s request timeouts.
- ``TOY_FAULT``: a checkpoint fault, injected through the trainer's ``on_checkpoint_phase`` hook.
  ``kill_before_commit:<step>`` makes global rank 0 SIGKILL itself once every rank's files of that save are
  written and synced, just before COMPLETE.json (the worst moment); ``fail_write:<step>`` makes every rank's
  part of that save fail after DCP wrote its files; ``enospc_from:<step>`` makes every save from that step on
  fail as a full disk does (OSError ENOSPC), for where a real small file system cannot be mounted;
  ``kill_at:<phase>:<step>`` makes global rank 0 SIGKILL itself at that
  :class:`~disttrain.trainer.checkpoint.manager.CheckpointPhase` of the first save of that step or a later one
  (a bucket's publisher may skip a save once a newer one is complete).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from typing import Optional

import torch
import toymodel  # a sibling: this folder is sys.path[0] of a script started by path
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from disttrain.trainer.checkpoint.manager import CheckpointPhase, PhaseHook
from disttrain.trainer.checkpoint.uploads import RetryPolicy
from disttrain.trainer.loop import ElasticTrainer


def fault_hook(spec: str) -> Optional[PhaseHook]:
    """The checkpoint hook for a ``TOY_FAULT`` value (None for no fault)."""
    if not spec:
        return None
    if spec.startswith("kill_at:"):
        return kill_hook(spec)
    kind, _, at = spec.partition(":")
    if kind not in ("kill_before_commit", "fail_write", "enospc_from") or not at.isdigit():
        raise ValueError(
            f"TOY_FAULT={spec!r}: expected kill_before_commit:<step>, fail_write:<step> or enospc_from:<step>"
        )
    at_step = int(at)

    def hook(phase: CheckpointPhase, step: int) -> None:
        if kind == "enospc_from" and step >= at_step and phase is CheckpointPhase.FILES_WRITTEN:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "fault injection")
        if step != at_step:
            return
        if kind == "kill_before_commit" and phase is CheckpointPhase.BEFORE_MANIFEST:
            print(f"fault injection: SIGKILL before COMPLETE.json of step {step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "fail_write" and phase is CheckpointPhase.FILES_WRITTEN:
            raise OSError(f"fault injection: write of step {step} failed")

    return hook


def kill_hook(spec: str) -> PhaseHook:
    """``kill_at:<phase>:<step>``: global rank 0 dies at that phase of a save of that step or later."""
    _, where, at = spec.split(":", 2)
    phase, at_step = CheckpointPhase(where), int(at)

    def hook(now: CheckpointPhase, step: int) -> None:
        if now is phase and step >= at_step and os.environ.get("RANK") == "0":
            print(f"fault injection: SIGKILL at {now.value} of step {step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def main() -> None:
    dataset = toymodel.regression_dataset(int(os.environ.get("TOY_DATASET", "97")))
    if os.environ.get("TOY_STREAM"):
        dataset = toymodel.RegressionStream(dataset)
    model = toymodel.TinyMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    drain_at = int(os.environ.get("TOY_DRAIN_AT", "0"))
    hang_at = int(os.environ.get("TOY_HANG_RANK1_AT", "0"))
    raise_at = int(os.environ.get("TOY_RAISE_RANK1_AT", "0"))
    sleep = float(os.environ.get("TOY_STEP_SLEEP", "0"))
    out_dir, run = os.environ["TOY_OUT"], os.environ.get("TOY_RUN", "run")
    hook = fault_hook(os.environ.get("TOY_FAULT", ""))
    counter = toymodel.StepCounter()
    options: dict = {
        "parallelism": os.environ.get("TOY_PARALLELISM", "ddp"),
        "precision": os.environ.get("TOY_PRECISION", "fp32"),
    }
    if os.environ.get("TOY_CLIP"):
        options["clip_grad_norm"] = float(os.environ["TOY_CLIP"])
    if os.environ.get("TOY_SCALER_GROWTH_INTERVAL"):
        options["grad_scaler"] = ShardedGradScaler(
            device="cpu", init_scale=1024.0, growth_interval=int(os.environ["TOY_SCALER_GROWTH_INTERVAL"])
        )
    if os.environ.get("TOY_UPLOAD_RETRY"):
        initial, longest = (float(x) for x in os.environ["TOY_UPLOAD_RETRY"].split(","))
        options["checkpoint_upload_retry"] = RetryPolicy(
            initial_s=initial, max_s=longest, connect_timeout_s=5.0, read_timeout_s=5.0
        )
    if os.environ.get("TOY_DEVICE"):
        options["device"] = os.environ["TOY_DEVICE"]
    if os.environ.get("TOY_LOG_EVERY"):
        options["log_every"] = int(os.environ["TOY_LOG_EVERY"])
    if os.environ.get("TOY_NUM_WORKERS"):
        options["num_workers"] = int(os.environ["TOY_NUM_WORKERS"])
    if os.environ.get("TOY_USER_STATE"):
        options["user_state"] = {"counter": counter}
    with (
        ElasticTrainer.from_env(model, optimizer, dataset, on_checkpoint_phase=hook, **options) as trainer,
        toymodel.open_records(out_dir, run) as records,
    ):
        for step in trainer.steps():
            if hang_at and step.index + 1 == hang_at and trainer.rank == 1:
                time.sleep(600)
            if raise_at and step.index + 1 == raise_at and trainer.rank == 1:
                raise RuntimeError(f"injected bug at step {raise_at}")

            def record(_loss_sum: float, _count: int, step=step) -> None:  # before the gradient is sent: train_step
                counter.count += 1
                record = toymodel.step_record(trainer, step)
                record["counter"] = counter.count
                record["interval"] = trainer.checkpoints.agreed_interval  # intervalSteps: auto, in force at this step
                toymodel.write_record(records, record)

            toymodel.train_step(trainer, step, before_sync=record)
            if sleep:
                time.sleep(sleep)
            if drain_at and step.index + 1 == drain_at:
                trainer.request_drain("TOY_DRAIN_AT")
        weights = trainer.full_model_state_dict()  # collective: whole tensors on rank 0, under DDP or FSDP2
        if trainer.rank == 0:
            torch.save(weights, os.path.join(out_dir, f"{run}-final.pt"))


if __name__ == "__main__":
    main()
