"""Where the seconds of a reform go: the worker's startup times and the phases computed from them.

Why: a reform's duration alone does not say what to make cheaper. The new group's rank 0 knows when its process
was spawned, when its imports finished, when the process group came up, when the checkpoint was loaded and when
the first step completed; the old workers note when they exited (:class:`WorkerStartup`, relayed by the job agent
into ``status.workerStartup``). The operator knows when it issued the directive. :func:`compute_phases` turns
these times into contiguous phases (:class:`ReformPhase`) that add up to the whole reform, from the first sign of
the loss to the first step at the new size.

Clocks differ between machines and a stamp can be missing (a worker without the control channel), so every
boundary is clamped to lie between its neighbours: a phase is never negative and the phases always add up to the
total. Pure: no torch, no I/O.
"""

from __future__ import annotations

import enum
import itertools
from typing import Optional

from pydantic import Field

from disttrain.api.spec import ContractModel

MAX_TIME = 253402300799.0
"""9999-12-31T23:59:59Z, as :data:`disttrain.api.control.MAX_TIME` (not imported: control imports this module)."""


class ReformPhase(str, enum.Enum):
    """The phases of a reform, in order; the values are the wire names in ``status.lastReform.phases``."""

    DETECTION = "detection"
    """First sign of the loss (a survivor's failed collective) to the operator's directive; 0 when planned."""
    DIRECTIVE = "directive"
    """Directive issued to the last old worker gone (agent relay, watchdog poll, drain checkpoint, exit)."""
    RESTART = "restart"
    """Old workers gone to the new worker process spawned: torchrun's restart and the rendezvous round."""
    IMPORTS = "imports"
    """Process spawned to the trainer module imported (Python, torch, disttrain)."""
    MODEL_BUILD = "modelBuild"
    """Trainer imported to ``ElasticTrainer.from_env`` called: the user's model, optimizer and dataset."""
    PROCESS_GROUP = "processGroup"
    """``from_env``: process group init, DDP/FSDP2 wrap, control channel."""
    CHECKPOINT_LOAD = "checkpointLoad"
    """Finding and loading the newest checkpoint (``ElasticTrainer._resume``)."""
    FIRST_STEP = "firstStep"
    """The first optimizer step at the new size."""


_Time = Field(None, ge=0.0, le=MAX_TIME, allow_inf_nan=False)


class WorkerStartup(ContractModel):
    """Unix times of one worker process's start (rank 0 of a group), and of the previous group's exit."""

    old_exit_first: Optional[float] = _Time
    """The first old worker that exited (a failed collective or the directive)."""
    old_exit_last: Optional[float] = _Time
    """The last old worker that exited."""
    spawned: Optional[float] = _Time
    """This process was created."""
    imported: Optional[float] = _Time
    """The trainer module finished importing."""
    setup_begin: Optional[float] = _Time
    """``ElasticTrainer.from_env`` was called."""
    group_ready: Optional[float] = _Time
    """``from_env`` returned (process group, wrap, channel)."""
    resumed: Optional[float] = _Time
    """The checkpoint was loaded (or none found)."""
    first_step: Optional[float] = _Time
    """The first optimizer step completed."""


class ReformPhases(ContractModel):
    """Seconds per phase of the last reform (:class:`ReformPhase`); they add up to ``total``."""

    detection: float = Field(0.0, ge=0)
    directive: float = Field(0.0, ge=0)
    restart: float = Field(0.0, ge=0)
    imports: float = Field(0.0, ge=0)
    model_build: float = Field(0.0, ge=0)
    process_group: float = Field(0.0, ge=0)
    checkpoint_load: float = Field(0.0, ge=0)
    first_step: float = Field(0.0, ge=0)
    total: float = Field(0.0, ge=0)
    """From the first sign of the loss (the directive when planned) to the first step at the new size."""

    def seconds(self) -> dict[ReformPhase, float]:
        """The phases in order, by :class:`ReformPhase`."""
        wire = self.model_dump(by_alias=True)
        return {phase: float(wire[phase.value]) for phase in ReformPhase}

    def describe(self) -> str:
        """One line for an Event: ``detection 0.4s, directive 0.2s, ...``."""
        return ", ".join(f"{phase.value} {s:.2f}s" for phase, s in self.seconds().items())


def compute_phases(issued_at: float, startup: WorkerStartup, *, planned: bool) -> ReformPhases:
    """The phases of a reform whose directive was issued at ``issued_at``, from the new rank 0's ``startup``.

    Unplanned (a loss): the reform starts at the first sign of the loss, the first old worker's exit, when that
    came before the directive (a survivor's collective failed at once); planned (a drain), at the directive.
    A missing stamp makes its phase 0 (the time goes to the next phase that has one).
    """
    start = issued_at
    if not planned and startup.old_exit_first is not None:
        start = min(issued_at, startup.old_exit_first)
    end = startup.first_step if startup.first_step is not None else issued_at
    end = max(end, start)
    stamps = [
        issued_at,
        startup.old_exit_last,
        startup.spawned,
        startup.imported,
        startup.setup_begin,
        startup.group_ready,
        startup.resumed,
    ]
    bounds = [start]
    for stamp in stamps:
        bounds.append(min(max(stamp if stamp is not None else bounds[-1], bounds[-1]), end))
    bounds.append(end)
    spans = [round(b - a, 3) for a, b in itertools.pairwise(bounds)]
    values = dict(zip((p.value for p in ReformPhase), spans, strict=True))
    return ReformPhases.model_validate({**values, "total": round(end - start, 3)})


def reform_phases(start: float, startup: Optional[WorkerStartup], *, planned: bool) -> Optional[ReformPhases]:
    """:func:`compute_phases` for a reform that began at ``start``, when ``startup`` is the new group's (its first
    step came after the start); None when the workers sent no startup stamps for it."""
    if startup is None or startup.first_step is None or startup.first_step < start:
        return None
    return compute_phases(start, startup, planned=planned)
