"""The operator's check of what the job agent wrote into the status, before the reconcile core reads it.

The agent validates what it reads from the store (:mod:`disttrain.api.control`), but the operator does not take
that on trust: the CRD schema gives these fields their types and nothing more, and one unparsable time in them
would make every reconcile of the job fail until someone repairs the status by hand. A value that fails here is
dropped from the core's view (as if the agent had not reported it yet) and named in the log; the status itself is
the agent's to correct with its next report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pydantic

from disttrain.api import control
from disttrain.api.status import SilentNode, StalledNode, StoreRejections
from disttrain.operator import patches

log = logging.getLogger("disttrain.operator")

TIME_FIELDS = ("roundStartTime", "lastProgressTime")
"""Top-level agent fields that hold an RFC 3339 time."""
NESTED_TIME_FIELDS = ("lastCheckpoint", "workerFailure", "checkpointInterval")
"""Agent fields that are objects with a ``time``."""
COUNT_FIELDS = ("step", "samplesConsumed", "worldSize", "rendezvousRound")
MAX_SILENT_NODES = 1024
MAX_ROUND_MEMBERS = 1024
_SILENT_NODES = pydantic.TypeAdapter(list[SilentNode])
_STALLED_NODES = pydantic.TypeAdapter(list[StalledNode])


def sanitize(status: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``status`` without the agent values that fail their checks, and a description of each one dropped."""
    clean = patches.copy_json(status)
    problems: list[str] = []
    for find in (_scalar_problems, _report_problems):  # a field dropped by the first is not looked at again
        for field, problem in find(clean):
            problems.append(f"status.{field}{problem}")
            clean.pop(field.split(".", 1)[0], None)
    return clean, problems


def _scalar_problems(status: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, what is wrong) for the times and counts that fail their checks."""
    found: list[tuple[str, str]] = []
    for field in TIME_FIELDS:
        value = status.get(field)
        if value is not None and not (isinstance(value, str) and control.is_valid_time(value)):
            found.append((field, f"={_show(value)} is no RFC 3339 time"))
    for field in NESTED_TIME_FIELDS:
        value = status.get(field)
        if not isinstance(value, dict) or value.get("time") is None:
            continue
        if not (isinstance(value["time"], str) and control.is_valid_time(value["time"])):
            found.append((f"{field}.time", f"={_show(value['time'])} is no RFC 3339 time"))
    for field in COUNT_FIELDS:
        value = status.get(field)
        if value is not None and not (isinstance(value, int) and 0 <= value <= control.MAX_COUNT):
            found.append((field, f"={_show(value)} is out of range [0, {control.MAX_COUNT}]"))
    return found


def _report_problems(status: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, what is wrong) for the agent's structured reports that fail their checks."""
    checks: tuple[tuple[str, Callable[[Any], str]], ...] = (
        ("checkpointInterval", _interval_problem),
        ("silentNodes", lambda v: f": {p}" if (p := _silent_nodes_problem(v)) else ""),
        ("stalledNodes", lambda v: f": {p}" if (p := _stalled_nodes_problem(v)) else ""),
        ("roundMembers", _round_members_problem),
        ("storeRejections", _rejections_problem),
    )
    found: list[tuple[str, str]] = []
    for field, check in checks:
        value = status.get(field)
        if value is not None and (problem := check(value)):
            found.append((field, problem))
    return found


def _round_members_problem(members: Any) -> str:
    if (
        isinstance(members, list)
        and len(members) <= MAX_ROUND_MEMBERS
        and all(isinstance(name, str) and 0 < len(name) <= 253 for name in members)
    ):
        return ""
    return f"={_show(members)} is no list of at most {MAX_ROUND_MEMBERS} pod names"


def _rejections_problem(rejections: Any) -> str:
    try:
        report = StoreRejections.model_validate(rejections)
    except pydantic.ValidationError as error:
        return f"={_show(rejections)} is no rejection report: {error.errors()[0]}"
    bad_time = next((r.time for r in report.recent if r.time and not 0.0 <= r.time <= control.MAX_TIME), None)
    return "" if bad_time is None else f".recent[].time={_show(bad_time)} is no RFC 3339 time"


def _interval_problem(value: Any) -> str:
    """Why ``value`` is no checkpoint interval report ("" when it is one)."""
    if not isinstance(value, dict):
        return f"={_show(value)} is no object"
    steps = value.get("steps")
    if not (isinstance(steps, int) and not isinstance(steps, bool) and 1 <= steps <= control.MAX_COUNT):
        return f".steps={_show(steps)} is out of range [1, {control.MAX_COUNT}]"
    for key in ("saveSeconds", "stepSeconds", "mtbfSeconds"):
        number = value.get(key)
        if not (isinstance(number, (int, float)) and not isinstance(number, bool) and 0 <= number <= control.MAX_TIME):
            return f".{key}={_show(number)} is no number of seconds"
    return ""


def _node_list_problem(value: Any, adapter: pydantic.TypeAdapter[Any]) -> tuple[str, list[Any]]:
    """Why ``value`` is no list of node entries of ``adapter``'s type ('' when it is one), and its entries."""
    if not isinstance(value, list) or len(value) > MAX_SILENT_NODES:
        return f"{_show(value)} is no list of at most {MAX_SILENT_NODES} entries", []
    try:
        entries = list(adapter.validate_python(value))
    except pydantic.ValidationError as error:
        return f"{_show(value)}: {error.errors()[0].get('loc')} {error.errors()[0].get('msg')}", []
    return ("an entry has an empty node" if any(not entry.node for entry in entries) else ""), entries


def _silent_nodes_problem(value: Any) -> str:
    """Why ``status.silentNodes`` cannot be used ('' when it can): the whole report goes, never a part of it."""
    problem, entries = _node_list_problem(value, _SILENT_NODES)
    bad = next(
        (e.last_heartbeat for e in entries if e.last_heartbeat and not control.is_valid_time(e.last_heartbeat)), None
    )
    return problem or (f"lastHeartbeat={_show(bad)} is no RFC 3339 time" if bad is not None else "")


def _stalled_nodes_problem(value: Any) -> str:
    """Why ``status.stalledNodes`` cannot be used ('' when it can): the whole report goes, never a part of it."""
    return _node_list_problem(value, _STALLED_NODES)[0]


def sanitized_job(raw: dict[str, Any], namespace: str, name: str) -> dict[str, Any]:
    """``raw`` (a job in wire form) with :func:`sanitize` applied to its status; every problem is logged."""
    status, problems = sanitize(raw.get("status") or {})
    for problem in problems:
        log.warning("%s/%s: ignoring what the job agent reported: %s", namespace, name, problem)
    return {**raw, "status": status}


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
