"""The final summary of a local run: steps, wall time, reforms with durations, restarts by reason, lost steps.

:class:`Recorder` follows the status after every tick and the log facts; it keeps the step trace so that the
work lost at each resume can be counted: the highest step any group reached before a resume minus the
checkpoint step it resumed from (0 for a planned drain or scale-up).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

from disttrain.operator.local.logtail import LogFacts


@dataclasses.dataclass(frozen=True)
class ReformSummary:
    reason: str
    from_nodes: int
    to_nodes: int
    duration_seconds: Optional[float]
    resumed_from_step: Optional[int] = None
    lost_steps: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Summary:
    job: str
    phase: str
    message: str
    steps: int
    samples: int
    wall_seconds: float
    reforms: tuple[ReformSummary, ...]
    restarts_by_reason: Mapping[str, int]
    lost_steps: int
    last_checkpoint_step: Optional[int]
    world_size: int
    infrastructure_losses_by_reason: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """``status.infrastructureLosses.byReason``: losses of infrastructure the job survived, beside its restarts."""
    goodput_seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """``status.goodput.seconds``: the causes with any seconds, in the order of ``api/goodput.py`` ``Cause``."""
    goodput_ratio: Optional[float] = None
    """``status.goodput.ratio``: training seconds / wall seconds."""

    @property
    def succeeded(self) -> bool:
        return self.phase == "Succeeded"

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["reforms"] = [dataclasses.asdict(r) for r in self.reforms]
        out["restarts_by_reason"] = dict(self.restarts_by_reason)
        out["infrastructure_losses_by_reason"] = dict(self.infrastructure_losses_by_reason)
        out["goodput_seconds"] = dict(self.goodput_seconds)
        return out


class Recorder:
    def __init__(self) -> None:
        self.trace: list[tuple[float, int]] = []
        self.reforms: list[dict[str, Any]] = []
        self._reform_keys: set[str] = set()
        self.job = ""

    def on_event(self, event: Mapping[str, Any]) -> None:
        pass

    def on_status(self, status: Mapping[str, Any], facts: LogFacts, now: float) -> None:
        step = int(status.get("step", 0) or 0)
        if not self.trace or self.trace[-1][1] != step:
            self.trace.append((now, step))
        reform = status.get("lastReform") or {}
        key = f"{reform.get('start')}|{reform.get('reason')}"
        if reform.get("durationSeconds") is not None and key not in self._reform_keys:
            self._reform_keys.add(key)
            self.reforms.append(dict(reform, seenAt=now))

    def lost_steps_at_resumes(self, facts: LogFacts) -> list[tuple[float, int, int]]:
        """(time, resumed from step, steps lost) for every resume after the first start."""
        out = []
        for at, resumed in facts.resumes:
            before = [s for t, s in self.trace if t < at] + [s for t, s in facts.drains if t <= at]
            peak = max(before, default=0)
            if peak == 0 and resumed == 0:
                continue  # the first start
            out.append((at, resumed, max(0, peak - resumed)))
        return out

    def summary(self, status: Mapping[str, Any], wall: float, facts: LogFacts) -> Summary:
        resumes = self.lost_steps_at_resumes(facts)
        reforms = []
        for record in self.reforms:
            done = record["seenAt"]
            matched = [r for r in resumes if r[0] <= done]
            resumed, lost = (matched[-1][1], matched[-1][2]) if matched else (None, None)
            reforms.append(
                ReformSummary(
                    reason=record.get("reason", ""),
                    from_nodes=int(record.get("from", 0)),
                    to_nodes=int(record.get("to", 0)),
                    duration_seconds=record.get("durationSeconds"),
                    resumed_from_step=resumed,
                    lost_steps=lost,
                )
            )
        ckpt = status.get("lastCheckpoint") or {}
        goodput = status.get("goodput") or {}
        return Summary(
            job=self.job,
            phase=str(status.get("phase", "Pending")),
            message=str(status.get("message", "")),
            steps=int(status.get("step", 0) or 0),
            samples=int(status.get("samplesConsumed", 0) or 0),
            wall_seconds=round(wall, 2),
            reforms=tuple(reforms),
            restarts_by_reason=dict((status.get("restarts") or {}).get("byReason", {})),
            lost_steps=sum(r[2] for r in resumes),
            last_checkpoint_step=ckpt.get("step"),
            world_size=int(status.get("worldSize", 0) or 0),
            infrastructure_losses_by_reason=dict((status.get("infrastructureLosses") or {}).get("byReason", {})),
            goodput_seconds={cause: float(s) for cause, s in (goodput.get("seconds") or {}).items() if s},
            goodput_ratio=goodput.get("ratio"),
        )
