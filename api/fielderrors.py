"""A pydantic ``ValidationError`` as one line per error, each naming the field by its wire path
(``spec.rendezvous.port``, ``spec.template.spec.containers[0]``): what ``disttrain validate`` and the job agent
say of a spec they refuse."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


def wire_path(loc: tuple[Any, ...]) -> str:
    """``("spec", "containers", 0, "name")`` -> ``spec.containers[0].name``."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def field_errors(error: ValidationError, root: str, value_chars: int) -> list[tuple[str, str]]:
    """``(path, message)`` per error of ``error``: ``root`` names the object itself, and a refused value is shown
    in at most ``value_chars`` characters. Validator names (``function-after``, ...) are left out of the path."""
    found = []
    for item in error.errors(include_url=False):
        path = wire_path(tuple(p for p in item["loc"] if not (isinstance(p, str) and p.startswith("function-"))))
        if item["type"] == "missing":
            message = "required field is missing"
        elif item["type"] == "extra_forbidden":
            message = "unknown field"
        else:
            shown = repr(item.get("input"))
            shown = shown if len(shown) <= value_chars else shown[: value_chars - 3] + "..."
            message = f"{item['msg']} (got {shown})"
        found.append((path or root, message))
    return found
