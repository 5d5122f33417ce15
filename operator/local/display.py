"""What a person sees: a live panel (rich) while the job runs, and the final summary.

On a terminal the panel shows step, samples/s, loss, world size, the last checkpoint, the nodes and the newest
events; elsewhere (CI, pipes, tests) each event is printed as one line and progress every few seconds, so logs
stay readable.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from disttrain.operator.local.runtime import Snapshot
from disttrain.operator.local.summary import Summary

_STYLE = {"Warning": "yellow", "Normal": "green"}


def _fmt(value: Optional[float], spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def _progress(snapshot: Snapshot, max_steps: Optional[int]) -> Table:
    st = snapshot.status
    table = Table.grid(padding=(0, 2))
    for _ in range(4):
        table.add_column()
    ckpt = st.get("lastCheckpoint") or {}
    plan = st.get("plan") or {}
    step = st.get("step", 0)
    table.add_row("phase", f"[bold]{st.get('phase', 'Pending')}[/]", "elapsed", f"{snapshot.elapsed:.0f}s")
    table.add_row(
        "step",
        f"{step}" + (f" / {max_steps}" if max_steps else ""),
        "samples/s",
        _fmt(snapshot.samples_per_second, ".0f"),
    )
    table.add_row("loss", _fmt(snapshot.loss), "world size", str(st.get("worldSize", 0)))
    table.add_row(
        "nodes",
        f"{len([p for p in snapshot.pods if '-agent' not in p[0]])} (desired {st.get('desiredNodes', 0)})",
        "global batch",
        str(plan.get("globalBatch", "-")),
    )
    table.add_row("checkpoint", f"step {ckpt['step']}" if ckpt else "-", "reforms", str(st.get("reforms", 0)))
    restarts = (st.get("restarts") or {}).get("byReason") or {}
    table.add_row("restarts", ", ".join(f"{k} {v}" for k, v in restarts.items()) or "0", "", "")
    if st.get("lastFailure"):
        table.add_row("last failure", Text(st["lastFailure"], style="red"), "", "")
    return table


def _pods(snapshot: Snapshot) -> Table:
    table = Table("pod", "machine", "state", box=None, pad_edge=False)
    for name, machine, state in snapshot.pods:
        style = "red" if ("Lost" in state or "Failed" in state) else ("yellow" if "Terminating" in state else "")
        table.add_row(name, machine, Text(state, style=style))
    return table


def _events(events: list[dict[str, Any]]) -> Table:
    table = Table(box=None, show_header=False, pad_edge=False)
    for event in events:
        table.add_row(
            f"{event['elapsed']:6.1f}s", Text(event["reason"], style=_STYLE.get(event["type"], "")), event["message"]
        )
    return table


def format_event(event: dict[str, Any]) -> str:
    return f"[{event['elapsed']:7.1f}s] {event['type']:<7} {event['reason']}: {event['message']}"


class Display:
    """Live panel on a TTY, plain lines otherwise. Use as a context manager around the run."""

    def __init__(
        self, job: str, max_steps: Optional[int], console: Optional[Console] = None, live: Optional[bool] = None
    ) -> None:
        self.console = console or Console(stderr=False)
        self.job = job
        self.max_steps = max_steps
        self.live_enabled = self.console.is_terminal if live is None else live
        self._live: Optional[Live] = None
        self._last_line = 0.0
        self._header_done = False

    def __enter__(self) -> Display:
        if self.live_enabled:
            self._live = Live(console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def header(self, snapshot: Snapshot) -> None:
        if self._header_done or not snapshot.metrics_url:
            return
        self._header_done = True
        line = f"disttrain local: job {self.job}; operator metrics {snapshot.metrics_url}"
        if self._live is not None:
            self._live.console.print(line)
        else:
            self.console.print(line, highlight=False, soft_wrap=True)

    def on_tick(self, snapshot: Snapshot) -> None:
        self.header(snapshot)
        if self._live is not None:
            body = Group(
                _progress(snapshot, self.max_steps), Text(""), _pods(snapshot), Text(""), _events(snapshot.events)
            )
            title = f"disttrain local · {self.job} · metrics {snapshot.metrics_url}"
            sub = " ".join(snapshot.worker_metrics[:4])
            self._live.update(Panel(body, title=title, subtitle=f"workers: {sub}" if sub else None))
            return
        now = time.monotonic()
        if now - self._last_line >= 5.0:
            self._last_line = now
            st = snapshot.status
            ckpt = (st.get("lastCheckpoint") or {}).get("step", "-")
            self.console.print(
                f"[{snapshot.elapsed:7.1f}s] step {st.get('step', 0)}"
                + (f"/{self.max_steps}" if self.max_steps else "")
                + f" loss {_fmt(snapshot.loss)} samples/s {_fmt(snapshot.samples_per_second, '.0f')} "
                f"world {st.get('worldSize', 0)} checkpoint {ckpt} phase {st.get('phase', 'Pending')}"
                + (f" restarts {st['restarts'].get('total', 0)}" if (st.get("restarts") or {}).get("total") else ""),
                highlight=False,
                soft_wrap=True,
            )

    def on_event(self, event: dict[str, Any]) -> None:
        from disttrain.operator.local.runtime import QUIET_REASONS

        if self._live is None and event["reason"] not in QUIET_REASONS:
            self.console.print(format_event(event), highlight=False, markup=False, soft_wrap=True)


def render_summary(summary: Summary, console: Console) -> None:
    table = Table(title=f"disttrain local · {summary.job} · {summary.phase}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("result", f"{summary.phase}: {summary.message}")
    table.add_row("steps", f"{summary.steps} ({summary.samples} samples)")
    table.add_row("wall time", f"{summary.wall_seconds:.1f}s")
    last = summary.last_checkpoint_step
    table.add_row("last checkpoint", "-" if last is None else f"step {last}")
    reforms = [
        f"{r.reason}: {r.from_nodes}->{r.to_nodes} nodes in {_fmt(r.duration_seconds, '.1f')}s"
        + (f", resumed from step {r.resumed_from_step}" if r.resumed_from_step is not None else "")
        + (f", {r.lost_steps} steps lost" if r.lost_steps is not None else "")
        for r in summary.reforms
    ]
    table.add_row("reforms", "\n".join(reforms) or "none")
    table.add_row("restarts", ", ".join(f"{k}: {v}" for k, v in summary.restarts_by_reason.items()) or "none")
    losses = summary.infrastructure_losses_by_reason
    table.add_row("infrastructure losses", ", ".join(f"{k}: {v}" for k, v in losses.items()) or "none")
    table.add_row("lost steps", str(summary.lost_steps))
    if summary.goodput_ratio is not None:
        table.add_row("goodput", f"{summary.goodput_ratio:.3f} (training / wall time)")
        table.add_row("time by cause", "\n".join(f"{cause}: {s:.1f}s" for cause, s in summary.goodput_seconds.items()))
    console.print(table)
