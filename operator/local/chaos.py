"""The ``--chaos`` schedule: ``kill-node@30s,add-node@60s,kill-agent@90s``. Parsing only; the runtime acts.

Actions:

* ``kill-node`` (or ``kill-node:INDEX``): SIGKILL a node's whole process tree, as when a machine dies. Without
  an index the newest running node is chosen (never the one the group started with at index 0 unless it is
  the only one, so a demo keeps rank 0's log readable).
* ``drain-node`` (or ``drain-node:INDEX``): cordon a node's machine, as ``kubectl drain`` or a spot notice does: the
  operator drains the worker off it at a checkpoint and replaces it (``spec.elastic.departure``). The node is chosen
  as for kill-node.
* ``add-node``: a join; the desired node count grows by one (as ``disttrain local scale --replicas N+1``).
* ``remove-node``: a planned scale-down by one node.
* ``kill-agent``: SIGKILL the job agent; the runtime recreates it and the workers re-join.

Times are seconds since the run started (``30``, ``30s``, ``1.5m``) or, with ``@step=N``, once the trainer
reported step N.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

ACTIONS = ("kill-node", "drain-node", "add-node", "remove-node", "kill-agent")
INDEXED = ("kill-node", "drain-node")
"""Actions that take a node index (ACTION:INDEX)."""


class ChaosSyntaxError(ValueError):
    """A --chaos item that cannot be parsed; the message names it and says what is allowed."""


@dataclasses.dataclass(frozen=True)
class ChaosEvent:
    action: str
    at_seconds: Optional[float] = None
    """Seconds since the start of the run; None when the event waits for a step."""
    at_step: Optional[int] = None
    """Trainer step (as relayed in status.step) at or after which the event fires."""
    index: Optional[int] = None
    """Node index for kill-node:INDEX and drain-node:INDEX."""

    def is_due(self, elapsed: float, step: int) -> bool:
        if self.at_step is not None:
            return step >= self.at_step
        return self.at_seconds is not None and elapsed >= self.at_seconds

    def __str__(self) -> str:
        name = self.action if self.index is None else f"{self.action}:{self.index}"
        when = f"step={self.at_step}" if self.at_step is not None else f"{self.at_seconds:g}s"
        return f"{name}@{when}"


_ITEM = re.compile(
    r"^(?P<action>[a-z-]+)(?::(?P<index>\d+))?"
    r"@(?:(?P<step>step=\d+)|(?P<time>\d+(?:\.\d+)?)(?P<unit>s|m)?)$"
)


def parse_chaos(text: str) -> list[ChaosEvent]:
    """Events of a comma-separated schedule, in the order they fire (by time; step events keep their order)."""
    events: list[ChaosEvent] = []
    for raw in (part.strip() for part in text.split(",")):
        if not raw:
            continue
        match = _ITEM.match(raw)
        if match is None:
            raise ChaosSyntaxError(
                f"--chaos item {raw!r}: expected ACTION[:INDEX]@TIME (e.g. kill-node@30s, "
                f"kill-node:1@1m, add-node@step=40); actions: {', '.join(ACTIONS)}"
            )
        action = match["action"]
        if action not in ACTIONS:
            raise ChaosSyntaxError(f"--chaos item {raw!r}: unknown action {action!r}; allowed: {', '.join(ACTIONS)}")
        if match["index"] is not None and action not in INDEXED:
            raise ChaosSyntaxError(f"--chaos item {raw!r}: only {' and '.join(INDEXED)} take a node index")
        if match["step"]:
            events.append(
                ChaosEvent(
                    action,
                    at_step=int(match["step"].split("=")[1]),
                    index=int(match["index"]) if match["index"] else None,
                )
            )
            continue
        seconds = float(match["time"]) * (60.0 if match["unit"] == "m" else 1.0)
        events.append(ChaosEvent(action, at_seconds=seconds, index=int(match["index"]) if match["index"] else None))
    return sorted(events, key=lambda e: e.at_seconds if e.at_seconds is not None else float("inf"))
