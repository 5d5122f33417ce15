"""The control channel: keys in the job agent's TCPStore that carry directives to, and progress from, workers.

The job agent hosts the c10d rendezvous store; the same store carries these keys under ``disttrain/`` (torch's
rendezvous uses its own ``torch.rendezvous.*`` prefix). Values are JSON documents of the models below.
The operator never touches the store: it writes ``status.control`` and the agent copies it here.
"""

from __future__ import annotations

import enum
import logging
from typing import Optional, Protocol, TypeVar, Union

from pydantic import BaseModel, ConfigDict

log = logging.getLogger("disttrain.control")

PREFIX = "disttrain/"
# ControlSignal JSON, written by the agent whenever the operator's directive generation changes.
SIGNAL_KEY = PREFIX + "signal"
# TargetPlan JSON: the node count the operator wants the next rendezvous round to complete with.
TARGET_KEY = PREFIX + "target"
# ProgressReport JSON, written by the worker with global rank 0 after each logged step.
PROGRESS_KEY = PREFIX + "progress"
# CheckpointManifest JSON of the newest commit, written by global rank 0 after each commit.
CHECKPOINT_KEY = PREFIX + "checkpoint"
# WorkerFailure JSON, written by a worker just before it exits with a permanent (or other notable) code.
# torchrun turns every worker failure into its own exit code 1 (or restarts the worker), so the pod's exit
# code cannot carry the trainer's; this key can.
FAILURE_KEY = PREFIX + "failure"


class DirectiveAction(str, enum.Enum):
    """What the operator asks of the workers (``status.control.action``, relayed as :class:`ControlSignal`)."""

    NONE = "none"
    """Keep training."""
    DRAIN = "drain"
    """Checkpoint at the next step boundary, then exit (``ExitCode.DRAINED``): a planned reform loses no step."""
    REFORM = "reform"
    """Exit at once (``ExitCode.REFORM``), even inside a stuck collective; resume from the last checkpoint."""


class ControlSignal(BaseModel):
    model_config = ConfigDict(extra="forbid")
    generation: int
    action: DirectiveAction
    reason: str = ""


class TargetPlan(BaseModel):
    model_config = ConfigDict(extra="forbid")
    generation: int
    nodes: int
    exclude: list[str] = []
    """DISTTRAIN_NODE_NAMEs that must not join the next round (scale-down victims waiting to be deleted)."""


class WorkerFailure(BaseModel):
    model_config = ConfigDict(extra="forbid")
    exit_code: int
    node: str = ""
    message: str = ""
    time: float
    """Unix time of the report."""


class ProgressReport(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step: int
    samples_consumed: int
    world_size: int
    plan: dict[str, float | int]
    loss: Optional[float] = None
    samples_per_second: Optional[float] = None
    restart_count: int = 0
    run_id: str = ""
    resumed_from_step: Optional[int] = None
    process_id: str = ""
    """Unique id of the reporting worker process. torchrun starts new worker processes after every completed
    rendezvous round, so a new id means a new group even when run id, restart count and world size repeat."""
    time: float
    """Unix time of the report."""


class StoreReader(Protocol):
    """The part of a ``torch.distributed.Store`` that :func:`read_model` uses (the api never imports torch)."""

    def check(self, keys: list[str], /) -> bool: ...

    def get(self, key: str, /) -> Union[bytes, str]: ...


Model = TypeVar("Model", bound=BaseModel)


def read_model(store: StoreReader, key: str, model: type[Model]) -> Optional[Model]:
    """The ``model`` stored under ``key``; None when the key is absent or empty, or its value does not parse.

    ``check`` comes first because ``get`` blocks until the key exists. A value that does not parse is logged and
    skipped, never raised: a half-upgraded peer or a torn write must not stop the reader (the agent, the
    rendezvous handler, the watchdog), which simply tries again on its next round.
    """
    if not store.check([key]):
        return None
    raw = store.get(key)
    if not raw:
        return None
    try:
        return model.model_validate_json(raw)
    except ValueError:
        log.warning("ignoring an unparsable %s under %s: %r", model.__name__, key, raw[:200])
        return None
