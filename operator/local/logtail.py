"""Progress read from the node logs: loss, samples/s, resumes and drains as the trainer logs them.

The job status carries step and samples (relayed by the agent); the live display also wants the loss and what
each reform resumed from. Rank 0 logs ``step N loss L lr X world W samples/s R`` every few steps, every rank
logs ``resumed from checkpoint step-N`` and ``drained at step N``; reading them from the logs the runtime keeps
anyway needs nothing more from the trainer.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Optional

_STEP = re.compile(r"\bstep (\d+) loss (\S+) lr (\S+) world (\d+) samples/s (\d+(?:\.\d+)?)")
_RESUMED = re.compile(r"resumed (?:from checkpoint step-|in place from step )(\d+)")
_FRESH = re.compile(r"no complete checkpoint in .*: starting at step 0")
_DRAINED = re.compile(r"drained at step (\d+)")


@dataclasses.dataclass
class LogFacts:
    """What the logs said, newest first where it matters."""

    step: int = 0
    loss: Optional[float] = None
    lr: Optional[float] = None
    world: int = 0
    samples_per_second: Optional[float] = None
    resumes: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    """(time seen, checkpoint step resumed from; 0 for a fresh start), one per distinct resume."""
    drains: list[tuple[float, int]] = dataclasses.field(default_factory=list)


def parse_line(line: str, facts: LogFacts, now: float) -> None:
    match = _STEP.search(line)
    if match:
        step = int(match.group(1))
        facts.step = step
        facts.loss = _float(match.group(2))
        facts.lr = _float(match.group(3))
        facts.world = int(match.group(4))
        facts.samples_per_second = _float(match.group(5))
        return
    match = _RESUMED.search(line)
    resumed = int(match.group(1)) if match else (0 if _FRESH.search(line) else None)
    if resumed is not None:
        # Every rank logs the resume; one record per group start (same step within a few seconds).
        if not facts.resumes or facts.resumes[-1][1] != resumed or now - facts.resumes[-1][0] > 5:
            facts.resumes.append((now, resumed))
        return
    match = _DRAINED.search(line)
    if match:
        step = int(match.group(1))
        if not facts.drains or facts.drains[-1][1] != step:
            facts.drains.append((now, step))


def _float(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


class LogTail:
    """Reads new complete lines of every log in a folder on each :meth:`poll`."""

    def __init__(self, folder: pathlib.Path) -> None:
        self.folder = folder
        self.offsets: dict[pathlib.Path, int] = {}
        self.partial: dict[pathlib.Path, str] = {}
        self.facts = LogFacts()

    def poll(self, now: float) -> LogFacts:
        for path in sorted(self.folder.glob("*.log")):
            try:
                with path.open("rb") as source:
                    source.seek(self.offsets.get(path, 0))
                    data = source.read()
            except OSError:
                continue
            if not data:
                continue
            self.offsets[path] = self.offsets.get(path, 0) + len(data)
            text = self.partial.pop(path, "") + data.decode(errors="replace")
            lines = text.split("\n")
            if lines[-1]:
                self.partial[path] = lines[-1]
            for line in lines[:-1]:
                parse_line(line, self.facts, now)
        return self.facts
