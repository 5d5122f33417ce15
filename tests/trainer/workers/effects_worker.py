"""The toy training program of the side-effect and evaluation tests: the real loop on the shared tiny MLP.

Every step declares the effect ``notify`` (payload: the step); every second step is evaluated on a held-out set.
Both handlers are a downstream sink that refuses a key it has seen: ``$TOY_OUT/<name>.sink`` gets each accepted
key, ``<name>.refused`` each key offered again. Rank 0 notes each evaluation it runs in ``evals.log`` as
``<step> <pid>``.

``TOY_STEP_SLEEP``: seconds to sleep after each step (so background uploads keep up with the saves).

``EFFECT_FAULT=<phase>:<step>``: global rank 0 SIGKILLs itself at that checkpoint phase of that step's save
(:class:`~disttrain.trainer.checkpoint.manager.CheckpointPhase` values; ``<step>+``: that step's or a later one's),
or with ``in_handler`` once the sink accepted the ``notify`` effect of that step, before the trainer confirms it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workers"))
import toymodel

from disttrain.trainer.checkpoint.manager import CheckpointPhase
from disttrain.trainer.evaluation import EvalOptions
from disttrain.trainer.loop import ElasticTrainer

OUT = Path(os.environ["TOY_OUT"])
SLEEP = float(os.environ.get("TOY_STEP_SLEEP", "0"))
FAULT_WHERE, _, FAULT_STEP = os.environ.get("EFFECT_FAULT", "").partition(":")


def die(why: str) -> None:
    print(f"fault injection: SIGKILL {why}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def append(path: Path, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def sink(name: str) -> Callable[[str, dict[str, Any]], None]:
    """A downstream system that refuses duplicates by key."""

    def handle(key: str, payload: dict[str, Any]) -> None:
        path = OUT / f"{name}.sink"
        if key in (path.read_text().split() if path.exists() else []):
            append(OUT / f"{name}.refused", key)
            return
        append(path, key)
        if FAULT_WHERE == "in_handler" and name == "notify" and str(payload["step"]) == FAULT_STEP:
            die(f"after the sink took {key}, before its confirmation")

    return handle


def phase_hook(phase: CheckpointPhase, step: int) -> None:
    at = str(step) == FAULT_STEP or (FAULT_STEP.endswith("+") and step >= int(FAULT_STEP[:-1]))
    if phase.value == FAULT_WHERE and at and os.environ.get("RANK") == "0":
        die(f"at {phase.value} of step {step}")


def main() -> None:
    model = toymodel.TinyMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    trainer_box: list[ElasticTrainer] = []

    def evaluate(m: torch.nn.Module, batch: Any) -> dict[str, Any]:
        trainer = trainer_box[0]
        if trainer.rank == 0:
            append(OUT / "evals.log", f"{trainer.step} {os.getpid()}")
        x, y = batch
        return {"loss": torch.nn.functional.mse_loss(m(x), y, reduction="sum"), "count": len(y)}

    evaluation = EvalOptions(
        dataset=toymodel.regression_dataset(10),
        fn=evaluate,
        every_steps=2,
        batch_size=3,
        summarize=lambda sums: {"loss": sums["loss"] / sums["count"]},
        on_result=sink("eval"),
    )
    with ElasticTrainer.from_env(
        model,
        optimizer,
        toymodel.regression_dataset(64),
        on_checkpoint_phase=phase_hook,
        effects={"notify": sink("notify")},
        evaluation=evaluation,
    ) as trainer:
        trainer_box.append(trainer)
        for step in trainer.steps():
            toymodel.train_step(trainer, step)
            trainer.declare_effect("notify", {"step": step.index + 1})
            time.sleep(SLEEP)


if __name__ == "__main__":
    main()
