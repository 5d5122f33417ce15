"""Telling a failed collective (a peer died or hung) from a bug, so the worker exits REFORM instead of 1.

torch types some of these failures: ``torch.distributed.DistError`` and its subclasses ``DistBackendError``
(NCCL), ``DistNetworkError`` and ``DistStoreError`` (the TCPStore). Gloo does not. On torch 2.13.0 with gloo on
CPU, checked by experiment and by ``tests/trainer/test_collective_failures.py``, a survivor whose peer was
SIGKILLed during ``all_reduce`` (sync and async), ``barrier`` or ``all_gather_object`` gets a plain
``RuntimeError``::

    [.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:20866. ...

and one whose peer hangs past the collective timeout gets a plain ``RuntimeError`` too::

    [.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 4000ms for recv operation to complete

or, from an ``all_reduce`` whose pair was closed by gloo's own timeout, a message without any path::

    Application timeout caused pair closure

So for ``RuntimeError`` the message is still matched, here and nowhere else. The markers are the ones the
trainer has always used; the first two were seen on torch 2.13.0, the others cover older gloo builds, socket
errors and NCCL messages that were not reproduced on this CPU-only machine.

A desync is not a failed collective: with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (``spec.debug``) torch checks every
collective's fingerprint across ranks first and raises a plain ``RuntimeError`` on every rank of the mismatch
(torch 2.13.0, gloo on CPU, ``tests/e2e/test_desync.py``)::

    Detected mismatch between collectives on ranks. Rank 0 is running collective: CollectiveFingerPrint(
    SequenceNumber=2, OpType=ALLREDUCE, TensorShape=[4], TensorDtypes=Float, TensorDeviceTypes=...), but Rank 1
    is running collective: CollectiveFingerPrint(SequenceNumber=2, OpType=BROADCAST, ...).Collectives differ in
    the following aspects: ...

A re-formed group would run the same program into the same mismatch, so :func:`find_desync` names it and the
trainer exits PERMANENT; :func:`is_collective_failure` never counts it, even where the message says "gloo".
"""

from __future__ import annotations

import dataclasses
import os
import re
import resource
from typing import Optional

import torch.distributed as dist

from disttrain.api import conditions

CHECKED_ON = "torch 2.13.0, gloo on CPU"
"""Where :data:`RUNTIME_ERROR_MARKERS` was last checked against real failures."""

RUNTIME_ERROR_MARKERS: tuple[str, ...] = (
    "Connection closed by peer",  # gloo, peer died (seen on torch 2.13.0)
    "Timed out",
    "timed out",  # gloo, peer hung past the collective timeout (seen on torch 2.13.0)
    "caused pair closure",  # gloo, a pending operation past the collective timeout (seen on torch 2.13.0)
    "Gloo",
    "gloo",  # any gloo transport error: its messages carry the gloo source path
    "Connection reset",
    "Socket",
    "socket",  # transport errors of older builds
    "NCCL",  # NCCL errors not (yet) raised as DistBackendError
)
"""Substrings of a ``RuntimeError`` message that mean a collective failed."""


FAULT_ABORT_ON_COLLECTIVE_FAILURE = "FAULT_INJECT_ABORT_ON_COLLECTIVE_FAILURE"
"""Fault injection, for tests only: with this variable set to ``1`` a process aborts (SIGABRT) as soon as a failed
collective is classified here, as NCCL's watchdog aborts every survivor of a dead peer
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, which torchrun sets). Gloo on CPU raises instead; the CPU test of the operator's
failure accounting (``tests/e2e/test_incident_accounting.py``) sets it to see survivors die that way."""


