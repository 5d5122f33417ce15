"""Sets of pod names written compactly into status, so that status stays bounded at 10,000 nodes.

Worker pods are named ``<job>-worker-<index>[-<n>]`` (disttrain.operator.names): a set of them is a few runs of
numbers under one prefix. :func:`pack` writes ``["train-worker-[0-9999]"]`` for 10,000 names (22 bytes instead
of 230 KB); :func:`unpack` gives back exactly the same set. A name without a trailing number stays as it is.
Pod names are DNS subdomains, so ``[`` never occurs in one and the form is unambiguous.

:data:`PackedNames` is the pydantic type of such a field: a ``set[str]`` in memory, the packed list on the wire.
It also reads a plain list of names, or the keys of a mapping (the older ``name -> uid`` form of ``trackedPods``).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

_NUMBERED = re.compile(r"^(.*?)(0|[1-9][0-9]*)$")
_PACKED = re.compile(r"^(.*)\[(.*)\]$")
MAX_RANGE = 1_000_000
"""Largest run one packed entry may expand to (a status field is never trusted to be small by itself)."""


def pack(names: Iterable[str]) -> list[str]:
    """``names`` as sorted entries ``<prefix>[a-b,c,...]`` (numbered names) or plain names."""
    runs: dict[str, list[int]] = defaultdict(list)
    plain: set[str] = set()
    for name in set(names):
        match = _NUMBERED.match(name)
        if match and match.group(1) and not match.group(1).endswith("["):
            runs[match.group(1)].append(int(match.group(2)))
        else:
            plain.add(name)
    out = sorted(plain)
    for prefix in sorted(runs):
        numbers = sorted(runs[prefix])
        parts, start, end = [], numbers[0], numbers[0]
        for number in numbers[1:]:
            if number == end + 1:
                end = number
                continue
            parts.append(_run(start, end))
            start = end = number
        parts.append(_run(start, end))
        out.append(f"{prefix}[{','.join(parts)}]")
    return out


def _run(start: int, end: int) -> str:
    return str(start) if start == end else f"{start}-{end}"


def unpack(entries: Iterable[str]) -> set[str]:
    """The names :func:`pack` wrote; ValueError names an entry that is not of that form."""
    names: set[str] = set()
    for entry in entries:
        if not isinstance(entry, str):
            raise ValueError(f"expected a pod name or '<prefix>[ranges]', got {entry!r}")
        match = _PACKED.match(entry)
        if not match:
            names.add(entry)
            continue
        prefix, body = match.groups()
        for part in filter(None, body.split(",")):
            low, _, high = part.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise ValueError(f"{entry!r}: {part!r} is not a number or a range a-b")
            first, last = int(low), int(high or low)
            if last < first or last - first >= MAX_RANGE:
                raise ValueError(f"{entry!r}: range {part!r} must be ascending and under {MAX_RANGE} names")
            names.update(f"{prefix}{number}" for number in range(first, last + 1))
    return names


def _read(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return set(value)
    if isinstance(value, dict):  # the older name -> uid form
        return set(value)
    if isinstance(value, (list, tuple)):
        return unpack(value)
    return value


PackedNames = Annotated[
    set[str],
    BeforeValidator(_read),
    PlainSerializer(pack, return_type=list[str], when_used="always"),
    WithJsonSchema({"type": "array", "items": {"type": "string"}}),  # structural: no uniqueItems in a CRD
]
"""A set of pod names, packed on the wire (see the module docstring)."""
