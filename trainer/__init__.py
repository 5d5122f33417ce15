"""The in-container side: elastic context, sampler, checkpoints, batch/LR plan application, job agent.

The training API, for a script::

    from disttrain.trainer import ElasticTrainer

    with ElasticTrainer.from_env(model, optimizer, dataset, precision="bf16") as trainer:
        for step in trainer.steps():                 # one optimizer step
            for batch in step:                       # this rank's micro batches of the step
                x, y = batch.data
                step.backward(F.cross_entropy(trainer.model(x), y, reduction="sum"))

The keyword options of ``from_env`` are those of :class:`TrainerKwargs`; they become one :class:`TrainerOptions`.
The names below are loaded on first use: the job agent and the launcher import this package and must not pay for
torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from disttrain.trainer.loop import ElasticTrainer, MicroBatch, Step
    from disttrain.trainer.options import OptionError, TrainerKwargs, TrainerOptions

__all__ = ["ElasticTrainer", "MicroBatch", "OptionError", "Step", "TrainerKwargs", "TrainerOptions"]

_HOMES = {
    "ElasticTrainer": "disttrain.trainer.loop",
    "MicroBatch": "disttrain.trainer.step",
    "Step": "disttrain.trainer.step",
    "OptionError": "disttrain.trainer.options",
    "TrainerKwargs": "disttrain.trainer.options",
    "TrainerOptions": "disttrain.trainer.options",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