DESYNC_TEXT = "Detected mismatch between collectives on ranks"
"""How torch's ``ProcessGroupWrapper`` starts a fingerprint mismatch (``TORCH_DISTRIBUTED_DEBUG=DETAIL``)."""
_CALL = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\(")
_DIFFER = "Collectives differ in the following aspects:"


class CollectiveDesyncError(RuntimeError):
    """Ranks called different collectives: a bug of the program (the message says which ranks and ops)."""


@dataclasses.dataclass(frozen=True)
class CollectiveCall:
    """What one rank was calling, from torch's fingerprint."""

    rank: int
    op: str
    """torch's op type: ``ALLREDUCE``, ``BROADCAST``, ``BARRIER``..."""
    shapes: str = ""
    dtypes: str = ""
    sequence: Optional[int] = None

    def describe(self) -> str:
        details = [f"tensor shape {self.shapes}" if self.shapes else "", self.dtypes.lower(), self.seq_text()]
        return f"rank {self.rank} called {self.op}" + (
            f" ({', '.join(d for d in details if d)})" if any(details) else ""
        )

    def seq_text(self) -> str:
        return f"collective #{self.sequence}" if self.sequence is not None else ""


@dataclasses.dataclass(frozen=True)
class Desync:
    """A collective mismatch: each rank torch named, with its call, and how the calls differ."""

    calls: tuple[CollectiveCall, ...]
    differences: str = ""

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(call.rank for call in self.calls)

    def message(self) -> str:
        """One line for the status, the Event and the log, starting with ``conditions.DESYNC_MARKER``."""
        calls = " while ".join(call.describe() for call in self.calls)
        differ = f"; they differ in {self.differences}" if self.differences else ""
        return (
            f"{conditions.DESYNC_MARKER} {calls}{differ}. The ranks call collectives in a different order (a "
            "data-dependent branch, a rank that skipped one): a restart would repeat it"
        )


def parse_desync(text: str) -> Optional[Desync]:
    """The ranks and operations of torch's fingerprint mismatch in ``text``; None when it is none."""
    if DESYNC_TEXT not in text:
        return None
    matches = list(_CALL.finditer(text))
    calls = []
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        calls.append(_call(int(match.group(1)), text[match.end() : end].split(_DIFFER)[0]))
    differences = " ".join(text.split(_DIFFER, 1)[1].split()) if _DIFFER in text else ""
    return Desync(calls=tuple(calls), differences=differences[:300])


def find_desync(exc: BaseException) -> Optional[Desync]:
    """The desync ``exc`` (or the exception it was raised from) reports; None for any other error."""
    seen: set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        found = parse_desync(str(current))
        if found is not None:
            return found
        current = current.__cause__ or current.__context__
    return None


def _call(rank: int, fingerprint: str) -> CollectiveCall:
    op = re.search(r"OpType=(\w+)", fingerprint)
    shapes = re.search(r"TensorShape=(\[.*?\])(?=, Tensor|\))", fingerprint)
    dtypes = re.search(r"TensorDtypes=(.*?)(?=, TensorDeviceTypes|\))", fingerprint)
    sequence = re.search(r"SequenceNumber=(\d+)", fingerprint)
    return CollectiveCall(
        rank=rank,
        op=op.group(1) if op else "?",
        shapes=shapes.group(1) if shapes else "",
        dtypes=dtypes.group(1) if dtypes else "",
        sequence=int(sequence.group(1)) if sequence else None,
    )


def is_collective_failure(exc: BaseException) -> bool:
    """True when ``exc`` says a collective or the group's store failed: a peer is gone or hung. A desync
    (:func:`find_desync`) never is."""
    text = str(exc)
    if DESYNC_TEXT in text:
        return False
    failed = isinstance(exc, dist.DistError) or (
        isinstance(exc, RuntimeError) and any(marker in text for marker in RUNTIME_ERROR_MARKERS)
    )
    if failed:
        abort_if_injected()
    return failed


def abort_if_injected() -> None:
    """The fault hook of :data:`FAULT_ABORT_ON_COLLECTIVE_FAILURE`: abort without a core file when it is set."""
    if os.environ.get(FAULT_ABORT_ON_COLLECTIVE_FAILURE) == "1":
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.abort()
