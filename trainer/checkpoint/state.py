"""What a checkpoint holds, as DCP Statefuls: model and optimizer, the LR scheduler, and where training is.

Model and optimizer go through ``get_state_dict``/``set_state_dict`` (DCP reshards them on load); the trainer
state has global keys only (never per rank: RANK is not stable across restarts).
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

try:
    import numpy as _numpy
except ImportError:  # NumPy is optional: without it there is no NumPy RNG to save
    _numpy = None  # type: ignore[assignment]


class ModelOptimState(Stateful):
    """Model + optimizer through DCP's state-dict helpers, which unwrap DDP and initialise lazy optimizer state."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )


class SchedulerState(Stateful):
    """A user's LR scheduler as a Stateful. Only its plain values are saved: its base LRs are recomputed from the
    declared rule after every load anyway."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return {
            "json": json.dumps(
                {
                    k: v
                    for k, v in self.scheduler.state_dict().items()
                    if isinstance(v, (int, float, str, list, bool, type(None)))
                }
            )
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = json.loads(state_dict["json"])
        saved.pop("base_lrs", None)
        self.scheduler.__dict__.update(saved)


@dataclasses.dataclass
class TrainerState(Stateful):
    """Where training is, in global terms. RNG states (torch, Python, NumPy, CUDA) are saved once (rank 0's) and
    restored on every rank:
    randomness that must be reproducible is keyed by (seed, step, sample), never by rank or by this stream."""

    step: int = 0
    samples_consumed: int = 0
    data_cursor: int = 0
    lr_start_scale: float = -1.0
    lr_target_scale: float = -1.0
    lr_change_step: int = 0
    control_generation: int = -1

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["rng_torch"] = torch.get_rng_state()
        out["rng_python"] = random.getstate()
        if _numpy is not None:
            out["rng_numpy"] = _numpy.random.get_state()
        if torch.cuda.is_available():
            out["rng_cuda"] = torch.cuda.get_rng_state()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, type(getattr(self, f.name))(state_dict[f.name]))
        torch.set_rng_state(state_dict["rng_torch"])
        random.setstate(state_dict["rng_python"])
        if "rng_numpy" in state_dict and _numpy is not None:
            _numpy.random.set_state(state_dict["rng_numpy"])
        if "rng_cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["rng_cuda"])
