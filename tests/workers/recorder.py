"""The e2e training program: the real loop API on the shared tiny MLP, recording what every step did.

Settings come from the worker contract env like any disttrain program. ``E2E_OUT`` is a folder; each process
appends JSON lines to its own file: step, world size, global batch, the dataset indices this rank consumed,
this rank's loss sum and sample count, and the param-group LRs (:func:`toymodel.step_record` plus the loss,
time, load time and group). ``E2E_STEP_SLEEP`` slows steps down so chaos lands mid-run; ``E2E_HOLD_SAVE_STEP``
holds that step's commit open after every rank's files are written, before COMPLETE.json, so a node kill lands
inside the checkpoint write. ``E2E_RAISE_AT_STEP`` raises a RuntimeError after that step on every rank (a
deterministic bug), with ``E2E_RAISE_ONCE=1`` on the first process only; ``E2E_EXIT_AT_START`` exits with that
code before anything else. ``E2E_STALL_STEP`` with ``E2E_STALL_NODE`` makes that node's ranks sleep
``E2E_STALL_SECONDS`` (default 600) in that step, before the backward that reaches its gradient reduction: a
stalled rank, which its peers wait for. ``E2E_DESYNC_STEP`` with ``E2E_DESYNC_SKIP_RANK``: after that step's
backward every other rank broadcasts an extra tensor that rank skips (a data-dependent collective), a desync.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import toymodel  # a sibling: this folder is sys.path[0] of a script started by path

from disttrain.trainer.checkpoint.manager import CheckpointManager, CheckpointPhase, PhaseHook
from disttrain.trainer.loop import ElasticTrainer


def main() -> None:
    if os.environ.get("E2E_EXIT_AT_START"):
        raise SystemExit(int(os.environ["E2E_EXIT_AT_START"]))
    raise_at = int(os.environ.get("E2E_RAISE_AT_STEP", "0"))
    once = os.environ.get("E2E_RAISE_ONCE") == "1"
    dataset = toymodel.regression_dataset(int(os.environ.get("E2E_DATASET", "480")))
    model = toymodel.TinyMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sleep = float(os.environ.get("E2E_STEP_SLEEP", "0"))
    hold_step = int(os.environ.get("E2E_HOLD_SAVE_STEP", "0"))
    out_dir = os.environ["E2E_OUT"]
    hook = hold_commit(hold_step, 30.0, out_dir) if hold_step else None
    node = os.environ.get("DISTTRAIN_NODE_NAME", "node")
    stall_step = int(os.environ.get("E2E_STALL_STEP", "0"))
    stall_here = stall_step and os.environ.get("E2E_STALL_NODE") == node
    stall_seconds = float(os.environ.get("E2E_STALL_SECONDS", "600"))
    desync_step = int(os.environ.get("E2E_DESYNC_STEP", "0"))
    skip_rank = int(os.environ.get("E2E_DESYNC_SKIP_RANK", "-1"))
    with (
        ElasticTrainer.from_env(model, optimizer, dataset, log_every=1, on_checkpoint_phase=hook) as trainer,
        toymodel.open_records(out_dir, node) as records,
    ):
        load_seconds = _time_loads()
        loaded, last_group = 0.0, None
        for step in trainer.steps():
            # One torchrun round = one group; its store port is fresh each round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE).
            # Read at every step: a worker that re-forms in place is handed the next round's environment.
            env = os.environ
            group = f"{env.get('TORCHELASTIC_RUN_ID', '')}:{env.get('MASTER_PORT', '')}:{trainer.world_size}"
            if group != last_group:  # the load of this group's resume (0 for one from memory)
                loaded, load_seconds[0], last_group = load_seconds[0], 0.0, group

            def record(loss_sum: float, count: int, step=step, loaded=loaded, group=group) -> None:
                if stall_here and step.index + 1 == stall_step:
                    time.sleep(stall_seconds)  # stalled: evicted before it wakes
                toymodel.write_record(
                    records,
                    dict(
                        toymodel.step_record(trainer, step),
                        loss_sum=loss_sum,
                        count=count,
                        time=time.time(),
                        load_seconds=loaded,
                        group=f"{group}:{trainer.resumed_from}",
                    ),
                )

            toymodel.train_step(trainer, step, before_sync=record)
            if desync_step and step.index + 1 == desync_step and trainer.rank != skip_rank:
                torch.distributed.broadcast(torch.zeros(5), src=0)  # the skipping rank goes on to the boundary
            if sleep:
                time.sleep(sleep)
            if raise_at and step.index + 1 == raise_at and _first_to_claim(out_dir, once):
                raise RuntimeError(f"injected bug at step {raise_at}")


def _first_to_claim(out_dir: str, once: bool) -> bool:
    """True for every process, or with ``once`` for the first process of the whole job only."""
    if not once:
        return True
    try:
        os.close(os.open(os.path.join(out_dir, "raised-once"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _time_loads() -> list[float]:
    """Record how long loading the checkpoint took (the reform benchmark subtracts it): a one-item list the
    wrapped ``load`` fills in (of every manager of this process: an in-place reform makes a new one; a resume from
    memory loads nothing and leaves 0)."""
    original = CheckpointManager.load
    seconds = [0.0]

    def timed_load(self: CheckpointManager, *args: Any, **kwargs: Any) -> None:
        began = time.perf_counter()
        try:
            original(self, *args, **kwargs)
        finally:
            seconds[0] = time.perf_counter() - began

    CheckpointManager.load = timed_load  # type: ignore[method-assign]
    return seconds


def hold_commit(at_step: int, seconds: float, out_dir: str) -> PhaseHook:
    """Hold the commit of ``at_step`` open for ``seconds`` once, after every rank's files are written and before
    COMPLETE.json: a window for a node kill inside the checkpoint write. A marker file names the step and node."""

    def hook(phase: CheckpointPhase, step: int) -> None:
        if phase is not CheckpointPhase.BEFORE_MANIFEST or step != at_step:
            return  # BEFORE_MANIFEST happens on global rank 0 only
        if any(name.startswith(f"saving-{step}-") for name in os.listdir(out_dir)):
            return  # held once already, by an earlier group
        node = os.environ.get("DISTTRAIN_NODE_NAME", "node")
        open(os.path.join(out_dir, f"saving-{step}-{node}"), "w").close()
        time.sleep(seconds)

    return hook


if __name__ == "__main__":
    main()
